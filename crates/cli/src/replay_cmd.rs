//! `tensormem replay`: replays a PyTorch allocator trace under its recorded configuration and under
//! what-if configurations, and reports what each would have reserved.
//!
//! The work is the library's ([`tensormem_replay`]); this module reads the files, runs
//! the configurations, and prints a table, JSON, an SVG timeline, or the final snapshot.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use clap::Args;
use tensormem_cuda_alloc::snapshot::{ReadLimits, Snapshot, SnapshotError};
use tensormem_replay::{ExpectedStats, Replay, ReplayRun, RestoreCount, RunOptions};

use crate::embedded;
use crate::matrix_cmd;
use crate::plot;
use crate::replay_report;

/// Arguments of `tensormem replay`.
#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// A snapshot with a trace, as torch.cuda.memory._dump_snapshot writes it (pickle, gzip-compressed
    /// pickle, or tensormem's JSON). Default: a GPT-2 training trace built into the binary. Statistics
    /// saved beside it as NAME.stats.json (json.dumps(torch.cuda.memory_stats())) are checked too.
    trace: Option<PathBuf>,

    /// A what-if configuration (PYTORCH_CUDA_ALLOC_CONF syntax), applied over the recorded one the
    /// way torch.cuda.memory._set_allocator_settings would; repeat for several runs.
    /// backend:cudaMallocAsync models the driver's memory pool: used memory exact, reserved a lower
    /// bound.
    #[arg(long = "config", value_name = "STR")]
    configs: Vec<String>,

    /// Print {"trace", "events", "runs": [{"config", "stats", "devices": {"D": {"stats"}},
    /// "seconds"}]} as JSON on stdout, and nothing else there ("stats" is device 0's, as
    /// memory_stats() with no argument). A backend:cudaMallocAsync run adds "lower_bounds" (the
    /// keys of "stats" that are lower bounds) and, per device, "async_model" (what the model could
    /// not know, and its out-of-memory errors).
    #[arg(long)]
    json: bool,

    /// Write an SVG timeline of allocated, reserved and requested bytes, one panel per configuration.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// Write the replaying allocator's final snapshot (recorded configuration; with its own trace) as
    /// a pickle PyTorch's _memory_viz opens, or as JSON when FILE ends in .json.
    #[arg(long, value_name = "FILE")]
    snapshot_out: Option<PathBuf>,

    /// Memory of the simulated device, e.g. 80GiB (binary units; K, M, G, T also accepted). Default:
    /// what the trace implies (its expandable reservations, its out-of-memory events), else 1 TiB.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    capacity: Option<u64>,

    /// The most bytes read from TRACE, and the most a gzip-compressed TRACE may expand to (default
    /// 1GiB): a guard against files that are not snapshots. Raise it only for a trace you trust.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    max_trace_bytes: Option<u64>,

    /// Replay the trace under a grid of allocator settings and rank them by peak reserved bytes,
    /// with the recommended PYTORCH_CUDA_ALLOC_CONF: all four settings (expandable_segments,
    /// max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold), or those named
    /// (--matrix=expandable_segments,max_split_size_mb). Settings not named keep their recorded
    /// values. A configuration under which a request fails that the recorded run served is
    /// disqualified.
    #[arg(
        long,
        value_name = "SETTINGS",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "all",
        conflicts_with_all = ["configs", "plot", "snapshot_out"]
    )]
    matrix: Option<String>,

    /// The values --matrix tries for one setting, KEY:V1,V2,... in PYTORCH_CUDA_ALLOC_CONF syntax
    /// (max_split_size_mb:unlimited,64,256; roundup_power2_divisions:0,4;
    /// garbage_collection_threshold:off,0.7); the setting is then varied. Repeat for several.
    #[arg(long, value_name = "KEY:VALUES", requires = "matrix")]
    matrix_values: Vec<String>,

    /// The most values TRACE's pickle may build (default 33554432, about 2 GiB of memory at worst):
    /// a guard against pickle bombs. Raise it only for a trace you trust.
    #[arg(long, value_name = "N")]
    max_trace_values: Option<u64>,
}

impl ReplayArgs {
    /// The limits on reading the trace.
    fn read_limits(&self) -> ReadLimits {
        let mut limits = ReadLimits::DEFAULT;
        if let Some(bytes) = self.max_trace_bytes {
            limits = limits
                .with_max_input_bytes(bytes)
                .with_max_decompressed_bytes(bytes);
        }
        if let Some(values) = self.max_trace_values {
            limits = limits.with_max_values(values);
        }
        limits
    }
}

/// Where the trace came from.
struct Source {
    /// How to name it in output.
    name: String,
    snapshot: Snapshot,
    expected: Option<ExpectedStats>,
    /// Where the expected statistics came from, for the report.
    expected_from: Option<String>,
}

/// Runs `tensormem replay`.
pub(crate) fn run(args: ReplayArgs) -> Result<()> {
    let source = load(args.trace.as_deref(), &args.read_limits())?;
    let mut replay = Replay::new(&source.snapshot).map_err(flat)?;
    if let Some(expected) = source.expected.clone() {
        replay = replay.with_expected_stats(expected);
    }
    if let Some(settings) = &args.matrix {
        let matrix = matrix_cmd::MatrixArgs {
            settings,
            values: &args.matrix_values,
            capacity: args.capacity,
            json: args.json,
        };
        return matrix_cmd::run(&matrix, &source.name, &source.snapshot, &replay);
    }
    // Parse every configuration before running anything, so a typo fails at once.
    let mut plans = vec![(replay.recorded_config().clone(), true)];
    for text in &args.configs {
        plans.push((replay.what_if_config(text).map_err(flat)?, false));
    }

    let progress = progress_bar(replay.events() * plans.len() as u64);
    let mut runs = Vec::with_capacity(plans.len());
    for (index, (config, recorded)) in plans.into_iter().enumerate() {
        let done_before = replay.events() * index as u64;
        let report = |events: u64| {
            if let Some(bar) = &progress {
                bar.set_position(done_before + events);
            }
        };
        let mut options = RunOptions::new(config);
        options.check = recorded;
        options.capacity = args.capacity;
        options.snapshot = recorded && args.snapshot_out.is_some();
        options.record_history = options.snapshot;
        options.progress = progress
            .is_some()
            .then_some(&report as &(dyn Fn(u64) + Sync));
        runs.push(replay.run(&options).map_err(flat)?);
    }
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }

    if let Some(path) = &args.plot {
        plot::write_timeline(path, &source.name, &runs, args.capacity)
            .with_context(|| format!("cannot write the plot {}", path.display()))?;
    }
    if let Some(path) = &args.snapshot_out {
        write_snapshot(path, &runs[0])?;
    }
    crate::quiet_broken_pipe(print_report(&args, &source, &replay, &runs))
}

fn print_report(
    args: &ReplayArgs,
    source: &Source,
    replay: &Replay,
    runs: &[ReplayRun],
) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let mut json = json_report(&source.name, replay.events(), runs);
        json["pools"] = pools_json(replay);
        json["changed_while_running"] = changes_json(replay);
        serde_json::to_writer_pretty(&mut stdout, &json)?;
        writeln!(stdout)?;
    } else {
        replay_report::print(
            &mut stdout,
            &replay_report::Header {
                trace: &source.name,
                events: replay.events(),
                devices: replay.devices().len(),
                expected_from: source.expected_from.as_deref(),
                capacity: replay
                    .devices()
                    .into_iter()
                    .filter_map(|d| Some((d, replay.capacity_inference(d)?)))
                    .collect(),
                capacity_given: args.capacity.is_some(),
                pools: replay
                    .devices()
                    .into_iter()
                    .filter_map(|d| Some((d, replay.pool_attribution(d)?)))
                    .collect(),
                settings: replay
                    .devices()
                    .into_iter()
                    .filter_map(|d| Some((d, replay.settings_inference(d)?)))
                    .collect(),
            },
            runs,
        )?;
        if let Some(path) = &args.plot {
            writeln!(stdout, "timeline: {}", path.display())?;
        }
        if let Some(path) = &args.snapshot_out {
            writeln!(stdout, "snapshot: {}", path.display())?;
        }
    }
    stdout.flush()
}

/// A library error as one line (its message already names its cause).
fn flat(error: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("{error}")
}

/// A trace-reading error, naming the option that raises the limit it hit.
fn read_error(error: SnapshotError) -> anyhow::Error {
    let option = match &error {
        SnapshotError::TooLarge { limit, .. } if *limit == "max_values" => "--max-trace-values",
        SnapshotError::TooLarge { .. } => "--max-trace-bytes",
        _ => return flat(error),
    };
    anyhow!("{error} (here: {option})")
}

fn load(path: Option<&Path>, limits: &ReadLimits) -> Result<Source> {
    let Some(path) = path else {
        let snapshot = embedded::gpt2_train().map_err(flat)?;
        return Ok(Source {
            name: embedded::NAME.to_owned(),
            snapshot,
            expected: Some(embedded::gpt2_train_stats().map_err(flat)?),
            expected_from: Some(format!("built-in {}", embedded::STATS_NAME)),
        });
    };
    let snapshot = Snapshot::read_file_with_limits(path, limits).map_err(read_error)?;
    let beside = stats_beside(path);
    let expected =
        beside
            .as_ref()
            .filter(|p| p.is_file())
            .and_then(|p| match ExpectedStats::read_file(p) {
                Ok(stats) => Some((stats, p.display().to_string())),
                Err(error) => {
                    tracing::warn!(%error, "ignoring the statistics beside the trace");
                    None
                }
            });
    let (expected, expected_from) = match expected {
        Some((stats, from)) => (Some(stats), Some(from)),
        None => (None, None),
    };
    Ok(Source {
        name: path.display().to_string(),
        snapshot,
        expected,
        expected_from,
    })
}

/// `DIR/NAME.stats.json` for `DIR/NAME.pickle` (also `.pkl`, `.json`, with or without `.gz`).
pub(crate) fn stats_beside(trace: &Path) -> Option<PathBuf> {
    let mut name = trace.file_name()?.to_str()?;
    for suffix in [".gz", ".pickle", ".pkl", ".json"] {
        name = name.strip_suffix(suffix).unwrap_or(name);
    }
    Some(trace.with_file_name(format!("{name}.stats.json")))
}

fn progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("replaying {bar:40} {pos}/{len} events")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(bar)
}

fn write_snapshot(path: &Path, run: &ReplayRun) -> Result<()> {
    let snapshot = run
        .snapshot()
        .ok_or_else(|| anyhow!("the replay produced no snapshot"))?;
    let is_json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    if is_json {
        let file = std::fs::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        snapshot.write_json(file).map_err(flat)
    } else {
        snapshot.write_pickle_file(path).map_err(flat)
    }
}

fn json_report(trace: &str, events: u64, runs: &[ReplayRun]) -> serde_json::Value {
    let runs: Vec<serde_json::Value> = runs
        .iter()
        .map(|run| {
            let stats: BTreeMap<String, i64> = run.flat_stats();
            let devices: BTreeMap<String, serde_json::Value> = run
                .devices
                .iter()
                .map(|d| {
                    let mut entry = serde_json::json!({
                        "stats": d.stats.to_flat(),
                        "capacity": d.capacity,
                    });
                    if let Some(check) = &d.check {
                        entry["matches_record"] = serde_json::Value::Bool(check.matches());
                    }
                    if let Some(bounds) = &d.async_model {
                        entry["async_model"] = serde_json::json!(bounds);
                    }
                    if d.restores != RestoreCount::default() {
                        entry["checkpoint_restores"] = serde_json::json!({
                            "applied": d.restores.applied,
                            "not_applied": d.restores.not_applied,
                        });
                    }
                    (d.device.to_string(), entry)
                })
                .collect();
            let mut entry = serde_json::json!({
                "config": run.config.to_string(),
                "stats": stats,
                "devices": devices,
                "seconds": run.seconds,
            });
            if run.devices.len() > 1 {
                entry["total_stats"] = serde_json::json!(run.total_stats());
            }
            if let Some(matches) = run.matches_record() {
                entry["matches_record"] = serde_json::Value::Bool(matches);
            }
            if !run.lower_bounds().is_empty() {
                // The model of backend:cudaMallocAsync: these figures are at least the values given.
                entry["lower_bounds"] = serde_json::json!(run.lower_bounds());
            }
            entry
        })
        .collect();
    serde_json::json!({ "trace": trace, "events": events, "runs": runs })
}

/// Per device, which allocations the replay attributed to which pool, and the undecided ones.
fn pools_json(replay: &Replay) -> serde_json::Value {
    let devices: BTreeMap<String, serde_json::Value> = replay
        .devices()
        .into_iter()
        .filter_map(|d| {
            let a = replay.pool_attribution(d)?;
            let pools: Vec<serde_json::Value> = a
                .pools
                .iter()
                .map(|p| {
                    let evidence: BTreeMap<String, u64> = p
                        .by_evidence
                        .iter()
                        .map(|(e, n)| (format!("{e:?}"), *n))
                        .collect();
                    serde_json::json!({
                        "pool": [p.pool.0, p.pool.1],
                        "allocations": p.allocations,
                        "segments": p.segments,
                        "evidence": evidence,
                    })
                })
                .collect();
            let undecided: Vec<serde_json::Value> = a
                .undecided
                .iter()
                .map(|u| {
                    serde_json::json!({
                        "event": u.event,
                        "size": u.size,
                        "stream": u.stream.0,
                        "assumed": [u.assumed.0, u.assumed.1],
                    })
                })
                .collect();
            Some((
                d.to_string(),
                serde_json::json!({
                    "pools": pools,
                    "undecided": undecided,
                    "flips": a.flips,
                    "gave_up": a.gave_up,
                    "no_split": a.no_split.iter().map(|p| [p.0, p.1]).collect::<Vec<_>>(),
                    "own_allocator": a.own_allocator.iter().map(|p| [p.0, p.1]).collect::<Vec<_>>(),
                }),
            ))
        })
        .collect();
    serde_json::json!(devices)
}

/// Per device, what the program changed while it ran, as the replay infers it: the memory limits
/// (stretches of events under one limit each) and the allocator settings (the settings in force
/// before the recorded ones, and where they changed), empty lists when nothing changed.
fn changes_json(replay: &Replay) -> serde_json::Value {
    let devices: BTreeMap<String, serde_json::Value> = replay
        .devices()
        .into_iter()
        .map(|d| {
            let limits: Vec<serde_json::Value> = replay
                .capacity_inference(d)
                .map(|c| c.phases.as_slice())
                .unwrap_or_default()
                .iter()
                .map(|p| {
                    serde_json::json!({
                        "from_event": p.from_event,
                        "changed_after": p.changed_after,
                        "lower": p.lower,
                        "upper": p.upper,
                        "allowed": p.allowed,
                        "fraction": p.fraction,
                    })
                })
                .collect();
            let settings = replay.settings_inference(d);
            let phases: Vec<serde_json::Value> = settings
                .map(|s| s.phases.as_slice())
                .unwrap_or_default()
                .iter()
                .map(|p| serde_json::json!({"from_event": p.from_event, "config": p.config.to_string()}))
                .collect();
            (
                d.to_string(),
                serde_json::json!({
                    "limits": limits,
                    "settings": phases,
                    "settings_first_departure": settings.and_then(|s| s.first_departure),
                    "settings_switch_window": settings.and_then(|s| s.switch_window),
                }),
            )
        })
        .collect();
    serde_json::json!(devices)
}

/// Parses a byte count: a number with an optional unit (`B`, `K`/`KB`/`KiB`, `M`..., `G`...,
/// `T`...; all binary).
pub(crate) fn parse_bytes(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a size; write e.g. 80GiB or 85899345920"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown unit '{other}' in '{text}'; use B, KiB, MiB, GiB or TiB"
            ))
        }
    };
    let bytes = value * (1u64 << shift) as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("'{text}' is not a usable device size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("1.5 g"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("2T"), Ok(2 << 40));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
    }

    #[test]
    fn statistics_are_looked_for_beside_the_trace() {
        let beside = |p: &str| stats_beside(Path::new(p)).unwrap();
        assert_eq!(
            beside("traces/gpt2_train.pickle"),
            Path::new("traces/gpt2_train.stats.json")
        );
        assert_eq!(beside("x/run.pickle.gz"), Path::new("x/run.stats.json"));
        assert_eq!(beside("snap.json"), Path::new("snap.stats.json"));
    }
}
