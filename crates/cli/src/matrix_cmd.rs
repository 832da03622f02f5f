//! `tensormem replay --matrix`: the trace replayed under a grid of allocator settings, ranked by
//! peak reserved bytes, with the recommended `PYTORCH_CUDA_ALLOC_CONF`.
//!
//! The grid, the runs and the ranking are the library's ([`tensormem_replay::SettingsMatrix`]);
//! this module reads the options and prints a table or JSON.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};

use anyhow::{anyhow, Result};
use tensormem_cuda_alloc::size::format_size;
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_replay::{
    Grid, MatrixOptions, MatrixResult, MatrixRow, Replay, Setting, SettingsMatrix,
};

use crate::quiet_broken_pipe;

/// What `--matrix`, `--matrix-values`, `--capacity` and `--json` asked for.
pub(crate) struct MatrixArgs<'a> {
    /// `--matrix`'s value: `all`, or setting keys separated by commas.
    pub(crate) settings: &'a str,
    /// Each `--matrix-values KEY:V1,V2,...`.
    pub(crate) values: &'a [String],
    pub(crate) capacity: Option<u64>,
    pub(crate) json: bool,
}

/// Runs the matrix of `replay` (made from `snapshot`, named `trace` in output) and prints it.
pub(crate) fn run(
    args: &MatrixArgs<'_>,
    trace: &str,
    snapshot: &Snapshot,
    replay: &Replay,
) -> Result<()> {
    let matrix = SettingsMatrix::new(replay, snapshot);
    let grid = grid(&matrix, args)?;
    let total = grid.points().0.len();
    let bar = progress_bar(total);
    let report = |done: usize, _total: usize| {
        if let Some(bar) = &bar {
            bar.set_position(done as u64);
        }
    };
    let options = MatrixOptions {
        capacity: args.capacity,
        threads: 0,
        progress: bar
            .is_some()
            .then_some(&report as &(dyn Fn(usize, usize) + Sync)),
    };
    let result = matrix.run(&grid, &options).map_err(|e| anyhow!("{e}"))?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut stdout = std::io::stdout().lock();
    quiet_broken_pipe(if args.json {
        let json = json(trace, replay, &grid, &result);
        serde_json::to_writer_pretty(&mut stdout, &json)
            .map_err(std::io::Error::from)
            .and_then(|()| writeln!(stdout))
            .and_then(|()| stdout.flush())
    } else {
        print(
            &mut stdout,
            trace,
            replay,
            &grid,
            &result,
            args.capacity.is_some(),
        )
        .and_then(|()| stdout.flush())
    })
}

/// The grid `args` ask for.
fn grid(matrix: &SettingsMatrix<'_>, args: &MatrixArgs<'_>) -> Result<Grid> {
    let mut settings = Vec::new();
    for name in args.settings.split(',').map(str::trim) {
        if name == "all" {
            settings.extend(Setting::ALL);
        } else {
            settings.push(parse_setting(name)?);
        }
    }
    let mut grid = matrix.grid(&settings);
    for pair in args.values {
        let (key, values) = pair.split_once(':').ok_or_else(|| {
            anyhow!("--matrix-values '{pair}': write KEY:V1,V2,... (e.g. max_split_size_mb:unlimited,64,256)")
        })?;
        grid.set_values(parse_setting(key)?, values)?;
    }
    Ok(grid)
}

fn parse_setting(name: &str) -> Result<Setting> {
    Setting::from_key(name).ok_or_else(|| {
        anyhow!(tensormem_replay::GridError::UnknownSetting {
            name: name.to_owned()
        })
    })
}

fn progress_bar(total: usize) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("replaying {bar:40} {pos}/{len} configurations")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(bar)
}

/// The configuration column: the `--config` string, `(defaults)` when it names nothing.
fn label(row: &MatrixRow) -> String {
    let mut label = if row.point.what_if.is_empty() {
        "(defaults)".to_owned()
    } else {
        row.point.what_if.clone()
    };
    if row.recorded {
        label.push_str(" [recorded]");
    }
    label
}

/// `delta` bytes with its sign, and as a share of `base`.
fn signed_size(delta: i64, base: u64) -> String {
    if delta == 0 {
        return "0".to_owned();
    }
    let sign = if delta < 0 { "-" } else { "+" };
    let share = if base > 0 {
        format!(
            " ({sign}{:.1}%)",
            delta.unsigned_abs() as f64 * 100.0 / base as f64
        )
    } else {
        String::new()
    };
    format!("{sign}{}{share}", format_size(delta.unsigned_abs()))
}

fn print(
    out: &mut impl Write,
    trace: &str,
    replay: &Replay,
    grid: &Grid,
    result: &MatrixResult,
    capacity_given: bool,
) -> std::io::Result<()> {
    writeln!(
        out,
        "trace: {trace}: {} events, {}",
        replay.events(),
        crate::count(replay.devices().len() as u64, "device", "devices")
    )?;
    device_memory(out, replay, result, capacity_given)?;
    let recorded = result.recorded();
    let titles = [
        "rank",
        "configuration",
        "peak reserved",
        "vs recorded",
        "peak allocated",
        "reserved/allocated",
        "device allocs",
        "device frees",
        "retries",
        "OOMs",
        "path",
        "verdict",
    ];
    let rows: Vec<Vec<String>> = result
        .rows
        .iter()
        .enumerate()
        .map(|(index, row)| {
            vec![
                (index + 1).to_string(),
                label(row),
                format_size(row.peak_reserved()),
                signed_size(result.delta_reserved(row), recorded.peak_reserved()),
                format_size(row.peak_allocated()),
                row.ratio()
                    .map_or_else(|| "-".to_owned(), |r| format!("{r:.3}")),
                row.figure("num_device_alloc").to_string(),
                row.figure("num_device_free").to_string(),
                row.figure("num_alloc_retries").to_string(),
                row.figure("num_ooms").to_string(),
                path(row),
                verdict(row),
            ]
        })
        .collect();
    crate::table(out, &titles, &rows, &[1, 10, 11])?;
    for line in [
        "configuration: the --config string that gives the row over the recorded configuration",
        "path: \"as recorded\" when every request fails or succeeds as in the recorded run (the \
         figures are then the program's own); \"differs\" when an out-of-memory error moves: the \
         program would have gone on differently, the replay goes on as recorded",
        "verdict: disqualified when a request fails that the recorded run served",
    ] {
        writeln!(out, "{line}")?;
    }
    grid_lines(out, grid, result)?;
    recommendation(out, result)?;
    writeln!(
        out,
        "{} replayed in {:.2} s",
        crate::count(result.rows.len() as u64, "configuration", "configurations"),
        result.seconds
    )
}

/// The path column: whether the requests fail and succeed as recorded, and how they differ.
fn path(row: &MatrixRow) -> String {
    if row.same_path() {
        return "as recorded".to_owned();
    }
    let mut how = Vec::new();
    if row.new_ooms > 0 {
        how.push(crate::count(row.new_ooms, "new OOM", "new OOMs"));
    }
    if row.served_ooms > 0 {
        how.push(format!(
            "{} served",
            crate::count(row.served_ooms, "recorded OOM", "recorded OOMs")
        ));
    }
    let by_count = if row.by_request { "" } else { " (by count)" };
    format!("differs: {}{by_count}", how.join(", "))
}

/// The verdict column: `fits`, or why the row is disqualified.
fn verdict(row: &MatrixRow) -> String {
    if !row.disqualified() {
        return "fits".to_owned();
    }
    match row.first_new_oom {
        Some(first) => format!(
            "disqualified: out of memory (first: {} at event {} of cuda:{})",
            format_size(first.size),
            first.event,
            first.device
        ),
        None => "disqualified: out of memory".to_owned(),
    }
}

/// Each device's memory, and where it comes from.
fn device_memory(
    out: &mut impl Write,
    replay: &Replay,
    result: &MatrixResult,
    capacity_given: bool,
) -> std::io::Result<()> {
    for device in &result.recorded().run.devices {
        let inference = replay.capacity_inference(device.device);
        let source = if capacity_given {
            "--capacity"
        } else if inference.is_some_and(|c| c.capacity.is_some()) {
            "what the trace implies"
        } else {
            "the default: nothing in the trace bounds it; --capacity sets it"
        };
        let fraction = inference
            .and_then(|c| c.fraction)
            .map(|f| format!(", of which per_process_memory_fraction {f:.6} may be reserved"))
            .unwrap_or_default();
        writeln!(
            out,
            "device memory: cuda:{} {} ({source}){fraction}",
            device.device,
            format_size(device.capacity)
        )?;
    }
    Ok(())
}

/// The values tried, the notes and the combinations left out.
fn grid_lines(out: &mut impl Write, grid: &Grid, result: &MatrixResult) -> std::io::Result<()> {
    let values: Vec<String> = Setting::ALL
        .iter()
        .map(|&s| {
            let values = grid.values(s);
            if values.len() > 1 {
                format!("{s} {}", values.join(","))
            } else {
                format!("{s} {} (as recorded)", values.join(","))
            }
        })
        .collect();
    writeln!(out, "grid: {}", values.join("; "))?;
    for note in &result.notes {
        writeln!(out, "  {note}")?;
    }
    if result.left_out > 0 {
        writeln!(
            out,
            "  {} left out: each replays exactly as a row above (roundup_power2_divisions 1 rounds \
             as 0)",
            crate::count(result.left_out as u64, "combination", "combinations")
        )?;
    }
    Ok(())
}

fn recommendation(out: &mut impl Write, result: &MatrixResult) -> std::io::Result<()> {
    let (Some(best), Some(row)) = (result.recommendation(), result.best()) else {
        return writeln!(
            out,
            "no recommendation: every configuration of the grid runs out of memory on this device \
             where the recorded run did not"
        );
    };
    let recorded = result.recorded();
    let fraction = best
        .program_fraction
        .map(|f| {
            format!(
                ", with the program's own torch.cuda.set_per_process_memory_fraction() (replayed as {f:.6})"
            )
        })
        .unwrap_or_default();
    let path = if row.same_path() {
        String::new()
    } else {
        format!("; {}", row.path())
    };
    if best.recorded {
        writeln!(
            out,
            "recommended: keep the recorded configuration, PYTORCH_CUDA_ALLOC_CONF=\"{}\"{fraction}: \
             no configuration of the grid reserves less than its {}{path}",
            best.env,
            format_size(best.peak_reserved)
        )
    } else if recorded.disqualified() {
        writeln!(
            out,
            "recommended: PYTORCH_CUDA_ALLOC_CONF=\"{}\"{fraction}: peak reserved {}; the recorded \
             configuration runs out of memory on this device ({}){path}",
            best.env,
            format_size(best.peak_reserved),
            crate::count(recorded.new_ooms, "request fails", "requests fail"),
        )
    } else {
        let delta = best.peak_reserved as i64 - recorded.peak_reserved() as i64;
        writeln!(
            out,
            "recommended: PYTORCH_CUDA_ALLOC_CONF=\"{}\"{fraction}: peak reserved {}, {} against \
             the recorded configuration's {}{path}",
            best.env,
            format_size(best.peak_reserved),
            signed_size(delta, recorded.peak_reserved()),
            format_size(recorded.peak_reserved())
        )
    }
}

/// `--json`: every row with its figures, the grid, and the recommendation.
fn json(trace: &str, replay: &Replay, grid: &Grid, result: &MatrixResult) -> serde_json::Value {
    let recorded_peak = result.recorded().peak_reserved();
    let rows: Vec<serde_json::Value> = result
        .rows
        .iter()
        .enumerate()
        .map(|(index, row)| {
            let devices: BTreeMap<String, serde_json::Value> = row
                .run
                .devices
                .iter()
                .map(|d| {
                    (
                        d.device.to_string(),
                        serde_json::json!({
                            "stats": d.stats.to_flat(),
                            "capacity": d.capacity,
                            "refused": d.refused,
                        }),
                    )
                })
                .collect();
            let mut entry = serde_json::json!({
                "rank": index + 1,
                "what_if": row.point.what_if,
                "config": row.point.config.to_string(),
                "recorded": row.recorded,
                "peak_reserved": row.peak_reserved(),
                "peak_allocated": row.peak_allocated(),
                "reserved_over_allocated": row.ratio(),
                "delta_reserved": result.delta_reserved(row),
                "num_device_alloc": row.figure("num_device_alloc"),
                "num_device_free": row.figure("num_device_free"),
                "num_alloc_retries": row.figure("num_alloc_retries"),
                "num_ooms": row.figure("num_ooms"),
                "disqualified": row.disqualified(),
                "reason": row.reason(),
                "new_ooms": row.new_ooms,
                "served_ooms": row.served_ooms,
                "same_path": row.same_path(),
                "path": row.path(),
                "devices": devices,
                "seconds": row.run.seconds,
            });
            if let Some(matches) = row.run.matches_record() {
                entry["matches_record"] = serde_json::Value::Bool(matches);
            }
            entry
        })
        .collect();
    let values: BTreeMap<&str, Vec<String>> = Setting::ALL
        .iter()
        .map(|&s| (s.key(), grid.values(s)))
        .collect();
    let recommendation = result.recommendation().map(|r| {
        serde_json::json!({
            "PYTORCH_CUDA_ALLOC_CONF": r.env,
            "what_if": r.what_if,
            "program_fraction": r.program_fraction,
            "peak_reserved": r.peak_reserved,
            "delta_reserved": r.peak_reserved as i64 - recorded_peak as i64,
            "recorded": r.recorded,
        })
    });
    serde_json::json!({
        "trace": trace,
        "events": replay.events(),
        "grid": { "values": values, "notes": result.notes, "left_out": result.left_out },
        "rows": rows,
        "recommendation": recommendation,
        "seconds": result.seconds,
    })
}
