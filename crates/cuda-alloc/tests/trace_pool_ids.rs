//! `pool_id` on the allocator's own trace entries (the key PyTorch versions after 2.11 write): every
//! entry about a block or segment names the pool that owns it, `(0, 0)` for the default pools; an
//! out-of-memory entry names the pool the request was for, a snapshot entry the pool it was taken
//! of; annotations name none. The fast path records what the plain path does, trackers see the same
//! ids, and a pickle keeps them.
#![cfg(feature = "snapshot-io")]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::*;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction, TraceEntry};
use tensormem_cuda_alloc::{CachingAllocator, MempoolId};

const POOL: MempoolId = MempoolId(0, 5);
const DEFAULT: Option<(u64, u64)> = Some((0, 0));
const PRIVATE: Option<(u64, u64)> = Some((POOL.0, POOL.1));

/// A trace entry's `pool_id`.
type PoolId = Option<(u64, u64)>;
/// What a tracker saw: each entry's action and pool.
type Seen = Arc<Mutex<Vec<(TraceAction, PoolId)>>>;

/// Whether `action` concerns a block or a segment (an entry that names its pool).
fn about_memory(action: &TraceAction) -> bool {
    matches!(
        action,
        TraceAction::Alloc
            | TraceAction::FreeRequested
            | TraceAction::FreeCompleted
            | TraceAction::SegmentAlloc
            | TraceAction::SegmentFree
            | TraceAction::SegmentMap
            | TraceAction::SegmentUnmap
    )
}

/// The segments of `snapshot` as address ranges with their pool: start -> (end, pool).
fn segment_pools(snapshot: &Snapshot) -> BTreeMap<u64, (u64, (u64, u64))> {
    snapshot
        .segments
        .iter()
        .map(|s| (s.address, (s.address + s.total_size, s.segment_pool_id)))
        .collect()
}

/// The pool of the segment holding `addr` among `segments`.
fn pool_at(segments: &BTreeMap<u64, (u64, (u64, u64))>, addr: u64) -> Option<(u64, u64)> {
    let (_, &(end, pool)) = segments.range(..=addr).next_back()?;
    (addr < end).then_some(pool)
}

/// The entries without their times (for comparing two runs).
fn untimed(trace: &[TraceEntry]) -> Vec<(TraceAction, u64, u64, u64, PoolId)> {
    trace
        .iter()
        .map(|e| (e.action.clone(), e.addr, e.size, e.stream, e.pool_id))
        .collect()
}

/// Allocations in the default pools and in a private pool (small and large, on two streams), freed
/// and released: every entry about memory names the pool of the segment it concerns.
fn mixed_run(a: &CachingAllocator<SimDevice>) -> BTreeMap<u64, (u64, (u64, u64))> {
    a.record_history(true, 10_000);
    let eager_large = a.allocate(12 * MIB, S0).unwrap();
    let eager_small = a.allocate(3 * KIB, S1).unwrap();
    a.create_or_incref_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let pooled_large = a.allocate(12 * MIB, S0).unwrap();
    let pooled_small = a.allocate(3 * KIB, S1).unwrap();
    let pooled_again = a.allocate(5 * KIB, S1).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    // The segments while they live, for telling each address's pool.
    let segments = segment_pools(&a.snapshot());
    assert_eq!(
        segments
            .values()
            .filter(|(_, p)| *p == (POOL.0, POOL.1))
            .count(),
        2,
        "{segments:?}"
    );
    for x in [
        eager_large,
        eager_small,
        pooled_large,
        pooled_small,
        pooled_again,
    ] {
        a.free(x).unwrap();
    }
    // The MemPool goes (the context's reference, then the object's), then its cache; then the
    // default pools' cache.
    a.release_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_pool_cache(POOL).unwrap();
    a.empty_cache().unwrap();
    segments
}

#[test]
fn entries_about_memory_name_the_pool_of_their_segment() {
    let a = sim(GIB);
    let segments = mixed_run(&a);
    let trace = a.trace();
    let mut seen = BTreeMap::<(String, Option<(u64, u64)>), usize>::new();
    for e in &trace {
        if about_memory(&e.action) {
            let expected = pool_at(&segments, e.addr);
            assert!(expected.is_some(), "{e:?} is in no segment");
            assert_eq!(e.pool_id, expected, "{e:?}");
            *seen
                .entry((e.action.as_str().to_owned(), e.pool_id))
                .or_default() += 1;
        }
    }
    for action in [
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
    ] {
        for pool in [DEFAULT, PRIVATE] {
            assert!(
                seen.contains_key(&(action.to_owned(), pool)),
                "no {action} entry of {pool:?}: {seen:?}"
            );
        }
    }
    // The snapshot taken inside the run: of every pool.
    let snapshot = trace
        .iter()
        .find(|e| e.action == TraceAction::Snapshot)
        .unwrap();
    assert_eq!(snapshot.pool_id, DEFAULT);
}

#[test]
fn expandable_segments_name_the_pool_of_their_mappings() {
    let a = sim_with("expandable_segments:True", GIB);
    let segments = mixed_run(&a);
    let trace = a.trace();
    for action in [TraceAction::SegmentMap, TraceAction::SegmentUnmap] {
        for pool in [DEFAULT, PRIVATE] {
            assert!(
                trace
                    .iter()
                    .any(|e| e.action == action && e.pool_id == pool),
                "no {action:?} entry of {pool:?}"
            );
        }
    }
    for e in trace.iter().filter(|e| about_memory(&e.action)) {
        assert_eq!(e.pool_id, pool_at(&segments, e.addr), "{e:?}");
    }
}

#[test]
fn oom_snapshot_and_annotation_entries() {
    let a = sim(64 * MIB);
    a.record_history(true, 1000);
    a.record_annotation("step");
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    assert!(a.allocate(GIB, S0).is_err());
    a.end_allocate_to_pool(POOL).unwrap();
    assert!(a.allocate(GIB, S0).is_err());
    let _ = a.snapshot_with(Some(POOL), false);
    let _ = a.snapshot_with(Some(MempoolId::DEFAULT), false);
    let entries: Vec<(TraceAction, Option<(u64, u64)>)> = a
        .trace()
        .into_iter()
        .map(|e| (e.action, e.pool_id))
        .collect();
    assert_eq!(
        entries,
        [
            (TraceAction::UserDefined, None),
            // The pool each failed request was for.
            (TraceAction::Oom, PRIVATE),
            (TraceAction::Oom, DEFAULT),
            // The pool each snapshot was taken of (`(0, 0)`: all of them).
            (TraceAction::Snapshot, PRIVATE),
            (TraceAction::Snapshot, DEFAULT),
        ]
    );
    a.release_pool(POOL).unwrap();
}

#[test]
fn a_pickle_keeps_the_pool_ids() {
    let a = sim(GIB);
    mixed_run(&a);
    let snapshot = a.snapshot();
    assert!(snapshot.trace(0).iter().any(|e| e.pool_id == PRIVATE));
    let mut bytes = Vec::new();
    snapshot.write_pickle(&mut bytes).unwrap();
    let back = Snapshot::from_pickle_bytes(&bytes).unwrap();
    assert_eq!(back.trace(0), snapshot.trace(0));
    assert_eq!(back, snapshot);
}

#[test]
fn trackers_see_the_pool_ids_with_history_off() {
    let a = sim(GIB);
    let seen: Seen = Arc::default();
    let sink = Arc::clone(&seen);
    a.attach_allocator_trace_tracker(Box::new(move |e| {
        sink.lock().unwrap().push((e.action.clone(), e.pool_id));
    }));
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let pooled = a.allocate(MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let eager = a.allocate(MIB, S0).unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (TraceAction::SegmentAlloc, PRIVATE),
            (TraceAction::Alloc, PRIVATE),
            (TraceAction::SegmentAlloc, DEFAULT),
            (TraceAction::Alloc, DEFAULT),
        ]
    );
    a.free(pooled).unwrap();
    a.free(eager).unwrap();
    a.release_pool(POOL).unwrap();
}

#[test]
fn a_pool_put_to_sleep_and_woken_is_named_to_trackers() {
    let a = sim_with("expandable_segments:True", GIB);
    a.create_or_incref_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let pooled = a.allocate(30 * MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let seen: Seen = Arc::default();
    let sink = Arc::clone(&seen);
    a.attach_allocator_trace_tracker(Box::new(move |e| {
        sink.lock().unwrap().push((e.action.clone(), e.pool_id));
    }));
    a.sleep_pool(POOL, None).unwrap();
    a.wake_pool(POOL).unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(seen.contains(&(TraceAction::SegmentUnmap, PRIVATE)));
    assert!(seen.contains(&(TraceAction::SegmentMap, PRIVATE)));
    assert!(seen.iter().all(|(_, pool)| *pool == PRIVATE), "{seen:?}");
    a.free(pooled).unwrap();
    a.release_pool(POOL).unwrap();
}

/// The same calls with the fast path on and off record the same entries, pool ids included: hot
/// pairs (the same size freed and allocated again) in a private pool and in the default pools.
#[test]
fn the_fast_path_records_the_pool_ids_of_the_plain_path() {
    let run = |fast_path: bool| {
        let a = CachingAllocator::new(SimDevice::with_fixed_addresses(0, 512 << 20));
        a.set_fast_path_enabled(fast_path);
        a.record_history(true, 10_000);
        let mut keep = Vec::new();
        a.create_or_incref_pool(POOL).unwrap();
        for round in 0..40 {
            let size = [700, 4 * KIB, 3 * MIB][round % 3];
            a.begin_allocate_to_pool(POOL, move |s| s == S0).unwrap();
            // Each freed and asked for again at once: the parked block is handed back.
            let pooled = a.allocate(size, S0).unwrap();
            a.free(pooled).unwrap();
            let pooled = a.allocate(size, S0).unwrap();
            a.end_allocate_to_pool(POOL).unwrap();
            a.release_pool(POOL).unwrap();
            let eager = a.allocate(size, S1).unwrap();
            a.free(eager).unwrap();
            let eager = a.allocate(size, S1).unwrap();
            if round % 5 == 0 {
                keep.push(pooled);
            } else {
                a.free(pooled).unwrap();
            }
            a.free(eager).unwrap();
        }
        for x in keep {
            a.free(x).unwrap();
        }
        a.release_pool(POOL).unwrap();
        a.empty_cache().unwrap();
        untimed(&a.trace())
    };
    let (fast, plain) = (run(true), run(false));
    assert!(fast.iter().any(|e| e.4 == PRIVATE) && fast.iter().any(|e| e.4 == DEFAULT));
    assert_eq!(fast, plain);
}
