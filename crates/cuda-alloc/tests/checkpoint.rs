//! Checkpointing a private pool (`get_checkpoint_state`, `set_checkpoint_pool_state`,
//! `check_pool_live_allocations`) on the simulated device: a pool checkpointed after a capture,
//! allocated and freed past the checkpoint, and restored, has the same blocks live.

use std::collections::HashSet;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{
    Allocation, CachingAllocator, CheckpointDelta, DeviceAddress, Error, MempoolId, PoolCheckpoint,
    StreamId,
};

const POOL: MempoolId = MempoolId(1, 0);
const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;

fn allocator(config: &str) -> CachingAllocator<SimDevice> {
    CachingAllocator::with_config(
        SimDevice::new(1 << 30),
        AllocatorConfig::parse(config).unwrap(),
    )
}

/// Allocations of `sizes` on `S`, made while a capture sends `S` to `POOL`.
fn captured(alloc: &CachingAllocator<SimDevice>, sizes: &[usize]) -> Vec<Allocation> {
    alloc.begin_allocate_to_pool(POOL, |s| s == S).unwrap();
    let made = sizes
        .iter()
        .map(|&size| alloc.allocate(size, S).unwrap())
        .collect();
    alloc.end_allocate_to_pool(POOL).unwrap();
    made
}

fn ptrs(allocations: &[Allocation]) -> HashSet<DeviceAddress> {
    allocations.iter().map(Allocation::ptr).collect()
}

#[test]
fn a_restored_pool_has_the_checkpointed_blocks_live() {
    for config in ["", "max_split_size_mb:20"] {
        let alloc = allocator(config);
        // The capture: three small blocks in one 2 MiB segment, a large split block, one freed.
        let mut first = captured(&alloc, &[100_000, 200_000, 300_000, 6 * MIB, 3 * MIB]);
        let dead = first.remove(1);
        alloc.free(dead).unwrap();
        let live = ptrs(&first);
        let checkpoint = alloc.get_checkpoint_state(POOL).unwrap();
        assert_eq!(checkpoint.pool(), POOL);
        let mut listed = checkpoint.live_allocations();
        listed.sort();
        let mut expected: Vec<DeviceAddress> = live.iter().copied().collect();
        expected.sort();
        assert_eq!(listed, expected, "{config}");
        assert!(alloc.check_pool_live_allocations(POOL, &live).unwrap());
        alloc.check_invariants().unwrap();

        // Past the checkpoint: a replay's tensors die and others are made, in the same segments and
        // in a new one.
        let gone = first.remove(0);
        alloc.free(gone).unwrap();
        let second = captured(&alloc, &[150_000, 30 * MIB, 50_000]);
        assert!(!alloc.check_pool_live_allocations(POOL, &live).unwrap());
        let segments_past = alloc.snapshot().segments.len();
        let mut held_before: Vec<DeviceAddress> =
            first.iter().chain(&second).map(Allocation::ptr).collect();
        held_before.sort();

        let delta = alloc.set_checkpoint_pool_state(&checkpoint).unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(
            delta.freed, held_before,
            "{config}: every allocated block was freed"
        );
        let created = ptrs(&delta.created);
        assert_eq!(
            created, live,
            "{config}: the checkpointed blocks are live again"
        );
        assert!(alloc.check_pool_live_allocations(POOL, &live).unwrap());
        let now = alloc.get_checkpoint_state(POOL).unwrap();
        assert_eq!(now.live_allocations(), checkpoint.live_allocations());
        assert_eq!(
            now.segment_count(),
            checkpoint.segment_count() + 1,
            "{config}: the checkpointed segments and the one made since"
        );
        // Restoring again changes nothing but the handles.
        let again = alloc.set_checkpoint_pool_state(&checkpoint).unwrap();
        assert_eq!(alloc.get_checkpoint_state(POOL).unwrap(), now);
        let mut listed = live.iter().copied().collect::<Vec<_>>();
        listed.sort();
        assert_eq!(again.freed, listed);
        for stale in delta.created {
            assert!(matches!(
                alloc.free(stale),
                Err(Error::InvalidPointer { .. })
            ));
        }
        let delta: CheckpointDelta = again;
        assert_eq!(
            alloc.snapshot().segments.len(),
            segments_past,
            "{config}: the segment made since stays"
        );
        let stats = alloc.memory_stats();
        assert_eq!(stats.allocation.all.current, live.len() as i64);

        // The old handles are stale; the new ones free normally.
        for old in first.into_iter().chain(second) {
            assert!(matches!(alloc.free(old), Err(Error::InvalidPointer { .. })));
        }
        for new in delta.created {
            alloc.free(new).unwrap();
        }
        // Both graphs (captures) are destroyed.
        alloc.release_pool(POOL).unwrap();
        alloc.release_pool(POOL).unwrap();
        alloc.empty_cache().unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(alloc.reserved_bytes(), 0, "{config}");
    }
}

#[test]
fn checkpoints_are_refused_with_typed_errors_and_change_nothing() {
    let alloc = allocator("");
    assert!(matches!(
        alloc.get_checkpoint_state(POOL),
        Err(Error::Pool { .. })
    ));
    let made = captured(&alloc, &[4096, 8 * MIB]);
    let checkpoint: PoolCheckpoint = alloc.get_checkpoint_state(POOL).unwrap();

    // Another allocator's checkpoint.
    let other = allocator("");
    let other_made = captured(&other, &[4096]);
    assert!(matches!(
        other.set_checkpoint_pool_state(&checkpoint),
        Err(Error::Checkpoint { .. })
    ));

    // A block still used by another stream.
    alloc.record_stream(&made[0], StreamId(9)).unwrap();
    let before = alloc.snapshot().segments;
    match alloc.set_checkpoint_pool_state(&checkpoint) {
        Err(Error::Checkpoint { reason, .. }) => {
            assert!(reason.contains("synchronize"), "{reason}")
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
    assert_eq!(alloc.snapshot().segments, before, "nothing changed");
    assert!(alloc
        .check_pool_live_allocations(POOL, &ptrs(&made))
        .unwrap());

    for a in made {
        alloc.free(a).unwrap();
    }
    alloc.device().complete_stream_work(StreamId(9));
    // A checkpointed segment that was returned to the device.
    alloc.release_pool(POOL).unwrap();
    assert!(matches!(
        alloc.set_checkpoint_pool_state(&checkpoint),
        Err(Error::Pool { .. })
    ));
    for a in other_made {
        other.free(a).unwrap();
    }
}

/// Private pools grow expandable segments under `expandable_segments:True`, as in PyTorch; a
/// checkpoint holds each one's mapped blocks, and a restore cuts them again where the segment is
/// still mapped that far, leaving the unmapped rest as it is.
#[test]
fn pools_with_expandable_segments_are_checkpointed_where_mapped() {
    let alloc = allocator("expandable_segments:True");
    let mut first = captured(
        &alloc,
        &[100_000, 200_000, 300_000, 6 * MIB, 3 * MIB, 5 * MIB],
    );
    assert!(alloc.snapshot().segments.iter().all(|s| s.is_expandable));
    let dead = first.remove(1);
    alloc.free(dead).unwrap();
    let dead = first.remove(3);
    alloc.free(dead).unwrap();
    let live = ptrs(&first);
    let reserved = alloc.reserved_bytes();
    let checkpoint = alloc.get_checkpoint_state(POOL).unwrap();
    assert_eq!(checkpoint.segment_count(), 2, "a small and a large segment");
    let mut listed = checkpoint.live_allocations();
    listed.sort();
    let mut expected: Vec<DeviceAddress> = live.iter().copied().collect();
    expected.sort();
    assert_eq!(listed, expected);
    let before = alloc.memory_stats();

    // Past the checkpoint, within what is mapped: blocks die and others are made.
    let gone = first.remove(0);
    alloc.free(gone).unwrap();
    let second = captured(&alloc, &[150_000, 4 * MIB]);
    assert_eq!(alloc.reserved_bytes(), reserved, "nothing new was mapped");
    let mut held: Vec<DeviceAddress> = first.iter().chain(&second).map(Allocation::ptr).collect();
    held.sort();

    let delta = alloc.set_checkpoint_pool_state(&checkpoint).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(delta.freed, held);
    assert_eq!(ptrs(&delta.created), live);
    assert_eq!(alloc.get_checkpoint_state(POOL).unwrap(), checkpoint);
    let after = alloc.memory_stats();
    assert_eq!(
        after.allocated_bytes.all.current,
        before.allocated_bytes.all.current
    );
    assert_eq!(
        after.reserved_bytes.all.current,
        before.reserved_bytes.all.current
    );
    assert_eq!(
        after.inactive_split.all.current, 0,
        "expandable blocks are not split blocks"
    );
    assert_eq!(after.segment.all.current, before.segment.all.current);

    // Mapped further since the checkpoint: the checkpointed blocks no longer tile the mapped range.
    let grown = captured(&alloc, &[40 * MIB]);
    assert!(alloc.reserved_bytes() > reserved);
    let snapshot = alloc.snapshot().segments;
    match alloc.set_checkpoint_pool_state(&checkpoint) {
        Err(Error::Checkpoint { .. }) => {}
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
    assert_eq!(alloc.snapshot().segments, snapshot, "nothing changed");

    for a in delta.created.into_iter().chain(grown) {
        alloc.free(a).unwrap();
    }
    // The three captures are destroyed.
    for _ in 0..3 {
        alloc.release_pool(POOL).unwrap();
    }
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
}
