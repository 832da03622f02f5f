//! Size classes, best fit, splitting, merging and the `max_split_size` rules, at their boundaries.

mod common;

use common::*;
use tensormem_cuda_alloc::StreamId;

#[test]
fn sizes_round_up_to_512_bytes() {
    let a = sim(GIB);
    for (req, size) in [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024)] {
        let x = a.allocate(req, S0).unwrap();
        assert_eq!((x.size(), x.requested_size()), (size, req), "request {req}");
        a.free(x).unwrap();
    }
    let s = checked(&a);
    assert_eq!(
        s.segment.small_pool.current, 1,
        "one 2 MiB segment serves them all"
    );
    assert_eq!(s.reserved_bytes.all.current, 2 * MIB as i64);
    assert_eq!(
        s.requested_bytes.all.allocated,
        1 + 511 + 512 + 513 + 1000,
        "requested bytes count what was asked"
    );
    assert_eq!(s.allocated_bytes.all.allocated, 512 * 3 + 1024 * 2);
}

#[test]
fn one_mib_is_small_and_one_mib_plus_one_is_large() {
    let a = sim(GIB);
    let small = a.allocate(MIB, S0).unwrap();
    let large = a.allocate(MIB + 1, S0).unwrap();
    assert_eq!((small.size(), large.size()), (MIB, MIB + 512));
    let s = checked(&a);
    assert_eq!(s.segment.small_pool.current, 1);
    assert_eq!(s.segment.large_pool.current, 1);
    assert_eq!(s.reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(s.reserved_bytes.large_pool.current, 20 * MIB as i64);
    assert_eq!(s.allocation.small_pool.current, 1);
    assert_eq!(s.allocation.large_pool.current, 1);
}

#[test]
fn large_segments_are_20_mib_below_10_mib_and_rounded_to_2_mib_above() {
    for (req, segment) in [
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),
        (10 * MIB + 1, 12 * MIB),
        (64 * MIB, 64 * MIB),
        (64 * MIB + 1, 66 * MIB),
    ] {
        let a = sim(GIB);
        let _x = a.allocate(req, S0).unwrap();
        let s = checked(&a);
        assert_eq!(
            s.reserved_bytes.large_pool.current, segment as i64,
            "request {req}"
        );
    }
}

#[test]
fn small_blocks_split_down_to_512_bytes() {
    let a = sim(GIB);
    let x = a.allocate(MIB, S0).unwrap();
    // Leaves exactly 512 bytes: still split off.
    let y = a.allocate(MIB - 512, S0).unwrap();
    let z = a.allocate(512, S0).unwrap();
    assert_eq!(y.ptr().0, x.ptr().0 + MIB as u64);
    assert_eq!(z.ptr().0, y.ptr().0 + (MIB - 512) as u64);
    assert_eq!(checked(&a).segment.small_pool.current, 1);
    let w = a.allocate(512, S0).unwrap();
    assert_eq!(
        checked(&a).segment.small_pool.current,
        2,
        "the first segment is full"
    );
    for b in [x, y, z, w] {
        a.free(b).unwrap();
    }
}

#[test]
fn large_blocks_split_only_when_more_than_1_mib_remains() {
    // 19 MiB from a 20 MiB segment leaves exactly 1 MiB: not split, the whole segment is handed out.
    let a = sim(GIB);
    let x = a.allocate(19 * MIB, S0).unwrap();
    assert_eq!(x.size(), 20 * MIB);
    let s = checked(&a);
    assert_eq!(s.allocated_bytes.all.current, 20 * MIB as i64);
    assert_eq!(s.requested_bytes.all.current, 19 * MIB as i64);
    assert_eq!(s.inactive_split.all.current, 0);
    // 512 bytes less leaves 1 MiB + 512: split.
    let b = sim(GIB);
    let y = b.allocate(19 * MIB - 512, S0).unwrap();
    assert_eq!(y.size(), 19 * MIB - 512);
    let s = checked(&b);
    assert_eq!(s.inactive_split.large_pool.current, 1);
    assert_eq!(
        s.inactive_split_bytes.large_pool.current,
        (MIB + 512) as i64
    );
    a.free(x).unwrap();
    b.free(y).unwrap();
    assert_eq!(checked(&b).inactive_split.all.current, 0, "merged back");
}

#[test]
fn best_fit_takes_the_smallest_block_then_the_lowest_address() {
    let a = sim(GIB);
    // Segments of 16, 12 and 14 MiB at known addresses, then a second 14 MiB one below the first.
    a.device()
        .push_addresses([0x9000_0000, 0x1000_0000, 0x5000_0000, 0x3000_0000]);
    let blocks: Vec<_> = [16, 12, 14, 14]
        .iter()
        .map(|&m| a.allocate(m * MIB, S0).unwrap())
        .collect();
    for b in blocks {
        a.free(b).unwrap();
    }
    // 13 MiB: the 14 MiB blocks fit best (the remainder, 1 MiB, is not split off); the one at the
    // lower address wins.
    let x = a.allocate(13 * MIB, S0).unwrap();
    assert_eq!((x.ptr().0, x.size()), (0x3000_0000, 14 * MIB));
    let y = a.allocate(13 * MIB, S0).unwrap();
    assert_eq!(y.ptr().0, 0x5000_0000);
    let z = a.allocate(13 * MIB, S0).unwrap();
    assert_eq!(
        (z.ptr().0, z.size()),
        (0x9000_0000, 13 * MIB),
        "16 MiB block split"
    );
    checked(&a);
}

#[test]
fn blocks_belong_to_their_stream() {
    let a = sim(GIB);
    let x = a.allocate(4 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let y = a.allocate(4 * MIB, S1).unwrap();
    let s = checked(&a);
    assert_eq!(
        s.segment.large_pool.current, 2,
        "S1 cannot use S0's cached block"
    );
    a.free(y).unwrap();
    let z = a.allocate(4 * MIB, S0).unwrap();
    assert_eq!(checked(&a).segment.large_pool.current, 2);
    a.free(z).unwrap();
}

#[test]
fn freed_neighbours_merge_and_inactive_split_counts_follow() {
    let a = sim(GIB);
    let x = a.allocate(MIB + 1, S0).unwrap();
    let y = a.allocate(MIB + 1, S0).unwrap();
    let z = a.allocate(MIB + 1, S0).unwrap();
    assert_eq!(y.ptr().0, x.ptr().0 + (MIB + 512) as u64);
    let s = checked(&a);
    assert_eq!(
        s.inactive_split.large_pool.current, 1,
        "the rest of the segment"
    );
    a.free(y).unwrap();
    let s = checked(&a);
    assert_eq!(s.inactive_split.large_pool.current, 2);
    assert_eq!(
        s.inactive_split_bytes.large_pool.current,
        (20 * MIB - 2 * (MIB + 512)) as i64
    );
    a.free(x).unwrap();
    assert_eq!(
        checked(&a).inactive_split.large_pool.current,
        2,
        "x merged into y's block"
    );
    a.free(z).unwrap();
    let s = checked(&a);
    assert_eq!(s.inactive_split.all.current, 0, "one unsplit block again");
    assert_eq!(s.inactive_split_bytes.all.current, 0);
    assert_eq!(s.inactive_split.large_pool.peak, 2);
    assert_eq!(s.active.all.current, 0);
}

#[test]
fn oversize_blocks_serve_only_requests_within_the_rounding_tolerance() {
    let a = sim_with("max_split_size_mb:20", GIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    let s = checked(&a);
    assert_eq!(s.oversize_segments.current, 1);
    assert_eq!(s.oversize_allocations.current, 1);
    assert_eq!(s.max_split_size, 20 * MIB as i64);
    a.free(x).unwrap();
    assert_eq!(checked(&a).oversize_allocations.current, 0);
    // Below max_split_size: an oversize block is never used.
    let small = a.allocate(10 * MIB, S0).unwrap();
    assert_eq!(checked(&a).segment.large_pool.current, 2);
    a.free(small).unwrap();
    // 40 MiB >= 20 MiB + 20 MiB: refused for a 20 MiB request.
    let y = a.allocate(20 * MIB, S0).unwrap();
    assert_ne!(y.ptr().0, checked_addr(&a, 40 * MIB));
    assert_eq!(checked(&a).segment.large_pool.current, 3);
    a.free(y).unwrap();
    // 40 MiB < (20 MiB + 512) + 20 MiB: served, whole (oversize blocks are not split).
    let z = a.allocate(20 * MIB + 512, S0).unwrap();
    assert_eq!(z.size(), 40 * MIB);
    let s = checked(&a);
    assert_eq!(s.segment.large_pool.current, 3);
    assert_eq!(s.oversize_allocations.current, 1);
    assert_eq!(s.oversize_allocations.allocated, 3);
    a.free(z).unwrap();
}

/// The address of the cached block of `size` bytes, via the snapshot.
fn checked_addr(
    a: &tensormem_cuda_alloc::CachingAllocator<impl tensormem_cuda_alloc::Device>,
    size: usize,
) -> u64 {
    a.snapshot()
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.size == size as u64)
        .map_or(0, |b| b.address)
}

#[test]
fn max_non_split_rounding_widens_the_tolerance() {
    let a = sim_with("max_split_size_mb:20,max_non_split_rounding_mb:40", GIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let y = a.allocate(20 * MIB, S0).unwrap();
    assert_eq!(y.size(), 40 * MIB, "40 MiB < 20 MiB + 40 MiB");
    assert_eq!(checked(&a).segment.large_pool.current, 1);
    a.free(y).unwrap();
}

#[test]
fn blocks_below_max_split_size_still_split() {
    let a = sim_with("max_split_size_mb:20", GIB);
    let x = a.allocate(5 * MIB, S0).unwrap();
    assert_eq!(x.size(), 5 * MIB);
    let s = checked(&a);
    // The 20 MiB segment counts as oversize (it is not below max_split_size).
    assert_eq!(s.oversize_segments.current, 1);
    assert_eq!(s.oversize_allocations.current, 0);
    let y = a.allocate(5 * MIB, S0).unwrap();
    assert_eq!(y.ptr().0, x.ptr().0 + 5 * MIB as u64);
    a.free(x).unwrap();
    a.free(y).unwrap();
}

#[test]
fn roundup_power2_divisions_round_between_powers_of_two() {
    let a = sim_with("roundup_power2_divisions:4", GIB);
    let x = a.allocate(1200, S0).unwrap();
    // 1200 is below 512 * 4 = 2048: plain 512-byte rounding.
    assert_eq!(x.size(), 1536);
    let y = a.allocate(5 * MIB + 1, S0).unwrap();
    // Between 4 and 8 MiB in steps of 1 MiB.
    assert_eq!(y.size(), 6 * MIB);
    let list = sim_with("roundup_power2_divisions:[1:1,2:2,>:8]", GIB);
    let z = list.allocate(3 * MIB + 1, S0).unwrap();
    // [2 MiB, 4 MiB) uses 2 divisions: 4 MiB.
    assert_eq!(z.size(), 4 * MIB);
    let w = list.allocate(1536 * KIB + 1, S0).unwrap();
    // [1 MiB, 2 MiB) uses 1: no power-of-two rounding.
    assert_eq!(w.size(), 1536 * KIB + 512);
    for (alloc, b) in [(&a, x), (&a, y), (&list, z), (&list, w)] {
        alloc.free(b).unwrap();
    }
}

#[test]
fn many_streams_each_get_their_own_pools() {
    let a = sim(GIB);
    let blocks: Vec<_> = (0..16)
        .map(|s| a.allocate(512, StreamId(s)).unwrap())
        .collect();
    let s = checked(&a);
    assert_eq!(s.segment.small_pool.current, 16);
    for b in blocks {
        a.free(b).unwrap();
    }
    assert_eq!(checked(&a).active.all.current, 0);
}
