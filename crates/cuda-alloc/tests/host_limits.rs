//! The pinned host allocator following `pinned_max_round_threshold_mb` and
//! `pinned_max_cached_size_mb` (PyTorch 2.11's rules), on the simulated device with heap memory.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator, HOST_ALIGNMENT};
use tensormem_cuda_alloc::StreamId;

const MIB: usize = 1 << 20;

fn host(config: &str) -> HostCachingAllocator<SimDevice> {
    let config = AllocatorConfig::parse(config).unwrap();
    HostCachingAllocator::with_config(SimDevice::new(1 << 30), HeapSource, &config)
}

fn flat(host: &HostCachingAllocator<SimDevice>, key: &str) -> i64 {
    host.stats().to_flat()[key]
}

#[test]
fn by_default_every_request_is_rounded_to_a_power_of_two_and_cached() {
    let host = host("");
    let a = host.allocate(5 * MIB + 1).unwrap();
    assert_eq!(a.capacity(), 8 * MIB);
    host.free(a).unwrap();
    assert_eq!(flat(&host, "allocated_bytes.current"), 8 * MIB as i64);
    assert_eq!(flat(&host, "num_host_free"), 0);
}

#[test]
fn requests_above_the_round_threshold_take_whole_pages() {
    let host = host("pinned_max_round_threshold_mb:2");
    // At the threshold: still a power of two.
    assert_eq!(host.allocate(2 * MIB - 5).unwrap().capacity(), 2 * MIB);
    let small = host.allocate(MIB + 1).unwrap();
    assert_eq!(small.capacity(), 2 * MIB);
    let big = host.allocate(3 * MIB + 5).unwrap();
    assert_eq!(big.capacity(), 3 * MIB + HOST_ALIGNMENT);
    assert_eq!(big.len(), 3 * MIB + 5);
    assert_eq!(host.block_size(3 * MIB + 5), Some(3 * MIB + HOST_ALIGNMENT));
    assert_eq!(
        flat(&host, "allocated_bytes.current"),
        (2 * MIB + 2 * MIB + 3 * MIB + HOST_ALIGNMENT) as i64
    );
}

#[test]
fn unrounded_blocks_are_cached_and_serve_requests_of_their_class_they_cover() {
    let host = host("pinned_max_round_threshold_mb:1");
    let a = host.allocate(3 * MIB).unwrap();
    let addr = a.as_ptr();
    host.free(a).unwrap();
    assert_eq!(flat(&host, "allocated_bytes.current"), 3 * MIB as i64);
    // Larger than the cached block (same class, 2^22): a new block.
    let b = host.allocate(3 * MIB + MIB / 2).unwrap();
    assert_ne!(b.as_ptr(), addr);
    // Smaller: the cached block, whole.
    let c = host.allocate(5 * MIB / 2).unwrap();
    assert_eq!((c.as_ptr(), c.capacity()), (addr, 3 * MIB));
    assert_eq!(flat(&host, "num_host_alloc"), 2);
    host.free(b).unwrap();
    host.free(c).unwrap();
}

#[test]
fn blocks_above_the_cache_limit_go_back_to_the_system_when_freed() {
    let host = host("pinned_max_cached_size_mb:1");
    // Above the cache limit: not rounded either (the round threshold is unlimited).
    let big = host.allocate(2 * MIB + 1).unwrap();
    assert_eq!(big.capacity(), 2 * MIB + HOST_ALIGNMENT);
    let small = host.allocate(4000).unwrap();
    assert_eq!(small.capacity(), 4096);
    host.free(big).unwrap();
    host.free(small).unwrap();
    let stats = host.stats().to_flat();
    assert_eq!(
        stats["allocated_bytes.current"], 4096,
        "only the small one cached"
    );
    assert_eq!(stats["allocations.current"], 1);
    assert_eq!(stats["active_bytes.current"], 0);
    assert_eq!((stats["num_host_alloc"], stats["num_host_free"]), (2, 1));
    assert_eq!(stats["host_free_time.count"], 1);
    // Exactly at the limit: rounded and cached.
    let at = host.allocate(MIB).unwrap();
    assert_eq!(at.capacity(), MIB);
    host.free(at).unwrap();
    assert_eq!(flat(&host, "allocated_bytes.current"), (MIB + 4096) as i64);
}

#[test]
fn an_uncached_block_used_by_a_stream_goes_back_once_the_stream_is_done() {
    let host = host("pinned_max_cached_size_mb:1");
    let s = StreamId(7);
    let big = host.allocate(4 * MIB).unwrap();
    host.record_stream(&big, s).unwrap();
    host.free(big).unwrap();
    // The stream may still read it: held, and active.
    assert_eq!(flat(&host, "allocated_bytes.current"), 4 * MIB as i64);
    assert_eq!(flat(&host, "active_bytes.current"), 4 * MIB as i64);
    host.empty_cache().unwrap();
    assert_eq!(flat(&host, "allocated_bytes.current"), 4 * MIB as i64);
    host.device().complete_stream_work(s);
    // The next allocation processes the event and returns the block.
    let small = host.allocate(100).unwrap();
    let stats = host.stats().to_flat();
    assert_eq!(stats["allocated_bytes.current"], 4096);
    assert_eq!(stats["active_bytes.current"], 4096);
    assert_eq!(stats["num_host_free"], 1);
    host.free(small).unwrap();
}

#[test]
fn the_cache_limit_also_applies_when_the_round_threshold_is_higher() {
    // PyTorch: a request above the cache limit is not rounded, whatever the round threshold.
    let host = host("pinned_max_round_threshold_mb:8,pinned_max_cached_size_mb:2");
    let a = host.allocate(3 * MIB).unwrap();
    assert_eq!(a.capacity(), 3 * MIB);
    let b = host.allocate(MIB + 1).unwrap();
    assert_eq!(b.capacity(), 2 * MIB);
    host.free(a).unwrap();
    host.free(b).unwrap();
    assert_eq!(flat(&host, "allocated_bytes.current"), 2 * MIB as i64);
    host.empty_cache().unwrap();
    assert_eq!(flat(&host, "allocated_bytes.current"), 0);
}

/// Host memory reserved ahead of its use: pinned by several threads, cached, and then served
/// without pinning; a second reserve pins only what is missing; blocks above
/// `pinned_max_cached_size_mb` cannot be kept.
#[test]
fn a_reserve_pins_ahead_in_parallel_and_later_requests_pin_nothing() {
    let host = host("");
    assert_eq!(host.reserve(5 * MIB, 2 * MIB, 4).unwrap(), 6 * MIB);
    assert_eq!(flat(&host, "num_host_alloc"), 3);
    let taken: Vec<_> = (0..3).map(|_| host.allocate(2 * MIB).unwrap()).collect();
    assert_eq!(flat(&host, "num_host_alloc"), 3, "served from the reserve");
    for buffer in taken {
        host.free(buffer).unwrap();
    }
    assert_eq!(host.reserve(8 * MIB, 2 * MIB, 2).unwrap(), 8 * MIB);
    assert_eq!(flat(&host, "num_host_alloc"), 4, "one more block");
    assert_eq!(
        host.reserve(MIB, 2 * MIB, 8).unwrap(),
        8 * MIB,
        "enough already"
    );
    assert_eq!(flat(&host, "num_host_alloc"), 4);

    let capped = self::host("pinned_max_cached_size_mb:1");
    assert_eq!(capped.reserve(4 * MIB, 2 * MIB, 2).unwrap(), 0);
    assert_eq!(flat(&capped, "allocated_bytes.current"), 0);
}
