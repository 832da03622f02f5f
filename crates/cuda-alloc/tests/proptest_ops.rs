//! Random operation sequences: after every step the state is consistent, live blocks never overlap,
//! statistics equal what a snapshot adds up to, and in the end everything can be given back.

mod common;

use std::collections::BTreeMap;

use common::*;
use proptest::prelude::*;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::BlockState;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Error, StreamId};

const STREAMS: [StreamId; 3] = [S0, S1, S2];

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: usize, stream: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: usize },
    Complete { stream: usize },
    EmptyCache,
}

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
