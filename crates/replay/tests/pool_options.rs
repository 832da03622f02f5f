//! Memory pools made with options PyTorch's snapshot does not record (`torch.cuda.MemPool(...,
//! no_split=True)`, a pool with its own allocator): the replay infers them from the trace and
//! reproduces the run exactly.
//!
//! The traces are tensormem's own, on a simulated device, with `pool_id` removed as PyTorch 2.11
//! writes them.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, MempoolId, PoolOptions, StreamId};
mod common;

use common::{assert_exact, recorded, recording, xorshift};

const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;
const POOL: MempoolId = MempoolId(0, 1);

/// `size` bytes in `POOL` (inside `use_mem_pool`).
fn in_pool(allocator: &CachingAllocator<SimDevice>, size: usize) -> Allocation {
    allocator.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let a = allocator.allocate(size, S).unwrap();
    allocator.end_allocate_to_pool(POOL).unwrap();
    a
}

/// A pool whose blocks are never split, beside default allocations of the same sizes: in the
/// pool each request takes a whole cached block.
fn no_split_program(config: &str) -> CachingAllocator<SimDevice> {
    let allocator = recording(config);
    allocator
        .create_pool(
            POOL,
            PoolOptions {
                no_split: true,
                ..PoolOptions::default()
            },
        )
        .unwrap();
    let mut kept = Vec::new();
    for round in 0..4 {
        let big = in_pool(&allocator, 30 * MIB);
        let outside = allocator.allocate(30 * MIB, S).unwrap();
        allocator.free(big).unwrap();
        allocator.free(outside).unwrap();
        // Smaller requests: split from the cached 30 MiB block outside the pool, whole inside it.
        let small = in_pool(&allocator, (4 + round) * MIB);
        let small_out = allocator.allocate((4 + round) * MIB, S).unwrap();
        let tiny = in_pool(&allocator, 200_000);
        kept.extend([small, small_out, tiny]);
    }
    for a in kept {
        allocator.free(a).unwrap();
    }
    allocator
}

#[test]
fn a_pool_that_never_splits_is_found() {
    for config in ["", "max_split_size_mb:64"] {
        let allocator = no_split_program(config);
        let (snapshot, expected) = recorded(&allocator);
        let replay = assert_exact(&snapshot, expected);
        let attribution = replay.pool_attribution(0).unwrap();
        assert!(attribution.no_split.len() == 1, "{config}: {attribution:?}");
    }
}

/// A pool whose segments come from its own allocator (`MemPool(allocator=...)`, as `ncclMemAlloc`
/// or a sleep-mode allocator): under expandable segments its segments are still whole device
/// allocations, as PyTorch makes them.
#[test]
fn a_pool_with_its_own_allocator_is_found_under_expandable_segments() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use tensormem_cuda_alloc::{DeviceAddress, FnPoolAllocator};

    let allocator = recording("expandable_segments:True");
    let next = Arc::new(AtomicU64::new(0x7e00_0000_0000));
    let own = FnPoolAllocator::shared(
        move |size| {
            let size = (size as u64).div_ceil(2 << 20) * (2 << 20);
            Ok(DeviceAddress(next.fetch_add(size, Ordering::Relaxed)))
        },
        |_, _| Ok(()),
    );
    allocator
        .create_pool(
            POOL,
            PoolOptions {
                allocator: Some(own),
                ..PoolOptions::default()
            },
        )
        .unwrap();
    let mut kept = Vec::new();
    for i in 0..6 {
        kept.push(in_pool(&allocator, (3 + i) * MIB));
        kept.push(allocator.allocate((3 + i) * MIB, S).unwrap());
    }
    for a in kept {
        allocator.free(a).unwrap();
    }
    let (snapshot, expected) = recorded(&allocator);
    let replay = assert_exact(&snapshot, expected);
    let attribution = replay.pool_attribution(0).unwrap();
    assert_eq!(attribution.own_allocator.len(), 1, "{attribution:?}");
}

/// Two pools used in turn with the default pool, random sizes and lifetimes, only the second made
/// with `no_split`: an option tried on the first pool can look right for a while (it explains
/// part of what the second pool did); the replay keeps only the second's.
#[test]
fn only_the_pool_that_never_splits_is_found_among_several() {
    // The plain pool first: the one an option is tried on first.
    const PLAIN: MempoolId = POOL;
    const NO_SPLIT: MempoolId = MempoolId(0, 2);
    for seed in [9, 47, 5] {
        let allocator = recording("");
        allocator
            .create_pool(PLAIN, PoolOptions::default())
            .unwrap();
        allocator
            .create_pool(
                NO_SPLIT,
                PoolOptions {
                    no_split: true,
                    ..PoolOptions::default()
                },
            )
            .unwrap();
        let mut next = xorshift(seed);
        let mut live: Vec<Allocation> = Vec::new();
        for i in 0..200 {
            if live.len() > 10 || (!live.is_empty() && next() % 10 < 4) {
                let k = (next() % live.len() as u64) as usize;
                allocator.free(live.swap_remove(k)).unwrap();
                continue;
            }
            let size = if next().is_multiple_of(2) {
                (next() % 900 + 1) as usize * 1000
            } else {
                (next() % 40 + 1) as usize * MIB + 4321
            };
            let pool = [Some(PLAIN), Some(NO_SPLIT), None][i % 3];
            let a = match pool {
                Some(pool) => {
                    allocator.begin_allocate_to_pool(pool, |_| true).unwrap();
                    let a = allocator.allocate(size, S).unwrap();
                    allocator.end_allocate_to_pool(pool).unwrap();
                    a
                }
                None => allocator.allocate(size, S).unwrap(),
            };
            live.push(a);
        }
        for a in live {
            allocator.free(a).unwrap();
        }
        let (snapshot, expected) = recorded(&allocator);
        let replay = assert_exact(&snapshot, expected);
        let attribution = replay.pool_attribution(0).unwrap();
        assert_eq!(attribution.no_split, vec![NO_SPLIT], "seed {seed}");
    }
}
