//! A whole weight sync on the in-memory fake (`weights::fake`): ranks are threads, device memory
//! is byte vectors, streams are threads ordered by events. Every byte lands in the right tensor of
//! every receiver, buckets are cut at the configured size, a layout mismatch is refused before
//! any weight moves, and the pipeline keeps its order (checked on the fake's log).

use std::sync::Arc;
use std::time::Duration;

use tensormem_nccl::weights::fake::{Delays, Entry, FakeRank, FakeWorld, Lane, Op, Phase};
use tensormem_nccl::weights::{LocalTensor, Step, SyncOptions, WeightSync, MIN_BUCKET_BYTES};
use tensormem_nccl::{Error, Mismatch};

const BUCKET: usize = MIN_BUCKET_BYTES;

/// A mixed layout of 150 tensors (names and sizes): small vectors, matrices of a few hundred KiB,
/// two tensors larger than a bucket, an empty one.
fn layout() -> Vec<(String, usize)> {
    let mut out = vec![
        ("wte".to_owned(), 2 * BUCKET + 12_288),
        ("wpe".to_owned(), 196_608),
    ];
    for layer in 0..12 {
        let sizes = [
            3072, 3072, 110_592, 9216, 36_864, 3072, 3072, 147_456, 12_288,
        ];
        for (i, bytes) in sizes.into_iter().enumerate() {
            out.push((format!("h.{layer}.p{i}"), bytes + 512 * layer));
        }
        out.push((format!("h.{layer}.c_proj"), 147_456 + 1000));
        out.push((format!("h.{layer}.bias"), if layer == 5 { 0 } else { 8 }));
        out.push((format!("h.{layer}.ln"), 3072));
    }
    out.extend([
        ("lm_head".to_owned(), BUCKET + 4096),
        ("ln_f.weight".to_owned(), 3072),
        ("ln_f.bias".to_owned(), 3072),
    ]);
    out.push(("score".to_owned(), 100));
    assert_eq!(out.len(), 150);
    out
}

/// The bytes of tensor `index` at `version`: a function of the offset that no shift repeats.
fn pattern(index: usize, version: u8, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|j| {
            ((j.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 29) as u8)
                ^ (index as u8)
                ^ version.wrapping_mul(37)
        })
        .collect()
}

/// `rank`'s tensors of `layout`, allocated one by one in `order`, zeroed.
fn allocate(rank: &FakeRank, layout: &[(String, usize)], order: &[usize]) -> Vec<LocalTensor> {
    order
        .iter()
        .map(|&i| {
            let (name, bytes) = &layout[i];
            LocalTensor {
                name: name.clone(),
                ptr: rank.alloc(*bytes),
                bytes: *bytes as u64,
                meta: format!("u8[{bytes}]"),
            }
        })
        .collect()
}

/// Runs `f(rank)` for every rank of `world` on a thread of its own; the results in rank order.
fn on_ranks<T: Send>(
    world: &Arc<FakeWorld>,
    ranks: usize,
    f: impl Fn(FakeRank) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let (rank, f) = (world.rank(r), &f);
                s.spawn(move || f(rank))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

fn options() -> SyncOptions {
    SyncOptions {
        bucket_bytes: BUCKET,
        ..SyncOptions::default()
    }
}

/// Where in the log rank `rank`'s `op` reached `phase` (the first time).
fn at(log: &[Entry], rank: usize, op: Op, phase: Phase) -> usize {
    log.iter()
        .position(|e| e.rank == rank && e.op == op && e.phase == phase)
        .unwrap_or_else(|| panic!("rank {rank}: {op:?} never {phase:?}"))
}

/// Whether anything of the weights moved: a bucket's broadcast or a copy.
fn weights_moved(log: &[Entry]) -> bool {
    log.iter()
        .any(|e| matches!(e.op, Op::Broadcast(Step::Bucket(_)) | Op::Copy(_)))
}

#[test]
fn every_byte_lands_in_the_receivers_own_tensors_version_after_version() {
    let layout = layout();
    let total: usize = layout.iter().map(|t| t.1).sum();
    let (ranks, root) = (3, 1);
    let world = FakeWorld::new(ranks);
    on_ranks(&world, ranks, |me| {
        let n = layout.len();
        // The receivers hold their tensors in other orders than the sender, each allocated apart.
        let order: Vec<usize> = match me.rank() {
            1 => (0..n).collect(),
            0 => (0..n).rev().collect(),
            _ => (0..n)
                .filter(|i| i % 2 == 1)
                .chain((0..n).filter(|i| i % 2 == 0))
                .collect(),
        };
        let tensors = allocate(&me, &layout, &order);
        let mut sync =
            WeightSync::connect(me.engine(), me.collective(), root, &tensors, options()).unwrap();
        for version in 1..=2u8 {
            if me.rank() == root {
                for (t, &i) in tensors.iter().zip(&order) {
                    me.write(t.ptr, &pattern(i, version, layout[i].1));
                }
            }
            // SAFETY: the fake's memory; nothing else uses the tensors.
            let report = unsafe { sync.sync() }.unwrap();
            assert_eq!(report.sync, u64::from(version));
            assert_eq!(report.bytes, total as u64);
            assert_eq!(report.buckets, total.div_ceil(BUCKET));
            for (t, &i) in tensors.iter().zip(&order) {
                assert!(
                    me.read(t.ptr, layout[i].1) == pattern(i, version, layout[i].1),
                    "rank {}: {} holds other bytes at version {version}",
                    me.rank(),
                    t.name
                );
            }
        }
        drop(sync);
        assert_eq!(me.allocations(), n, "the staging buffers were given back");
    });
}

#[test]
fn buckets_are_cut_at_the_configured_size() {
    let layout = layout();
    let total: usize = layout.iter().map(|t| t.1).sum();
    let world = FakeWorld::new(2);
    let runs = on_ranks(&world, 2, |me| {
        let order: Vec<usize> = (0..layout.len()).collect();
        let tensors = allocate(&me, &layout, &order);
        let mut sync =
            WeightSync::connect(me.engine(), me.collective(), 0, &tensors, options()).unwrap();
        // SAFETY: the fake's memory; nothing else uses the tensors.
        let report = unsafe { sync.sync() }.unwrap();
        (sync.plan().clone(), report)
    });
    let n = total.div_ceil(BUCKET);
    let log = world.log();
    for (rank, (plan, report)) in runs.iter().enumerate() {
        let lens: Vec<usize> = plan.buckets().iter().map(|b| b.len()).collect();
        assert_eq!(lens.len(), n);
        assert!(lens[..n - 1].iter().all(|&l| l == BUCKET), "{lens:?}");
        assert_eq!(lens[n - 1], total - (n - 1) * BUCKET);
        for (k, bucket) in plan.buckets().iter().enumerate() {
            let covered: usize = bucket.spans().iter().map(|s| s.len).sum();
            assert_eq!(covered, bucket.len(), "bucket {k} is covered once");
        }
        // One broadcast per bucket.
        let broadcasts = log
            .iter()
            .filter(|e| e.rank == rank && e.phase == Phase::Issued)
            .filter(|e| matches!(e.op, Op::Broadcast(Step::Bucket(_))))
            .count();
        assert_eq!(broadcasts, n);
        // `wte` fills the first two buckets on its own: they go from and into it directly.
        assert_eq!(report.direct, 2, "{report:?}");
        for k in 0..2 {
            assert!(plan.buckets()[k].direct().is_some());
            assert!(!log
                .iter()
                .any(|e| e.rank == rank && e.op == Op::Copy(Step::Bucket(k))));
        }
    }
}

#[test]
fn a_mismatched_layout_is_refused_on_every_rank_before_any_weight_moves() {
    let layout = layout();
    let world = FakeWorld::new(3);
    let results = on_ranks(&world, 3, |me| {
        let order: Vec<usize> = (0..layout.len()).collect();
        let mut mine = layout.clone();
        if me.rank() == 2 {
            mine[7].1 += 2; // another size
            mine.remove(20); // a tensor the sender sends
        }
        let tensors = allocate(&me, &mine, &order[..mine.len()]);
        if me.rank() == 0 {
            for (i, t) in tensors.iter().enumerate() {
                me.write(t.ptr, &pattern(i, 1, mine[i].1));
            }
        }
        let result = WeightSync::connect(me.engine(), me.collective(), 0, &tensors, options());
        let untouched = me.rank() == 0
            || tensors
                .iter()
                .all(|t| me.read(t.ptr, t.bytes as usize).iter().all(|&b| b == 0));
        assert!(untouched, "rank {}: nothing was written", me.rank());
        let error = result.err();
        assert_eq!(
            me.allocations(),
            tensors.len(),
            "staging given back after a refusal"
        );
        error
    });
    let fingerprint = |e: &Option<Error>| match e {
        Some(Error::LayoutRejected { fingerprint }) => *fingerprint,
        other => panic!("rejected: {other:?}"),
    };
    assert_eq!(fingerprint(&results[0]), fingerprint(&results[1]));
    assert_eq!(
        results[2],
        Some(Error::Layout {
            mismatches: vec![
                Mismatch::Size {
                    name: layout[7].0.clone(),
                    sent: layout[7].1 as u64,
                    here: layout[7].1 as u64 + 2
                },
                Mismatch::Missing {
                    name: layout[20].0.clone()
                },
            ]
        })
    );
    assert!(!weights_moved(&world.log()));
}

#[test]
fn a_bucket_size_that_differs_is_named_where_it_differs() {
    let world = FakeWorld::new(2);
    let results = on_ranks(&world, 2, |me| {
        let tensors = allocate(&me, &layout(), &[0, 1, 2]);
        let options = SyncOptions {
            bucket_bytes: BUCKET << me.rank(),
            ..SyncOptions::default()
        };
        WeightSync::connect(me.engine(), me.collective(), 0, &tensors, options).err()
    });
    assert!(
        matches!(results[0], Some(Error::LayoutRejected { .. })),
        "{results:?}"
    );
    assert_eq!(
        results[1],
        Some(Error::BucketSize {
            sender: BUCKET as u64,
            here: 2 * BUCKET as u64
        })
    );
}

#[test]
fn a_sync_between_different_plans_is_refused_and_the_next_one_goes_through() {
    let layout = layout();
    let world = FakeWorld::new(2);
    on_ranks(&world, 2, |me| {
        let all: Vec<usize> = (0..layout.len()).collect();
        let (first, second) = (
            allocate(&me, &layout, &all),
            allocate(&me, &layout, &all[..40]),
        );
        let connect = |tensors: &[LocalTensor]| {
            WeightSync::connect(me.engine(), me.collective(), 0, tensors, options()).unwrap()
        };
        let (mut whole, mut part) = (connect(&first), connect(&second));
        if me.rank() == 0 {
            for (i, t) in first.iter().enumerate() {
                me.write(t.ptr, &pattern(i, 3, layout[i].1));
            }
        }
        // Rank 0 syncs one plan while rank 1 syncs the other: both refuse, nothing moves.
        let crossed = if me.rank() == 0 {
            // SAFETY: the fake's memory; nothing else uses the tensors.
            unsafe { whole.sync() }
        } else {
            // SAFETY: as above.
            unsafe { part.sync() }
        };
        assert!(
            matches!(crossed, Err(Error::LayoutRejected { .. })),
            "{crossed:?}"
        );
        assert!(!weights_moved(&world.log()));
        // SAFETY: as above.
        let report = unsafe { whole.sync() }.unwrap();
        assert_eq!(report.sync, 1, "the refused sync is not counted");
        for (i, t) in first.iter().enumerate() {
            assert!(me.read(t.ptr, layout[i].1) == pattern(i, 3, layout[i].1));
        }
    });
}

#[test]
fn the_pipeline_overlaps_and_never_reads_a_bucket_before_it_is_in_place() {
    // Every tensor smaller than a bucket, so that every bucket goes through a staging buffer;
    // copies and broadcasts take time, so that work not ordered after them would see stale bytes.
    let layout: Vec<(String, usize)> = (0..48)
        .map(|i| (format!("w{i}"), 150_000 + 4096 * (i % 7)))
        .collect();
    let delays = Delays {
        copy: Duration::from_millis(3),
        broadcast: Duration::from_millis(4),
    };
    let world = FakeWorld::with_delays(2, delays);
    let buckets = on_ranks(&world, 2, |me| {
        let order: Vec<usize> = (0..layout.len()).collect();
        let tensors = allocate(&me, &layout, &order);
        if me.rank() == 0 {
            for (i, t) in tensors.iter().enumerate() {
                me.write(t.ptr, &pattern(i, 5, layout[i].1));
            }
        }
        let mut sync =
            WeightSync::connect(me.engine(), me.collective(), 0, &tensors, options()).unwrap();
        // SAFETY: the fake's memory; nothing else uses the tensors.
        let report = unsafe { sync.sync() }.unwrap();
        assert_eq!(report.direct, 0);
        for (i, t) in tensors.iter().enumerate() {
            assert!(
                me.read(t.ptr, layout[i].1) == pattern(i, 5, layout[i].1),
                "w{i}"
            );
        }
        report.buckets
    });
    let n = buckets[0];
    assert!(n >= 6, "{n} buckets");
    let log = world.log();
    let (send, recv) = (0, 1);
    let bcast = |k| Op::Broadcast(Step::Bucket(k));
    let copy = |k| Op::Copy(Step::Bucket(k));
    let mut overlapped = 0;
    for k in 0..n {
        // The sender packs bucket k before broadcasting it, and packs into a staging buffer
        // only once the broadcast of the bucket before in it (k - 2) is done.
        assert!(
            at(&log, send, copy(k), Phase::Finished) < at(&log, send, bcast(k), Phase::Started)
        );
        if k >= 2 {
            assert!(
                at(&log, send, bcast(k - 2), Phase::Finished)
                    < at(&log, send, copy(k), Phase::Started)
            );
        }
        // A receiver unpacks bucket k only once its broadcast is done, receives into a staging
        // buffer only once the bucket before in it is unpacked, and issues the broadcast of
        // bucket k + 1 before the unpacking of bucket k finishes.
        assert!(
            at(&log, recv, bcast(k), Phase::Finished) < at(&log, recv, copy(k), Phase::Started)
        );
        if k >= 2 {
            assert!(
                at(&log, recv, copy(k - 2), Phase::Finished)
                    < at(&log, recv, bcast(k), Phase::Started)
            );
        }
        if k + 1 < n {
            assert!(
                at(&log, recv, bcast(k + 1), Phase::Issued)
                    < at(&log, recv, copy(k), Phase::Finished)
            );
            if at(&log, recv, bcast(k + 1), Phase::Started)
                < at(&log, recv, copy(k), Phase::Finished)
            {
                overlapped += 1;
            }
        }
    }
    assert!(
        overlapped > 0,
        "the unpacking of a bucket ran beside the next broadcast"
    );
    assert!(log.iter().all(|e| e.lane
        == match e.op {
            Op::Copy(_) => Lane::Compute,
            _ => Lane::Comm,
        }));
}

#[test]
fn a_sync_returns_once_the_last_bucket_is_in_place_even_when_it_goes_straight_into_a_tensor() {
    // The last two buckets lie inside `last` on both ranks: they are broadcast into it directly,
    // and nothing but the sync's final wait orders the caller after them.
    let layout = vec![
        ("first".to_owned(), 300_000),
        ("last".to_owned(), 3 * BUCKET),
    ];
    let delays = Delays {
        copy: Duration::ZERO,
        broadcast: Duration::from_millis(20),
    };
    let world = FakeWorld::with_delays(2, delays);
    on_ranks(&world, 2, |me| {
        let tensors = allocate(&me, &layout, &[0, 1]);
        let mut sync =
            WeightSync::connect(me.engine(), me.collective(), 0, &tensors, options()).unwrap();
        assert!(sync.plan().buckets().last().unwrap().direct().is_some());
        for version in 1..=2u8 {
            if me.rank() == 0 {
                for (i, t) in tensors.iter().enumerate() {
                    me.write(t.ptr, &pattern(i, version, layout[i].1));
                }
            }
            // SAFETY: the fake's memory; nothing else uses the tensors.
            unsafe { sync.sync() }.unwrap();
            for (i, t) in tensors.iter().enumerate() {
                assert!(
                    me.read(t.ptr, layout[i].1) == pattern(i, version, layout[i].1),
                    "rank {}: {} at version {version}",
                    me.rank(),
                    t.name
                );
            }
        }
    });
}

/// A receiving rank that stops syncing (alive, but never joins the next sync): the sender's next
/// sync ends with `TimedOut` once the timeout has passed, instead of waiting for ever, and the
/// sync is broken from then on.
#[test]
fn a_rank_that_stops_syncing_is_a_timeout_on_the_others_not_a_hang() {
    let layout = layout();
    let world = FakeWorld::new(2);
    let timeout = Duration::from_millis(300);
    let sender_done = std::sync::Barrier::new(2);
    let results = on_ranks(&world, 2, |me| {
        let order: Vec<usize> = (0..layout.len()).collect();
        let tensors = allocate(&me, &layout, &order);
        let options = SyncOptions {
            timeout,
            ..options()
        };
        let mut sync =
            WeightSync::connect(me.engine(), me.collective(), 0, &tensors, options).unwrap();
        // SAFETY: the fake's memory; nothing else uses the tensors.
        unsafe { sync.sync() }.unwrap();
        if me.rank() == 1 {
            // Stops syncing; once the sender has given up, its process goes away.
            sender_done.wait();
            world.lose(1);
            return None;
        }
        // SAFETY: as above.
        let second = unsafe { sync.sync() }.map(|_| ());
        // SAFETY: as above.
        let third = unsafe { sync.sync() }.map(|_| ());
        sender_done.wait();
        Some((second, third))
    });
    let Some((second, third)) = &results[0] else {
        panic!("the sender returns its results")
    };
    match second {
        Err(Error::TimedOut { rank: 0, waited }) => assert!(*waited >= timeout),
        other => panic!("expected a timeout on the sender, got {other:?}"),
    }
    assert_eq!(third, &Err(Error::Broken));
    let message = second.as_ref().unwrap_err().to_string();
    assert!(message.contains("ncclCommAbort"), "{message}");
}

/// A receiving rank lost mid-sync (its process died; the communicator reports it, as NCCL's
/// asynchronous error does): the sender's sync fails with the communicator's error at once, with
/// no timeout to wait out.
#[test]
fn a_rank_lost_mid_sync_is_an_error_on_the_others_at_once() {
    let layout = layout();
    let world = FakeWorld::new(2);
    let results = on_ranks(&world, 2, |me| {
        let order: Vec<usize> = (0..layout.len()).collect();
        let tensors = allocate(&me, &layout, &order);
        let mut sync =
            WeightSync::connect(me.engine(), me.collective(), 0, &tensors, options()).unwrap();
        // SAFETY: the fake's memory; nothing else uses the tensors.
        unsafe { sync.sync() }.unwrap();
        if me.rank() == 1 {
            world.lose(1);
            return None;
        }
        // SAFETY: as above.
        Some(unsafe { sync.sync() }.map(|_| ()))
    });
    match &results[0] {
        Some(Err(Error::Collective { code: 6, .. })) => {}
        other => panic!("expected the communicator's remote error, got {other:?}"),
    }
}
