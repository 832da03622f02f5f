//! Caching turned off (`PYTORCH_NO_CUDA_MEMORY_CACHING` / `TENSORMEM_NO_CUDA_MEMORY_CACHING`): every
//! allocation is a device allocation of its own, returned to the device when freed (once no other
//! stream uses it), with statistics and invariants kept.

mod common;

use common::env;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::{caching_disabled_by_env_with, AllocatorConfig};
use tensormem_cuda_alloc::{CachingAllocator, StreamId};

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

#[test]
fn every_allocation_is_its_own_device_allocation_returned_when_freed() {
    let alloc = uncached("");
    let a = alloc.allocate(3000, S).unwrap();
    let b = alloc.allocate(3000, S).unwrap();
    let c = alloc.allocate(25 << 20, S).unwrap();
    let sim = alloc.device().counters();
    assert_eq!(sim.mallocs, 3, "no allocation came from the cache");
    assert_eq!(sim.allocated_bytes, 3072 + 3072 + (25 << 20), "exact sizes");
    let stats = alloc.memory_stats();
    assert_eq!(stats.segment.all.current, 3);
    assert_eq!(stats.reserved_bytes.all.current, 3072 + 3072 + (25 << 20));
    assert_eq!(stats.inactive_split.all.current, 0, "nothing was split");
    alloc.check_invariants().unwrap();

    alloc.free(a).unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 2);
    assert_eq!(alloc.reserved_bytes(), 3072 + (25 << 20));
    let raw = alloc.raw_alloc(1 << 20, S).unwrap();
    alloc.raw_free(raw).unwrap();
    alloc.free(b).unwrap();
    alloc.free(c).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 0);
    let flat = alloc.memory_stats().to_flat();
    assert_eq!(flat["reserved_bytes.all.current"], 0);
    assert_eq!(flat["num_device_alloc"], 4);
    assert_eq!(flat["num_device_free"], 4);
    assert_eq!(flat["allocation.all.allocated"], 4);
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
    alloc.device().complete_stream_work(OTHER);
    let b = alloc.allocate(512, S).unwrap(); // processes the completed event first
    assert_eq!(alloc.device().counters().live_allocations, 1, "only b");
    alloc.free(b).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.device().counters().live_allocations, 0);
}

#[test]
fn expandable_segments_are_not_used_and_caching_comes_back_on() {
    let alloc = uncached("expandable_segments:True");
    let a = alloc.allocate(4 << 20, S).unwrap();
    assert_eq!(alloc.device().counters().reserved_ranges, 0);
    assert_eq!(alloc.device().counters().mallocs, 1);
    alloc.free(a).unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);

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
