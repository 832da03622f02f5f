//! Turning one device's recorded trace into the operations a replay performs.
//!
//! A trace records what PyTorch's allocator did; a replay needs what its *callers* did. This module
//! reads one device's events once and produces:
//!
//! - the calls to make: allocations (with the size asked for and the stream), frees (with the
//!   synthetic stream that holds the block back when the trace says its free completed later),
//!   completions of that held-back work, failed requests (`oom`), and `empty_cache` calls;
//! - the addresses the real device gave new segments and expandable reservations, in order;
//! - what the trace says the allocator's answer was: the address of every allocation and the bytes
//!   reserved at that moment, for checking a replay under the recorded configuration;
//! - an upper bound on the device's memory, where the layout of expandable reservations gives one.
//!
//! Allocations and frees are matched by address while the trace is read, so that the replay keeps
//! live allocations in a plain vector indexed by *slot* instead of a map.

mod build;

use crate::capacity::CapacityFacts;
use tensormem_cuda_alloc::device::StreamId;
use tensormem_cuda_alloc::snapshot::{Segment, TraceEntry};
use tensormem_cuda_alloc::MempoolId;

/// Under which settings a free whose completion the trace shows right before a run of releases
/// completed at once rather than by the synchronization of that run: the run may be one that does
/// not synchronize, and which runs do depends on the settings in force (the trace alone does not
/// say, so the replay reads it under the settings the program ran under at that point).
///
/// Packed in one word (the top bit: the run ends in a new segment; the rest: the smallest segment
/// it releases), so that [`Op`] stays four words: the replay walks millions of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AtOnce(u64);

impl AtOnce {
    const COLLECTING: u64 = 1 << 63;

    /// `collecting`: the run ends in a new segment, so under garbage collection it can be
    /// `garbage_collect_cached_blocks`, which does not synchronize. `splitting_from`: the run
    /// releases only segments at least this large and ends in a new segment (0: it does not), so
    /// under a `max_split_size` no larger it can be `release_available_cached_blocks`, which does
    /// not synchronize either.
    pub(crate) fn new(collecting: bool, splitting_from: u64) -> Self {
        let flag = if collecting { Self::COLLECTING } else { 0 };
        AtOnce(flag | splitting_from.min(Self::COLLECTING - 1))
    }

    /// Whether the free completed at once under `max_split_size` and garbage collection on or off
    /// (`collects`).
    pub(crate) fn holds(self, max_split_size: usize, collects: bool) -> bool {
        if collects {
            return self.0 & Self::COLLECTING != 0;
        }
        let splitting_from = self.0 & !Self::COLLECTING;
        max_split_size != usize::MAX
            && splitting_from > 0
            && u64::try_from(max_split_size).is_ok_and(|m| splitting_from >= m)
    }
}

/// One call of the replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// `allocate(size, stream)`; the allocation is kept in `slot`. `instance` indexes
    /// [`DevicePlan::instances`]: the recorded segment it landed in ([`NO_INSTANCE`] if none).
    Alloc {
        size: u64,
        stream: StreamId,
        slot: u32,
        instance: u32,
    },
    /// Free the allocation in `slot`. With `held_on`, the block is first recorded as used on that
    /// synthetic stream, whose work completes at the matching [`Op::Complete`], unless `at_once`
    /// says the free completed at once under the settings the program ran under then.
    Free {
        slot: u32,
        held_on: Option<StreamId>,
        at_once: AtOnce,
    },
    /// The work on synthetic stream `stream` is done: the block it held back (of `requested` bytes)
    /// returns to its pool at the next allocation.
    Complete { stream: StreamId, requested: u64 },
    /// A request that failed with out of memory in the recorded run. `capacity` is the device memory
    /// the record implies: the bytes still reserved after the allocator released what it could, plus
    /// what the device reported free.
    Oom {
        size: u64,
        stream: StreamId,
        capacity: u64,
        /// The device had room for the segment the request needed: the failure was the memory
        /// fraction's, and says nothing about the device's size.
        device_had_room: bool,
        /// Segments were released right before the failure (a request for the default pools
        /// releases every idle segment of theirs before it fails).
        after_releases: bool,
    },
    /// A run of segment releases (`segment_free`, `segment_unmap`) that did not end in an `oom`;
    /// `run` indexes [`DevicePlan::releases`].
    Release { run: u32 },
    /// A run of segment releases starts: the segments it releases are
    /// [`DevicePlan::release_sets`]`[set]` (private pools they belong to were released by their
    /// users before).
    ReleaseStarts { set: u32 },
    /// The recorded pool may have been in the state [`DevicePlan::restores`]`[restore]` returns it
    /// to: checkpoint the pool.
    Checkpoint { restore: u32 },
    /// A restore of a private pool to a checkpoint ([`DevicePlan::restores`]`[restore]`) starts:
    /// the allocations and frees up to its end are its work.
    Restore { restore: u32 },
}

/// A restore of a private pool to a checkpoint (`setCheckpointPoolState`), as the trace shows it
/// (see [`crate::restore`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RestorePlan {
    /// One past its last event.
    pub(crate) end: u32,
    /// The recorded segments it restores.
    pub(crate) instances: Vec<u32>,
    /// The blocks allocated in the checkpoint (address, size), in address order.
    pub(crate) live: Vec<(u64, u64)>,
    /// The addresses of the blocks free in the checkpoint.
    pub(crate) free: Vec<u64>,
}

/// A run of segment releases that did not end in an `oom`.
///
/// PyTorch releases cached segments inside an allocation only when the request finds no cached
/// block and the device refuses a new segment (or for garbage collection), so a run followed by
/// anything but a new segment was `torch.cuda.empty_cache()`. A run followed by a new segment was
/// one too if the device had room for that segment or the cache could have served the allocation
/// that follows (decided when replaying); else the replayed allocator makes the releases itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReleaseRun {
    /// The size of the new segment that follows the run, if one does; for a mapping of an
    /// expandable segment, the request's segment size, which the allocator checks against the
    /// memory fraction before it maps.
    pub(crate) next_segment: Option<u64>,
    /// The next allocation after the run: size asked for and stream.
    pub(crate) next_alloc: Option<(u64, StreamId)>,
    /// The segments it releases: [`DevicePlan::release_sets`]`[set]`.
    pub(crate) set: u32,
}

/// No recorded segment (an allocation outside every segment the trace shows).
pub(crate) const NO_INSTANCE: u32 = u32::MAX;

/// One recorded segment (or expandable reservation), from its creation to its release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Instance {
    /// Its address.
    pub(crate) addr: u64,
    /// Its size (for an expandable reservation: the extent its mappings reached).
    pub(crate) size: u64,
    /// The index of the allocation that made it (the first one landing in it), if any.
    pub(crate) first_alloc: Option<u32>,
    /// The pool the snapshot's final segments give it (`segment_pool_id`), when it lives to the end.
    pub(crate) final_pool: Option<MempoolId>,
    /// Whether the trace releases it.
    pub(crate) released: bool,
}

/// What the trace says about one allocation: where it landed and the bytes reserved afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Expected {
    pub(crate) addr: u64,
    pub(crate) reserved: u64,
}

/// One device's trace, ready to replay.
#[derive(Clone, Debug, Default)]
pub(crate) struct DevicePlan {
    /// The device index (position in `device_traces`).
    pub(crate) device: usize,
    pub(crate) ops: Vec<Op>,
    /// For each op, the index of the trace event it came from.
    pub(crate) op_events: Vec<u32>,
    /// The release runs [`Op::Release`] refers to.
    pub(crate) releases: Vec<ReleaseRun>,
    /// The recorded segments (and expandable reservations), in order of creation.
    pub(crate) instances: Vec<Instance>,
    /// For each run of releases, the instances it releases.
    pub(crate) release_sets: Vec<Vec<u32>>,
    /// For each run of releases, the segments (not expandable reservations) that held no block,
    /// allocated or waiting for its stream's work, when the run started: what a release of every
    /// pool's cache could have freed.
    pub(crate) idle_at_release: Vec<Vec<u32>>,
    /// For each [`Op::Alloc`], in order, what the trace recorded.
    pub(crate) expected: Vec<Expected>,
    /// Slots needed (the most allocations live at once).
    pub(crate) slots: usize,
    /// Addresses of new segments (`segment_alloc`), in order.
    pub(crate) malloc_addrs: Vec<u64>,
    /// Start addresses of expandable reservations (the first `segment_map` of each), in order.
    pub(crate) reserve_addrs: Vec<u64>,
    /// The recorded decisions that bound the device's memory.
    pub(crate) capacity: CapacityFacts,
    /// Distinct streams the trace names (every stream the replay allocates on is one of them: those
    /// of allocations, and of requests that ran out of memory without allocating).
    pub(crate) streams: usize,
    /// Trace events of this device.
    pub(crate) events: usize,
    /// Frees of blocks the trace never allocated (a trace that starts mid-run): skipped.
    pub(crate) unmatched_frees: usize,
    /// The segments the snapshot holds for this device (its state when it was taken).
    pub(crate) segments: Vec<Segment>,
    /// The checkpoint restores [`Op::Checkpoint`] and [`Op::Restore`] refer to.
    pub(crate) restores: Vec<RestorePlan>,
}

/// Why a trace cannot be turned into a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PlanError {
    /// More events than the plan's 32-bit indices hold.
    TooManyEvents,
    /// A synthetic stream id would collide with the trace's streams.
    StreamIds,
}

impl DevicePlan {
    /// Reads device `device`'s events; `segments` are the snapshot's segments of that device.
    pub(crate) fn build(
        device: usize,
        trace: &[TraceEntry],
        segments: Vec<Segment>,
    ) -> Result<DevicePlan, PlanError> {
        build::build(device, trace, segments)
    }

    fn push(&mut self, event: u32, op: Op) {
        self.ops.push(op);
        self.op_events.push(event);
    }

    /// Completes, after the allocation of `event`, the work of blocks PyTorch freed by
    /// synchronizing inside it: if the replayed allocator synchronized too, this changes nothing;
    /// if it did not, the blocks still return to their pools.
    fn flush(&mut self, event: u32, synced: &mut Vec<Op>) {
        for op in synced.drain(..) {
            self.push(event, op);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensormem_cuda_alloc::size::LARGE_BUFFER;
    use tensormem_cuda_alloc::snapshot::TraceAction;

    fn entry(action: TraceAction, addr: u64, size: u64, stream: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream,
            ..TraceEntry::default()
        }
    }

    #[test]
    fn frees_completed_later_are_held_on_synthetic_streams_in_completion_order() {
        use TraceAction::*;
        let trace = [
            entry(SegmentAlloc, 0x1000_0000, 20 << 20, 0),
            entry(Alloc, 0x1000_0000, 4096, 0),
            entry(Alloc, 0x1000_1000, 4096, 0),
            entry(FreeRequested, 0x1000_0000, 4096, 0),
            entry(FreeRequested, 0x1000_1000, 4096, 0),
            entry(FreeCompleted, 0x1000_1000, 4096, 0),
            entry(FreeCompleted, 0x1000_0000, 4096, 0),
        ];
        let plan = DevicePlan::build(0, &trace, Vec::new()).unwrap();
        let held: Vec<Option<StreamId>> = plan
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Free { held_on, .. } => Some(*held_on),
                _ => None,
            })
            .collect();
        let (a, b) = (held[0].unwrap(), held[1]);
        // The second free completes at once (event 5 follows event 4 directly).
        assert_eq!(b, None);
        assert!(a.0 > 1 << 62);
        assert_eq!(plan.malloc_addrs, vec![0x1000_0000]);
        assert_eq!(plan.slots, 2);
        assert_eq!(
            plan.expected[1],
            Expected {
                addr: 0x1000_1000,
                reserved: 20 << 20
            }
        );
        assert!(matches!(plan.ops.last(), Some(Op::Complete { stream, .. }) if *stream == a));
    }

    #[test]
    fn release_runs_say_what_follows_them() {
        use TraceAction::*;
        let trace = [
            entry(SegmentAlloc, 0x1000_0000, 20 << 20, 0),
            entry(Alloc, 0x1000_0000, 4096, 0),
            entry(FreeRequested, 0x1000_0000, 4096, 0),
            entry(FreeCompleted, 0x1000_0000, 4096, 0),
            entry(SegmentFree, 0x1000_0000, 20 << 20, 0),
            entry(SegmentAlloc, 0x2000_0000, 40 << 20, 0),
            entry(Alloc, 0x2000_0000, 30 << 20, 0),
            entry(SegmentFree, 0x2000_0000, 40 << 20, 0),
            entry(Snapshot, 0, 0, 0),
            entry(SegmentFree, 0x4000_0000, 2 << 20, 0),
            entry(Alloc, 0x3000_0000, 4096, 0),
            entry(SegmentFree, 0x5000_0000, 2 << 20, 0),
            entry(Oom, 0, 64 << 20, 0),
        ];
        let plan = DevicePlan::build(0, &trace, Vec::new()).unwrap();
        let releases: Vec<(u32, ReleaseRun)> = plan
            .ops
            .iter()
            .zip(&plan.op_events)
            .filter_map(|(op, &e)| match op {
                Op::Release { run } => Some((e, plan.releases[*run as usize])),
                _ => None,
            })
            .collect();
        let run = |next_segment, size, set| ReleaseRun {
            next_segment,
            next_alloc: Some((size, StreamId(0))),
            set,
        };
        assert_eq!(
            releases,
            vec![
                (4, run(Some(40 << 20), 30 << 20, 0)),
                (7, run(None, 4096, 1))
            ]
        );
        // Every run's segments, the out-of-memory one's too; segments the trace never showed made
        // are not among them.
        assert_eq!(plan.release_sets, vec![vec![0], vec![1], vec![]]);
        assert!(plan.instances.iter().all(|i| i.released));
        assert_eq!(plan.instances[1].first_alloc, Some(1));
    }

    #[test]
    fn expandable_reservations_bound_the_device_memory() {
        use TraceAction::*;
        let large = 0x3_0000_0000u64;
        let small = large + 9 * (1 << 30);
        let trace = [
            entry(SegmentMap, large, 40 << 20, 0),
            entry(SegmentMap, small, 2 << 20, 0),
            entry(SegmentMap, large + (40 << 20), 20 << 20, 0),
        ];
        let plan = DevicePlan::build(0, &trace, Vec::new()).unwrap();
        assert_eq!(plan.reserve_addrs, vec![large, small]);
        let bound = plan.capacity.layout_bound.unwrap();
        let chunk = LARGE_BUFFER as u64;
        let reservation = (bound + bound / 8).div_ceil(chunk) * chunk;
        assert!(reservation <= small - large);
        let more = bound + 1;
        assert!((more + more / 8).div_ceil(chunk) * chunk > small - large);
    }

    #[test]
    fn an_oom_carries_the_device_memory_it_implies() {
        use TraceAction::*;
        let trace = [
            entry(SegmentAlloc, 0x1000_0000, 20 << 20, 0),
            entry(SegmentAlloc, 0x2000_0000, 20 << 20, 0),
            entry(SegmentFree, 0x1000_0000, 20 << 20, 0),
            entry(Oom, 1 << 20, 64 << 20, 0),
        ];
        let plan = DevicePlan::build(0, &trace, Vec::new()).unwrap();
        assert_eq!(
            plan.ops,
            vec![
                Op::ReleaseStarts { set: 0 },
                Op::Oom {
                    size: 64 << 20,
                    stream: StreamId(0),
                    capacity: (20 << 20) + (1 << 20),
                    device_had_room: false,
                    after_releases: true,
                },
            ]
        );
    }
}
