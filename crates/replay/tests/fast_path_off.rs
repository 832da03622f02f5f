//! The allocator's fast path against its plain path on every recorded trace: each trace in the
//! corpus is replayed twice, once as usual and once with the fast path switched off
//! (`TENSORMEM_FAST_PATH=0`, read when the replay makes its allocator), and the two runs must agree
//! figure for figure, in whether they match the record, and in their final snapshots.
//!
//! One test in its own binary: the environment variable is process-wide.

use std::path::{Path, PathBuf};

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::{CachingAllocator, FAST_PATH_ENV};
use tensormem_replay::{Replay, ReplayRun};

mod common;

use common::traces_dir;

/// The recorded traces: every `NAME.pickle` or `NAME.pickle.gz` beside a `NAME.stats.json`.
fn corpus(dir: &Path) -> Vec<PathBuf> {
    let mut traces: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("the trace corpus")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let stem = name
                .strip_suffix(".pickle.gz")
                .or_else(|| name.strip_suffix(".pickle"));
            stem.is_some_and(|stem| dir.join(format!("{stem}.stats.json")).is_file())
        })
        .collect();
    traces.sort();
    traces
}

fn run(snapshot: &Snapshot, fast_path: bool) -> ReplayRun {
    // This binary runs one test, so no other thread reads the environment meanwhile.
    std::env::set_var(FAST_PATH_ENV, if fast_path { "1" } else { "0" });
    let probe = CachingAllocator::new(SimDevice::new(1 << 20));
    assert_eq!(
        probe.is_fast_path_enabled(),
        fast_path,
        "the switch is read"
    );
    let replay = Replay::new(snapshot).expect("a replayable trace");
    replay.run_recorded().expect("the recorded run completes")
}

#[test]
fn every_trace_replays_alike_with_the_fast_path_off() {
    let traces = corpus(&traces_dir());
    assert!(
        !traces.is_empty(),
        "no traces in {}",
        traces_dir().display()
    );
    for path in traces {
        let snapshot = Snapshot::read_file(&path).expect("a readable trace");
        let fast = run(&snapshot, true);
        let plain = run(&snapshot, false);
        let name = path.display();
        assert_eq!(fast.flat_stats(), plain.flat_stats(), "{name}: statistics");
        assert_eq!(fast.total_stats(), plain.total_stats(), "{name}: totals");
        assert_eq!(
            fast.matches_record(),
            plain.matches_record(),
            "{name}: agreement with the record"
        );
        assert_eq!(fast.refused(), plain.refused(), "{name}: refused events");
        // The segments and their blocks (the trace's entries carry clock readings of each run).
        assert_eq!(
            fast.snapshot().map(|s| s.segments),
            plain.snapshot().map(|s| s.segments),
            "{name}: final segments"
        );
    }
    std::env::remove_var(FAST_PATH_ENV);
}
