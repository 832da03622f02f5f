//! `record_stream`: blocks used on other streams are reused only after that work completes.

mod common;

use common::*;
use tensormem_cuda_alloc::snapshot::{BlockState, TraceAction};

#[test]
fn a_block_used_elsewhere_waits_for_the_other_stream() {
    let a = sim(GIB);
    a.record_history(true, 1000);
    let x = a.allocate(12 * MIB, S0).unwrap();
    let addr = x.ptr();
    a.record_stream(&x, S1).unwrap();
    a.free(x).unwrap();
    let s = checked(&a);
    assert_eq!(s.allocation.all.current, 0, "the caller's free is done");
    assert_eq!(s.active.all.current, 1, "the block is still in use on S1");
    assert_eq!(s.active_bytes.all.current, 12 * MIB as i64);
    let state =
        |a: &tensormem_cuda_alloc::CachingAllocator<_>| a.snapshot().segments[0].blocks[0].state;
    assert_eq!(state(&a), BlockState::ActivePendingFree);
    // S1's work is not done: a new request cannot reuse the block.
    let y = a.allocate(12 * MIB, S0).unwrap();
    assert_ne!(y.ptr(), addr);
    assert_eq!(checked(&a).segment.all.current, 2);
    a.free(y).unwrap();
    // Now it is: the next allocation returns the block to the pool first (and reuses it: lowest
    // address among equal sizes, or the only one).
    a.device().complete_stream_work(S1);
    let z = a.allocate(12 * MIB, S0).unwrap();
    let s = checked(&a);
    assert_eq!(s.segment.all.current, 2, "no new segment");
    assert_eq!(s.active.all.current, 1);
    let actions: Vec<_> = a.trace().into_iter().map(|e| e.action).collect();
    let completed = actions
        .iter()
        .rposition(|x| *x == TraceAction::FreeCompleted)
        .unwrap();
    assert_eq!(
        actions[completed + 1],
        TraceAction::Alloc,
        "free completes at the next allocation"
    );
    a.free(z).unwrap();
}

#[test]
fn uses_on_the_allocation_stream_need_no_event() {
    let a = sim(GIB);
    let x = a.allocate(4096, S0).unwrap();
    a.record_stream(&x, S0).unwrap();
    a.free(x).unwrap();
    assert_eq!(checked(&a).active.all.current, 0);
    assert_eq!(a.device().counters().events_recorded, 0);
}

#[test]
fn every_recorded_stream_must_finish() {
    let a = sim(GIB);
    let x = a.allocate(4096, S0).unwrap();
    a.record_stream(&x, S1).unwrap();
    a.record_stream(&x, S2).unwrap();
    a.record_stream(&x, S1).unwrap();
    a.free(x).unwrap();
    assert_eq!(
        a.device().counters().events_recorded,
        2,
        "one event per stream"
    );
    a.device().complete_stream_work(S1);
    let y = a.allocate(512, S0).unwrap();
    assert_eq!(checked(&a).active.all.current, 2, "S2 still uses the block");
    a.device().complete_stream_work(S2);
    let z = a.allocate(512, S0).unwrap();
    assert_eq!(checked(&a).active.all.current, 2, "y and z only");
    a.free(y).unwrap();
    a.free(z).unwrap();
}

#[test]
fn events_are_pooled() {
    let a = sim(GIB);
    for _ in 0..10 {
        let x = a.allocate(4096, S0).unwrap();
        a.record_stream(&x, S1).unwrap();
        a.free(x).unwrap();
        a.device().complete_stream_work(S1);
        let y = a.allocate(4096, S0).unwrap();
        a.free(y).unwrap();
    }
    let c = a.device().counters();
    assert_eq!((c.events_created, c.events_recorded), (1, 10));
    assert_eq!(checked(&a).active.all.current, 0);
}

#[test]
fn events_of_one_stream_complete_in_order() {
    let a = sim(GIB);
    let x = a.allocate(12 * MIB, S0).unwrap();
    let y = a.allocate(14 * MIB, S0).unwrap();
    for b in [&x, &y] {
        a.record_stream(b, S1).unwrap();
    }
    a.free(x).unwrap();
    a.free(y).unwrap();
    a.device().complete_stream_markers(S1, 1);
    let z = a.allocate(512, S0).unwrap();
    let s = checked(&a);
    assert_eq!(
        s.active_bytes.large_pool.current,
        14 * MIB as i64,
        "only x's event is done"
    );
    a.free(z).unwrap();
}

#[test]
fn empty_cache_waits_for_outstanding_events() {
    let a = sim(GIB);
    let x = a.allocate(12 * MIB, S0).unwrap();
    a.record_stream(&x, S1).unwrap();
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    let s = checked(&a);
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.active.all.current, 0);
    assert_eq!(a.device().counters().live_allocations, 0);
}
