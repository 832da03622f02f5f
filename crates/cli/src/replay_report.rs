//! The human-readable report of `tensormem replay`: one table row per configuration, then what was
//! checked against the record and, if anything differed, where.

use std::io::{self, Write};

use tensormem_cuda_alloc::size::format_size;
use tensormem_replay::{
    AsyncBounds, CapacityInference, Check, DeviceRun, PoolAttribution, PoolEvidence, ReplayRun,
    SettingsInference,
};

/// What the report says about the trace.
pub(crate) struct Header<'a> {
    pub(crate) trace: &'a str,
    pub(crate) events: u64,
    pub(crate) devices: usize,
    /// Where the expected statistics came from, if any.
    pub(crate) expected_from: Option<&'a str>,
    /// Per device, what the trace says about the memory the allocator could obtain.
    pub(crate) capacity: Vec<(usize, &'a CapacityInference)>,
    /// Whether `--capacity` set the device's memory.
    pub(crate) capacity_given: bool,
    /// Per device, which allocations went to which pool.
    pub(crate) pools: Vec<(usize, &'a PoolAttribution)>,
    /// Per device, the allocator settings the program changed while it ran.
    pub(crate) settings: Vec<(usize, &'a SettingsInference)>,
}

/// Writes the report.
pub(crate) fn print(
    out: &mut impl Write,
    header: &Header<'_>,
    runs: &[ReplayRun],
) -> io::Result<()> {
    writeln!(
        out,
        "trace: {}: {} events, {} device{}",
        header.trace,
        header.events,
        header.devices,
        if header.devices == 1 { "" } else { "s" }
    )?;
    let titles = [
        "configuration",
        "peak allocated",
        "peak reserved",
        "reserved/allocated",
        "device allocs",
        "device frees",
        "retries",
        "OOMs",
        "matches record",
    ];
    let rows: Vec<Vec<String>> = runs
        .iter()
        .flat_map(|run| {
            if run.devices.len() > 1 {
                run.devices
                    .iter()
                    .map(|d| row(run, Some(d)))
                    .collect::<Vec<_>>()
            } else {
                vec![row(run, None)]
            }
        })
        .collect();
    // The configuration and whether it matches the record read from the left.
    crate::table(out, &titles, &rows, &[0, 8])?;
    writeln!(out, "{LEGEND}")?;
    for run in runs.iter().filter(|r| !r.lower_bounds().is_empty()) {
        async_lines(out, run)?;
    }
    for (device, inference) in &header.capacity {
        capacity_line(out, *device, inference, header.capacity_given)?;
    }
    for (device, attribution) in &header.pools {
        pools_lines(out, *device, attribution)?;
    }
    for (device, settings) in &header.settings {
        settings_lines(out, *device, settings)?;
    }
    for run in runs.iter().filter(|r| r.recorded) {
        details(out, header, run)?;
    }
    Ok(())
}

/// One table row: the run's figures, or one device's when `device` is given (traces of several
/// devices get a row per device).
fn row(run: &ReplayRun, device: Option<&DeviceRun>) -> Vec<String> {
    let stats = match device {
        Some(d) => d.stats.to_flat(),
        None => run.flat_stats(),
    };
    let figure = |key: &str| stats.get(key).copied().unwrap_or(0);
    let allocated = figure("allocated_bytes.all.peak");
    let reserved = figure("reserved_bytes.all.peak");
    // Figures of the model of `backend:cudaMallocAsync` that are lower bounds.
    let at_least = if run.lower_bounds().contains(&"reserved_bytes.all.peak") {
        ">= "
    } else {
        ""
    };
    let ratio = if allocated > 0 {
        format!("{at_least}{:.3}", reserved as f64 / allocated as f64)
    } else {
        "-".to_owned()
    };
    let mut label = run.label();
    if run.recorded {
        label.push_str(" [recorded]");
    }
    if let Some(d) = device {
        label.push_str(&format!(" cuda:{}", d.device));
    }
    let matched = match device {
        Some(d) => d.check.as_ref().map(Check::matches),
        None => run.matches_record(),
    };
    let matches = match matched {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    };
    let bounds: Vec<&AsyncBounds> = match device {
        Some(d) => d.async_model.iter().collect(),
        None => run
            .devices
            .iter()
            .find(|d| d.device == 0)
            .or_else(|| run.devices.first())
            .and_then(|d| d.async_model.as_ref())
            .into_iter()
            .collect(),
    };
    if let Some(bounds) = bounds.first() {
        // PyTorch counts none of these under this backend; the OOMs are the model's certain ones.
        return vec![
            label,
            format_size(allocated.max(0) as u64),
            format!("{at_least}{}", format_size(reserved.max(0) as u64)),
            ratio,
            "-".to_owned(),
            "-".to_owned(),
            "-".to_owned(),
            (bounds.ooms + bounds.limit_ooms).to_string(),
            matches.to_owned(),
        ];
    }
    vec![
        label,
        format_size(allocated.max(0) as u64),
        format_size(reserved.max(0) as u64),
        ratio,
        figure("num_device_alloc").to_string(),
        figure("num_device_free").to_string(),
        figure("num_alloc_retries").to_string(),
        figure("num_ooms").to_string(),
        matches.to_owned(),
    ]
}

/// What the trace says about the device's memory, when it says anything.
fn capacity_line(
    out: &mut impl Write,
    device: usize,
    inference: &CapacityInference,
    given: bool,
) -> io::Result<()> {
    let bounded = inference.upper.is_some() || inference.layout_bound.is_some();
    if !bounded && inference.capacity.is_none() {
        return Ok(());
    }
    let what = match inference.fraction {
        Some(f) => format!("per_process_memory_fraction {f} x device memory"),
        None => "the memory the allocator could obtain".to_owned(),
    };
    let upper = inference.upper.map_or_else(|| "-".to_owned(), format_size);
    let mut reasons = Vec::new();
    if inference.oom_bounds > 0 {
        reasons.push(format!("{} OOMs", inference.oom_bounds));
    }
    if inference.retry_bounds > 0 {
        reasons.push(format!(
            "{} cache release{} before a new segment",
            inference.retry_bounds,
            if inference.retry_bounds == 1 { "" } else { "s" }
        ));
    }
    if let Some(layout) = inference.layout_bound {
        reasons.push(format!(
            "expandable reservations: at most {}",
            format_size(layout)
        ));
    }
    let picked = inference.capacity.map_or_else(
        || "the default".to_owned(),
        |c| format!("{c} bytes ({})", format_size(c)),
    );
    let verdict = if given {
        "--capacity overrides it".to_owned()
    } else if !inference.phases.is_empty() {
        format!(
            "no single value fits every recorded decision: the limit changed while the program ran \
             (below); device memory {picked}"
        )
    } else if inference.consistent {
        format!("device memory {picked}")
    } else {
        format!("NO value fits every recorded decision; device memory {picked} (the upper end)")
    };
    if inference.phases.is_empty() {
        writeln!(
            out,
            "device {device}: {what} in [{}, {upper}] ({}; the least is the most the trace reserved): {verdict}",
            format_size(inference.lower),
            if reasons.is_empty() { "nothing bounds it above".to_owned() } else { reasons.join(", ") },
        )?;
    } else {
        writeln!(out, "device {device}: {what}: {verdict}")?;
    }
    phase_lines(out, device, inference)?;
    if inference.fraction_implied {
        writeln!(
            out,
            "  assumption: device {device}: the trace records no memory fraction, but requests failed \
             although the device had room: torch.cuda.set_per_process_memory_fraction() was in force; \
             its value and the device's size are not in the trace, only the bytes the fraction allowed \
             (the interval above), and the replay uses a fraction and a size that allow them"
        )?;
    }
    Ok(())
}

/// The limits a program set while it ran, when no single one fits its trace: per stretch of
/// events, the bytes allowed, what bounds them, and between which events the limit changed.
fn phase_lines(
    out: &mut impl Write,
    device: usize,
    inference: &CapacityInference,
) -> io::Result<()> {
    if inference.phases.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "  assumption: device {device}: torch.cuda.set_per_process_memory_fraction() was called again \
         while the program ran (the trace does not record it); the replay changes the limit where \
         the recorded decisions need it:"
    )?;
    for phase in &inference.phases {
        let when = match phase.changed_after {
            None => format!("from event {}", phase.from_event),
            Some(after) => format!(
                "from event {} (changed after event {after})",
                phase.from_event
            ),
        };
        let upper = phase.upper.map_or_else(|| "-".to_owned(), format_size);
        writeln!(
            out,
            "    {when}: allowed in [{}, {upper}], replayed with {} (fraction {:.6})",
            format_size(phase.lower),
            format_size(phase.allowed),
            phase.fraction,
        )?;
    }
    Ok(())
}

/// The allocator settings the program changed while it ran, when the recorded ones do not explain
/// its trace: the settings found in force before and where they changed, or how far the search
/// got.
fn settings_lines(
    out: &mut impl Write,
    device: usize,
    settings: &SettingsInference,
) -> io::Result<()> {
    let shown = |config: &tensormem_cuda_alloc::config::AllocatorConfig| {
        let text = config.to_string();
        if text.is_empty() {
            "PyTorch's defaults".to_owned()
        } else {
            text
        }
    };
    let window = |which: &str| {
        settings
            .switch_window
            .map(|(from, to)| {
                format!(" (no recorded allocation tells apart {which} at events {from} to {to})")
            })
            .unwrap_or_default()
    };
    let Some(first) = settings.first_departure else {
        if let [made, later] = settings.phases.as_slice() {
            writeln!(
                out,
                "  assumption: device {device}: the allocator was made with {} (its max_split_size \
                 figure) and the program set the recorded {} while it ran, at a point no allocation \
                 tells{}",
                shown(&made.config),
                shown(&later.config),
                window("the change"),
            )?;
        }
        return Ok(());
    };
    if let [earlier, later] = settings.phases.as_slice() {
        writeln!(
            out,
            "  assumption: device {device}: the allocator settings changed while the program ran \
             (torch.cuda.memory._set_allocator_settings, not in the trace): {} until event {}, the \
             recorded {} from there{}; the recorded settings alone depart from the record at \
             event {first}",
            shown(&earlier.config),
            later.from_event,
            shown(&later.config),
            window("a change"),
        )?;
        return Ok(());
    }
    if let [_, _, _, ..] = settings.phases.as_slice() {
        let stretches: Vec<String> = settings
            .phases
            .iter()
            .map(|p| format!("{} from event {}", shown(&p.config), p.from_event))
            .collect();
        writeln!(
            out,
            "  assumption: device {device}: the allocator settings changed {} times while the \
             program ran (torch.cuda.memory._set_allocator_settings, not in the trace): {}{}; \
             the recorded settings alone depart from the record at event {first}",
            settings.phases.len() - 1,
            stretches.join(", "),
            window("the last change"),
        )?;
        return Ok(());
    }
    let found = match &settings.explained_until {
        Some((config, until)) => format!(
            "; the settings that explain it furthest, {}, depart at {}",
            shown(config),
            until.map_or_else(|| "its end".to_owned(), |e| format!("event {e}")),
        ),
        None => String::new(),
    };
    writeln!(
        out,
        "  device {device}: the recorded allocator settings depart from the record at event {first}, \
         and no single change of rounding, splitting, garbage collection or expandable segments \
         explains the trace ({} replays tried{}{found})",
        settings.replays,
        if settings.exhausted {
            ", the budget for a trace this long"
        } else {
            ""
        }
    )
}

/// Which allocations went to which pool, when any went to a private pool or any is undecided.
fn pools_lines(
    out: &mut impl Write,
    device: usize,
    attribution: &PoolAttribution,
) -> io::Result<()> {
    if !attribution.has_private() && attribution.undecided.is_empty() {
        return Ok(());
    }
    let shares: Vec<String> = attribution
        .pools
        .iter()
        .map(|share| {
            let name = if share.pool.is_default() {
                "default pools".to_owned()
            } else if share.pool.0 >= tensormem_replay::UNNAMED_POOL_BASE {
                format!(
                    "unnamed private pool {}",
                    share.pool.0 - tensormem_replay::UNNAMED_POOL_BASE
                )
            } else {
                format!("private pool {}", share.pool)
            };
            let why: Vec<String> = share
                .by_evidence
                .iter()
                .map(|(evidence, n)| {
                    let what = match evidence {
                        PoolEvidence::Recorded => "recorded pool_id",
                        PoolEvidence::FinalSegments => "final segments",
                        PoolEvidence::PoolRelease => "released with its pool only",
                        PoolEvidence::DefaultCouldServe => "default pool could have served",
                        PoolEvidence::Contradiction => "other pool contradicted",
                        PoolEvidence::Assumed => "assumed",
                    };
                    format!("{n} {what}")
                })
                .collect();
            format!(
                "{name}: {} in {} ({})",
                crate::count(share.allocations, "allocation", "allocations"),
                crate::count(share.segments, "segment", "segments"),
                why.join(", ")
            )
        })
        .collect();
    writeln!(
        out,
        "device {device} pools (inferred): {}",
        shares.join("; ")
    )?;
    if attribution.flips > 0 || attribution.gave_up {
        writeln!(
            out,
            "  {} assumptions flipped by the record{}",
            attribution.flips,
            if attribution.gave_up {
                "; gave up: the record contradicts every assignment tried"
            } else {
                ""
            }
        )?;
    }
    let listed = |pools: &[tensormem_cuda_alloc::MempoolId]| {
        pools
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !attribution.no_split.is_empty() {
        writeln!(
            out,
            "  assumption: device {device}: private pool {} made with no_split \
             (torch.cuda.MemPool(no_split=True), not in the snapshot): the record agrees only so",
            listed(&attribution.no_split)
        )?;
    }
    if !attribution.own_allocator.is_empty() {
        writeln!(
            out,
            "  assumption: device {device}: private pool {} made with its own allocator \
             (torch.cuda.MemPool(allocator=...), not in the snapshot): its segments are whole \
             device allocations under expandable segments",
            listed(&attribution.own_allocator)
        )?;
    }
    if attribution.private_ooms > 0 {
        writeln!(
            out,
            "  {} out-of-memory requests replayed in a private pool{}",
            attribution.private_ooms,
            if attribution.ooms_from_stats > 0 {
                format!(
                    " ({} of them by the recorded num_alloc_retries: the trace shows the same for either pool)",
                    attribution.ooms_from_stats
                )
            } else {
                String::new()
            }
        )?;
    }
    if let Some(first) = attribution.undecided.first() {
        writeln!(
            out,
            "  {} allocations whose pool the trace does not decide (replayed in the assumed pool); first: event {}, {} bytes on stream {}, assumed {}",
            attribution.undecided.len(),
            first.event,
            first.size,
            first.stream,
            first.assumed
        )?;
    }
    Ok(())
}

/// What a row of the model of `backend:cudaMallocAsync` means: which figures are exact, which are
/// bounds, and what it found about running out of memory.
fn async_lines(out: &mut impl Write, run: &ReplayRun) -> io::Result<()> {
    let Some(first) = run.devices.iter().find_map(|d| d.async_model.as_ref()) else {
        return Ok(());
    };
    writeln!(
        out,
        "{}: modelled, not replayed: the driver's memory pool places each request, and PyTorch \
         records no trace under this backend.\n  peak allocated: the pool's used memory, the live \
         requested bytes (exact; the driver documents no rounding of them).\n  peak reserved is a \
         lower bound (>=): the used memory rounded up to the pool's {} physical granularity \
         (assumed), held until empty_cache() (nothing goes back at synchronisations); what the pool \
         holds beyond it (fragmentation, memory kept for reuse across streams) is the driver's \
         decision, recorded nowhere.\n  device allocs, frees, retries: PyTorch counts none under \
         this backend; OOMs: requests that fail for certain.",
        run.label(),
        format_size(first.granularity)
    )?;
    for device in &run.devices {
        let Some(bounds) = &device.async_model else {
            continue;
        };
        let mut found = Vec::new();
        if bounds.capacity_known {
            found.push(format!(
                "on {} of device memory: {} (the pool would need more than the device has), at \
                 least {} left for fragmentation at the fullest",
                format_size(bounds.capacity),
                crate::count(
                    bounds.ooms,
                    "certain out-of-memory error",
                    "certain out-of-memory errors"
                ),
                format_size(bounds.headroom)
            ));
        } else {
            found.push(
                "the trace implies no device size (give --capacity): no request is known to fail"
                    .to_owned(),
            );
        }
        if let Some(limit) = bounds.memory_limit {
            found.push(format!(
                "{} by PyTorch's limit of {} from the program's memory fraction (exact for that \
                 limit; the trace bounds it to the interval below)",
                crate::count(bounds.limit_ooms, "request refused", "requests refused"),
                format_size(limit)
            ));
        }
        if bounds.recorded_ooms_served > 0 {
            found.push(format!(
                "{} that failed in the recorded run fit the device here and count as served \
                 (whether the driver's fragmentation fails them is unknown)",
                crate::count(bounds.recorded_ooms_served, "request", "requests")
            ));
        }
        if bounds.empty_cache_calls > 0 {
            found.push(format!(
                "{} in the trace trim the pool",
                crate::count(
                    bounds.empty_cache_calls,
                    "empty_cache() call",
                    "empty_cache() calls"
                )
            ));
        }
        writeln!(out, "  device {}: {}", device.device, found.join("; "))?;
    }
    Ok(())
}

/// The table's columns as `torch.cuda.memory_stats()` names them.
const LEGEND: &str = "columns as memory_stats() keys: peak allocated = allocated_bytes.all.peak, \
peak reserved = reserved_bytes.all.peak,\n  device allocs = num_device_alloc, device frees = \
num_device_free, retries = num_alloc_retries, OOMs = num_ooms";

/// What the recorded run was checked against, and what differed.
fn details(out: &mut impl Write, header: &Header<'_>, run: &ReplayRun) -> io::Result<()> {
    let checks: Vec<&Check> = run
        .devices
        .iter()
        .filter_map(|d| d.check.as_ref())
        .collect();
    let allocations: u64 = checks.iter().map(|c| c.allocations).sum();
    let segments: usize = checks
        .iter()
        .filter_map(|c| c.segments.as_ref())
        .map(|s| s.recorded)
        .sum();
    let blocks: usize = checks
        .iter()
        .filter_map(|c| c.segments.as_ref())
        .map(|s| s.blocks)
        .sum();
    let mut against = vec![
        format!(
            "{allocations} allocations (address and bytes reserved after each, from the trace)"
        ),
        format!(
            "{} and {} (the snapshot's final state)",
            crate::count(segments as u64, "segment", "segments"),
            crate::count(blocks as u64, "block", "blocks")
        ),
    ];
    let stats: Vec<(usize, usize)> = run
        .devices
        .iter()
        .filter_map(|d| Some((d.device, d.check.as_ref()?.stats.as_ref()?.compared)))
        .collect();
    match (stats.as_slice(), header.expected_from) {
        ([(_, compared)], Some(from)) if run.devices.len() == 1 => {
            against.push(format!("{compared} figures of memory_stats() ({from})"));
        }
        ([_, ..], Some(from)) => {
            let per: Vec<String> = stats
                .iter()
                .map(|(d, n)| format!("{n} of memory_stats({d})"))
                .collect();
            against.push(format!("figures {} ({from})", per.join(", ")));
        }
        _ => against.push("no memory_stats() record (none saved as NAME.stats.json)".to_owned()),
    }
    writeln!(out, "checked against the record: {}", against.join("; "))?;
    for (device, check) in run
        .devices
        .iter()
        .filter_map(|d| Some((d.device, d.check.as_ref()?)))
    {
        if let Some(divergence) = &check.divergence {
            writeln!(
                out,
                "  first divergence: {divergence} ({} address and {} reserved-bytes mismatches)",
                check.address_mismatches, check.reserved_mismatches
            )?;
        }
        if let Some(segments) = &check.segments {
            for mismatch in segments.mismatches.iter().take(5) {
                writeln!(out, "  segments: {mismatch}")?;
            }
        }
        if let Some(stats) = &check.stats {
            if stats.compared == 0 {
                writeln!(
                    out,
                    "  memory_stats(): none of the record's {} figures is one the replay produces, \
                     so nothing was compared (not a match)",
                    stats.recorded
                )?;
            }
            for (key, written) in stats.unreadable.iter().take(10) {
                writeln!(
                    out,
                    "  {key}: PyTorch {written}, which is not a whole number a memory_stats() figure can be"
                )?;
            }
            for m in stats.mismatches.iter().take(10) {
                writeln!(
                    out,
                    "  device {device}: {}: replay {}, PyTorch {}",
                    m.key, m.replayed, m.recorded
                )?;
            }
            for m in &stats.undetermined {
                writeln!(
                    out,
                    "  assumption: device {device}: {}: replay {}, PyTorch {} (not a mismatch: {})",
                    m.key,
                    m.replayed,
                    m.recorded,
                    tensormem_replay::StatsCheck::undetermined_reason(&m.key).unwrap_or("")
                )?;
            }
        }
    }
    for device in &run.devices {
        let restores = device.restores;
        if restores.applied + restores.not_applied > 0 {
            writeln!(
                out,
                "  inferred: device {}: {} of CUDA graph trees (setCheckpointPoolState; the trace \
                 shows only the blocks they cut), {} through the allocator's checkpoint API{}",
                device.device,
                crate::count(
                    restores.applied + restores.not_applied,
                    "checkpoint restore",
                    "checkpoint restores"
                ),
                restores.applied,
                if restores.not_applied > 0 {
                    format!(
                        ", {} replayed as requests (no checkpoint the replay took agreed with it, \
                         or the pool has expandable segments)",
                        restores.not_applied
                    )
                } else {
                    String::new()
                }
            )?;
        }
        if device.addresses.invented > 0 {
            writeln!(
                out,
                "  device {}: {} segments placed at invented addresses (the recorded ones did not fit)",
                device.device, device.addresses.invented
            )?;
        }
        if device.unmatched_frees > 0 {
            writeln!(
                out,
                "  device {}: {} frees of blocks the trace never allocated were skipped (it starts mid-run)",
                device.device, device.unmatched_frees
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use tensormem_cuda_alloc::config::AllocatorConfig;
    use tensormem_replay::{SettingsInference, SettingsPhase};

    use super::settings_lines;

    fn phase(from_event: usize, config: &str) -> SettingsPhase {
        SettingsPhase {
            from_event,
            config: AllocatorConfig::parse(config).unwrap(),
        }
    }

    fn lines(settings: &SettingsInference) -> String {
        let mut out = Vec::new();
        settings_lines(&mut out, 0, settings).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn several_changes_are_listed_stretch_by_stretch() {
        let settings = SettingsInference {
            first_departure: Some(30),
            phases: vec![
                phase(0, ""),
                phase(310, "roundup_power2_divisions:4"),
                phase(649, "max_split_size_mb:64"),
            ],
            switch_window: Some((640, 660)),
            ..SettingsInference::default()
        };
        let text = lines(&settings);
        assert!(text.contains("changed 2 times"), "{text}");
        assert!(
            text.contains(
                "PyTorch's defaults from event 0, roundup_power2_divisions:4 from event 310, \
                 max_split_size_mb:64 from event 649"
            ),
            "{text}"
        );
        assert!(
            text.contains("the last change at events 640 to 660"),
            "{text}"
        );
        assert!(
            text.contains("depart from the record at event 30"),
            "{text}"
        );
    }

    #[test]
    fn a_change_no_allocation_tells_names_what_the_allocator_was_made_with() {
        let settings = SettingsInference {
            first_departure: None,
            phases: vec![phase(0, ""), phase(0, "max_split_size_mb:300")],
            switch_window: Some((0, 412)),
            ..SettingsInference::default()
        };
        let text = lines(&settings);
        assert!(
            text.contains("made with PyTorch's defaults (its max_split_size figure)"),
            "{text}"
        );
        assert!(
            text.contains("the recorded max_split_size_mb:300"),
            "{text}"
        );
    }

    #[test]
    fn nothing_is_said_when_the_recorded_settings_explain_the_trace() {
        assert_eq!(lines(&SettingsInference::default()), "");
    }
}
