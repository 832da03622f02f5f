//! Private pools (CUDA graph capture, `torch.cuda.MemPool`) in traces written by tensormem's own
//! allocator, whose real pool of every allocation is known: with the trace entries' `pool_id` taken
//! out (PyTorch 2.11's format), the replay infers the pools from the trace alone and reproduces the
//! run exactly. (`recorded_pools.rs` replays the same kind of traces with their `pool_id`.)

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, MempoolId, StreamId};
use tensormem_replay::{ExpectedStats, PoolEvidence, Replay};

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

/// `snapshot` as PyTorch 2.11 writes it: no `pool_id` on trace entries.
fn without_pool_ids(mut snapshot: Snapshot) -> Snapshot {
    for entry in snapshot.device_traces.iter_mut().flatten() {
        entry.pool_id = None;
    }
    snapshot
}

fn replay_exactly(allocator: &CachingAllocator<SimDevice>) -> Replay {
    let original = allocator.memory_stats();
    let snapshot: Snapshot = without_pool_ids(allocator.snapshot());
    let replay = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(ExpectedStats {
            figures: original.to_flat(),
            ..ExpectedStats::default()
        });
    let run = replay.run_recorded().unwrap();
    let check = run.devices[0].check.as_ref().unwrap();
    assert_eq!(check.divergence, None);
    assert_eq!(
        check.segments.as_ref().unwrap().mismatches,
        Vec::<String>::new()
    );
    assert_eq!(check.stats.as_ref().unwrap().mismatches, Vec::new());
    assert_eq!(run.devices[0].stats, original);
    assert_eq!(run.matches_record(), Some(true));
    replay
}

/// `use_mem_pool` around every third allocation, on the same stream as the others; the pool is
/// destroyed (released and emptied) before the snapshot, so no final segment names it.
#[test]
fn a_mem_pool_used_between_default_allocations_is_inferred() {
    let allocator = CachingAllocator::new(SimDevice::new(1 << 40));
    allocator.record_history(true, 1 << 20);
    let pool = MempoolId(0, 1);
    let stream = StreamId(0);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut eager, mut pooled): (Vec<Allocation>, Vec<Allocation>) = (Vec::new(), Vec::new());
    let mut pooled_count = 0u64;
    for i in 0..400 {
        let size = 1 + rng.below(8 << 20) as usize;
        if i % 3 == 0 {
            allocator.begin_allocate_to_pool(pool, |_| true).unwrap();
            pooled.push(allocator.allocate(size, stream).unwrap());
            allocator.end_allocate_to_pool(pool).unwrap();
            if pooled_count > 0 {
                // `use_mem_pool` takes a reference for its duration; the MemPool object holds one.
                allocator.release_pool(pool).unwrap();
            }
            pooled_count += 1;
        } else {
            eager.push(allocator.allocate(size, stream).unwrap());
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
    // The MemPool is destroyed: its last reference goes and its cache is emptied.
    allocator.release_pool(pool).unwrap();
    allocator.empty_pool_cache(pool).unwrap();
    let snapshot = allocator.snapshot();
    assert!(snapshot
        .segments
        .iter()
        .all(|s| s.segment_pool_id == (0, 0)));

    let replay = replay_exactly(&allocator);
    let attribution = replay.pool_attribution(0).unwrap();
    assert!(attribution.has_private());
    let private: u64 = attribution
        .pools
        .iter()
        .filter(|p| !p.pool.is_default())
        .map(|p| p.allocations)
        .sum();
    assert_eq!(private, pooled_count);
    assert!(!attribution.gave_up && attribution.undecided.is_empty());
    drop(eager);
}

/// A graph captured on its own stream after warm-up on that stream in the default pool; the graph
/// is destroyed, the program goes on, and `empty_cache` releases the pool's free segments with the
/// default pool's. Blocks still held by the program keep some of the pool's segments alive.
#[test]
fn a_graph_capture_pool_is_inferred_and_released_with_empty_cache() {
    let allocator = CachingAllocator::new(SimDevice::new(1 << 40));
    allocator.record_history(true, 1 << 20);
    let (main, capture) = (StreamId(0), StreamId(0x3bd5_f590));
    let pool = MempoolId(1, 0);
    let mut rng = Rng(42);
    let sizes: Vec<usize> = (0..40)
        .map(|_| 512 + rng.below(12 << 20) as usize)
        .collect();
    // Warm-up on the capture stream, default pool.
    let mut warm = Vec::new();
    for &size in &sizes {
        warm.push(allocator.allocate(size, capture).unwrap());
        if warm.len() > 6 {
            allocator.free(warm.remove(0)).unwrap();
        }
    }
    let kept_warm = warm.pop().unwrap();
    for a in warm.drain(..) {
        allocator.free(a).unwrap();
    }
    // Capture: the same requests go to the graph's pool although cached default blocks fit.
    allocator
        .begin_allocate_to_pool(pool, move |s| s == capture)
        .unwrap();
    let mut graph = Vec::new();
    for &size in &sizes {
        graph.push(allocator.allocate(size, capture).unwrap());
        if graph.len() > 6 {
            allocator.free(graph.remove(0)).unwrap();
        }
    }
    allocator.end_allocate_to_pool(pool).unwrap();
    let static_outputs = graph.split_off(graph.len() - 2);
    for a in graph {
        allocator.free(a).unwrap();
    }
    // The graph is destroyed; eager work goes on, then the cache is emptied.
    allocator.release_pool(pool).unwrap();
    let mut eager = Vec::new();
    for _ in 0..60 {
        eager.push(
            allocator
                .allocate(1 + rng.below(16 << 20) as usize, main)
                .unwrap(),
        );
        if eager.len() > 8 {
            let a = eager.swap_remove(rng.below(eager.len() as u64) as usize);
            allocator.free(a).unwrap();
        }
    }
    allocator.empty_cache().unwrap();
    assert!(allocator
        .snapshot()
        .segments
        .iter()
        .any(|s| s.segment_pool_id == (1, 0)));

    let replay = replay_exactly(&allocator);
    let attribution = replay.pool_attribution(0).unwrap();
    let graph_pool = attribution
        .pools
        .iter()
        .find(|p| p.pool == pool)
        .expect("the graph's pool is attributed");
    assert_eq!(graph_pool.allocations, sizes.len() as u64);
    assert!(graph_pool
        .by_evidence
        .contains_key(&PoolEvidence::FinalSegments));
    drop((kept_warm, static_outputs, eager));
}

/// Traces without private pools attribute everything to the default pools and leave nothing
/// undecided.
#[test]
fn default_only_traces_have_nothing_undecided() {
    let allocator = CachingAllocator::new(SimDevice::new(1 << 40));
    allocator.record_history(true, 1 << 16);
    let mut rng = Rng(7);
    let mut live = Vec::new();
    for _ in 0..300 {
        live.push(
            allocator
                .allocate(1 + rng.below(30 << 20) as usize, StreamId(rng.below(2)))
                .unwrap(),
        );
        if live.len() > 12 {
            let a = live.swap_remove(rng.below(live.len() as u64) as usize);
            allocator.free(a).unwrap();
        }
    }
    allocator.empty_cache().unwrap();
    let replay = replay_exactly(&allocator);
    let attribution = replay.pool_attribution(0).unwrap();
    assert!(!attribution.has_private());
    assert!(attribution.undecided.is_empty());
    assert_eq!(attribution.flips, 0);
    drop(live);
}

/// An expandable segment whose reservation was released (everything unmapped by `empty_cache`) and a
/// new one reserved at the same address later: the replay sees two reservations, and places both
/// where the trace recorded them.
#[test]
fn an_expandable_reservation_released_and_reused_at_the_same_address_is_new() {
    let device = SimDevice::new(8 << 30);
    let base = 0x7f00_0000_0000u64;
    let elsewhere = base + (1 << 40);
    device.push_addresses([base, elsewhere, base]);
    let mut config = tensormem_cuda_alloc::config::AllocatorConfig::default();
    config.apply("expandable_segments:True").unwrap();
    let allocator = CachingAllocator::with_config(device, config);
    allocator.record_history(true, 1 << 16);
    let stream = StreamId(0);
    let first = allocator.allocate(30 << 20, stream).unwrap();
    assert_eq!(first.ptr().0, base);
    allocator.free(first).unwrap();
    allocator.empty_cache().unwrap();
    let small = allocator.allocate(4096, stream).unwrap();
    assert_eq!(small.ptr().0, elsewhere);
    let again = allocator.allocate(50 << 20, stream).unwrap();
    assert_eq!(
        again.ptr().0,
        base,
        "the reservation was made again at the same address"
    );
    let replay = replay_exactly(&allocator);
    let run = replay.run_recorded().unwrap();
    assert_eq!(run.devices[0].addresses.invented, 0);
    drop((again, small));
}
