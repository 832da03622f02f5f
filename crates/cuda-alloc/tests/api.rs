//! Pointer-based calls, lookups, the trace, snapshots and statistics resets.

mod common;

use common::*;
use tensormem_cuda_alloc::snapshot::{BlockState, SegmentType, TraceAction};
use tensormem_cuda_alloc::{DeviceAddress, Error};

#[test]
fn raw_pointers_round_trip() {
    let a = sim(GIB);
    let p = a.raw_alloc(3000, S0).unwrap();
    assert_eq!(a.raw_alloc(0, S0).unwrap(), DeviceAddress(0));
    a.record_stream_ptr(p, S1).unwrap();
    a.raw_free(p).unwrap();
    assert_eq!(checked(&a).active.all.current, 1, "pending on S1");
    assert!(
        matches!(a.raw_free(p), Err(Error::InvalidPointer { .. })),
        "double free"
    );
    assert!(matches!(
        a.raw_free(DeviceAddress(0xdead_0000)),
        Err(Error::InvalidPointer { .. })
    ));
    assert!(a.raw_free(DeviceAddress(0)).is_ok(), "null is ignored");
    let q = a.allocate(512, S0).unwrap().into_ptr();
    a.raw_free(q).unwrap();
    checked(&a);
}

#[test]
fn freeing_a_handle_after_its_pointer_was_freed_is_an_error() {
    let a = sim(GIB);
    let x = a.allocate(512, S0).unwrap();
    a.raw_free(x.ptr()).unwrap();
    // The slot is reused by a new allocation at the same address: the stale handle is refused.
    let y = a.allocate(512, S0).unwrap();
    assert_eq!(y.ptr(), x.ptr());
    assert!(matches!(a.free(x), Err(Error::InvalidPointer { .. })));
    assert_eq!(checked(&a).allocation.all.current, 1);
    a.free(y).unwrap();
}

#[test]
fn zero_sized_allocations_are_null_and_free() {
    let a = sim(GIB);
    let x = a.allocate(0, S0).unwrap();
    assert_eq!((x.ptr(), x.size()), (DeviceAddress(0), 0));
    a.record_stream(&x, S1).unwrap();
    a.free(x).unwrap();
    assert_eq!(checked(&a).allocation.all.allocated, 0);
}

#[test]
fn base_allocation_finds_the_whole_device_allocation() {
    let a = sim(GIB);
    let x = a.allocate(3 * MIB, S0).unwrap();
    let y = a.allocate(5 * MIB, S0).unwrap();
    assert_eq!(a.base_allocation(y.ptr()).unwrap(), (x.ptr(), 20 * MIB));
    assert_eq!(a.base_allocation(x.ptr()).unwrap(), (x.ptr(), 20 * MIB));
    assert!(matches!(
        a.base_allocation(y.ptr().offset(512)),
        Err(Error::InvalidPointer { .. })
    ));
    a.free(x).unwrap();
    a.free(y).unwrap();
}

#[test]
fn largest_cached_block_and_cache_info() {
    let a = sim(GIB);
    assert_eq!(a.largest_cached_block(), 0);
    let x = a.allocate(3 * MIB, S0).unwrap();
    assert_eq!(a.largest_cached_block(), 17 * MIB as u64);
    assert_eq!(a.cache_info().unwrap(), (GIB - 20 * MIB) as u64);
    a.free(x).unwrap();
    assert_eq!(a.largest_cached_block(), 20 * MIB as u64);
}

#[test]
fn empty_cache_returns_every_unused_segment() {
    let a = sim(GIB);
    let keep = a.allocate(MIB + 1, S0).unwrap();
    let blocks: Vec<_> = [512, 64 * KIB, 12 * MIB, 30 * MIB]
        .iter()
        .map(|&n| a.allocate(n, S1).unwrap())
        .collect();
    for b in blocks {
        a.free(b).unwrap();
    }
    a.empty_cache().unwrap();
    let s = checked(&a);
    assert_eq!(s.segment.all.current, 1, "only the segment in use remains");
    assert_eq!(s.reserved_bytes.all.current, 20 * MIB as i64);
    assert_eq!(a.device().counters().live_allocations, 1);
    a.free(keep).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(checked(&a).reserved_bytes.all.current, 0);
    assert_eq!(a.device().counters().used_bytes, 0);
}

#[test]
fn the_trace_records_every_action_in_order() {
    let a = sim(GIB);
    a.record_annotation("before");
    assert!(a.trace().is_empty(), "history is off");
    a.record_history(true, 100);
    assert!(a.is_history_enabled());
    let x = a.allocate(1000, S1).unwrap();
    a.record_annotation("step 1");
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    let _ = a.snapshot();
    let trace = a.trace();
    let actions: Vec<_> = trace.iter().map(|e| e.action.clone()).collect();
    assert_eq!(
        actions,
        [
            TraceAction::SegmentAlloc,
            TraceAction::Alloc,
            TraceAction::UserDefined,
            TraceAction::FreeRequested,
            TraceAction::FreeCompleted,
            TraceAction::SegmentFree,
            TraceAction::Snapshot,
        ]
    );
    assert_eq!((trace[1].size, trace[1].stream), (1000, S1.0));
    assert_eq!(trace[2].user_metadata.as_deref(), Some("step 1"));
    assert_eq!(trace[0].size, 2 * MIB as u64);
    assert!(trace.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    assert!(
        trace[0].time_us > 1_600_000_000_000_000,
        "microseconds since the epoch"
    );
    // Turning history off clears it; the ring keeps the newest entries.
    a.record_history(false, 2);
    a.record_history(true, 2);
    for _ in 0..3 {
        let x = a.allocate(512, S0).unwrap();
        a.free(x).unwrap();
    }
    let kept: Vec<_> = a.trace().into_iter().map(|e| e.action).collect();
    assert_eq!(
        kept,
        [TraceAction::FreeRequested, TraceAction::FreeCompleted]
    );
}

#[test]
fn snapshots_describe_segments_and_pickle_for_pytorch() {
    let a = sim(GIB);
    a.record_history(true, 100);
    let x = a.allocate(3000, S0).unwrap();
    let y = a.allocate(12 * MIB, S1).unwrap();
    a.record_stream(&y, S0).unwrap();
    a.free(y).unwrap();
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 2);
    let small = snap
        .segments
        .iter()
        .find(|s| s.segment_type == SegmentType::Small)
        .unwrap();
    assert_eq!(
        (small.total_size, small.allocated_size),
        (2 * MIB as u64, 3072)
    );
    assert_eq!(small.requested_size, 3000);
    assert_eq!(small.blocks[0].state, BlockState::ActiveAllocated);
    assert_eq!(small.blocks[1].state, BlockState::Inactive);
    assert_eq!(small.blocks[1].address, small.address + 3072);
    let large = snap
        .segments
        .iter()
        .find(|s| s.segment_type == SegmentType::Large)
        .unwrap();
    assert_eq!(large.stream, S1.0);
    assert_eq!(large.blocks[0].state, BlockState::ActivePendingFree);
    assert_eq!(large.active_size, 12 * MIB as u64);
    assert_eq!(snap.device_traces[0].len(), 5);
    let settings = snap.allocator_settings.as_ref().unwrap();
    assert_eq!(settings.max_split_size, Some(-1));
    // Written as a pickle and read back, it is the same snapshot.
    #[cfg(feature = "snapshot-io")]
    {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("snapshot.pickle");
        snap.write_pickle_file(&path).unwrap();
        assert_eq!(
            tensormem_cuda_alloc::snapshot::Snapshot::read_file(&path).unwrap(),
            snap
        );
    }
    a.free(x).unwrap();
}

#[test]
fn peaks_and_totals_reset() {
    let a = sim(GIB);
    let x = a.allocate(12 * MIB, S0).unwrap();
    let y = a.allocate(14 * MIB, S1).unwrap();
    a.free(x).unwrap();
    let s = checked(&a);
    assert_eq!(s.allocated_bytes.all.peak, 26 * MIB as i64);
    assert_eq!(s.allocated_bytes.large_pool.freed, 12 * MIB as i64);
    a.reset_peak_stats();
    let s = a.memory_stats();
    assert_eq!(s.allocated_bytes.all.peak, 14 * MIB as i64);
    assert_eq!(
        s.allocated_bytes.all.allocated,
        26 * MIB as i64,
        "totals kept"
    );
    a.reset_accumulated_stats();
    let s = a.memory_stats();
    assert_eq!(
        (s.allocated_bytes.all.allocated, s.allocated_bytes.all.freed),
        (0, 0)
    );
    assert_eq!(s.num_device_alloc, 0);
    assert_eq!(
        s.allocated_bytes.all.current,
        14 * MIB as i64,
        "current kept"
    );
    let z = a.allocate(12 * MIB, S0).unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.peak, 26 * MIB as i64);
    a.free(y).unwrap();
    a.free(z).unwrap();
}

#[test]
fn settings_change_at_run_time() {
    let a = sim(GIB);
    assert!(
        a.apply_settings("max_split_size_mb:10").is_err(),
        "below 20"
    );
    a.apply_settings("max_split_size_mb:20, garbage_collection_threshold:0.8")
        .unwrap();
    let config = a.config();
    assert_eq!(config.max_split_size, 20 * MIB);
    assert!((config.garbage_collection_threshold - 0.8).abs() < 1e-12);
    // The stat keeps the value from creation, as PyTorch's does.
    assert_eq!(a.memory_stats().max_split_size, -1);
}

/// Blocks counted as oversize under one `max_split_size` and freed under another: the counts follow
/// each call's limit, as PyTorch's do (they may go below zero), and the invariants still hold.
#[test]
fn oversize_counts_follow_the_limit_in_force_at_each_call() {
    let a = sim(GIB);
    a.apply_settings("max_split_size_mb:64").unwrap();
    let big = a.allocate(100 * MIB, S0).unwrap();
    assert_eq!(a.memory_stats().oversize_allocations.current, 1);
    a.apply_settings("").unwrap();
    let other = a.allocate(80 * MIB, S0).unwrap();
    a.free(big).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(
        a.memory_stats().oversize_allocations.current,
        1,
        "not counted when freed"
    );
    a.apply_settings("max_split_size_mb:64").unwrap();
    a.free(other).unwrap();
    assert_eq!(a.memory_stats().oversize_allocations.current, 0);
    a.check_invariants().unwrap();
    // The same settings object, set whole.
    let mut config = a.config();
    config.max_split_size = 32 * MIB;
    a.set_settings(&config).unwrap();
    assert_eq!(a.config().max_split_size, 32 * MIB);
    a.check_invariants().unwrap();
}

#[test]
fn flat_stats_have_pytorchs_keys() {
    let a = sim(GIB);
    let x = a.allocate(100, S0).unwrap();
    let flat = a.memory_stats().to_flat();
    assert_eq!(flat["allocated_bytes.all.current"], 512);
    assert_eq!(flat["allocated_bytes.small_pool.current"], 512);
    assert_eq!(flat["requested_bytes.all.current"], 100);
    assert_eq!(flat["reserved_bytes.all.current"], 2 * MIB as i64);
    assert_eq!(flat["segment.small_pool.peak"], 1);
    assert_eq!(flat["num_device_alloc"], 1);
    assert_eq!(flat["max_split_size"], -1);
    a.free(x).unwrap();
}
