//! Private pools (CUDA graphs): isolation, capture-aware event handling, release.

mod common;

use common::*;
use tensormem_cuda_alloc::{Error, MempoolId};

const POOL: MempoolId = MempoolId(1, 0);

#[test]
fn allocations_during_a_capture_come_from_the_private_pool_and_stay_there() {
    let a = sim(GIB);
    a.begin_allocate_to_pool(POOL, |s| s == S0).unwrap();
    let x = a.allocate(12 * MIB, S0).unwrap();
    let other = a.allocate(12 * MIB, S1).unwrap();
    a.free(x).unwrap();
    // Inside the capture the private block is reused.
    let y = a.allocate(12 * MIB, S0).unwrap();
    assert_eq!(checked(&a).segment.all.current, 2);
    a.free(y).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    // After it, S0 allocations come from the default pool: the private block is not used.
    let z = a.allocate(12 * MIB, S0).unwrap();
    assert_eq!(checked(&a).segment.all.current, 3);
    let snap = a.snapshot();
    let pools: Vec<_> = snap.segments.iter().map(|s| s.segment_pool_id).collect();
    assert_eq!(pools.iter().filter(|&&p| p == (1, 0)).count(), 1);
    // empty_cache leaves the private pool alone while a graph may still replay it.
    a.empty_cache().unwrap();
    assert_eq!(checked(&a).segment.all.current, 3, "all in use, or private");
    a.free(other).unwrap();
    a.free(z).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    let s = checked(&a);
    assert_eq!(s.segment.all.current, 0);
    assert!(
        a.private_pools().is_empty(),
        "a released pool with no segments disappears"
    );
}

#[test]
fn a_released_pool_lives_until_its_blocks_are_freed() {
    let a = sim(GIB);
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let x = a.allocate(MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        a.private_pools(),
        [(POOL, 0)],
        "its segment is still in use"
    );
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    assert!(a.private_pools().is_empty());
    assert_eq!(checked(&a).reserved_bytes.all.current, 0);
}

#[test]
fn pools_can_be_shared_and_calls_are_checked() {
    let a = sim(GIB);
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    assert!(matches!(
        a.begin_allocate_to_pool(POOL, |_| true),
        Err(Error::Pool { .. })
    ));
    a.end_allocate_to_pool(POOL).unwrap();
    assert!(matches!(
        a.end_allocate_to_pool(POOL),
        Err(Error::Pool { .. })
    ));
    // A second capture shares the pool.
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert_eq!(a.private_pools(), [(POOL, 2)]);
    a.release_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    assert!(matches!(a.release_pool(POOL), Err(Error::Pool { .. })));
    assert!(matches!(
        a.release_pool(MempoolId(9, 9)),
        Err(Error::Pool { .. })
    ));
}

#[test]
fn events_of_blocks_freed_during_a_capture_wait_for_its_end() {
    let a = sim(GIB);
    let x = a.allocate(12 * MIB, S0).unwrap();
    a.record_stream(&x, S1).unwrap();
    a.begin_allocate_to_pool(POOL, |s| s == S2).unwrap();
    a.free(x).unwrap();
    assert_eq!(
        a.device().counters().events_recorded,
        0,
        "deferred while capturing"
    );
    let y = a.allocate(512, S0).unwrap();
    assert_eq!(checked(&a).active.all.current, 2, "still pending");
    a.end_allocate_to_pool(POOL).unwrap();
    // The next allocation records the deferred event; S1's work is not done yet.
    let z = a.allocate(512, S0).unwrap();
    assert_eq!(a.device().counters().events_recorded, 1);
    assert_eq!(checked(&a).active.all.current, 3);
    a.device().complete_stream_work(S1);
    let w = a.allocate(512, S0).unwrap();
    assert_eq!(checked(&a).active_bytes.large_pool.current, 0);
    for b in [y, z, w] {
        a.free(b).unwrap();
    }
}

#[test]
fn streams_recorded_during_the_capture_need_no_event_after_it() {
    let a = sim(GIB);
    a.begin_allocate_to_pool(POOL, |s| s == S2).unwrap();
    let x = a.allocate(12 * MIB, S0).unwrap();
    a.record_stream(&x, S1).unwrap();
    a.free(x).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let y = a.allocate(512, S0).unwrap();
    assert_eq!(a.device().counters().events_recorded, 0);
    assert_eq!(
        checked(&a).active_bytes.large_pool.current,
        0,
        "freed without an event"
    );
    a.free(y).unwrap();
}
