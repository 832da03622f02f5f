//! Expandable segments: one growing segment per stream and pool, mapped and unmapped in chunks.

mod common;

use common::*;
use tensormem_cuda_alloc::snapshot::TraceAction;
use tensormem_cuda_alloc::Error;

#[test]
fn the_segment_grows_in_place() {
    let a = sim_with("expandable_segments:True", GIB);
    a.record_history(true, 1000);
    let x = a.allocate(30 * MIB, S0).unwrap();
    let s = checked(&a);
    assert_eq!(
        s.reserved_bytes.large_pool.current,
        40 * MIB as i64,
        "two 20 MiB chunks"
    );
    assert_eq!(
        s.segment.all.current, 0,
        "expandable segments are not counted as segments"
    );
    assert_eq!(s.num_device_alloc, 1);
    // 15 MiB: the free 10 MiB after x grows by one more chunk into the unmapped space.
    let y = a.allocate(15 * MIB, S0).unwrap();
    assert_eq!(y.ptr().0, x.ptr().0 + 30 * MIB as u64, "right after x");
    let s = checked(&a);
    assert_eq!(s.reserved_bytes.large_pool.current, 60 * MIB as i64);
    assert_eq!(s.num_device_alloc, 2);
    assert_eq!(
        s.inactive_split.all.current, 0,
        "not counted for expandable segments"
    );
    let maps: Vec<(u64, u64)> = a
        .trace()
        .iter()
        .filter(|e| e.action == TraceAction::SegmentMap)
        .map(|e| (e.addr, e.size))
        .collect();
    assert_eq!(
        maps,
        [
            (x.ptr().0, 40 * MIB as u64),
            (x.ptr().0 + 40 * MIB as u64, 20 * MIB as u64)
        ]
    );
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1, "one contiguous mapped range");
    assert!(snap.segments[0].is_expandable);
    assert_eq!(snap.segments[0].total_size, 60 * MIB as u64);
    // Small requests use their own (2 MiB chunk) segment.
    let z = a.allocate(4096, S0).unwrap();
    assert_eq!(
        checked(&a).reserved_bytes.small_pool.current,
        2 * MIB as i64
    );
    assert_eq!(a.device().counters().reserved_ranges, 2);
    for b in [x, y, z] {
        a.free(b).unwrap();
    }
}

#[test]
fn empty_cache_unmaps_free_chunks_and_releases_empty_segments() {
    let a = sim_with("expandable_segments:True", GIB);
    a.record_history(true, 1000);
    let x = a.allocate(30 * MIB, S0).unwrap();
    let y = a.allocate(15 * MIB, S0).unwrap();
    a.free(x).unwrap();
    // [0, 30) free, [30, 45) y, [45, 60) free: only the first chunk [0, 20) is wholly free.
    a.empty_cache().unwrap();
    let s = checked(&a);
    assert_eq!(s.reserved_bytes.all.current, 40 * MIB as i64);
    assert_eq!(s.num_device_free, 1);
    assert_eq!(a.device().counters().mapped_bytes, 40 * MIB as u64);
    let unmaps: Vec<_> = a
        .trace()
        .iter()
        .filter(|e| e.action == TraceAction::SegmentUnmap)
        .map(|e| (e.addr + 30 * MIB as u64 - y.ptr().0, e.size))
        .collect();
    assert_eq!(unmaps, [(0, 20 * MIB as u64)]);
    // Freed again, the hole is refilled at the lowest address first.
    let z = a.allocate(20 * MIB, S0).unwrap();
    assert_eq!(z.ptr().0, y.ptr().0 - 30 * MIB as u64);
    a.free(z).unwrap();
    a.free(y).unwrap();
    a.empty_cache().unwrap();
    let s = checked(&a);
    assert_eq!(s.reserved_bytes.all.current, 0);
    let c = a.device().counters();
    assert_eq!((c.mapped_bytes, c.reserved_ranges, c.used_bytes), (0, 0, 0));
}

#[test]
fn running_out_unmaps_cached_chunks_to_grow_elsewhere() {
    let a = sim_with("expandable_segments:True", 60 * MIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x).unwrap();
    // Another stream needs 40 MiB: only after S0's cached chunks are unmapped does it fit.
    let y = a.allocate(40 * MIB, S1).unwrap();
    let s = checked(&a);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.reserved_bytes.all.current, 40 * MIB as i64);
    a.free(y).unwrap();
}

#[test]
fn expandable_memory_cannot_be_shared() {
    let a = sim_with("expandable_segments:True", GIB);
    let x = a.allocate(MIB, S0).unwrap();
    assert!(matches!(
        a.base_allocation(x.ptr()),
        Err(Error::ExpandableNotShareable { .. })
    ));
    a.free(x).unwrap();
}

#[test]
fn switching_expandable_segments_off_keeps_new_blocks_out_of_them() {
    let a = sim_with("expandable_segments:True", GIB);
    let x = a.allocate(30 * MIB, S0).unwrap();
    a.free(x).unwrap();
    a.apply_settings("expandable_segments:False").unwrap();
    let y = a.allocate(10 * MIB, S0).unwrap();
    let s = checked(&a);
    assert_eq!(
        s.segment.all.current, 1,
        "a plain segment, not the cached expandable block"
    );
    let (base, size) = a.base_allocation(y.ptr()).unwrap();
    assert_eq!((base, size), (y.ptr(), 10 * MIB));
    a.free(y).unwrap();
}
