//! `CachingAllocator::would_serve_from_cache`: it answers exactly whether the next `allocate` is
//! served from the cache (no new device memory), under the configurations that change rounding and
//! splitting, and it changes nothing.

mod common;

use common::*;
use proptest::prelude::*;
use tensormem_cuda_alloc::snapshot::TraceAction;
use tensormem_cuda_alloc::{Allocation, StreamId};

/// Whether `allocate(size, stream)` obtained new device memory (the query's negation): a new
/// segment, or more of an expandable segment mapped.
fn allocate_grew(
    alloc: &tensormem_cuda_alloc::CachingAllocator<tensormem_cuda_alloc::backend::sim::SimDevice>,
    size: usize,
    stream: StreamId,
) -> (bool, Option<Allocation>) {
    let before = alloc.reserved_bytes();
    let a = alloc.allocate(size, stream).ok();
    (alloc.reserved_bytes() != before, a)
}

const CONFIGS: [&str; 6] = [
    "",
    "expandable_segments:True",
    "expandable_segments:True,max_split_size_mb:40",
    "max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "max_split_size_mb:24,max_non_split_rounding_mb:30,roundup_power2_divisions:[64:8,>:2]",
];

/// The configurations under which an allocation the query says no to may still need no new
/// memory: expandable segments with a split limit.
const FIRST_LOOK_ONLY: [usize; 1] = [2];

#[derive(Clone, Debug)]
enum Step {
    Alloc(usize, bool),
    Free(usize),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let size = prop_oneof![
        1usize..4096,
        4096usize..(1 << 20),
        (1usize << 20)..(12 << 20),
        (12usize << 20)..(64 << 20),
    ];
    prop::collection::vec(
        prop_oneof![
            3 => (size, any::<bool>()).prop_map(|(s, other)| Step::Alloc(s, other)),
            2 => any::<prop::sample::Index>().prop_map(|i| Step::Free(i.index(1 << 16))),
        ],
        1..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_query_predicts_every_allocation(config in 0..CONFIGS.len(), steps in steps()) {
        let alloc = sim_with(CONFIGS[config], 8 * GIB);
        let mut live: Vec<Allocation> = Vec::new();
        for step in steps {
            match step {
                Step::Alloc(size, other) => {
                    let stream = if other { S1 } else { S0 };
                    let predicted = alloc.would_serve_from_cache(size, stream);
                    let (grew, a) = allocate_grew(&alloc, size, stream);
                    if FIRST_LOOK_ONLY.contains(&config) {
                        // A request below the split limit that the first look refuses (no oversize
                        // block for it) can still take the free mapped end of an expandable segment.
                        prop_assert!(!predicted || !grew, "size {} on {:?} under '{}'", size, stream, CONFIGS[config]);
                    } else {
                        prop_assert_eq!(predicted, !grew, "size {} on {:?} under '{}'", size, stream, CONFIGS[config]);
                    }
                    live.extend(a);
                }
                Step::Free(i) => {
                    if !live.is_empty() {
                        let a = live.swap_remove(i % live.len());
                        alloc.free(a).unwrap();
                    }
                }
            }
        }
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn the_query_changes_nothing() {
    let alloc = sim_with("garbage_collection_threshold:0.5", GIB);
    alloc.set_memory_fraction(0.9).unwrap();
    alloc.record_history(true, 100);
    let a = alloc.allocate(3 * MIB, S0).unwrap();
    let b = alloc.allocate(5 * KIB, S0).unwrap();
    alloc.free(a).unwrap();
    let stats = alloc.memory_stats();
    let trace = alloc.snapshot().device_traces[0].len();
    for size in [KIB, 2 * MIB, 3 * MIB, 100 * MIB] {
        for stream in [S0, S1, StreamId(77)] {
            let _ = alloc.would_serve_from_cache(size, stream);
        }
    }
    assert_eq!(alloc.memory_stats(), stats);
    // Only the snapshot taken above added a trace entry.
    let entries = alloc.snapshot().device_traces[0].clone();
    assert_eq!(entries.len(), trace + 1);
    assert_eq!(entries.last().unwrap().action, TraceAction::Snapshot);
    alloc.free(b).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn oversize_rules_apply() {
    // With max_split_size 20 MiB, a cached 40 MiB block serves a 30 MiB request only within the
    // non-split rounding (20 MiB by default), and never a small-ish large request below the limit.
    let alloc = sim_with("max_split_size_mb:20", 8 * GIB);
    let big = alloc.allocate(40 * MIB, S0).unwrap();
    alloc.free(big).unwrap();
    assert!(alloc.would_serve_from_cache(40 * MIB, S0));
    assert!(alloc.would_serve_from_cache(30 * MIB, S0));
    assert!(!alloc.would_serve_from_cache(19 * MIB, S0));
    assert!(!alloc.would_serve_from_cache(12 * MIB, S0));
    assert!(!alloc.would_serve_from_cache(41 * MIB, S0));
    assert!(!alloc.would_serve_from_cache(0, S0));
    assert!(!alloc.would_serve_from_cache(usize::MAX, S0));
}
