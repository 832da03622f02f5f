//! The settings matrix on the recorded PyTorch traces (`traces/`, or `$TENSORMEM_TRACES_DIR`): the
//! recorded configuration's row is a plain replay, rows are ranked with the configurations that run
//! out of memory last, the recommendation replays to the figure reported, the combinations left out
//! replay alike, and a grid restricted to some settings varies only those.

use tensormem_cuda_alloc::config::{AllocatorConfig, MB};
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_replay::{MatrixOptions, MatrixResult, Replay, RunOptions, Setting, SettingsMatrix};

mod common;

use common::load_trace;

/// The trace `name` and the replay of it, with its recorded statistics.
fn load(name: &str) -> (Snapshot, Replay) {
    let (snapshot, expected) = load_trace(name);
    let replay = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(expected);
    (snapshot, replay)
}

fn matrix(
    snapshot: &Snapshot,
    replay: &Replay,
    settings: &[Setting],
    capacity: Option<u64>,
) -> MatrixResult {
    let matrix = SettingsMatrix::new(replay, snapshot);
    let options = MatrixOptions {
        capacity,
        ..MatrixOptions::default()
    };
    matrix.run(&matrix.grid(settings), &options).unwrap()
}

/// Asserts the ranking: rows that fit by peak reserved bytes, then the disqualified ones.
fn assert_ranked(result: &MatrixResult) {
    let fits = result.rows.iter().take_while(|r| !r.disqualified()).count();
    assert!(
        result.rows[fits..].iter().all(|r| r.disqualified()),
        "disqualified rows come last"
    );
    for pair in result.rows[..fits].windows(2) {
        assert!(pair[0].peak_reserved() <= pair[1].peak_reserved());
    }
    for pair in result.rows[fits..].windows(2) {
        assert!(pair[0].new_ooms <= pair[1].new_ooms);
    }
    for row in &result.rows {
        assert_eq!(row.disqualified(), row.reason().is_some());
    }
}

#[test]
fn the_recorded_row_is_a_plain_replay_of_the_recorded_configuration() {
    for name in [
        "gpt2_train",
        "oom_pressure",
        "two_gpu",
        "varlen_pressure__per_process_memory_fraction-0.025_garbage_collection_threshold-0.6",
        "oom_gc__fraction-0.004_garbage_collection_threshold-0.6",
    ] {
        let (snapshot, replay) = load(name);
        let result = matrix(&snapshot, &replay, &[Setting::ExpandableSegments], None);
        let plain = replay.run_recorded().unwrap();
        let row = result.recorded();
        assert_eq!(row.point.config, *replay.recorded_config(), "{name}");
        assert_eq!(row.run.matches_record(), Some(true), "{name}");
        assert_eq!(row.run.total_stats(), plain.total_stats(), "{name}");
        for (ours, theirs) in row.run.devices.iter().zip(&plain.devices) {
            assert_eq!(ours.stats.to_flat(), theirs.stats.to_flat(), "{name}");
            assert_eq!(ours.refused, theirs.refused, "{name}");
        }
        // Its requests fail exactly where the trace's did, compared one by one.
        assert!(row.same_path() && row.by_request, "{name}: {}", row.path());
        assert_eq!(result.delta_reserved(row), 0);
    }
}

#[test]
fn rows_are_ranked_by_peak_reserved_with_configurations_that_run_out_of_memory_last() {
    // gpt2_train peaks at 5.66 GiB reserved: on a 5.5 GiB device the recorded configuration runs
    // out of memory where the recorded run did not; expandable segments (5.53 GiB) need retries.
    let (snapshot, replay) = load("gpt2_train");
    let result = matrix(&snapshot, &replay, &Setting::ALL, Some(5632 * MB as u64));
    assert_ranked(&result);
    let recorded = result.recorded();
    assert!(recorded.disqualified(), "{}", recorded.path());
    assert!(recorded.reason().unwrap().starts_with("out of memory"));
    assert!(recorded.first_new_oom.is_some());
    assert!(!recorded.same_path());
    let best = result.best().expect("some configuration fits 5.5 GiB");
    assert!(best.same_path());
    assert!(best.figure("num_ooms") == 0);
    assert!(result.rows.iter().any(|r| !r.disqualified()));
    assert!(result.rows.iter().any(|r| r.disqualified()));

    // On a trace whose recorded run ran out of memory, rows are ranked the same way, and those
    // that serve a request that failed in the record say their path differs.
    let (snapshot, replay) = load("oom_pressure");
    let result = matrix(
        &snapshot,
        &replay,
        &[Setting::ExpandableSegments, Setting::RoundupPower2Divisions],
        None,
    );
    assert_ranked(&result);
    assert!(!result.recorded().disqualified());
    assert!(result
        .rows
        .iter()
        .any(|r| !r.disqualified() && r.served_ooms > 0 && !r.same_path()));
}

#[test]
fn the_recommended_configuration_parses_and_replays_to_the_reported_peak() {
    for (name, capacity) in [
        ("gpt2_train", None),
        ("gpt2_train__expandable_segments-True", Some(6 << 30)),
        ("varlen_pressure2__fraction-0.004", None),
        ("oom_max_split__fraction-0.005_max_split_size_mb-32", None),
    ] {
        let (snapshot, replay) = load(name);
        let result = matrix(&snapshot, &replay, &Setting::ALL, capacity);
        let recommendation = result.recommendation().expect("a configuration fits");
        let best = result.best().unwrap();
        assert_eq!(recommendation.peak_reserved, best.peak_reserved());
        assert!(recommendation.peak_reserved <= result.recorded().peak_reserved());
        // PYTORCH_CUDA_ALLOC_CONF is read from the defaults; a fraction the program sets through
        // torch.cuda.set_per_process_memory_fraction() comes on top.
        let mut config = AllocatorConfig::parse(&recommendation.env).unwrap();
        if let Some(fraction) = recommendation.program_fraction {
            assert!(!recommendation.env.contains("per_process_memory_fraction"));
            config.per_process_memory_fraction = fraction;
        }
        assert_eq!(config, recommendation.config, "{name}");
        let mut options = RunOptions::new(config);
        options.capacity = capacity;
        let run = replay.run(&options).unwrap();
        assert_eq!(
            run.total_stats()["reserved_bytes.all.peak"] as u64,
            recommendation.peak_reserved,
            "{name}"
        );
        // Every row's --config string gives its configuration over the recorded one.
        for row in &result.rows {
            assert_eq!(
                replay.what_if_config(&row.point.what_if).unwrap(),
                row.point.config,
                "{name}: {}",
                row.point.what_if
            );
        }
    }
}

#[test]
fn combinations_left_out_replay_exactly_as_the_ones_kept() {
    let figures = |replay: &Replay, what_if: &str| {
        let run = replay.run_with(what_if).unwrap();
        (run.total_stats(), run.refused())
    };
    // One rounding division rounds as none.
    let (snapshot, replay) = load("oom_gc__fraction-0.004_garbage_collection_threshold-0.6");
    let settings_matrix = SettingsMatrix::new(&replay, &snapshot);
    let mut grid = settings_matrix.grid(&[]);
    grid.set_values(Setting::RoundupPower2Divisions, "0,1,4")
        .unwrap();
    let result = settings_matrix
        .run(&grid, &MatrixOptions::default())
        .unwrap();
    assert_eq!((result.rows.len(), result.left_out), (2, 1));
    assert_eq!(
        figures(
            &replay,
            "roundup_power2_divisions:1,garbage_collection_threshold:0.6"
        ),
        figures(&replay, "garbage_collection_threshold:0.6")
    );
    assert_ne!(
        figures(
            &replay,
            "roundup_power2_divisions:4,garbage_collection_threshold:0.6"
        ),
        figures(&replay, "garbage_collection_threshold:0.6")
    );

    // Garbage collection acts only under a memory fraction: gpt2_train has none, and the grid
    // does not vary it there.
    let (snapshot, replay) = load("gpt2_train");
    assert_eq!(
        figures(&replay, "garbage_collection_threshold:0.6"),
        figures(&replay, "")
    );
    let grid = SettingsMatrix::new(&replay, &snapshot).grid(&Setting::ALL);
    assert!(!grid.varies(Setting::GarbageCollectionThreshold));
    assert!(grid.notes[0].contains("memory fraction"));
    // Where there is one, it acts and is varied.
    let (snapshot, replay) = load("oom_gc__fraction-0.004_garbage_collection_threshold-0.6");
    assert_ne!(
        figures(&replay, "garbage_collection_threshold:0.8"),
        figures(&replay, "garbage_collection_threshold:0.6")
    );
    let grid = SettingsMatrix::new(&replay, &snapshot).grid(&Setting::ALL);
    assert_eq!(
        grid.values(Setting::GarbageCollectionThreshold),
        ["off", "0.6", "0.8"]
    );
}

#[test]
fn a_restricted_grid_varies_only_the_settings_asked_for() {
    let (snapshot, replay) = load("oom_max_split__fraction-0.005_max_split_size_mb-32");
    let recorded = replay.recorded_config().clone();
    assert_eq!(recorded.max_split_size, 32 * MB);

    let only_expandable = matrix(&snapshot, &replay, &[Setting::ExpandableSegments], None);
    assert_eq!(only_expandable.rows.len(), 2);
    for row in &only_expandable.rows {
        // The others keep the recorded values, max_split_size_mb:32 included.
        assert_eq!(row.point.config.max_split_size, 32 * MB);
        assert_eq!(
            row.point.config.garbage_collection_threshold,
            recorded.garbage_collection_threshold
        );
        assert_eq!(
            row.point.config.roundup_power2_divisions,
            recorded.roundup_power2_divisions
        );
    }

    // Values given for a setting: those and the recorded one.
    let settings_matrix = SettingsMatrix::new(&replay, &snapshot);
    let mut grid = settings_matrix.grid(&[]);
    grid.set_values(Setting::MaxSplitSize, "unlimited,64")
        .unwrap();
    assert_eq!(
        grid.values(Setting::MaxSplitSize),
        ["unlimited", "32", "64"]
    );
    let result = settings_matrix
        .run(&grid, &MatrixOptions::default())
        .unwrap();
    let mut splits: Vec<usize> = result
        .rows
        .iter()
        .map(|r| r.point.config.max_split_size)
        .collect();
    splits.sort_unstable();
    assert_eq!(splits, [32 * MB, 64 * MB, usize::MAX]);
    assert!(result
        .rows
        .iter()
        .all(|r| !r.point.config.expandable_segments));
    assert_ranked(&result);
}

#[test]
fn parallel_runs_give_the_figures_of_runs_one_at_a_time() {
    let (snapshot, replay) = load("two_gpu");
    let settings_matrix = SettingsMatrix::new(&replay, &snapshot);
    let grid = settings_matrix.grid(&Setting::ALL);
    let run = |threads| {
        let options = MatrixOptions {
            threads,
            ..MatrixOptions::default()
        };
        let result = settings_matrix.run(&grid, &options).unwrap();
        result
            .rows
            .iter()
            .map(|r| (r.point.what_if.clone(), r.run.total_stats()))
            .collect::<Vec<_>>()
    };
    let one = run(1);
    assert!(one.len() > 2);
    assert_eq!(run(3), one);
}
