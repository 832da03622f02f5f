//! Caching turned off (`PYTORCH_NO_CUDA_MEMORY_CACHING` / `TENSORMEM_NO_CUDA_MEMORY_CACHING`), as
//! PyTorch's `forceUncachedAllocator`: every allocation is a device allocation of exactly the size
//! asked for, returned to the device when freed (once no other stream uses it), outside the
//! allocator's books (no statistic, no trace entry, no snapshot segment); the invariant walk passes
//! after every step.

mod common;

use common::env;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::{caching_disabled_by_env_with, AllocatorConfig};
use tensormem_cuda_alloc::snapshot::TraceAction;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, Error, MempoolId, StreamId};

const S: StreamId = StreamId(0);
const OTHER: StreamId = StreamId(5);

#[test]
fn the_environment_decides_pytorch_rule_first_tensormem_variable_overrides() {
    assert!(!caching_disabled_by_env_with(env(&[])));
    // PyTorch's rule: present means on, whatever the value.
    assert!(caching_disabled_by_env_with(env(&[(
        "PYTORCH_NO_CUDA_MEMORY_CACHING",
        "0"
    )])));
    assert!(caching_disabled_by_env_with(env(&[(
        "TENSORMEM_NO_CUDA_MEMORY_CACHING",
        "1"
    )])));
    // Ours, set to 0 or empty, keeps caching on for tensormem whatever PyTorch's says.
    for off in ["0", ""] {
        assert!(!caching_disabled_by_env_with(env(&[
            ("TENSORMEM_NO_CUDA_MEMORY_CACHING", off),
            ("PYTORCH_NO_CUDA_MEMORY_CACHING", "1"),
        ])));
    }
}

fn uncached(config: &str) -> CachingAllocator<SimDevice> {
    let alloc = CachingAllocator::with_config(
        SimDevice::new(1 << 30),
        AllocatorConfig::parse(config).unwrap(),
    );
    alloc.set_caching_disabled(true);
    assert!(alloc.is_caching_disabled());
    alloc
}

/// Every figure of `memory_stats()` is zero (as PyTorch's are in this mode), but `max_split_size`
/// (a setting) and `num_sync_all_streams` (which `empty_cache` counts, in PyTorch too); the trace has
/// no entry but those of snapshots; a snapshot shows no segment.
fn assert_books_empty(alloc: &CachingAllocator<SimDevice>) {
    let flat = alloc.memory_stats().to_flat();
    let counted: Vec<_> = flat
        .iter()
        .filter(|(key, value)| {
            !matches!(key.as_str(), "max_split_size" | "num_sync_all_streams") && **value != 0
        })
        .collect();
    assert!(counted.is_empty(), "figures that counted: {counted:?}");
    assert_eq!(alloc.reserved_bytes(), 0);
    let traced: Vec<_> = alloc
        .trace()
        .into_iter()
        .filter(|e| e.action != TraceAction::Snapshot)
        .collect();
    assert!(traced.is_empty(), "trace entries: {traced:?}");
    assert!(
        alloc.snapshot().segments.is_empty(),
        "a snapshot shows no segment"
    );
    alloc.check_invariants().unwrap();
}

#[test]
fn every_allocation_is_exactly_its_size_from_the_device_and_outside_the_books() {
    let alloc = uncached("");
    alloc.record_history(true, 1000);
    let a = alloc.allocate(3000, S).unwrap();
    let b = alloc.allocate(3000, S).unwrap();
    let c = alloc.allocate((25 << 20) + 7, S).unwrap();
    assert_eq!((a.size(), a.requested_size()), (3000, 3000));
    assert_eq!(c.size(), (25 << 20) + 7);
    let sim = alloc.device().counters();
    assert_eq!(sim.mallocs, 3, "no allocation came from a cache");
    assert_eq!(
        sim.allocated_bytes,
        3000 + 3000 + (25 << 20) + 7,
        "exact sizes: no rounding"
    );
    assert_books_empty(&alloc);

    alloc.free(a).unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 2);
    let raw = alloc.raw_alloc(1 << 20, S).unwrap();
    assert_eq!(alloc.base_allocation(raw).unwrap(), (raw, 1 << 20));
    alloc.raw_free(raw).unwrap();
    assert!(matches!(
        alloc.raw_free(raw),
        Err(Error::InvalidPointer { .. })
    ));
    alloc.free(b).unwrap();
    alloc.free(c).unwrap();
    let sim = alloc.device().counters();
    assert_eq!((sim.live_allocations, sim.frees), (0, 4));
    assert_books_empty(&alloc);
}

#[test]
fn a_zero_sized_request_is_null_and_no_device_call() {
    let alloc = uncached("");
    let empty = alloc.allocate(0, S).unwrap();
    assert_eq!(empty.ptr(), DeviceAddress(0));
    assert_eq!(alloc.device().counters().mallocs, 0);
    alloc.free(empty).unwrap();
    assert_eq!(alloc.raw_alloc(0, S).unwrap(), DeviceAddress(0));
    assert_books_empty(&alloc);
}

#[test]
fn a_block_used_by_another_stream_goes_back_once_that_stream_is_done() {
    let alloc = uncached("");
    let a = alloc.allocate(1 << 20, S).unwrap();
    alloc.record_stream(&a, OTHER).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        alloc.device().counters().live_allocations,
        1,
        "still in use by the other stream's queued work"
    );
    alloc.check_invariants().unwrap();
    alloc.device().complete_stream_work(OTHER);
    let b = alloc.allocate(512, S).unwrap(); // returns the completed one first
    assert_eq!(alloc.device().counters().live_allocations, 1, "only b");
    // By pointer too; empty_cache waits for the other stream.
    let p = alloc.raw_alloc(4096, S).unwrap();
    alloc.record_stream_ptr(p, OTHER).unwrap();
    alloc.raw_free(p).unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 2);
    alloc.empty_cache().unwrap();
    alloc.free(b).unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 0);
    assert_books_empty(&alloc);
}

#[test]
fn out_of_memory_is_the_usual_error_with_nothing_recorded() {
    let alloc = CachingAllocator::new(SimDevice::new(8 << 20));
    alloc.set_caching_disabled(true);
    alloc.record_history(true, 100);
    let held = alloc.allocate(6 << 20, S).unwrap();
    let err = alloc.allocate(4 << 20, S).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("expected out of memory, got {err}")
    };
    assert_eq!(oom.alloc_size, 4 << 20, "the size asked for");
    assert_books_empty(&alloc);
    assert_eq!(
        alloc.memory_stats().num_sync_all_streams,
        0,
        "nothing was cached: no cache emptied"
    );
    alloc.free(held).unwrap();
    let fits = alloc.allocate(4 << 20, S).unwrap();
    alloc.free(fits).unwrap();
}

#[test]
fn blocks_cached_before_stay_until_empty_cache_and_are_not_reused() {
    let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
    let cached = alloc.allocate(1 << 20, S).unwrap();
    alloc.free(cached).unwrap();
    let reserved = alloc.reserved_bytes();
    assert!(reserved > 0);
    alloc.set_caching_disabled(true);
    let a = alloc.allocate(1 << 20, S).unwrap();
    assert_eq!(alloc.device().counters().mallocs, 2, "not from the cache");
    assert_eq!(
        alloc.reserved_bytes(),
        reserved,
        "the uncached one is not counted"
    );
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    assert_eq!(alloc.device().counters().live_allocations, 1, "only a");
    alloc.free(a).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 0);
}

#[test]
fn a_private_pool_is_served_as_with_caching_on() {
    const POOL: MempoolId = MempoolId(1, 0);
    let alloc = uncached("");
    alloc.begin_allocate_to_pool(POOL, |s| s == S).unwrap();
    let x = alloc.allocate(3000, S).unwrap();
    assert_eq!(x.size(), 3072, "rounded, from the pool");
    assert_eq!(alloc.memory_stats().allocation.all.current, 1);
    alloc.free(x).unwrap();
    alloc.end_allocate_to_pool(POOL).unwrap();
    alloc.release_pool(POOL).unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn dropping_the_allocator_returns_what_is_still_allocated() {
    let device = std::sync::Arc::new(SimDevice::new(1 << 30));
    let alloc = CachingAllocator::new(std::sync::Arc::clone(&device));
    alloc.set_caching_disabled(true);
    let kept = alloc.allocate(5000, S).unwrap().into_ptr();
    let used = alloc.allocate(6000, S).unwrap();
    alloc.record_stream(&used, OTHER).unwrap();
    alloc.free(used).unwrap();
    assert_ne!(kept, DeviceAddress(0));
    assert_eq!(device.counters().live_allocations, 2);
    drop(alloc);
    assert_eq!(device.counters().live_allocations, 0);
}

#[test]
fn expandable_segments_are_not_used_and_caching_comes_back_on() {
    let alloc = uncached("expandable_segments:True");
    let a = alloc.allocate(4 << 20, S).unwrap();
    assert_eq!(alloc.device().counters().reserved_ranges, 0);
    assert_eq!(alloc.device().counters().mallocs, 1);
    assert_eq!(alloc.reserved_bytes(), 0, "outside the books");
    alloc.free(a).unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 0);

    alloc.set_caching_disabled(false);
    let b = alloc.allocate(4 << 20, S).unwrap();
    alloc.free(b).unwrap();
    assert!(alloc.reserved_bytes() > 0, "cached again");
    assert_eq!(
        alloc.device().counters().reserved_ranges,
        1,
        "expandable again"
    );
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}
