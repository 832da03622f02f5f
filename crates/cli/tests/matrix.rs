//! `tensormem replay --matrix`, run as a user runs it: the built binary, its exit status, stdout and
//! stderr.

mod common;

use common::{json, stderr, stdout, tensormem, trace};

#[test]
fn the_matrix_of_the_built_in_trace_ranks_configurations_and_recommends_one() {
    let output = tensormem(&["replay", "--matrix"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stdout(&output);
    assert!(
        text.starts_with("trace: built-in gpt2_train: 9679 events"),
        "{text}"
    );
    let recorded = text
        .lines()
        .find(|l| l.contains("(defaults) [recorded]"))
        .expect("a row for the recorded configuration");
    // PyTorch's own peak reserved bytes (6079643648), no difference with itself.
    assert!(
        recorded.contains("5.66 GiB") && recorded.contains(" 0 "),
        "{recorded}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("   1  expandable_segments:True  ")),
        "{text}"
    );
    assert!(
        text.contains("recommended: PYTORCH_CUDA_ALLOC_CONF=\"expandable_segments:True\""),
        "{text}"
    );
    assert!(
        text.contains("garbage_collection_threshold not varied"),
        "{text}"
    );
}

#[test]
fn the_json_has_every_row_ranked_with_its_verdict() {
    // gpt2_train reserves 5.66 GiB at its peak: on 5.5 GiB the recorded configuration runs out.
    let report = json(&["replay", "--matrix", "--json", "--capacity", "5.5GiB"]);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 60);
    assert_eq!(rows.iter().filter(|r| r["recorded"] == true).count(), 1);
    let fits: Vec<&serde_json::Value> = rows
        .iter()
        .take_while(|r| r["disqualified"] == false)
        .collect();
    assert!(!fits.is_empty() && fits.len() < rows.len());
    assert!(rows[fits.len()..].iter().all(|r| r["disqualified"] == true
        && r["reason"].as_str().unwrap().starts_with("out of memory")
        && r["same_path"] == false));
    let peaks: Vec<u64> = fits
        .iter()
        .map(|r| r["peak_reserved"].as_u64().unwrap())
        .collect();
    assert!(peaks.windows(2).all(|w| w[0] <= w[1]), "{peaks:?}");
    let recorded = rows.iter().find(|r| r["recorded"] == true).unwrap();
    assert_eq!(recorded["disqualified"], true);
    // Checked against the record, which it no longer reproduces on the smaller device.
    assert_eq!(recorded["matches_record"], false);
    let recommendation = &report["recommendation"];
    assert_eq!(recommendation["peak_reserved"], rows[0]["peak_reserved"]);
    assert_eq!(
        recommendation["PYTORCH_CUDA_ALLOC_CONF"], rows[0]["config"],
        "no fraction in this trace: the row's whole configuration"
    );
    assert_eq!(report["grid"]["values"]["expandable_segments"][1], "True");
}

#[test]
fn the_matrix_can_be_restricted_to_some_settings_and_values() {
    let report = json(&[
        "replay",
        "--matrix=expandable_segments",
        "--json",
        &trace("oom_max_split__fraction-0.005_max_split_size_mb-32.pickle"),
    ]);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for row in rows {
        // The recorded max_split_size_mb:32 is kept where it is not varied.
        assert!(
            row["what_if"]
                .as_str()
                .unwrap()
                .contains("max_split_size_mb:32"),
            "{row}"
        );
    }
    // The trace may follow the option, and values may be given.
    let report = json(&[
        "replay",
        "--matrix",
        &trace("gpt2_train.pickle"),
        "--matrix-values",
        "max_split_size_mb:unlimited,64",
        "--matrix-values",
        "roundup_power2_divisions:0",
        "--json",
    ]);
    let values = &report["grid"]["values"];
    assert_eq!(
        values["max_split_size_mb"],
        serde_json::json!(["unlimited", "64"])
    );
    assert_eq!(values["roundup_power2_divisions"], serde_json::json!(["0"]));
    assert_eq!(report["rows"].as_array().unwrap().len(), 2 * 2);
}

#[test]
fn bad_matrix_options_fail_with_one_line() {
    for (args, what) in [
        (
            vec!["replay", "--matrix=max_split"],
            "'max_split' is not a setting",
        ),
        (
            vec![
                "replay",
                "--matrix",
                "--matrix-values",
                "max_split_size_mb:8",
            ],
            "invalid value '8' for max_split_size_mb",
        ),
        (
            vec![
                "replay",
                "--matrix",
                "--matrix-values",
                "garbage_collection_threshold:0.6",
            ],
            "acts only under a memory fraction",
        ),
    ] {
        let output = tensormem(&args);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let err = stderr(&output);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("tensormem: error: ") && err.contains(what),
            "{err}"
        );
        assert_eq!(stdout(&output), "");
    }
    // --matrix replays its own configurations: --config is a usage error.
    let output = tensormem(&["replay", "--matrix", "--config", "expandable_segments:True"]);
    assert_eq!(output.status.code(), Some(2));
}
