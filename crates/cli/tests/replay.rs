//! `tensormem replay` and `tensormem snapshot summary`, run as a user runs them: the built binary,
//! its exit status, stdout and stderr.

use std::process::{Command, Output};

mod common;

use common::{stderr, stdout, tensormem, trace};

/// Asserts a failure reported on exactly one line that names `what`.
fn fails_with_one_line(output: &Output, what: &str) {
    assert!(!output.status.success(), "should fail");
    let err = stderr(output);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr, got: {err}");
    assert!(lines[0].starts_with("tensormem: error: "), "{err}");
    assert!(lines[0].contains(what), "{err} should mention {what}");
    assert_eq!(stdout(output), "", "nothing on stdout");
}

#[test]
fn replay_with_no_arguments_replays_the_built_in_trace_and_matches_the_record() {
    let output = tensormem(&["replay"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(text.contains("built-in gpt2_train: 9679 events"), "{text}");
    let row = text
        .lines()
        .find(|l| l.contains("[recorded]"))
        .expect("a row for the recorded configuration");
    // Peak allocated and reserved as PyTorch reported them (5414578688 and 6079643648 bytes).
    assert!(
        row.contains("5.04 GiB") && row.contains("5.66 GiB"),
        "{row}"
    );
    assert!(row.ends_with(" yes"), "{row}");
    assert!(text.contains("41 figures of memory_stats()"), "{text}");
}

#[test]
fn json_output_is_the_documented_object_and_nothing_else() {
    let output = tensormem(&[
        "replay",
        &trace("multistream.pickle"),
        "--json",
        "--config",
        "expandable_segments:True",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).expect("stdout is JSON");
    let object = value.as_object().unwrap();
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["changed_while_running", "events", "pools", "runs", "trace"]
    );
    // A program that changed nothing while it ran: no stretches of limits, no settings phases.
    let changed = &value["changed_while_running"]["0"];
    assert_eq!(changed["limits"], serde_json::json!([]));
    assert_eq!(changed["settings"], serde_json::json!([]));
    assert_eq!(value["events"], 1207);
    assert!(value["trace"]
        .as_str()
        .unwrap()
        .ends_with("multistream.pickle"));
    let runs = value["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for (i, run) in runs.iter().enumerate() {
        let mut keys: Vec<&str> = run
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        if i == 0 {
            // The recorded configuration is checked against the record.
            assert_eq!(
                keys,
                ["config", "devices", "matches_record", "seconds", "stats"]
            );
            assert_eq!(run["matches_record"], true);
        } else {
            assert_eq!(keys, ["config", "devices", "seconds", "stats"]);
        }
        assert!(run["seconds"].as_f64().unwrap() > 0.0);
        // One device: its section holds the top-level figures.
        assert_eq!(run["devices"]["0"]["stats"], run["stats"]);
    }
    assert_eq!(runs[0]["config"], "");
    assert_eq!(runs[1]["config"], "expandable_segments:True");
    // PyTorch's figures for the recorded run.
    let stats = &runs[0]["stats"];
    assert_eq!(stats["reserved_bytes.all.peak"], 92_274_688);
    assert_eq!(stats["requested_bytes.all.peak"], 49_545_295);
    assert_eq!(stats["num_device_alloc"], 8);
    assert_eq!(runs[1]["stats"]["segment.all.peak"], 0);
}

#[test]
fn cuda_malloc_async_is_modelled_with_reserved_as_a_lower_bound() {
    let output = tensormem(&["replay", "--config", "backend:cudaMallocAsync"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    let row = text
        .lines()
        .find(|l| l.starts_with("backend:cudaMallocAsync "))
        .expect("a row for the async backend");
    // Peak allocated: gpt2_train's live requested bytes (5405825640); reserved at least that
    // rounded up to 2 MiB (5406457856).
    assert!(
        row.contains("5.03 GiB") && row.contains(">= 5.04 GiB"),
        "{row}"
    );
    assert!(
        text.contains("peak reserved is a lower bound (>=)"),
        "{text}"
    );

    let output = tensormem(&["replay", "--json", "--config", "backend:cudaMallocAsync"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).expect("stdout is JSON");
    let run = &value["runs"][1];
    assert_eq!(run["config"], "backend:cudaMallocAsync");
    assert_eq!(
        run["lower_bounds"],
        serde_json::json!(["reserved_bytes.all.current", "reserved_bytes.all.peak"])
    );
    assert_eq!(run["stats"]["allocated_bytes.all.peak"], 5_405_825_640u64);
    assert_eq!(run["stats"]["reserved_bytes.all.peak"], 5_406_457_856u64);
    assert_eq!(run["stats"]["num_device_alloc"], 0);
    let model = &run["devices"]["0"]["async_model"];
    assert_eq!(model["granularity"], 2 << 20);
    assert_eq!(model["ooms"], 0);
    assert!(value["runs"][0].get("lower_bounds").is_none());
}

#[test]
fn a_missing_file_fails_with_one_line() {
    fails_with_one_line(
        &tensormem(&["replay", "/nonexistent/trace.pickle"]),
        "/nonexistent/trace.pickle",
    );
}

#[test]
fn a_file_that_is_not_a_snapshot_fails_with_one_line() {
    let cargo_toml = format!("{}/Cargo.toml", env!("CARGO_MANIFEST_DIR"));
    fails_with_one_line(
        &tensormem(&["replay", &cargo_toml]),
        "not a memory snapshot",
    );
    let dir = tempfile::tempdir().unwrap();
    let truncated = dir.path().join("truncated.pickle");
    let whole = std::fs::read(trace("multistream.pickle")).unwrap();
    std::fs::write(&truncated, &whole[..whole.len() / 2]).unwrap();
    fails_with_one_line(
        &tensormem(&["replay", truncated.to_str().unwrap()]),
        "pickle",
    );
}

#[test]
fn a_bad_configuration_fails_with_one_line_before_replaying() {
    fails_with_one_line(
        &tensormem(&["replay", "--config", "expandable_segments:maybe"]),
        "expandable_segments:maybe",
    );
    fails_with_one_line(
        &tensormem(&["replay", "--config", "no_such_key:1"]),
        "no_such_key",
    );
}

#[test]
fn the_table_has_a_legend_and_no_timing_and_the_plot_draws_the_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("timeline.svg");
    let output = tensormem(&[
        "replay",
        "--capacity",
        "6GiB",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(!text.contains("events/s"), "{text}");
    assert!(
        text.contains("peak reserved = reserved_bytes.all.peak")
            && text.contains("device allocs = num_device_alloc"),
        "{text}"
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.contains("capacity (6.00 GiB)"),
        "the legend names the capacity"
    );
    assert!(plot.contains("stroke-dasharray"), "the capacity is drawn");
    assert!(plot.contains("[recorded]") && !plot.contains("(recorded)"));
    // Requested is drawn before allocated, which stays visible on top of it.
    let first = |colour: &str| {
        plot.find(&format!("<polyline fill=\"none\" stroke=\"{colour}\""))
            .unwrap()
    };
    assert!(
        first("#2ca02c") < first("#1f77b4"),
        "requested under allocated"
    );
    // Round ticks: 2 GiB steps on the byte axis, 2000-event steps on the event axis.
    assert!(
        plot.contains(">2.00 GiB<") && plot.contains(">6.00 GiB<"),
        "byte ticks"
    );
    assert!(
        plot.contains(">8000<") && !plot.contains(">2419<"),
        "event ticks"
    );
}

#[test]
fn plots_and_snapshots_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("timeline.svg");
    let pickle = dir.path().join("final.pickle");
    let json = dir.path().join("final.json");
    let output = tensormem(&[
        "replay",
        "--config",
        "max_split_size_mb:64",
        "--plot",
        svg.to_str().unwrap(),
        "--snapshot-out",
        pickle.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..80]);
    assert!(text.trim_end().ends_with("</svg>"));
    assert_eq!(
        text.matches("<polyline").count(),
        2 * 3,
        "two panels of three lines"
    );
    assert!(text.contains("max_split_size_mb:64"));

    // The snapshot is the replaying allocator's, with its trace: it replays to the same result.
    let summary = tensormem(&["snapshot", "summary", pickle.to_str().unwrap()]);
    assert!(summary.status.success(), "{}", stderr(&summary));
    assert!(
        stdout(&summary).contains("segments: 76"),
        "{}",
        stdout(&summary)
    );
    let again = tensormem(&["replay", pickle.to_str().unwrap()]);
    assert!(again.status.success(), "{}", stderr(&again));
    let text = stdout(&again);
    let row = text.lines().find(|l| l.contains("[recorded]")).unwrap();
    assert!(row.contains("5.66 GiB") && row.ends_with(" yes"), "{text}");

    let output = tensormem(&["replay", "--snapshot-out", json.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(value["segments"].as_array().unwrap().len(), 76);
}

#[test]
fn a_small_device_reports_out_of_memory() {
    let output = tensormem(&["replay", "--capacity", "3GiB", "--json"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let stats = &value["runs"][0]["stats"];
    assert!(stats["num_ooms"].as_i64().unwrap() > 0);
    assert!(stats["reserved_bytes.all.peak"].as_i64().unwrap() <= 3 << 30);
}

#[test]
fn snapshot_summary_describes_a_pytorch_trace() {
    let output = tensormem(&["snapshot", "summary", &trace("multistream.pickle")]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    for expected in [
        "segments: 8 (4 small, 4 large; 0 expandable)",
        "reserved:  88.00 MiB",
        "largest free block: 20.00 MiB",
        "2.75 MiB in 1 block waiting for other streams",
        "internal fragmentation (allocated - requested)",
        "external fragmentation (reserved - allocated): 88.00 MiB",
        "0x3f90e520",
        "trace: device 0: 1207 events (400 alloc, 400 free_requested, 399 free_completed, 8 segment_alloc)",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

#[test]
fn snapshot_summary_of_a_non_snapshot_fails_with_one_line() {
    fails_with_one_line(
        &tensormem(&["snapshot", "summary", "/nonexistent.pickle"]),
        "/nonexistent.pickle",
    );
}

#[test]
fn replay_of_dev_zero_is_refused_at_once() {
    let output = tensormem(&["replay", "/dev/zero"]);
    fails_with_one_line(&output, "not a pickle");
}

#[test]
fn replay_with_a_figure_beyond_i64_does_not_match_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let pickle = dir.path().join("multistream.pickle");
    std::fs::copy(trace("multistream.pickle"), &pickle).unwrap();
    std::fs::write(
        dir.path().join("multistream.stats.json"),
        r#"{"num_device_alloc": 1e30, "device": "NVIDIA H200"}"#,
    )
    .unwrap();
    let output = tensormem(&["replay", pickle.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    let row = text
        .lines()
        .find(|l| l.contains("[recorded]"))
        .expect("a row for the recorded configuration");
    assert!(row.ends_with(" NO"), "{text}");
    assert!(text.contains("1 figures of memory_stats()"), "{text}");
    assert!(
        text.contains("num_device_alloc: PyTorch 1e+30, which is not a whole number"),
        "{text}"
    );
}

#[test]
fn replay_limits_name_their_option_and_can_be_raised() {
    let trace = trace("multistream.pickle");
    let output = tensormem(&["replay", &trace, "--max-trace-values", "1000"]);
    fails_with_one_line(&output, "--max-trace-values");
    let output = tensormem(&["replay", &trace, "--max-trace-bytes", "1KiB"]);
    fails_with_one_line(&output, "--max-trace-bytes");
    let output = tensormem(&["replay", &trace, "--max-trace-values", "100000000"]);
    assert!(output.status.success(), "{}", stderr(&output));
}

/// Two devices: one table row each, `--json` with each device's statistics, checked against the
/// stats file's `"devices"` map; the top level is device 0's.
#[test]
fn a_two_device_trace_has_a_row_and_a_json_section_per_device() {
    let path = trace("two_gpu.pickle");
    let output = tensormem(&["replay", &path]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    for device in ["cuda:0", "cuda:1"] {
        let row = text
            .lines()
            .find(|l| l.contains("[recorded]") && l.contains(device))
            .unwrap_or_else(|| panic!("no row for {device} in:\n{text}"));
        assert!(row.ends_with(" yes"), "{row}");
    }
    assert!(text.contains("41 of memory_stats(1)"), "{text}");

    let output = tensormem(&["replay", &path, "--json"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace("two_gpu.stats.json")).unwrap())
            .unwrap();
    let run = &value["runs"][0];
    assert_eq!(run["matches_record"], true);
    for device in ["0", "1"] {
        let stats = &run["devices"][device]["stats"];
        for key in [
            "reserved_bytes.all.peak",
            "num_device_alloc",
            "allocation.all.allocated",
        ] {
            assert_eq!(
                stats[key], expected["devices"][device][key],
                "{device} {key}"
            );
        }
    }
    assert_eq!(
        run["stats"]["reserved_bytes.all.peak"],
        expected["reserved_bytes.all.peak"]
    );
    let total = run["total_stats"]["num_device_alloc"].as_i64().unwrap();
    assert_eq!(
        total,
        expected["devices"]["0"]["num_device_alloc"]
            .as_i64()
            .unwrap()
            + expected["devices"]["1"]["num_device_alloc"]
                .as_i64()
                .unwrap()
    );
}

/// A run under a memory fraction with out-of-memory errors matches with no flag, and says which
/// interval the allowed memory was inferred from.
#[test]
fn a_pressure_trace_reports_the_inferred_capacity_interval() {
    let output = tensormem(&[
        "replay",
        &trace("varlen_pressure__per_process_memory_fraction-0.019.pickle.gz"),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    let row = text.lines().find(|l| l.contains("[recorded]")).unwrap();
    assert!(row.ends_with(" yes"), "{text}");
    assert!(
        text.contains("per_process_memory_fraction 0.019 x device memory in [2.63 GiB, 2.74 GiB]"),
        "{text}"
    );
    assert!(text.contains("6 OOMs"), "{text}");
}

/// A CUDA graph capture: the attribution to the graph's private pool is reported.
#[test]
fn a_graph_capture_trace_reports_its_private_pool() {
    let output = tensormem(&["replay", &trace("cudagraph_train.pickle")]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    let row = text.lines().find(|l| l.contains("[recorded]")).unwrap();
    assert!(row.ends_with(" yes"), "{text}");
    assert!(
        text.contains("private pool (1, 0): 22 allocations in 6 segments"),
        "{text}"
    );
    let output = tensormem(&["replay", &trace("cudagraph_train.pickle"), "--json"]);
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let pools = value["pools"]["0"]["pools"].as_array().unwrap();
    assert!(pools.iter().any(|p| p["pool"] == serde_json::json!([1, 0])));
    assert_eq!(value["pools"]["0"]["undecided"], serde_json::json!([]));
}

#[test]
fn warnings_to_a_pipe_carry_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("multistream.pickle");
    std::fs::copy(trace("multistream.pickle"), &copy).unwrap();
    std::fs::write(dir.path().join("multistream.stats.json"), "not json").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tensormem"))
        .args(["replay", copy.to_str().unwrap()])
        .env_remove("TENSORMEM_LOG")
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(!err.contains('\x1b'), "colour codes in a pipe: {err:?}");
    assert!(
        err.contains("WARN") && err.contains("ignoring the statistics beside the trace"),
        "{err}"
    );
}
