//! The differential proof of the fast path: random call sequences on two allocators, one with the
//! fast path on and one with it off ([`CachingAllocator::set_fast_path_enabled`]), compared call by
//! call (addresses, sizes, errors), statistic by statistic and snapshot by snapshot; and the cases
//! each invalidating event of [`HotPair::still_valid`](super::state::HotPair::still_valid) needs.

use std::sync::atomic::Ordering::Relaxed;

use proptest::prelude::*;

use crate::backend::sim::SimDevice;
use crate::config::AllocatorConfig;
use crate::{Allocation, CachingAllocator, RecordContext, StreamId};

const STREAMS: [StreamId; 2] = [StreamId(0x10), StreamId(0x20)];
/// Sizes that repeat (so frees park and allocations of the same size follow), across the small
/// and large pools, the split rules (20 MiB segments filled to their last MiB) and the oversize
/// limit of the configurations below.
const SIZES: [usize; 9] = [
    512,
    1536,
    4096,
    (1 << 20) + 1,
    3 << 20,
    8 << 20,
    9 << 20,
    25 << 20,
    64 << 20,
];
const CONFIGS: [&str; 4] = [
    "",
    "max_split_size_mb:20",
    "expandable_segments:True",
    "garbage_collection_threshold:0.5,max_split_size_mb:40,max_non_split_rounding_mb:30",
];

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: usize,
        stream: usize,
    },
    /// Allocate the size last freed, on its stream (the hot pair's allocation).
    Again,
    /// `raw_alloc` (the pointer index on from then on).
    RawAlloc {
        size: usize,
        stream: usize,
    },
    /// `raw_free` of the newest pointer.
    RawFreeNewest,
    /// Free the newest live allocation (the hot pair's free).
    FreeNewest,
    Free {
        pick: usize,
    },
    RecordStream {
        pick: usize,
        stream: usize,
    },
    Complete {
        stream: usize,
    },
    EmptyCache,
    /// Replace the settings by one of `CONFIGS` (what a handed-back block was checked against
    /// changes). The invariant walk is skipped afterwards: it counts oversize blocks by the
    /// current `max_split_size`, the figures by the one at the time (as PyTorch's do).
    Reconfigure(usize),
    /// Compare the snapshots and walk the invariants (both take the locks, which settles a
    /// parked block: not after every step, or nothing would stay parked).
    Check,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SIZES.len(), prop_oneof![4 => Just(0usize), 1 => Just(1usize)])
            .prop_map(|(s, stream)| Op::Alloc { size: SIZES[s], stream }),
        3 => Just(Op::Again),
        1 => (0..SIZES.len(), 0usize..2).prop_map(|(s, stream)| Op::RawAlloc { size: SIZES[s], stream }),
        1 => Just(Op::RawFreeNewest),
        4 => Just(Op::FreeNewest),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), 0usize..2).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0usize..2).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
        1 => (0..CONFIGS.len()).prop_map(Op::Reconfigure),
        1 => Just(Op::Check),
    ]
}

fn allocator(config: &str, defer: bool) -> CachingAllocator<SimDevice> {
    let a = CachingAllocator::with_config(
        // The same invented addresses for both allocators.
        SimDevice::with_fixed_addresses(0, 512 << 20),
        AllocatorConfig::parse(config).expect("valid config"),
    );
    if config.contains("garbage_collection") {
        a.set_memory_fraction(0.9).expect("valid fraction");
    }
    a.set_fast_path_enabled(defer);
    a
}

/// One allocator defers merges, the other never does: every call must come out the same
/// (addresses, sizes, errors), and so must the statistics and the snapshot after it. Returns
/// how many frees of the deferring allocator took the express lane (`hot_pair.rs`).
fn run(config: &str, ops: &[Op]) -> Result<u64, TestCaseError> {
    let fast = allocator(config, true);
    let plain = allocator(config, false);
    let mut live: Vec<(Allocation, Allocation)> = Vec::new();
    let mut last_freed = None;
    let mut raw_live: Vec<(crate::DeviceAddress, crate::DeviceAddress)> = Vec::new();
    let mut reconfigured = false;
    for op in ops {
        let op = match *op {
            Op::Again => match last_freed {
                Some((size, stream)) => Op::Alloc { size, stream },
                None => continue,
            },
            ref op => op.clone(),
        };
        match op {
            Op::Alloc { size, stream } => {
                let (x, y) = (
                    fast.allocate(size, STREAMS[stream]),
                    plain.allocate(size, STREAMS[stream]),
                );
                match (x, y) {
                    (Ok(x), Ok(y)) => {
                        prop_assert_eq!((x.ptr(), x.size()), (y.ptr(), y.size()));
                        live.push((x, y));
                    }
                    (Err(x), Err(y)) => prop_assert_eq!(x.to_string(), y.to_string()),
                    (x, y) => prop_assert!(false, "{x:?} against {y:?}"),
                }
            }
            Op::FreeNewest | Op::Free { .. } if !live.is_empty() => {
                let at = match op {
                    Op::Free { pick } => pick % live.len(),
                    _ => live.len() - 1,
                };
                let (x, y) = live.remove(at);
                let stream = STREAMS.iter().position(|&s| s == x.stream());
                last_freed = stream.map(|stream| (x.requested_size(), stream));
                fast.free(x)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                plain
                    .free(y)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                let (x, y) = &live[pick % live.len()];
                fast.record_stream(x, STREAMS[stream])
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                plain
                    .record_stream(y, STREAMS[stream])
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Complete { stream } => {
                fast.device().complete_stream_work(STREAMS[stream]);
                plain.device().complete_stream_work(STREAMS[stream]);
            }
            Op::EmptyCache => {
                fast.empty_cache()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                plain
                    .empty_cache()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Reconfigure(config) => {
                reconfigured = true;
                let config = AllocatorConfig::parse(CONFIGS[config]).expect("valid config");
                fast.set_config(&config);
                plain.set_config(&config);
            }
            Op::RawAlloc { size, stream } => {
                match (
                    fast.raw_alloc(size, STREAMS[stream]),
                    plain.raw_alloc(size, STREAMS[stream]),
                ) {
                    (Ok(x), Ok(y)) => {
                        prop_assert_eq!(x, y);
                        raw_live.push((x, y));
                    }
                    (Err(x), Err(y)) => prop_assert_eq!(x.to_string(), y.to_string()),
                    (x, y) => prop_assert!(false, "{x:?} against {y:?}"),
                }
            }
            Op::RawFreeNewest if !raw_live.is_empty() => {
                let (x, y) = raw_live.pop().expect("not empty");
                fast.raw_free(x)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                plain
                    .raw_free(y)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Check => {
                prop_assert_eq!(fast.snapshot(), plain.snapshot());
                if !reconfigured {
                    fast.check_invariants()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
            _ => {}
        }
        // Statistics are read without the shard locks: they must agree with a block parked.
        prop_assert_eq!(fast.memory_stats(), plain.memory_stats());
    }
    if !reconfigured {
        fast.check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    for (x, y) in live {
        fast.free(x)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        plain
            .free(y)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    for (x, y) in raw_live {
        fast.raw_free(x)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        plain
            .raw_free(y)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    prop_assert_eq!(fast.memory_stats(), plain.memory_stats());
    prop_assert_eq!(fast.snapshot(), plain.snapshot());
    Ok(fast.express_frees.load(Relaxed))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn deferred_merges_decide_alike(
        config in 0usize..CONFIGS.len(),
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        run(CONFIGS[config], &ops)?;
    }
}

/// A handed-back block's checks are not reused once the free set changed: `X` (512 B, between
/// two blocks in use) becomes free while `B` is allocated, so the next 512 B request must get
/// `X`, not `B` parked again.
#[test]
fn a_verdict_goes_stale_with_the_free_set() {
    let alloc = Op::Alloc {
        size: 512,
        stream: 0,
    };
    // A, X, C, B; B parked and handed back; X freed (parked, then settled by B's free); again.
    let ops = [
        alloc.clone(),
        alloc.clone(),
        alloc.clone(),
        alloc,
        Op::FreeNewest,
        Op::Again,
        Op::Free { pick: 1 },
        Op::FreeNewest,
        Op::Again,
        Op::Check,
    ];
    run("", &ops).expect("the deferring allocator decides as the plain one");
}

/// A hot pair's allocation restores the figures its free lowered without comparing them with
/// the limits, which is exact only while the limits stand still: here another stream's new peak
/// hands the parked stream's headroom out meanwhile, and the allocation after it must still
/// raise the peak (read after the other stream's block is gone, so that reading cannot catch
/// the peak up with the current sum). Fails if `restores` ignores the limits' epoch.
#[test]
fn a_hot_pair_rechecks_limits_that_changed() {
    let ops = [
        Op::Alloc {
            size: 3 << 20,
            stream: 0,
        },
        Op::FreeNewest,
        Op::Alloc {
            size: 8 << 20,
            stream: 1,
        },
        Op::Again,
        Op::Free { pick: 0 },
        Op::Check,
    ];
    run("", &ops).expect("the deferring allocator decides as the plain one");
}

/// The same for `requested_bytes`: a hot pair whose second request is larger (the same rounded
/// size) raises it above where the free found it, so its peak must be compared. Fails if
/// `restores` ignores the request's size.
#[test]
fn a_larger_request_is_compared_with_its_limit() {
    let ops = [
        Op::Alloc {
            size: (3 << 20) - 100,
            stream: 0,
        },
        Op::FreeNewest,
        Op::Alloc {
            size: 3 << 20,
            stream: 0,
        },
        Op::FreeNewest,
        Op::Check,
    ];
    run("", &ops).expect("the deferring allocator decides as the plain one");
}

/// A handed-back block's checks are not reused once the settings changed: with
/// `max_split_size_mb:20` best fit no longer takes the 20 MiB merged block for 3 MiB.
#[test]
fn a_verdict_goes_stale_with_the_settings() {
    let ops = [
        Op::Alloc {
            size: 3 << 20,
            stream: 0,
        },
        Op::FreeNewest,
        Op::Again,
        Op::FreeNewest,
        Op::Reconfigure(1),
        Op::Again,
        Op::Check,
    ];
    run("", &ops).expect("the deferring allocator decides as the plain one");
}

#[test]
fn the_hot_pair_parks_and_unparks() {
    let (a, plain) = (allocator("", true), allocator("", false));
    for _ in 0..3 {
        let (x, y) = (
            a.allocate(512, STREAMS[0]).expect("allocates"),
            plain.allocate(512, STREAMS[0]).expect("allocates"),
        );
        assert_eq!(x.ptr(), y.ptr());
        a.free(x).expect("frees");
        plain.free(y).expect("frees");
        let shard = a.streams.get(STREAMS[0]).expect("shard");
        assert!(shard.state.lock().fast.is_parked(), "the free parked");
        assert_eq!(a.memory_stats(), plain.memory_stats());
    }
    // A request of another size settles the parked block and takes the usual path.
    let (x, y) = (
        a.allocate(4096, STREAMS[0]).expect("allocates"),
        plain.allocate(4096, STREAMS[0]).expect("allocates"),
    );
    assert_eq!(x.ptr(), y.ptr());
    assert_eq!(a.memory_stats(), plain.memory_stats());
    a.free(x).expect("frees");
    plain.free(y).expect("frees");
    assert_eq!(a.snapshot(), plain.snapshot());
    a.check_invariants().expect("consistent");
}

/// The hot pair of `size` bytes on stream 0, `pairs` times after its first allocation: the
/// first free parks, the allocation after it leaves the memo, and
/// every later pair may take the express lane.
fn hot_pairs(size: usize, pairs: usize) -> Vec<Op> {
    let mut ops = vec![Op::Alloc { size, stream: 0 }];
    ops.extend(again(pairs));
    ops
}

/// `n` hot pairs of the newest allocation: free it, allocate the same again.
fn again(n: usize) -> impl Iterator<Item = Op> {
    (0..n).flat_map(|_| [Op::FreeNewest, Op::Again])
}

/// `ops` after a hot pair of `size` bytes that took the express lane once (the pair's block is
/// the newest live allocation).
fn after_express(size: usize, ops: &[Op]) -> Vec<Op> {
    let mut all = hot_pairs(size, 2);
    all.extend_from_slice(ops);
    all.push(Op::Check);
    all
}

/// Hot pairs of blocks split from a segment (512 B, 1 MiB, 3 MiB: merged with the free rest)
/// and of a whole segment (64 MiB, with no free neighbour) take the lane, and the statistics
/// and snapshots agree with an allocator that never defers (`run` compares them after every
/// call).
#[test]
fn hot_pairs_take_the_express_lane() {
    for size in [512, 1 << 20, 3 << 20, 64 << 20] {
        let mut ops = hot_pairs(size, 10);
        ops.push(Op::Check);
        let express = run("", &ops).expect("decides as the plain allocator");
        assert_eq!(
            express, 10,
            "{size} B: every free after the first hand-back"
        );
    }
}

/// Pointer-API hot pairs (`raw_alloc` / `raw_free`) take the lane exactly as handle pairs do,
/// with the pointer index kept (the run's checks compare it with the allocated blocks).
#[test]
fn raw_hot_pairs_take_the_express_lane() {
    for size in [512, 1 << 20, 64 << 20] {
        let mut raw = vec![Op::RawAlloc { size, stream: 0 }];
        for _ in 0..10 {
            raw.extend([Op::RawFreeNewest, Op::RawAlloc { size, stream: 0 }]);
        }
        raw.push(Op::Check);
        let mut handles = hot_pairs(size, 10);
        handles.push(Op::Check);
        let express = run("", &raw).expect("decides as the plain allocator");
        assert!(express > 0, "{size} B: no raw free took the lane");
        assert_eq!(
            express,
            run("", &handles).expect("decides as the plain allocator"),
            "{size} B"
        );
    }
}

/// The lane is taken in the garbage-collection configuration too (the clock's readings), for
/// blocks below its `max_split_size` (40 MiB).
#[test]
fn the_express_lane_keeps_the_clock() {
    let config = "garbage_collection_threshold:0.5,max_split_size_mb:40";
    for size in [512, 3 << 20, 32 << 20] {
        let mut ops = hot_pairs(size, 5);
        ops.push(Op::Check);
        assert!(run(config, &ops).expect("decides alike") > 0, "{size} B");
    }
}

/// The block before the hot 512 B one freed meanwhile: a 1 KiB block is freed by the usual path
/// (the size handed out last is 512), a 512 B one is parked and then settled by the hot block's
/// free taking the lock. Either way the free set changes, and the hot block must merge with it.
/// Fails if the lane ignores the free set's version.
#[test]
fn a_neighbour_freed_meanwhile_stops_the_lane() {
    for before in [1024, 512] {
        let alloc = |size| Op::Alloc { size, stream: 0 };
        let ops = [
            alloc(before),
            alloc(512),
            Op::FreeNewest,
            Op::Again,
            Op::FreeNewest,
            Op::Again,
            Op::Free { pick: 0 },
            Op::FreeNewest,
            Op::Check,
        ];
        let express = run("", &ops).expect("decides as the plain allocator");
        assert_eq!(express, 1, "{before} B before: the second pair's free only");
    }
}

/// A block used by another stream stays active after its free until that stream's work
/// completes. Fails if the lane ignores the block's other-stream uses.
#[test]
fn a_block_used_elsewhere_leaves_by_the_usual_path() {
    let ops = after_express(
        512,
        &[
            Op::RecordStream { pick: 0, stream: 1 },
            Op::FreeNewest,
            Op::Check,
            Op::Complete { stream: 1 },
            Op::Check,
        ],
    );
    run("", &ops).expect("decides as the plain allocator");
}

/// `max_split_size_mb:20` set between two pairs of a whole 20 MiB segment: the free counts the
/// block as an oversize allocation leaving (PyTorch's figures follow the settings of the moment).
/// Fails if the lane ignores the settings' version.
#[test]
fn new_settings_stop_the_lane() {
    let ops = after_express(20 << 20, &[Op::Reconfigure(1), Op::FreeNewest, Op::Check]);
    run("", &ops).expect("decides as the plain allocator");
}

/// A block of `max_split_size` or more never takes the lane (its frees and allocations count
/// oversize allocations). Fails if `express_after` ignores the limit.
#[test]
fn oversize_blocks_keep_their_counts() {
    let ops = after_express(20 << 20, &[Op::FreeNewest, Op::Again, Op::Check]);
    let express = run("max_split_size_mb:20", &ops).expect("decides as the plain allocator");
    assert_eq!(express, 0);
}

/// A block handed back for a request other than the one its free recorded does not take the
/// lane at its next free (the record holds the old request's bytes). Fails if `express_after`
/// ignores the request.
#[test]
fn another_request_leaves_by_the_usual_path() {
    let size = (3 << 20) - 100;
    let mut ops = hot_pairs(size, 1);
    ops.extend([
        Op::FreeNewest,
        Op::Alloc {
            size: 3 << 20,
            stream: 0,
        },
        Op::FreeNewest,
        Op::Check,
    ]);
    run("", &ops).expect("decides as the plain allocator");
}

/// The express allocation restores figures without comparing them with the limits only while
/// the limits stand still: another stream's new peak meanwhile must be seen (as
/// `a_hot_pair_rechecks_limits_that_changed` for the usual path). Fails if
/// `may_unpark_express` ignores the limits' epoch.
#[test]
fn the_express_allocation_rechecks_limits_that_changed() {
    let mut ops = hot_pairs(3 << 20, 2);
    ops.extend([
        Op::FreeNewest,
        Op::Alloc {
            size: 8 << 20,
            stream: 1,
        },
        Op::Again,
        Op::Free { pick: 0 },
        Op::Check,
    ]);
    assert!(run("", &ops).expect("decides as the plain allocator") > 0);
}

/// A larger request of the same rounded size after an express free: compared with its limit by
/// the usual path. Fails if `may_unpark_express` ignores the request.
#[test]
fn a_larger_request_after_an_express_free_is_compared() {
    let size = (3 << 20) - 100;
    let mut ops = hot_pairs(size, 2);
    ops.extend([
        Op::FreeNewest,
        Op::Alloc {
            size: 3 << 20,
            stream: 0,
        },
        Op::Check,
    ]);
    assert!(run("", &ops).expect("decides as the plain allocator") > 0);
}

/// A block handed back while history kept stacks keeps its stack until its free; the free
/// after history stopped must drop it (the usual path), or the block's next allocation would
/// show it in snapshots. Fails if the lane ignores the stack tables.
#[test]
fn kept_stacks_leave_by_the_usual_path() {
    type Sim = crate::CachingAllocator<crate::backend::sim::SimDevice>;
    let (a, plain) = (allocator("", true), allocator("", false));
    let both = |f: &dyn Fn(&Sim)| {
        f(&a);
        f(&plain);
    };
    let pair = |x: &Sim| {
        let b = x.allocate(512, STREAMS[0]).expect("allocates");
        x.free(b).expect("frees");
    };
    // Parked with no stack, handed back with one: the pair is hot, its block has a stack.
    both(&|x| pair(x));
    both(&|x| x.record_history_with_context(true, 1000, RecordContext::State));
    let (x, y) = (
        a.allocate(512, STREAMS[0]).expect("allocates"),
        plain.allocate(512, STREAMS[0]).expect("allocates"),
    );
    assert!(a
        .streams
        .get(STREAMS[0])
        .expect("shard")
        .state
        .lock()
        .fast
        .has_memo());
    both(&|x| x.record_history(false, 1));
    a.free(x).expect("frees");
    plain.free(y).expect("frees");
    assert_eq!(
        a.express_frees.load(Relaxed),
        0,
        "the kept stack sent the free the usual way"
    );
    both(&|x| pair(x));
    both(&|x| pair(x));
    let (x, y) = (
        a.allocate(512, STREAMS[0]).expect("allocates"),
        plain.allocate(512, STREAMS[0]).expect("allocates"),
    );
    assert_eq!(a.snapshot(), plain.snapshot());
    assert!(
        a.express_frees.load(Relaxed) > 0,
        "later pairs took the lane"
    );
    a.free(x).expect("frees");
    plain.free(y).expect("frees");
    assert_eq!(a.memory_stats(), plain.memory_stats());
}

/// A block between two blocks in use (it parks whole, in a split segment) takes the lane with
/// both inactive-split figures. Fails if the lane leaves out `inactive_split`.
#[test]
fn a_block_between_two_in_use_takes_the_lane() {
    let alloc = Op::Alloc {
        size: 512,
        stream: 0,
    };
    let mut ops = vec![
        alloc.clone(),
        alloc.clone(),
        alloc,
        Op::Free { pick: 1 },
        Op::Again,
    ];
    ops.extend(again(3));
    ops.push(Op::Check);
    assert_eq!(run("", &ops).expect("decides as the plain allocator"), 3);
}

/// The record's amounts changed meanwhile without the hot block's pool changing: a block of
/// the hot size, for another request, parked in a private pool (a capture on the stream) and
/// settled there. The hot block's free must write its own amounts. Fails if the lane ignores
/// the record's stamp.
#[test]
fn a_record_changed_elsewhere_stops_the_lane() {
    let (a, plain) = (allocator("", true), allocator("", false));
    let pool = crate::MempoolId(1, 1);
    let mut live = Vec::new();
    for x in [&a, &plain] {
        for _ in 0..3 {
            let b = x.allocate(512, STREAMS[0]).expect("allocates");
            x.free(b).expect("frees");
        }
        let hot = x.allocate(512, STREAMS[0]).expect("allocates");
        x.begin_allocate_to_pool(pool, |s| s == STREAMS[0])
            .expect("capture begins");
        let other = x.allocate(500, STREAMS[0]).expect("allocates");
        x.free(other).expect("frees");
        x.end_allocate_to_pool(pool).expect("capture ends");
        // Takes every lock: settles the private pool's parked block.
        let _ = x.snapshot();
        live.push(hot);
    }
    let (y, x) = (live.pop().expect("plain's"), live.pop().expect("a's"));
    assert_eq!(
        a.express_frees.load(Relaxed),
        2,
        "the pairs before took the lane"
    );
    a.free(x).expect("frees");
    plain.free(y).expect("frees");
    assert_eq!(
        a.express_frees.load(Relaxed),
        2,
        "the free took the usual path"
    );
    assert_eq!(a.memory_stats(), plain.memory_stats());
    assert_eq!(a.snapshot(), plain.snapshot());
}

/// Garbage collection releases the whole free segments whose age (the pool's clock ticks, one
/// per best fit anywhere, since their free) is at least the average: `X` and `Z` (on stream 1),
/// freed before five express pairs on stream 0, are older than `Y`, freed after them, so only
/// they go. Fails if the express allocation leaves out best fit's clock tick (all three would
/// be as old, and all three would go).
#[test]
fn express_allocations_tick_the_clock() {
    let alloc = |size: usize, stream: usize| Op::Alloc { size, stream };
    // W1, W2, X, Z, Y on stream 1; the hot block B on stream 0, handed back once by each path.
    let mut ops = vec![alloc(64 << 20, 1); 5];
    ops.extend([
        alloc(3 << 20, 0),
        Op::FreeNewest,
        Op::Again,
        Op::FreeNewest,
        Op::Again,
    ]);
    ops.extend([Op::Free { pick: 2 }, Op::Free { pick: 2 }]);
    ops.extend(again(5));
    // W1, W2, Y, B live: Y goes, then a request no free block fits collects garbage.
    ops.extend([Op::Free { pick: 2 }, alloc(100 << 20, 0), Op::Check]);
    let express = run("garbage_collection_threshold:0.5", &ops).expect("decides alike");
    assert!(express >= 6, "{express} express frees");
}

/// A whole segment parked by the express lane keeps the clock's reading of its free: `B` (on
/// stream 0, parked last) is younger than `X` (on stream 1, freed two pairs before), so
/// garbage collection releases only `X`. Fails if the lane parks with another reading.
#[test]
fn an_express_free_keeps_its_clock_reading() {
    let alloc = |size: usize, stream: usize| Op::Alloc { size, stream };
    // W1, W2, W3, X on stream 1; the hot whole segment B on stream 0.
    let mut ops = vec![alloc(64 << 20, 1); 4];
    ops.push(alloc(32 << 20, 0));
    ops.extend(again(3));
    ops.push(Op::Free { pick: 3 });
    ops.extend(again(2));
    // B parks; a request no free block fits collects garbage.
    ops.extend([Op::FreeNewest, alloc(200 << 20, 1), Op::Check]);
    let express = run("garbage_collection_threshold:0.5", &ops).expect("decides alike");
    assert!(express >= 4, "{express} express frees");
}

/// An express free while garbage collection is off takes the clock's reading from the hand-back
/// without loading it; it must be the clock's, which stood still since. Here the clock ran
/// during hot pairs on stream 1 with collection on; collection goes off (settings), `B` (a
/// whole 32 MiB segment on stream 0) takes the lane and stays parked; collection comes back on
/// and a request no free block fits collects: `B` and the 20 MiB segment parked before the
/// switch are as old, and both go. Fails if the lane parks `B` with a clock of 0 (it would be
/// the oldest, and go alone).
#[test]
fn an_express_free_with_collection_off_keeps_the_clock() {
    let alloc = |size: usize, stream: usize| Op::Alloc { size, stream };
    let mut ops = vec![alloc(64 << 20, 1); 3];
    ops.push(alloc(3 << 20, 1));
    ops.extend(again(5));
    ops.extend([Op::FreeNewest, Op::Reconfigure(0), alloc(32 << 20, 0)]);
    ops.extend(again(3));
    // Reserved: 3 x 64 + 20 + 32 MiB, 13.6 MiB over half of 90% of the device's 512 MiB.
    ops.extend([
        Op::FreeNewest,
        Op::Reconfigure(3),
        alloc(100 << 20, 0),
        Op::Check,
    ]);
    let express = run("garbage_collection_threshold:0.5", &ops).expect("decides alike");
    assert!(express >= 6, "{express} express frees");
}
