//! The pinned host caching allocator on the simulated device (events) with heap memory: size classes,
//! reuse gated by the events of the streams that used a block, `empty_cache`, PyTorch's host keys.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator, PinnedBuffer};
use tensormem_cuda_alloc::{Error, StreamId};

fn host() -> HostCachingAllocator<SimDevice> {
    HostCachingAllocator::new(SimDevice::new(1 << 30), HeapSource)
}

#[test]
fn requests_round_to_powers_of_two_and_reuse_their_class() {
    let host = host();
    let mut a = host.allocate(3000).unwrap();
    assert_eq!((a.len(), a.capacity()), (3000, 4096));
    a.as_mut_slice().fill(0xAB);
    assert!(a.as_slice().iter().all(|&b| b == 0xAB));
    let b = host.allocate(5000).unwrap();
    assert_eq!(b.capacity(), 8192);
    let c = host.allocate(1 << 20).unwrap();
    assert_eq!(c.capacity(), 1 << 20);
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    host.free(a).unwrap();
    host.free(b).unwrap();
    // Same class: the freed block again; another class: not it.
    let d = host.allocate(4000).unwrap();
    assert_eq!(d.as_ptr(), pa);
    let e = host.allocate(6000).unwrap();
    assert_eq!(e.as_ptr(), pb);
    let f = host.allocate(100).unwrap();
    assert_ne!(
        f.as_ptr(),
        pa,
        "a 4 KiB block in use is not handed out twice"
    );
    let flat = host.stats().to_flat();
    assert_eq!(flat["num_host_alloc"], 4);
    assert_eq!(flat["allocations.current"], 4);
    assert_eq!(
        flat["allocated_bytes.current"],
        4096 + 8192 + (1 << 20) + 4096
    );
    assert_eq!(flat["active_requests.current"], 4);
    for buffer in [c, d, e, f] {
        host.free(buffer).unwrap();
    }
    assert_eq!(host.stats().active_bytes.current, 0);
}

#[test]
fn a_block_used_by_streams_is_reused_only_after_their_work_completes() {
    let host = host();
    let (s1, s2) = (StreamId(1), StreamId(2));
    let a = host.allocate(4096).unwrap();
    let pa = a.as_ptr();
    host.record_stream(&a, s1).unwrap();
    host.record_stream(&a, s2).unwrap();
    host.free(a).unwrap();
    assert_eq!(
        host.stats().active_requests.current,
        1,
        "still in use by copies"
    );
    let b = host.allocate(4096).unwrap();
    assert_ne!(b.as_ptr(), pa, "not reused while both streams may read it");
    host.device().complete_stream_work(s1);
    let c = host.allocate(4096).unwrap();
    assert_ne!(c.as_ptr(), pa, "stream 2 may still read it");
    host.device().complete_stream_work(s2);
    let d = host.allocate(4096).unwrap();
    assert_eq!(d.as_ptr(), pa, "reused once both completed");
    assert_eq!(host.stats().num_host_alloc, 3);
    // The streams recorded before are forgotten once the block is reused.
    host.free(d).unwrap();
    let e = host.allocate(4096).unwrap();
    assert_eq!(e.as_ptr(), pa);
    for buffer in [b, c, e] {
        host.free(buffer).unwrap();
    }
}

#[test]
fn empty_cache_returns_free_blocks_and_keeps_those_in_use() {
    let host = host();
    let live = host.allocate(1 << 16).unwrap();
    let pending = host.allocate(1 << 12).unwrap();
    host.record_stream(&pending, StreamId(3)).unwrap();
    host.free(pending).unwrap();
    let cached = host.allocate(1 << 20).unwrap();
    host.free(cached).unwrap();
    host.empty_cache().unwrap();
    let stats = host.stats();
    assert_eq!(stats.num_host_free, 1);
    assert_eq!(
        stats.allocations.current, 2,
        "the live and the pending block stay"
    );
    assert_eq!(stats.allocated_bytes.current, (1 << 16) + (1 << 12));
    host.device().complete_stream_work(StreamId(3));
    host.free(live).unwrap();
    host.empty_cache().unwrap();
    let flat = host.stats().to_flat();
    assert_eq!(flat["allocations.current"], 0);
    assert_eq!(flat["allocated_bytes.current"], 0);
    assert_eq!(flat["allocations.peak"], 3);
    assert_eq!(flat["num_host_free"], 3);
    assert_eq!(flat["host_free_time.count"], 3);
    assert!(flat.contains_key("host_alloc_time.avg"));
    host.reset_accumulated_stats();
    host.reset_peak_stats();
    let flat = host.stats().to_flat();
    assert_eq!((flat["num_host_alloc"], flat["allocations.peak"]), (0, 0));
}

#[test]
fn foreign_and_empty_buffers() {
    let (one, other) = (host(), host());
    let a: PinnedBuffer = one.allocate(10).unwrap();
    assert!(matches!(
        other.record_stream(&a, StreamId(0)),
        Err(Error::InvalidPointer { .. })
    ));
    let empty = one.allocate(0).unwrap();
    assert!(empty.is_empty() && empty.as_slice().is_empty());
    one.free(empty).unwrap();
    one.free(a).unwrap();
    assert_eq!(one.stats().allocations.current, 1);
}
