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

use std::collections::{BTreeMap, HashMap};

use crate::capacity::{CapacityFacts, OomFact};
use crate::restore;
use tensormem_cuda_alloc::device::StreamId;
use tensormem_cuda_alloc::size::{LARGE_BUFFER, SMALL_BUFFER};
use tensormem_cuda_alloc::snapshot::{Segment, TraceAction, TraceEntry};
use tensormem_cuda_alloc::MempoolId;

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
    /// synthetic stream, whose work completes at the matching [`Op::Complete`].
    Free {
        slot: u32,
        held_on: Option<StreamId>,
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
    /// The size of the new segment (or mapping) that follows the run, if one does.
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

/// A recorded expandable reservation, as far as the trace shows it.
struct Reservation {
    base: u64,
    /// Highest end of any mapping in it so far.
    extent: u64,
    /// Chunk size of its pool (from the size of its first mapping).
    chunk: u64,
    /// Bytes mapped in it now.
    mapped: u64,
    /// Everything was unmapped: the reservation was released.
    retired: bool,
}

/// The recorded segments live at a point of the trace, by address.
#[derive(Default)]
struct LiveSegments {
    /// Start address -> (end, instance).
    by_addr: BTreeMap<u64, (u64, u32)>,
}

impl LiveSegments {
    fn open(&mut self, instances: &mut Vec<Instance>, addr: u64, size: u64) {
        self.by_addr
            .insert(addr, (addr + size, instances.len() as u32));
        instances.push(Instance {
            addr,
            size,
            first_alloc: None,
            final_pool: None,
            released: false,
        });
    }

    fn grow(&mut self, instances: &mut [Instance], addr: u64, end: u64) {
        if let Some((e, id)) = self.by_addr.get_mut(&addr) {
            *e = (*e).max(end);
            instances[*id as usize].size = *e - addr;
        }
    }

    fn close(&mut self, instances: &mut [Instance], addr: u64) {
        if let Some((_, id)) = self.by_addr.remove(&addr) {
            instances[id as usize].released = true;
        }
    }

    /// The live instance containing `addr`.
    fn find(&self, addr: u64) -> u32 {
        match self.by_addr.range(..=addr).next_back() {
            Some((_, &(end, id))) if addr < end => id,
            _ => NO_INSTANCE,
        }
    }

    /// Gives the instances alive at the end the pool of the snapshot's segment at their address.
    fn finish(&self, instances: &mut [Instance], segments: &[Segment]) {
        for s in segments {
            let id = self.find(s.address);
            if let Some(i) = instances.get_mut(id as usize) {
                let (a, b) = s.segment_pool_id;
                i.final_pool = Some(MempoolId(a, b));
            }
        }
    }
}

impl DevicePlan {
    /// Reads device `device`'s events; `segments` are the snapshot's segments of that device,
    /// `max_split_size` the recorded configuration's and `collects` whether it sets a garbage
    /// collection threshold (both tell which releases synchronized).
    pub(crate) fn build(
        device: usize,
        trace: &[TraceEntry],
        segments: Vec<Segment>,
        max_split_size: usize,
        collects: bool,
    ) -> Result<DevicePlan, PlanError> {
        if u32::try_from(trace.len()).is_err() {
            return Err(PlanError::TooManyEvents);
        }
        let completion = completion_events(trace);
        let mut streams: Vec<u64> = trace.iter().map(|e| e.stream).collect();
        streams.sort_unstable();
        streams.dedup();
        // Synthetic streams sort after every real one, in the order their work completes in the
        // trace, so that the allocator visits completed blocks in the order PyTorch freed them.
        let synthetic_base = trace
            .iter()
            .map(|e| e.stream)
            .max()
            .unwrap_or(0)
            .max(1 << 62)
            .checked_add(1)
            .ok_or(PlanError::StreamIds)?;
        synthetic_base
            .checked_add(2 * trace.len() as u64)
            .ok_or(PlanError::StreamIds)?;

        let mut plan = DevicePlan {
            device,
            streams: streams.len(),
            events: trace.len(),
            segments,
            ..DevicePlan::default()
        };
        let mut live: HashMap<u64, u32> = HashMap::new();
        let mut spare_slots: Vec<u32> = Vec::new();
        let mut held: HashMap<u64, StreamId> = HashMap::new();
        let mut reservations: Vec<Reservation> = Vec::new();
        let mut segments_live = LiveSegments::default();
        // Per recorded segment, its blocks allocated or waiting for their stream's work.
        let mut busy: HashMap<u32, u32> = HashMap::new();
        let mut block_segment: HashMap<u64, u32> = HashMap::new();
        let mut reserved: u64 = 0;
        // The most bytes reserved right after a new segment, the release runs that may have made
        // room for a new segment, the out-of-memory errors.
        let mut facts = CapacityFacts::default();
        let mut never_completed = 0u64;
        // Completions PyTorch saw by synchronizing, inside the allocation that follows.
        let mut synced: Vec<Op> = Vec::new();
        let found = restore::find(trace);
        let mut checkpoint_after: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        let mut restore_at: HashMap<usize, u32> = HashMap::new();
        for (id, r) in found.iter().enumerate() {
            for &c in &r.candidates {
                checkpoint_after.entry(c).or_default().push(id as u32);
            }
            restore_at.insert(r.start, id as u32);
            plan.restores.push(RestorePlan {
                end: r.end as u32,
                instances: Vec::new(),
                live: r.live.clone(),
                free: r.free.clone(),
            });
        }
        for (i, e) in trace.iter().enumerate() {
            let event = i as u32;
            if let Some(ids) = i
                .checked_sub(1)
                .and_then(|last| checkpoint_after.get(&last))
            {
                for &restore in ids {
                    plan.push(event, Op::Checkpoint { restore });
                }
            }
            match &e.action {
                TraceAction::Alloc => {
                    if let Some(&restore) = restore_at.get(&i) {
                        plan.restores[restore as usize].instances = found[restore as usize]
                            .segments
                            .iter()
                            .map(|&(head, _)| segments_live.find(head))
                            .collect();
                        plan.push(event, Op::Restore { restore });
                    }
                    let slot = spare_slots.pop().unwrap_or_else(|| {
                        plan.slots += 1;
                        (plan.slots - 1) as u32
                    });
                    live.insert(e.addr, slot);
                    let instance = segments_live.find(e.addr);
                    if instance != NO_INSTANCE {
                        *busy.entry(instance).or_default() += 1;
                        block_segment.insert(e.addr, instance);
                    }
                    if let Some(i) = plan.instances.get_mut(instance as usize) {
                        if i.first_alloc.is_none() {
                            i.first_alloc = Some(plan.expected.len() as u32);
                        }
                    }
                    plan.push(
                        event,
                        Op::Alloc {
                            size: e.size,
                            stream: e.stream_id(),
                            slot,
                            instance,
                        },
                    );
                    plan.expected.push(Expected {
                        addr: e.addr,
                        reserved,
                    });
                    plan.flush(event, &mut synced);
                }
                TraceAction::FreeRequested => {
                    let Some(slot) = live.remove(&e.addr) else {
                        plan.unmatched_frees += 1;
                        continue;
                    };
                    spare_slots.push(slot);
                    let held_on = match completion.get(&i) {
                        // Completed at once, unless by the synchronization of the next
                        // allocation's out-of-memory sequence (nothing is recorded in between).
                        Some(&Some(done))
                            if done == i + 1
                                && (!completed_by_synchronizing(trace, done)
                                    || released_without_synchronizing(
                                        trace,
                                        done,
                                        max_split_size,
                                        collects,
                                    )) =>
                        {
                            None
                        }
                        Some(&Some(done)) => Some(StreamId(synthetic_base + done as u64)),
                        _ => {
                            never_completed += 1;
                            Some(StreamId(
                                synthetic_base + trace.len() as u64 + never_completed,
                            ))
                        }
                    };
                    if let Some(stream) = held_on {
                        held.insert(e.addr, stream);
                    }
                    plan.push(event, Op::Free { slot, held_on });
                }
                TraceAction::FreeCompleted => {
                    if let Some(instance) = block_segment.remove(&e.addr) {
                        if let Some(n) = busy.get_mut(&instance) {
                            *n = n.saturating_sub(1);
                        }
                    }
                    if let Some(stream) = held.remove(&e.addr) {
                        let complete = Op::Complete {
                            stream,
                            requested: e.size,
                        };
                        if completed_by_synchronizing(trace, i) {
                            synced.push(complete);
                        } else {
                            plan.push(event, complete);
                        }
                    }
                }
                TraceAction::SegmentAlloc => {
                    plan.malloc_addrs.push(e.addr);
                    segments_live.open(&mut plan.instances, e.addr, e.size);
                    reserved += e.size;
                    facts.reached = facts.reached.max(reserved);
                }
                TraceAction::SegmentMap => {
                    reserved += e.size;
                    facts.reached = facts.reached.max(reserved);
                    let end = e.addr + e.size;
                    match reservations
                        .iter_mut()
                        .find(|r| !r.retired && e.addr >= r.base && e.addr <= r.extent)
                    {
                        Some(r) => {
                            r.extent = r.extent.max(end);
                            r.mapped += e.size;
                            segments_live.grow(&mut plan.instances, r.base, r.extent);
                        }
                        None => {
                            plan.reserve_addrs.push(e.addr);
                            reservations.push(Reservation {
                                base: e.addr,
                                extent: end,
                                chunk: chunk_of_first_map(e.size),
                                mapped: e.size,
                                retired: false,
                            });
                            segments_live.open(&mut plan.instances, e.addr, e.size);
                        }
                    }
                }
                TraceAction::SegmentFree | TraceAction::SegmentUnmap => {
                    let before = reserved;
                    reserved = reserved.saturating_sub(e.size);
                    let starts = release_run_starts(trace, i);
                    if starts {
                        let set = plan.release_sets.len() as u32;
                        plan.release_sets.push(Vec::new());
                        let idle = segments_live
                            .by_addr
                            .iter()
                            .filter(|(base, _)| {
                                !reservations.iter().any(|r| !r.retired && r.base == **base)
                            })
                            .map(|(_, &(_, id))| id)
                            .filter(|id| busy.get(id).copied().unwrap_or(0) == 0)
                            .collect();
                        plan.idle_at_release.push(idle);
                        plan.push(event, Op::ReleaseStarts { set });
                    }
                    let instance = segments_live.find(e.addr);
                    if let Some(set) = plan.release_sets.last_mut() {
                        if instance != NO_INSTANCE && !set.contains(&instance) {
                            set.push(instance);
                        }
                    }
                    if e.action == TraceAction::SegmentFree {
                        segments_live.close(&mut plan.instances, e.addr);
                    } else if let Some(r) = reservations
                        .iter_mut()
                        .find(|r| !r.retired && e.addr >= r.base && e.addr < r.extent)
                    {
                        // A reservation left with nothing mapped is released with its last
                        // mapping: a later mapping at its address starts a new one.
                        r.mapped = r.mapped.saturating_sub(e.size);
                        if r.mapped == 0 {
                            r.retired = true;
                            segments_live.close(&mut plan.instances, r.base);
                        }
                    }
                    if starts {
                        let set = plan.release_sets.len() as u32 - 1;
                        let next_segment = match release_run_end(trace, i) {
                            RunEnd::Oom => continue,
                            RunEnd::Segment(size) => {
                                facts.retries.push((before, size));
                                Some(size)
                            }
                            RunEnd::Other => None,
                        };
                        let next_alloc = trace[i..]
                            .iter()
                            .find(|e| e.action == TraceAction::Alloc)
                            .map(|e| (e.size, e.stream_id()));
                        let run = plan.releases.len() as u32;
                        plan.releases.push(ReleaseRun {
                            next_segment,
                            next_alloc,
                            set,
                        });
                        plan.push(event, Op::Release { run });
                    }
                }
                TraceAction::Oom => {
                    let fact = OomFact {
                        reserved,
                        size: e.size,
                        device_free: e.addr,
                    };
                    facts.ooms.push(fact);
                    plan.push(
                        event,
                        Op::Oom {
                            size: e.size,
                            stream: e.stream_id(),
                            capacity: reserved + e.addr,
                            device_had_room: fact.device_had_room(),
                            after_releases: trace[..i]
                                .iter()
                                .rev()
                                .find(|e| !is_note(&e.action))
                                .is_some_and(|e| is_release(&e.action)),
                        },
                    );
                    plan.flush(event, &mut synced);
                }
                TraceAction::Snapshot | TraceAction::UserDefined | TraceAction::Other(_) => {}
            }
        }
        plan.flush(trace.len().saturating_sub(1) as u32, &mut synced);
        facts.layout_bound = capacity_bound(&reservations, &plan.malloc_addrs);
        segments_live.finish(&mut plan.instances, &plan.segments);
        plan.capacity = facts;
        Ok(plan)
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

/// For every `free_requested` event (by index), the index of the `free_completed` event of the same
/// block, or `None` when the trace ends first.
fn completion_events(trace: &[TraceEntry]) -> HashMap<usize, Option<usize>> {
    let mut requested: HashMap<u64, usize> = HashMap::new();
    let mut completion = HashMap::new();
    for (i, e) in trace.iter().enumerate() {
        match e.action {
            TraceAction::FreeRequested => {
                requested.insert(e.addr, i);
                completion.insert(i, None);
            }
            TraceAction::FreeCompleted => {
                if let Some(free) = requested.remove(&e.addr) {
                    completion.insert(free, Some(i));
                }
            }
            _ => {}
        }
    }
    completion
}

/// Whether the release run right after the `free_completed` event at `done` can be one that does
/// not synchronize:
/// - under `max_split_size`, `release_available_cached_blocks`: a request that finds no cached
///   block and no room first releases just enough oversize cached blocks (each at least
///   `max_split_size`) and tries again;
/// - with garbage collection (`collects`), `garbage_collect_cached_blocks`: a request that finds
///   no cached block first releases old cached segments while the bytes reserved are above the
///   threshold, then makes a new segment.
///
/// A block freed right before such a run was free at once, not held back until a synchronization.
/// A run that ends in an `oom` (or, under `max_split_size` alone, also releases smaller segments)
/// was `release_cached_blocks`, which synchronizes first.
fn released_without_synchronizing(
    trace: &[TraceEntry],
    done: usize,
    max_split_size: usize,
    collects: bool,
) -> bool {
    if collects {
        return matches!(release_run_end(trace, done + 1), RunEnd::Segment(_));
    }
    if max_split_size == usize::MAX {
        return false;
    }
    let Ok(max_split) = u64::try_from(max_split_size) else {
        return false;
    };
    let mut released_any = false;
    for e in trace[done + 1..].iter().filter(|e| !is_note(&e.action)) {
        if e.action != TraceAction::SegmentFree {
            return released_any && e.action == TraceAction::SegmentAlloc;
        }
        if e.size < max_split {
            return false;
        }
        released_any = true;
    }
    false
}

/// Whether the `free_completed` event at `i` of a held-back block came from synchronizing with
/// every stream (the out-of-memory sequence or `empty_cache`, which release segments right after)
/// rather than from finding the block's event done at the start of an allocation. The difference
/// matters: blocks freed at the start of an allocation can serve it, those freed by synchronizing
/// cannot.
///
/// Before `empty_cache` (a run of releases that no allocation follows) it makes no difference
/// for blocks `empty_cache` synchronizes, and `empty_cache` of one private pool synchronizes only
/// that pool's blocks: such a completion is taken as the free's own.
fn completed_by_synchronizing(trace: &[TraceEntry], i: usize) -> bool {
    let Some(next) = trace[i..]
        .iter()
        .position(|e| e.action != TraceAction::FreeCompleted && !is_note(&e.action))
        .map(|n| i + n)
    else {
        return false;
    };
    match trace[next].action {
        TraceAction::Oom => true,
        ref a if is_release(a) => !matches!(release_run_end(trace, next), RunEnd::Other),
        _ => false,
    }
}

fn is_release(action: &TraceAction) -> bool {
    matches!(action, TraceAction::SegmentFree | TraceAction::SegmentUnmap)
}

/// Events that say nothing about the allocator's decisions.
fn is_note(action: &TraceAction) -> bool {
    matches!(
        action,
        TraceAction::Snapshot | TraceAction::UserDefined | TraceAction::Other(_)
    )
}

/// Whether event `i` (a release) is the first of a run of releases.
fn release_run_starts(trace: &[TraceEntry], i: usize) -> bool {
    trace[..i]
        .iter()
        .rev()
        .find(|e| !is_note(&e.action))
        .is_none_or(|e| !is_release(&e.action))
}

/// What follows a run of releases.
enum RunEnd {
    /// An `oom` event: the releases were the out-of-memory sequence's.
    Oom,
    /// A new segment (`segment_alloc`) or mapping (`segment_map`) of this many bytes.
    Segment(u64),
    /// Anything else, or the end of the trace.
    Other,
}

/// What follows the run of releases starting at `i`.
fn release_run_end(trace: &[TraceEntry], i: usize) -> RunEnd {
    match trace[i..]
        .iter()
        .find(|e| !is_release(&e.action) && !is_note(&e.action))
    {
        Some(e) if e.action == TraceAction::Oom => RunEnd::Oom,
        Some(e)
            if matches!(
                e.action,
                TraceAction::SegmentAlloc | TraceAction::SegmentMap
            ) =>
        {
            RunEnd::Segment(e.size)
        }
        _ => RunEnd::Other,
    }
}

/// The chunk size of an expandable segment, judged from its first mapping: large-pool mappings are
/// whole 20 MiB chunks, small-pool ones 2 MiB chunks.
fn chunk_of_first_map(size: u64) -> u64 {
    if size.is_multiple_of(LARGE_BUFFER as u64) {
        LARGE_BUFFER as u64
    } else {
        SMALL_BUFFER as u64
    }
}

/// The most device memory for which every recorded reservation (`total * 9 / 8` rounded up to whole
/// chunks, as the allocator reserves) ends before the next recorded address above it; `None` when
/// nothing lies above any reservation.
fn capacity_bound(reservations: &[Reservation], malloc_addrs: &[u64]) -> Option<u64> {
    let mut bound: Option<u64> = None;
    for r in reservations {
        let next = reservations
            .iter()
            .map(|o| o.base)
            .chain(malloc_addrs.iter().copied())
            .filter(|&a| a > r.base)
            .min();
        let Some(next) = next else { continue };
        let room = (next - r.base) / r.chunk * r.chunk;
        let fits = largest_total_within(room);
        bound = Some(bound.map_or(fits, |b| b.min(fits)));
    }
    bound
}

/// The largest `total` with `total + total / 8 <= room`.
fn largest_total_within(room: u64) -> u64 {
    let mut total = (u128::from(room) * 8 / 9) as u64;
    while total + total / 8 > room {
        total -= 1;
    }
    while (total + 1) + (total + 1) / 8 <= room {
        total += 1;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let plan = DevicePlan::build(0, &trace, Vec::new(), usize::MAX, false).unwrap();
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
        let plan = DevicePlan::build(0, &trace, Vec::new(), usize::MAX, false).unwrap();
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
        let plan = DevicePlan::build(0, &trace, Vec::new(), usize::MAX, false).unwrap();
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
        let plan = DevicePlan::build(0, &trace, Vec::new(), usize::MAX, false).unwrap();
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
