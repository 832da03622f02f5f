//! `tensormem replay` and `tensormem snapshot summary`, run as a user runs them: the built binary,
//! its exit status, stdout and stderr.

use std::path::PathBuf;
use std::process::{Command, Output};

fn tensormem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensormem"))
        .args(args)
        .env_remove("TENSORMEM_LOG")
        .output()
        .expect("the tensormem binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).expect("stderr is UTF-8")
}

fn trace(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces")
        .join(name)
        .display()
        .to_string()
}

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
    assert!(row.contains(" yes "), "{row}");
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
    assert_eq!(keys, ["events", "runs", "trace"]);
    assert_eq!(value["events"], 1207);
    assert!(value["trace"]
        .as_str()
        .unwrap()
        .ends_with("multistream.pickle"));
    let runs = value["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        let mut keys: Vec<&str> = run
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, ["config", "seconds", "stats"]);
        assert!(run["seconds"].as_f64().unwrap() > 0.0);
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
    let row = stdout(&again);
    assert!(row.contains("5.66 GiB") && row.contains(" yes "), "{row}");

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
        "2.75 MiB in 1 blocks waiting for other streams",
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
    assert!(row.contains(" NO "), "{text}");
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
