//! What-if runs against the same program run for real under the other configuration: tensormem's
//! own allocator on a simulated device plays PyTorch's (it records PyTorch's events), so the
//! replay of the first run under the second configuration must give the second run's figures.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_replay::Replay;

mod common;

use common::TOTAL;

const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;

/// The program: under a limit of 400 MiB, 390 MiB allocated (one more request refused) and freed,
/// then three times: blocks
/// allocated and freed, `empty_cache()` called, a larger block (a new segment right after the
/// program's release; the trace shows it was the program's: the allocator had room for it).
fn program(config: &str) -> CachingAllocator<SimDevice> {
    let allocator = CachingAllocator::with_config(
        SimDevice::with_fixed_addresses(0, TOTAL),
        AllocatorConfig::parse(config).unwrap(),
    );
    allocator.record_history(true, 1 << 20);
    allocator
        .set_memory_fraction((400 * MIB) as f64 / TOTAL as f64)
        .unwrap();
    let mut first: Vec<_> = (0..13)
        .map(|_| allocator.allocate(30 * MIB, S).unwrap())
        .collect();
    // Over the limit: the out-of-memory error the program catches tells the replay a limit was set.
    assert!(allocator.allocate(30 * MIB, S).is_err());
    let kept = first.pop().unwrap();
    for block in first {
        allocator.free(block).unwrap();
    }
    allocator.empty_cache().unwrap();
    allocator.free(kept).unwrap();
    for round in 0..3 {
        let blocks: Vec<_> = (0..4)
            .map(|_| allocator.allocate(30 * MIB, S).unwrap())
            .collect();
        for block in blocks {
            allocator.free(block).unwrap();
        }
        allocator.empty_cache().unwrap();
        let big = allocator.allocate((50 + 10 * round) * MIB, S).unwrap();
        allocator.free(big).unwrap();
    }
    allocator
}

/// The program's `empty_cache()` calls stay the program's in a what-if run that adds garbage
/// collection (under which the replay's own state would take them for the collector's).
#[test]
fn the_programs_empty_cache_stays_the_programs_under_garbage_collection() {
    let recorded = common::recorded(&program("")).0;
    let what_if = "garbage_collection_threshold:0.6";
    let real = program(what_if).memory_stats().to_flat();
    let replay = Replay::new(&recorded).unwrap();
    let answer = replay.run_with(what_if).unwrap().flat_stats();
    for key in [
        "num_device_alloc",
        "num_device_free",
        "reserved_bytes.all.peak",
        "reserved_bytes.all.freed",
        "segment.all.allocated",
        "num_alloc_retries",
    ] {
        assert_eq!(answer[key], real[key], "{key}");
    }
}
