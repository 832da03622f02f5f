//! What the replay tests share: where the recorded PyTorch traces are and how one is read, and, for
//! the tests that record their traces with tensormem's own allocator, the recording allocator on a
//! simulated device, the snapshot as PyTorch writes it, and the check that a replay reproduces the
//! record exactly.

#![allow(dead_code)] // each test file uses its part

use std::path::PathBuf;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::CachingAllocator;
use tensormem_replay::{ExpectedStats, Replay};

/// The recorded PyTorch traces: `traces/` of the repository, or `$TENSORMEM_TRACES_DIR`.
pub(crate) fn traces_dir() -> PathBuf {
    std::env::var_os("TENSORMEM_TRACES_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces"),
        PathBuf::from,
    )
}

/// The recorded trace `name` (`name.pickle`, or `name.pickle.gz` for the large ones kept
/// compressed) and its recorded statistics (`name.stats.json`).
pub(crate) fn load_trace(name: &str) -> (Snapshot, ExpectedStats) {
    let dir = traces_dir();
    let plain = dir.join(format!("{name}.pickle"));
    let path = if plain.is_file() {
        plain
    } else {
        dir.join(format!("{name}.pickle.gz"))
    };
    let snapshot = Snapshot::read_file(path).unwrap();
    let expected = ExpectedStats::read_file(dir.join(format!("{name}.stats.json"))).unwrap();
    (snapshot, expected)
}

/// The simulated device's memory: large enough that only limits the tests set bind.
pub(crate) const TOTAL: u64 = 1 << 40;

/// An allocator under `config` recording its history, on a device that gives the same addresses
/// every run.
pub(crate) fn recording(config: &str) -> CachingAllocator<SimDevice> {
    let allocator = CachingAllocator::with_config(
        SimDevice::with_fixed_addresses(0, TOTAL),
        AllocatorConfig::parse(config).unwrap(),
    );
    allocator.record_history(true, 1 << 20);
    allocator
}

/// The allocator's snapshot, written as a pickle and read back.
pub(crate) fn snapshot_of(allocator: &CachingAllocator<SimDevice>) -> Snapshot {
    let mut bytes = Vec::new();
    allocator.snapshot().write_pickle(&mut bytes).unwrap();
    Snapshot::from_pickle_bytes(&bytes).unwrap()
}

/// `snapshot` as PyTorch 2.11 writes it: no `pool_id` on trace entries.
pub(crate) fn without_pool_ids(mut snapshot: Snapshot) -> Snapshot {
    for entry in snapshot.device_traces.iter_mut().flatten() {
        entry.pool_id = None;
    }
    snapshot
}

/// The allocator's snapshot as PyTorch 2.11 writes it, and its statistics.
pub(crate) fn recorded(allocator: &CachingAllocator<SimDevice>) -> (Snapshot, ExpectedStats) {
    let figures = allocator.memory_stats().to_flat();
    (
        without_pool_ids(snapshot_of(allocator)),
        ExpectedStats::from_figures(figures),
    )
}

/// Replays `snapshot` under its recorded configuration and asserts every decision and figure is
/// the record's: each allocation's address and bytes reserved, the final segments, every figure of
/// `expected`.
pub(crate) fn assert_exact(snapshot: &Snapshot, expected: ExpectedStats) -> Replay {
    let replay = Replay::new(snapshot).unwrap().with_expected_stats(expected);
    let run = replay.run_recorded().unwrap();
    let check = run.devices[0].check.as_ref().unwrap();
    assert_eq!(check.divergence, None, "{check:?}");
    assert_eq!(check.address_mismatches, 0);
    assert_eq!(check.reserved_mismatches, 0);
    assert_eq!(
        check.segments.as_ref().unwrap().mismatches,
        Vec::<String>::new()
    );
    assert_eq!(check.stats.as_ref().unwrap().mismatches, Vec::new());
    assert_eq!(run.matches_record(), Some(true));
    replay
}

/// A small deterministic generator (xorshift64) from `seed` (not 0): the same sequence every run,
/// for test programs that allocate and free in a fixed pseudo-random order.
pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}
