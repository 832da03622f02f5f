//! Traces whose entries name their pool (`pool_id`, written by PyTorch after 2.11 and by
//! tensormem's own allocator): the replay takes each allocation's pool from the record, before any
//! inference, attributes it with [`PoolEvidence::Recorded`] and reproduces the run exactly, also
//! where the trace without `pool_id` leaves the pools undecidable.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction};
use tensormem_cuda_alloc::{Allocation, CachingAllocator, MempoolId, StreamId};
use tensormem_replay::{ExpectedStats, PoolAttribution, PoolEvidence, Replay};

mod common;

use common::{assert_exact, recording, snapshot_of, without_pool_ids};

const POOL: MempoolId = MempoolId(0, 1);
const STREAM: StreamId = StreamId(0);

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `size` bytes in `POOL` (a `use_mem_pool` context around one allocation; the `MemPool` object
/// holds its own reference).
fn in_pool(allocator: &CachingAllocator<SimDevice>, size: usize) -> Allocation {
    allocator.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let a = allocator.allocate(size, STREAM).unwrap();
    allocator.end_allocate_to_pool(POOL).unwrap();
    allocator.release_pool(POOL).unwrap();
    a
}

/// The allocator's snapshot, written as a pickle and read back, replayed under its recorded
/// configuration: exact, figure for figure.
fn replay_exactly(allocator: &CachingAllocator<SimDevice>) -> (Snapshot, Replay) {
    let original = allocator.memory_stats();
    let snapshot = snapshot_of(allocator);
    let replay = assert_exact(&snapshot, ExpectedStats::from_figures(original.to_flat()));
    (snapshot, replay)
}

/// Allocations per pool.
fn shares(attribution: &PoolAttribution) -> Vec<(MempoolId, u64)> {
    attribution
        .pools
        .iter()
        .map(|p| (p.pool, p.allocations))
        .collect()
}

/// Every allocation attributed by the record.
fn all_recorded(attribution: &PoolAttribution) -> bool {
    attribution
        .pools
        .iter()
        .all(|p| p.by_evidence.keys().all(|&e| e == PoolEvidence::Recorded))
}

/// Two 100 KiB blocks on one stream, each in a new 2 MiB segment: one in `POOL` and one in the
/// default pools, in the order `private_first` says. Both blocks are freed, and both segments
/// released in the order they were made: the default pools' by `empty_cache`, `POOL`'s when the
/// `MemPool` goes. The snapshot is taken with no segment left.
///
/// Without `pool_id` both orders write the same trace: either segment could be either pool's.
fn undecidable(private_first: bool) -> CachingAllocator<SimDevice> {
    let allocator = recording("");
    allocator.create_or_incref_pool(POOL).unwrap();
    let (first, second) = if private_first {
        let x = in_pool(&allocator, 100 << 10);
        (x, allocator.allocate(100 << 10, STREAM).unwrap())
    } else {
        let x = allocator.allocate(100 << 10, STREAM).unwrap();
        (x, in_pool(&allocator, 100 << 10))
    };
    assert_ne!(first.ptr(), second.ptr());
    allocator.free(first).unwrap();
    allocator.free(second).unwrap();
    let destroy_pool = || {
        allocator.release_pool(POOL).unwrap();
        allocator.empty_pool_cache(POOL).unwrap();
    };
    if private_first {
        destroy_pool();
        allocator.empty_cache().unwrap();
    } else {
        allocator.empty_cache().unwrap();
        destroy_pool();
    }
    allocator
}

#[test]
fn pools_the_trace_alone_cannot_tell_are_read_from_pool_id() {
    let (private_first, _) = replay_exactly(&undecidable(true));
    let (default_first, _) = replay_exactly(&undecidable(false));
    let frees = |s: &Snapshot| {
        s.trace(0)
            .iter()
            .filter(|e| e.action == TraceAction::SegmentFree)
            .count()
    };
    assert_eq!((frees(&private_first), frees(&default_first)), (2, 2));
    assert!(private_first.segments.is_empty() && default_first.segments.is_empty());

    // Without `pool_id` the two runs are the same trace (times aside): whatever the inference
    // decides, it is wrong for one of them.
    let untimed = |s: &Snapshot| {
        without_pool_ids(s.clone()).device_traces[0]
            .iter()
            .map(|e| (e.action.clone(), e.addr, e.size, e.stream))
            .collect::<Vec<_>>()
    };
    assert_eq!(untimed(&private_first), untimed(&default_first));
    assert_ne!(
        private_first
            .trace(0)
            .iter()
            .map(|e| e.pool_id)
            .collect::<Vec<_>>(),
        default_first
            .trace(0)
            .iter()
            .map(|e| e.pool_id)
            .collect::<Vec<_>>(),
    );

    // With it, each is attributed as it ran: the first allocation of the trace to its pool.
    for (snapshot, first_pool) in [(&private_first, POOL), (&default_first, MempoolId::DEFAULT)] {
        let replay = Replay::new(snapshot).unwrap();
        let attribution = replay.pool_attribution(0).unwrap();
        assert_eq!(
            shares(attribution),
            [(MempoolId::DEFAULT, 1), (POOL, 1)],
            "{first_pool}"
        );
        assert!(all_recorded(attribution), "{attribution:?}");
        assert!(attribution.undecided.is_empty() && attribution.flips == 0);
        let first = snapshot
            .trace(0)
            .iter()
            .find(|e| e.action == TraceAction::Alloc)
            .unwrap();
        assert_eq!(first.pool_id, Some((first_pool.0, first_pool.1)));
    }
}

/// `use_mem_pool` around every third allocation on the one stream, the `MemPool` destroyed before
/// the snapshot (no final segment names it), with and without expandable segments: every
/// allocation's pool comes from the record, and the replay is exact.
#[test]
fn a_mem_pool_between_default_allocations_is_attributed_by_the_record() {
    for config in ["", "expandable_segments:True"] {
        let allocator = recording(config);
        allocator.create_or_incref_pool(POOL).unwrap();
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let (mut eager, mut pooled): (Vec<Allocation>, Vec<Allocation>) = (Vec::new(), Vec::new());
        let (mut eager_count, mut pooled_count) = (0u64, 0u64);
        for i in 0..300 {
            let size = 1 + rng.below(8 << 20) as usize;
            if i % 3 == 0 {
                pooled.push(in_pool(&allocator, size));
                pooled_count += 1;
            } else {
                eager.push(allocator.allocate(size, STREAM).unwrap());
                eager_count += 1;
            }
            if eager.len() > 20 {
                let a = eager.swap_remove(rng.below(eager.len() as u64) as usize);
                allocator.free(a).unwrap();
            }
            if pooled.len() > 10 {
                let a = pooled.swap_remove(rng.below(pooled.len() as u64) as usize);
                allocator.free(a).unwrap();
            }
        }
        for a in pooled.drain(..) {
            allocator.free(a).unwrap();
        }
        allocator.release_pool(POOL).unwrap();
        allocator.empty_pool_cache(POOL).unwrap();

        let (snapshot, replay) = replay_exactly(&allocator);
        assert!(
            snapshot
                .segments
                .iter()
                .all(|s| s.segment_pool_id == (0, 0)),
            "{config}"
        );
        let attribution = replay.pool_attribution(0).unwrap();
        assert_eq!(
            shares(attribution),
            [(MempoolId::DEFAULT, eager_count), (POOL, pooled_count)],
            "{config}"
        );
        assert!(all_recorded(attribution), "{config}: {attribution:?}");
        assert!(attribution.undecided.is_empty() && attribution.flips == 0);
        drop(eager);
    }
}
