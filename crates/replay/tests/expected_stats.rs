//! The recorded `memory_stats()` a replay is checked against: figures that cannot be read are errors,
//! never dropped, and a record that confirms nothing is not a match.

use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_replay::{Error, ExpectedStats, Replay};

mod common;

use common::traces_dir;

fn refused(json: &str) -> String {
    match ExpectedStats::from_json(json) {
        Err(e @ Error::ExpectedStats { .. }) => e.to_string(),
        Err(other) => panic!("{json}: unexpected error {other}"),
        Ok(stats) => panic!("{json}: read as {stats:?}"),
    }
}

/// A replay of `multistream` checked against `json`.
fn check_against(json: &str) -> (Option<bool>, tensormem_replay::StatsCheck) {
    let snapshot = Snapshot::read_file(traces_dir().join("multistream.pickle")).unwrap();
    let run = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(ExpectedStats::from_json(json).unwrap())
        .run_recorded()
        .unwrap();
    let stats = run.devices[0]
        .check
        .as_ref()
        .unwrap()
        .stats
        .clone()
        .unwrap();
    (run.matches_record(), stats)
}

#[test]
fn figures_beyond_i64_or_not_whole_are_kept_and_fail_the_check() {
    for (json, written) in [
        (r#"{"num_device_alloc": 1e30}"#, "1e+30"),
        (
            r#"{"num_device_alloc": 18446744073709551615}"#,
            "18446744073709551615",
        ),
        (r#"{"num_device_alloc": 2.5}"#, "2.5"),
    ] {
        let stats = ExpectedStats::from_json(json).unwrap();
        assert!(stats.figures.is_empty(), "{json}");
        assert_eq!(stats.unreadable["num_device_alloc"], written);
        let (matches, check) = check_against(json);
        assert_eq!(matches, Some(false), "{json}");
        assert_eq!(check.compared, 1);
        assert_eq!(check.unreadable[0].0, "num_device_alloc");
    }
    let edge = ExpectedStats::from_json(
        r#"{"a": 9223372036854775807, "b": -9223372036854775808, "device": "NVIDIA H200"}"#,
    )
    .unwrap();
    assert_eq!(edge.figures.len(), 2);
    assert_eq!(edge.figures["a"], i64::MAX);
}

#[test]
fn figures_written_as_strings_are_kept_and_fail_the_check() {
    let json = r#"{"num_device_alloc": "12", "device": "NVIDIA H200"}"#;
    let stats = ExpectedStats::from_json(r#"{"a": 1, "num_device_alloc": "12"}"#).unwrap();
    assert_eq!(stats.non_numbers["num_device_alloc"], r#""12""#);
    assert!(!stats.figures.contains_key("num_device_alloc"));
    // Strings alone are not a record.
    assert!(ExpectedStats::from_json(json).is_err());
    let (matches, check) = check_against(&json.replace("\"device\"", "\"wall_s\": 1, \"device\""));
    assert_eq!(matches, Some(false));
    assert_eq!(check.compared, 1);
    assert_eq!(check.recorded, 2);
    assert_eq!(
        check.unreadable,
        vec![("num_device_alloc".to_owned(), r#""12""#.to_owned())]
    );
}

#[test]
fn a_record_without_figures_is_an_error() {
    for json in ["{}", r#"{"device": "NVIDIA H200", "alloc_conf": ""}"#] {
        let message = refused(json);
        assert!(message.contains("no memory_stats() figure"), "{message}");
    }
}

#[test]
fn a_record_that_confirms_nothing_is_not_a_match() {
    let (matches, stats) = check_against(r#"{"no_such_figure.all.peak": 1, "wall_s": 0.5}"#);
    assert_eq!((stats.recorded, stats.compared), (2, 0));
    assert_eq!(matches, Some(false));

    // The real record confirms the replay (its `wall_s` is not a figure the replay produces).
    let json = std::fs::read_to_string(traces_dir().join("multistream.stats.json")).unwrap();
    let (matches, stats) = check_against(&json);
    assert!(stats.compared > 30, "{stats:?}");
    assert!(stats.unreadable.is_empty());
    assert_eq!(matches, Some(true));
}

#[test]
fn an_endless_stats_file_is_refused() {
    let e = ExpectedStats::read_file("/dev/zero").unwrap_err();
    assert!(e.to_string().contains("larger than"), "{e}");
}
