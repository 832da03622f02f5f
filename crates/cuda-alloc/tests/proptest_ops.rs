//! Random operation sequences: after every step the state is consistent, live blocks never overlap,
//! statistics equal what a snapshot adds up to, and in the end everything can be given back. The
//! differential twin: the same operations on an allocator with the fast path off
//! ([`CachingAllocator::set_fast_path_enabled`]) give the same addresses, errors, statistics,
//! snapshot segments and trace entries (their pool ids included: some allocations go to a private
//! pool).

mod common;

use std::collections::BTreeMap;

use common::*;
use proptest::prelude::*;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::BlockState;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Error, RecordContext, StreamId};

const STREAMS: [StreamId; 3] = [S0, S1, S2];

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: usize,
        stream: usize,
    },
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
    /// Frees the allocation made last.
    FreeNewest,
    /// Allocates the size freed last again, on its stream (a hot pair when it follows a free).
    Again,
    /// Switches memory history (trace entries, no stacks) on or off: calls stop or start being
    /// quiet.
    History {
        on: bool,
    },
    /// Allocates in private pool `TWIN_POOL` (a `MemPool` context around one allocation).
    PoolAlloc {
        size: usize,
        stream: usize,
    },
    /// `Again` in `TWIN_POOL` (a hot pair there when the block freed last was the pool's).
    PoolAgain,
}

/// The private pool the twin's `PoolAlloc` allocates in.
const TWIN_POOL: tensormem_cuda_alloc::MempoolId = tensormem_cuda_alloc::MempoolId(0, 9);

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..26, 0usize..3).prop_map(|(bits, stream)| Op::Alloc {
            size: ((1usize << bits) | (bits as usize * 977)) .max(1),
            stream,
        }),
        5 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0usize..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (0usize..3).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
    ]
}

const CONFIGS: [&str; 4] = [
    "",
    "max_split_size_mb:20",
    "expandable_segments:True",
    "roundup_power2_divisions:[1:4,16:2,>:8],max_split_size_mb:40,max_non_split_rounding_mb:30",
];

fn check_against_snapshot(a: &CachingAllocator<SimDevice>) -> Result<(), TestCaseError> {
    a.check_invariants()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let stats = a.memory_stats();
    let snap = a.snapshot();
    let (mut allocated, mut active, mut requested, mut reserved) = (0, 0, 0, 0);
    for segment in &snap.segments {
        reserved += segment.total_size as i64;
        for b in &segment.blocks {
            if b.state == BlockState::ActiveAllocated {
                allocated += b.size as i64;
            }
            if b.state != BlockState::Inactive {
                active += b.size as i64;
                requested += b.requested_size as i64;
            }
        }
    }
    prop_assert_eq!(stats.allocated_bytes.all.current, allocated);
    prop_assert_eq!(stats.active_bytes.all.current, active);
    prop_assert_eq!(stats.requested_bytes.all.current, requested);
    prop_assert_eq!(stats.reserved_bytes.all.current, reserved);
    prop_assert!(stats.allocated_bytes.all.peak >= stats.allocated_bytes.all.current);
    Ok(())
}

fn run(config: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let a = sim_with(config, 256 * MIB);
    let mut live: Vec<Allocation> = Vec::new();
    // Live ranges by address: no two may overlap.
    let mut ranges: BTreeMap<u64, u64> = BTreeMap::new();
    for op in ops {
        match *op {
            Op::Alloc { size, stream } => match a.allocate(size, STREAMS[stream]) {
                Ok(x) => {
                    let (start, end) = (x.ptr().0, x.ptr().0 + x.size() as u64);
                    prop_assert!(x.size() >= size);
                    if let Some((&s, &len)) = ranges.range(..end).next_back() {
                        prop_assert!(s + len <= start, "{start:#x} overlaps {s:#x}+{len}");
                    }
                    ranges.insert(start, x.size() as u64);
                    live.push(x);
                }
                Err(Error::OutOfMemory(_)) => {}
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            },
            Op::Free { pick } if !live.is_empty() => {
                let x = live.swap_remove(pick % live.len());
                ranges.remove(&x.ptr().0);
                a.free(x).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                let x = &live[pick % live.len()];
                a.record_stream(x, STREAMS[stream])
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Complete { stream } => a.device().complete_stream_work(STREAMS[stream]),
            Op::EmptyCache => a
                .empty_cache()
                .map_err(|e| TestCaseError::fail(e.to_string()))?,
            Op::FreeNewest if !live.is_empty() => {
                let x = live.pop().expect("not empty");
                ranges.remove(&x.ptr().0);
                a.free(x).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::History { on } => a.record_history_with_context(on, 1000, RecordContext::Never),
            _ => {}
        }
        check_against_snapshot(&a)?;
    }
    for x in live {
        a.free(x).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    a.empty_cache()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    check_against_snapshot(&a)?;
    let stats = a.memory_stats();
    prop_assert_eq!(stats.reserved_bytes.all.current, 0);
    prop_assert_eq!(stats.active.all.current, 0);
    let device = a.device().counters();
    prop_assert_eq!(device.used_bytes, 0);
    prop_assert_eq!(device.reserved_ranges, 0);
    Ok(())
}

/// Sizes the twin's hot pairs repeat: small and large pools, blocks split and not, a request that
/// rounds up, one of `max_split_size_mb:20`.
const TWIN_SIZES: [usize; 7] = [
    512,
    1000,
    65_536,
    1 << 20,
    3 << 20,
    (3 << 20) - 100,
    20 << 20,
];

/// Operations for the differential twin: hot pairs (`FreeNewest`, `Again`) weigh more, so the fast
/// path's lanes are taken often, between everything that stops them.
fn twin_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (prop::sample::select(&TWIN_SIZES[..]), 0usize..3)
            .prop_map(|(size, stream)| Op::Alloc { size, stream }),
        2 => (0u32..26, 0usize..3).prop_map(|(bits, stream)| Op::Alloc {
            size: ((1usize << bits) | (bits as usize * 977)).max(1),
            stream,
        }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        6 => Just(Op::FreeNewest),
        6 => Just(Op::Again),
        1 => (any::<usize>(), 0usize..3)
            .prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0usize..3).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
        1 => any::<bool>().prop_map(|on| Op::History { on }),
        2 => (prop::sample::select(&TWIN_SIZES[..]), 0usize..3)
            .prop_map(|(size, stream)| Op::PoolAlloc { size, stream }),
        2 => Just(Op::PoolAgain),
    ]
}

/// One allocator of the twin: on a device that invents the same addresses as the other's.
fn twin(config: &str, fast_path: bool) -> CachingAllocator<SimDevice> {
    let a = CachingAllocator::with_config(
        SimDevice::with_fixed_addresses(0, 256 * MIB as u64),
        AllocatorConfig::parse(config).expect("valid config"),
    );
    a.set_fast_path_enabled(fast_path);
    a
}

/// The fast path decided as the plain path: the same statistics, and (`snapshots`) the same
/// snapshot segments and trace entries (times aside; pool ids included). A snapshot settles a parked block, so it is taken only now and then, to leave
/// the fast path's lanes open in between.
fn same_state(
    fast: &CachingAllocator<SimDevice>,
    plain: &CachingAllocator<SimDevice>,
    snapshots: bool,
    step: &str,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        fast.memory_stats(),
        plain.memory_stats(),
        "{}: statistics differ with the fast path off",
        step
    );
    if snapshots {
        prop_assert_eq!(
            fast.snapshot().segments,
            plain.snapshot().segments,
            "{}: snapshot segments differ with the fast path off",
            step
        );
        let untimed = |a: &CachingAllocator<SimDevice>| {
            a.trace()
                .into_iter()
                .map(|e| (e.action, e.addr, e.size, e.stream, e.pool_id))
                .collect::<Vec<_>>()
        };
        prop_assert_eq!(
            untimed(fast),
            untimed(plain),
            "{}: trace entries differ with the fast path off",
            step
        );
        fast.check_invariants()
            .map_err(|e| TestCaseError::fail(format!("{step}: {e}")))?;
    }
    Ok(())
}

/// Both outcomes of one call: equal, `Ok` or the same error.
fn same_outcome<T: PartialEq + std::fmt::Debug>(
    fast: &Result<T, Error>,
    plain: &Result<T, Error>,
    step: &str,
) -> Result<(), TestCaseError> {
    match (fast, plain) {
        (Ok(f), Ok(p)) => prop_assert_eq!(f, p, "{}: outcomes differ with the fast path off", step),
        (Err(f), Err(p)) => prop_assert_eq!(
            f.to_string(),
            p.to_string(),
            "{}: errors differ with the fast path off",
            step
        ),
        _ => {
            return Err(TestCaseError::fail(format!(
                "{step}: {:?} with the fast path on, {:?} off",
                fast.as_ref().err(),
                plain.as_ref().err()
            )))
        }
    }
    Ok(())
}

/// Runs `ops` on the differential twin: every outcome, statistic and (now and then) snapshot equal.
fn run_twin(config: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let (fast, plain) = (twin(config, true), twin(config, false));
    prop_assert!(fast.is_fast_path_enabled() && !plain.is_fast_path_enabled());
    for a in [&fast, &plain] {
        a.create_or_incref_pool(TWIN_POOL)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    // Live allocations of both, in allocation order (`FreeNewest` frees the last).
    let mut live: Vec<(Allocation, Allocation)> = Vec::new();
    // The size and stream freed last (what `Again` asks for).
    let mut last_freed: Option<(usize, usize)> = None;
    let free = |(f, p): (Allocation, Allocation), step: &str| -> Result<(), TestCaseError> {
        let (rf, rp) = (fast.free(f), plain.free(p));
        same_outcome(&rf, &rp, step)
    };
    for (i, op) in ops.iter().enumerate() {
        let step = format!("step {i} ({op:?})");
        let mut snapshots = false;
        match *op {
            Op::Alloc { size, stream } => {
                twin_alloc(&fast, &plain, &mut live, size, stream, &step)?
            }
            Op::Again => {
                if let Some((size, stream)) = last_freed {
                    twin_alloc(&fast, &plain, &mut live, size, stream, &step)?;
                }
            }
            Op::Free { pick } if !live.is_empty() => {
                let pair = live.remove(pick % live.len());
                last_freed = Some((pair.0.requested_size(), stream_index(pair.0.stream())));
                free(pair, &step)?;
            }
            Op::FreeNewest if !live.is_empty() => {
                let pair = live.pop().expect("not empty");
                last_freed = Some((pair.0.requested_size(), stream_index(pair.0.stream())));
                free(pair, &step)?;
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                let (f, p) = &live[pick % live.len()];
                let (rf, rp) = (
                    fast.record_stream(f, STREAMS[stream]),
                    plain.record_stream(p, STREAMS[stream]),
                );
                same_outcome(&rf, &rp, &step)?;
            }
            Op::Complete { stream } => {
                fast.device().complete_stream_work(STREAMS[stream]);
                plain.device().complete_stream_work(STREAMS[stream]);
            }
            Op::EmptyCache => {
                let (rf, rp) = (fast.empty_cache(), plain.empty_cache());
                same_outcome(&rf, &rp, &step)?;
                snapshots = true;
            }
            Op::History { on } => {
                fast.record_history_with_context(on, 1000, RecordContext::Never);
                plain.record_history_with_context(on, 1000, RecordContext::Never);
            }
            Op::PoolAlloc { .. } | Op::PoolAgain => {
                let (size, stream) = match *op {
                    Op::PoolAlloc { size, stream } => (size, stream),
                    _ => match last_freed {
                        Some(last) => last,
                        None => continue,
                    },
                };
                let routed = STREAMS[stream];
                for a in [&fast, &plain] {
                    a.begin_allocate_to_pool(TWIN_POOL, move |s| s == routed)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                let outcome = twin_alloc(&fast, &plain, &mut live, size, stream, &step);
                for a in [&fast, &plain] {
                    a.end_allocate_to_pool(TWIN_POOL)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    a.release_pool(TWIN_POOL)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                outcome?;
            }
            _ => {}
        }
        same_state(&fast, &plain, snapshots || i % 16 == 15, &step)?;
    }
    for pair in live.drain(..).rev() {
        free(pair, "final free")?;
    }
    same_state(&fast, &plain, true, "after the final frees")?;
    let (rf, rp) = (fast.empty_cache(), plain.empty_cache());
    same_outcome(&rf, &rp, "final empty_cache")?;
    same_state(&fast, &plain, true, "at the end")?;
    Ok(())
}

/// Allocates `size` bytes on `STREAMS[stream]` from both allocators of the twin: the same address
/// and size, or the same error.
fn twin_alloc(
    fast: &CachingAllocator<SimDevice>,
    plain: &CachingAllocator<SimDevice>,
    live: &mut Vec<(Allocation, Allocation)>,
    size: usize,
    stream: usize,
    step: &str,
) -> Result<(), TestCaseError> {
    let (rf, rp) = (
        fast.allocate(size, STREAMS[stream]),
        plain.allocate(size, STREAMS[stream]),
    );
    let key = |r: &Result<Allocation, Error>| {
        r.as_ref()
            .map(|x| (x.ptr(), x.size()))
            .map_err(ToString::to_string)
    };
    prop_assert_eq!(
        key(&rf),
        key(&rp),
        "{}: allocations differ with the fast path off",
        step
    );
    if let (Ok(f), Ok(p)) = (rf, rp) {
        live.push((f, p));
    }
    Ok(())
}

/// The index in [`STREAMS`] of `stream`.
fn stream_index(stream: StreamId) -> usize {
    STREAMS
        .iter()
        .position(|&s| s == stream)
        .expect("one of the test's streams")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_fast_path_decides_as_the_plain_path(
        config in 0usize..CONFIGS.len(),
        ops in proptest::collection::vec(twin_op(), 1..150),
    ) {
        run_twin(CONFIGS[config], &ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_sequences_keep_the_allocator_consistent(
        config in 0usize..CONFIGS.len(),
        ops in proptest::collection::vec(op(), 1..100),
    ) {
        run(CONFIGS[config], &ops)?;
    }
}
