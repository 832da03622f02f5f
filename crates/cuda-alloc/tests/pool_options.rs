//! Memory-pool options (PyTorch's `MemPool(allocator, use_on_oom, no_split)`): a pool used as the
//! last resort before out-of-memory, a pool that never splits, a pool with its own allocator.

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use common::*;
use tensormem_cuda_alloc::{
    DeviceAddress, DeviceError, Error, FnPoolAllocator, MempoolId, PoolOptions,
};

const POOL: MempoolId = MempoolId(0, 7);
const OTHER: MempoolId = MempoolId(0, 8);

/// Allocates `size` bytes in `pool` (as `use_mem_pool` does: every stream of this test).
fn in_pool(
    a: &tensormem_cuda_alloc::CachingAllocator<tensormem_cuda_alloc::backend::sim::SimDevice>,
    pool: MempoolId,
    size: usize,
) -> tensormem_cuda_alloc::Allocation {
    a.begin_allocate_to_pool(pool, |_| true).unwrap();
    let x = a.allocate(size, S0).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    // `begin_allocate_to_pool` added a user, as PyTorch's does; `use_mem_pool` gives it back.
    a.release_pool(pool).unwrap();
    x
}

fn segment_pools(
    a: &tensormem_cuda_alloc::CachingAllocator<tensormem_cuda_alloc::backend::sim::SimDevice>,
) -> Vec<(u64, (u64, u64), usize)> {
    a.snapshot()
        .segments
        .iter()
        .map(|s| (s.address, s.segment_pool_id, s.blocks.len()))
        .collect()
}

#[test]
fn a_request_that_would_run_out_of_memory_is_served_by_a_use_on_oom_pool() {
    let a = sim(64 * MIB);
    a.create_pool(
        POOL,
        PoolOptions {
            use_on_oom: true,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    assert!(a.pool_options(POOL).unwrap().use_on_oom);
    let p = in_pool(&a, POOL, 20 * MIB);
    let pool_ptr = p.ptr();
    a.free(p).unwrap();
    // A cached default block too small for the request below: the fallback comes before it is
    // released (PyTorch 2.10 and later).
    let small = a.allocate(12 * MIB, S0).unwrap();
    let big = a.allocate(30 * MIB, S0).unwrap();
    a.free(small).unwrap();
    let before = checked(&a);
    assert_eq!(before.reserved_bytes.all.current as usize, 62 * MIB);

    let x = a
        .allocate(20 * MIB, S0)
        .expect("served from the use_on_oom pool");
    assert_eq!(x.ptr(), pool_ptr, "the pool's free block");
    let s = checked(&a);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(
        s.num_device_free, before.num_device_free,
        "nothing released"
    );
    assert_eq!(s.num_device_alloc, before.num_device_alloc);
    assert_eq!(s.allocated_bytes.all.current as usize, 50 * MIB);
    // The block stays the pool's: freeing it puts it back there, not in the default pools.
    a.free(x).unwrap();
    let pools = segment_pools(&a);
    assert!(pools.contains(&(pool_ptr.0, (0, 7), 1)), "{pools:?}");
    a.free(big).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(checked(&a).reserved_bytes.all.current, 0);
    assert!(a.private_pools().is_empty());
}

#[test]
fn without_use_on_oom_the_same_request_releases_the_cache_and_runs_out_of_memory() {
    let a = sim(64 * MIB);
    a.create_pool(POOL, PoolOptions::default()).unwrap();
    let p = in_pool(&a, POOL, 20 * MIB);
    a.free(p).unwrap();
    let small = a.allocate(12 * MIB, S0).unwrap();
    let big = a.allocate(30 * MIB, S0).unwrap();
    a.free(small).unwrap();
    let err = a.allocate(20 * MIB, S0).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
    let s = checked(&a);
    assert_eq!(s.num_ooms, 1);
    assert_eq!(
        s.num_device_free, 1,
        "the cached default block was released"
    );
    a.free(big).unwrap();
    // Turned off (as PyTorch does for a pool it destroys), the pool is not used either.
    a.set_use_on_oom(POOL, true).unwrap();
    a.set_use_on_oom(POOL, false).unwrap();
    let c = a.allocate(40 * MIB, S0).unwrap();
    assert!(matches!(
        a.allocate(20 * MIB, S0).unwrap_err(),
        Error::OutOfMemory(_)
    ));
    a.free(c).unwrap();
    a.release_pool(POOL).unwrap();
    // Turning it off for a pool that is gone is granted; turning it on is not.
    a.empty_cache().unwrap();
    a.set_use_on_oom(POOL, false).unwrap();
    assert!(matches!(
        a.set_use_on_oom(POOL, true),
        Err(Error::Pool { .. })
    ));
}

#[test]
fn a_use_on_oom_pool_serves_no_request_that_is_already_for_a_pool_nor_lends_after_release() {
    let a = sim(64 * MIB);
    a.create_pool(
        POOL,
        PoolOptions {
            use_on_oom: true,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    a.create_pool(OTHER, PoolOptions::default()).unwrap();
    let p = in_pool(&a, POOL, 20 * MIB);
    a.free(p).unwrap();
    let big = a.allocate(40 * MIB, S0).unwrap();
    // A request of another pool does not fall back.
    a.begin_allocate_to_pool(OTHER, |_| true).unwrap();
    let err = a.allocate(20 * MIB, S0).unwrap_err();
    a.end_allocate_to_pool(OTHER).unwrap();
    a.release_pool(OTHER).unwrap();
    assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
    // Once every user gave the pool up, it lends nothing: its free segment goes back to the device
    // with the rest of the cache instead, and the request gets a new segment.
    a.release_pool(POOL).unwrap();
    let before = checked(&a).num_device_free;
    let x = a.allocate(20 * MIB, S0).unwrap();
    let s = checked(&a);
    assert_eq!(s.num_device_free, before + 1, "the released pool's segment");
    assert_eq!(s.num_alloc_retries, 1);
    a.free(x).unwrap();
    a.free(big).unwrap();
    checked(&a);
}

#[test]
fn use_on_oom_works_under_a_memory_fraction() {
    let a = sim(GIB);
    a.set_memory_fraction(64.0 / 1024.0).unwrap();
    a.create_pool(
        POOL,
        PoolOptions {
            use_on_oom: true,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let p = in_pool(&a, POOL, 20 * MIB);
    let pool_ptr = p.ptr();
    a.free(p).unwrap();
    let big = a.allocate(40 * MIB, S0).unwrap();
    let x = a.allocate(20 * MIB, S0).unwrap();
    assert_eq!(x.ptr(), pool_ptr);
    a.free(x).unwrap();
    a.free(big).unwrap();
    assert_eq!(checked(&a).num_ooms, 0);
}

#[test]
fn a_no_split_pool_never_splits_a_block() {
    let a = sim(GIB);
    a.create_pool(
        POOL,
        PoolOptions {
            no_split: true,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    // Small: a 2 MiB segment each, handed out whole.
    let s1 = a.allocate(KIB, S0).unwrap();
    let s2 = a.allocate(KIB, S0).unwrap();
    assert_eq!(s1.size(), 2 * MIB);
    // Large: a 20 MiB segment for 3 MiB, handed out whole.
    let l1 = a.allocate(3 * MIB, S0).unwrap();
    assert_eq!(l1.size(), 20 * MIB);
    a.free(l1).unwrap();
    // The free whole block serves a smaller request again, still whole.
    let l2 = a.allocate(2 * MIB, S0).unwrap();
    assert_eq!(l2.size(), 20 * MIB);
    let s = checked(&a);
    assert_eq!(s.segment.all.current, 3);
    assert_eq!(s.allocated_bytes.all.current as usize, 24 * MIB);
    assert_eq!(s.inactive_split.all.current, 0);
    for (_, pool, blocks) in segment_pools(&a) {
        assert_eq!((pool, blocks), ((0, 7), 1), "one block per segment");
    }
    for x in [s1, s2, l2] {
        a.free(x).unwrap();
    }
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(checked(&a).reserved_bytes.all.current, 0);
    // The default pools still split.
    let d = a.allocate(KIB, S0).unwrap();
    assert_eq!(d.size(), KIB);
    a.free(d).unwrap();
}

#[test]
fn no_split_set_after_the_pool_was_used_applies_from_then_on() {
    let a = sim(GIB);
    a.create_pool(POOL, PoolOptions::default()).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let x = a.allocate(KIB, S0).unwrap();
    assert_eq!(x.size(), KIB);
    a.set_no_split(POOL).unwrap();
    let y = a.allocate(KIB, S0).unwrap();
    assert_eq!(y.size(), 2 * MIB - KIB, "the free remainder, whole");
    a.free(x).unwrap();
    a.free(y).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    checked(&a);
    assert!(matches!(a.set_no_split(OTHER), Err(Error::Pool { .. })));
}

/// A user's allocator over a fake address range, with its calls recorded.
#[derive(Default)]
struct Recorder {
    next: AtomicU64,
    limit: u64,
    mallocs: Mutex<Vec<(u64, usize)>>,
    frees: Mutex<Vec<(u64, usize)>>,
}

fn own_allocator(limit: u64) -> (Arc<Recorder>, PoolOptions) {
    let r = Arc::new(Recorder {
        next: AtomicU64::new(0x10_0000_0000),
        limit,
        ..Recorder::default()
    });
    let (m, f) = (Arc::clone(&r), Arc::clone(&r));
    let allocator = FnPoolAllocator::shared(
        move |size| {
            let used: usize = m.mallocs.lock().unwrap().iter().map(|x| x.1).sum::<usize>()
                - m.frees.lock().unwrap().iter().map(|x| x.1).sum::<usize>();
            if (used + size) as u64 > m.limit {
                return Err(DeviceError::OutOfMemory { bytes: size as u64 });
            }
            let ptr = m.next.fetch_add(size as u64 + (1 << 21), SeqCst);
            m.mallocs.lock().unwrap().push((ptr, size));
            Ok(DeviceAddress(ptr))
        },
        move |ptr: DeviceAddress, size| {
            f.frees.lock().unwrap().push((ptr.0, size));
            Ok(())
        },
    );
    let options = PoolOptions {
        allocator: Some(allocator),
        ..PoolOptions::default()
    };
    (r, options)
}

#[test]
fn a_pool_with_its_own_allocator_takes_and_returns_segments_through_it() {
    for config in ["", "expandable_segments:True"] {
        let a = sim_with(config, GIB);
        let (r, options) = own_allocator(u64::MAX);
        a.create_pool(POOL, options).unwrap();
        assert!(a.pool_options(POOL).unwrap().allocator.is_some());
        a.begin_allocate_to_pool(POOL, |_| true).unwrap();
        let x = a.allocate(3 * MIB, S0).unwrap();
        let y = a.allocate(KIB, S0).unwrap();
        a.end_allocate_to_pool(POOL).unwrap();
        a.release_pool(POOL).unwrap();
        let mallocs = r.mallocs.lock().unwrap().clone();
        assert_eq!(
            mallocs.iter().map(|m| m.1).collect::<Vec<_>>(),
            [20 * MIB, 2 * MIB],
            "{config}: whole segments, never expandable ones"
        );
        assert_eq!(x.ptr().0, mallocs[0].0, "{config}");
        let s = checked(&a);
        assert_eq!(s.segment.all.current, 2, "{config}");
        assert_eq!(s.reserved_bytes.all.current as usize, 22 * MIB, "{config}");
        assert_eq!(s.num_device_alloc, 2, "{config}");
        // The default pools still use the device.
        let d = a.allocate(KIB, S0).unwrap();
        assert_eq!(r.mallocs.lock().unwrap().len(), 2);
        a.free(d).unwrap();
        a.free(x).unwrap();
        a.free(y).unwrap();
        assert!(r.frees.lock().unwrap().is_empty(), "{config}: cached");
        a.release_pool(POOL).unwrap();
        a.empty_cache().unwrap();
        let mut frees = r.frees.lock().unwrap().clone();
        frees.sort_unstable();
        let mut expected = mallocs.clone();
        expected.sort_unstable();
        assert_eq!(frees, expected, "{config}: every segment back to the user");
        let s = checked(&a);
        assert_eq!(
            s.num_device_free, 3,
            "{config}: two of the pool, one default"
        );
        assert_eq!(s.reserved_bytes.all.current, 0, "{config}");
        assert!(a.private_pools().is_empty());
    }
}

#[test]
fn an_own_allocator_out_of_memory_is_the_allocators_and_dropping_returns_its_segments() {
    let a = sim(GIB);
    let (r, options) = own_allocator(30 * MIB as u64);
    a.create_pool(POOL, options).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let x = a.allocate(20 * MIB, S0).unwrap();
    let err = a.allocate(20 * MIB, S0).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
    let y = a.allocate(KIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert_eq!(checked(&a).num_ooms, 1);
    a.free(y).unwrap();
    let _ = x.into_ptr();
    // An allocation not freed is forgotten with the allocator; its segment goes back all the same.
    drop(a);
    assert_eq!(r.frees.lock().unwrap().len(), 2);
}

#[test]
fn an_allocator_can_only_be_given_to_a_new_pool() {
    let a = sim(GIB);
    a.create_pool(POOL, PoolOptions::default()).unwrap();
    let (_r, options) = own_allocator(u64::MAX);
    let err = a.create_pool(POOL, options).unwrap_err();
    assert!(matches!(err, Error::Pool { .. }), "{err}");
    assert!(err.to_string().contains("new pool id"), "{err}");
    assert_eq!(a.pool_use_count(POOL), 1);
}

/// The fast path decides a `no_split` pool's splits as the plain path does: a block split off
/// before `no_split` was set, freed next to the free rest of its segment (the fast path parks such a
/// free) and asked for again at its size, comes back the same with the fast path on and off (whole,
/// since the pool no longer splits).
#[test]
fn a_no_split_pool_splits_the_same_with_the_fast_path_on_and_off() {
    let sizes = |fast: bool| {
        let a = sim(8 * GIB);
        a.set_fast_path_enabled(fast);
        a.create_or_incref_pool(POOL).unwrap();
        a.begin_allocate_to_pool(POOL, |_| true).unwrap();
        let first = a.allocate(2 * MIB, S0).unwrap();
        let x = a.allocate(3 * MIB, S0).unwrap();
        a.set_no_split(POOL).unwrap();
        let mut out = Vec::new();
        let mut x = Some(x);
        for _ in 0..3 {
            a.free(x.take().unwrap()).unwrap();
            let again = a.allocate(3 * MIB, S0).unwrap();
            out.push(again.size());
            x = Some(again);
        }
        a.free(x.unwrap()).unwrap();
        a.free(first).unwrap();
        a.end_allocate_to_pool(POOL).unwrap();
        checked(&a);
        out
    };
    let plain = sizes(false);
    assert!(
        plain.iter().all(|&s| s > 3 * MIB),
        "the whole free block: {plain:?}"
    );
    assert_eq!(sizes(true), plain);
}
