//! Reading one device's trace into a [`DevicePlan`], event by event: each kind of event has its
//! phase, which decides the calls the replay makes for it and what the trace says about the
//! allocator's answer.

use std::collections::{BTreeMap, HashMap};

use super::{
    AtOnce, DevicePlan, Expected, Instance, Op, PlanError, ReleaseRun, RestorePlan, NO_INSTANCE,
};
use crate::capacity::OomFact;
use crate::restore::{self, Restore};
use tensormem_cuda_alloc::device::StreamId;
use tensormem_cuda_alloc::size::{allocation_size, LARGE_BUFFER, SMALL_BUFFER};
use tensormem_cuda_alloc::snapshot::{Segment, TraceAction, TraceEntry};
use tensormem_cuda_alloc::MempoolId;

/// Reads device `device`'s events (see [`DevicePlan::build`]).
pub(super) fn build(
    device: usize,
    trace: &[TraceEntry],
    segments: Vec<Segment>,
) -> Result<DevicePlan, PlanError> {
    if u32::try_from(trace.len()).is_err() {
        return Err(PlanError::TooManyEvents);
    }
    let mut builder = Builder::new(device, trace, segments)?;
    builder.plan_restores();
    for (i, e) in trace.iter().enumerate() {
        builder.event(i, e);
    }
    Ok(builder.finish())
}

/// The state of the reading of one trace: the plan so far and what the events seen tell about the
/// allocator's blocks, segments and streams at this point.
struct Builder<'t> {
    trace: &'t [TraceEntry],
    /// For every `free_requested` event, the `free_completed` event of its block.
    completion: HashMap<usize, Option<usize>>,
    /// The first synthetic stream id.
    synthetic_base: u64,
    plan: DevicePlan,
    /// The slot of every live allocation, by address.
    live: HashMap<u64, u32>,
    /// Slots freed, for the next allocations.
    spare_slots: Vec<u32>,
    /// The synthetic stream each block freed but not yet completed is held on, by address.
    held: HashMap<u64, StreamId>,
    /// When each segment of `cuMemAlloc` was in use, in the order they were made.
    lives: Vec<Life>,
    /// The index in `lives` of each segment live now, by address.
    segment_lives: HashMap<u64, usize>,
    reservations: Vec<Reservation>,
    segments_live: LiveSegments,
    /// Per recorded segment, its blocks allocated or waiting for their stream's work.
    busy: HashMap<u32, u32>,
    /// The recorded segment of each such block, by address.
    block_segment: HashMap<u64, u32>,
    /// Bytes reserved at this point.
    reserved: u64,
    /// Frees whose work the trace never completes.
    never_completed: u64,
    /// Completions PyTorch saw by synchronizing, inside the allocation that follows.
    synced: Vec<Op>,
    /// The checkpoint restores of the trace.
    found: Vec<Restore>,
    /// The restores whose pool may have been in the checkpoint state after each event.
    checkpoint_after: BTreeMap<usize, Vec<u32>>,
    /// The restore starting at each event.
    restore_at: HashMap<usize, u32>,
}

impl<'t> Builder<'t> {
    /// An empty plan for `trace`: counts the streams it names and places the synthetic streams
    /// after them.
    fn new(
        device: usize,
        trace: &'t [TraceEntry],
        segments: Vec<Segment>,
    ) -> Result<Builder<'t>, PlanError> {
        let completion = completion_events(trace);
        let mut streams: Vec<u64> = trace.iter().map(|e| e.stream).collect();
        streams.sort_unstable();
        streams.dedup();
        let synthetic_base = synthetic_base(trace)?;
        Ok(Builder {
            trace,
            completion,
            synthetic_base,
            plan: DevicePlan {
                device,
                streams: streams.len(),
                events: trace.len(),
                segments,
                ..DevicePlan::default()
            },
            live: HashMap::new(),
            spare_slots: Vec::new(),
            held: HashMap::new(),
            lives: Vec::new(),
            segment_lives: HashMap::new(),
            reservations: Vec::new(),
            segments_live: LiveSegments::default(),
            busy: HashMap::new(),
            block_segment: HashMap::new(),
            reserved: 0,
            never_completed: 0,
            synced: Vec::new(),
            found: Vec::new(),
            checkpoint_after: BTreeMap::new(),
            restore_at: HashMap::new(),
        })
    }

    /// Finds the checkpoint restores of the trace ([`restore::find`]): after which events their
    /// pool must be checkpointed, at which event each starts, and the plan of each.
    fn plan_restores(&mut self) {
        self.found = restore::find(self.trace);
        for (id, r) in self.found.iter().enumerate() {
            for &c in &r.candidates {
                self.checkpoint_after.entry(c).or_default().push(id as u32);
            }
            self.restore_at.insert(r.start, id as u32);
            self.plan.restores.push(RestorePlan {
                end: r.end as u32,
                instances: Vec::new(),
                live: r.live.clone(),
                free: r.free.clone(),
            });
        }
    }

    /// Reads event `i`: checkpoints the pools of the restores that may start from the state
    /// before it, then the event itself by its kind.
    fn event(&mut self, i: usize, e: &TraceEntry) {
        let event = i as u32;
        if let Some(ids) = i
            .checked_sub(1)
            .and_then(|last| self.checkpoint_after.get(&last))
        {
            for &restore in ids {
                self.plan.push(event, Op::Checkpoint { restore });
            }
        }
        match &e.action {
            TraceAction::Alloc => self.alloc(i, e),
            TraceAction::FreeRequested => self.free_requested(i, e),
            TraceAction::FreeCompleted => self.free_completed(i, e),
            TraceAction::SegmentAlloc => self.segment_alloc(i, e),
            TraceAction::SegmentMap => self.segment_map(i, e),
            TraceAction::SegmentFree | TraceAction::SegmentUnmap => self.release(i, e),
            TraceAction::Oom => self.oom(i, e),
            TraceAction::Snapshot | TraceAction::UserDefined | TraceAction::Other(_) => {}
        }
    }

    /// An `alloc` event: the allocation (in a free slot, landing in the recorded segment at its
    /// address), preceded by the start of the restore it begins, if it begins one; what the trace
    /// recorded of it; then the completions PyTorch saw by synchronizing inside it.
    fn alloc(&mut self, i: usize, e: &TraceEntry) {
        let event = i as u32;
        if let Some(&restore) = self.restore_at.get(&i) {
            self.plan.restores[restore as usize].instances = self.found[restore as usize]
                .segments
                .iter()
                .map(|&(head, _)| self.segments_live.find(head))
                .collect();
            self.plan.push(event, Op::Restore { restore });
        }
        let slot = self.spare_slots.pop().unwrap_or_else(|| {
            self.plan.slots += 1;
            (self.plan.slots - 1) as u32
        });
        self.live.insert(e.addr, slot);
        let instance = self.segments_live.find(e.addr);
        if instance != NO_INSTANCE {
            *self.busy.entry(instance).or_default() += 1;
            self.block_segment.insert(e.addr, instance);
        }
        if let Some(i) = self.plan.instances.get_mut(instance as usize) {
            if i.first_alloc.is_none() {
                i.first_alloc = Some(self.plan.expected.len() as u32);
            }
        }
        self.plan.push(
            event,
            Op::Alloc {
                size: e.size,
                stream: e.stream_id(),
                slot,
                instance,
            },
        );
        self.plan.expected.push(Expected {
            addr: e.addr,
            reserved: self.reserved,
        });
        self.plan.flush(event, &mut self.synced);
    }

    /// A `free_requested` event: the free of the allocation at its address (skipped when the
    /// trace never allocated it), held on a synthetic stream unless it completed at once
    /// ([`held_on`](Self::held_on)).
    fn free_requested(&mut self, i: usize, e: &TraceEntry) {
        let Some(slot) = self.live.remove(&e.addr) else {
            self.plan.unmatched_frees += 1;
            return;
        };
        self.spare_slots.push(slot);
        let (held_on, at_once) = self.held_on(i);
        if let Some(stream) = held_on {
            self.held.insert(e.addr, stream);
        }
        self.plan.push(
            i as u32,
            Op::Free {
                slot,
                held_on,
                at_once,
            },
        );
    }

    /// Whether the free of event `i` completed at once (`None`) or waited for other work: then
    /// the synthetic stream that holds the block until its `free_completed` event (in the order
    /// of those events; frees never completed come after all of them). A free completed by the
    /// synchronization of the next allocation's release run (nothing recorded in between) is held,
    /// with the settings under which that run did not synchronize and it completed at once.
    fn held_on(&mut self, i: usize) -> (Option<StreamId>, AtOnce) {
        match self.completion.get(&i) {
            Some(&Some(done)) if done == i + 1 && !completed_by_synchronizing(self.trace, done) => {
                (None, AtOnce::default())
            }
            Some(&Some(done)) => {
                let at_once = if done == i + 1 {
                    released_without_synchronizing(self.trace, done)
                } else {
                    AtOnce::default()
                };
                (Some(StreamId(self.synthetic_base + done as u64)), at_once)
            }
            _ => {
                self.never_completed += 1;
                let stream =
                    StreamId(self.synthetic_base + self.trace.len() as u64 + self.never_completed);
                (Some(stream), AtOnce::default())
            }
        }
    }

    /// A `free_completed` event: the block no longer keeps its segment busy, and the work of the
    /// stream holding it completes, here or (when PyTorch saw it by synchronizing) after the
    /// allocation that follows.
    fn free_completed(&mut self, i: usize, e: &TraceEntry) {
        if let Some(instance) = self.block_segment.remove(&e.addr) {
            if let Some(n) = self.busy.get_mut(&instance) {
                *n = n.saturating_sub(1);
            }
        }
        if let Some(stream) = self.held.remove(&e.addr) {
            let complete = Op::Complete {
                stream,
                requested: e.size,
            };
            if completed_by_synchronizing(self.trace, i) {
                self.synced.push(complete);
            } else {
                self.plan.push(i as u32, complete);
            }
        }
    }

    /// A `segment_alloc` event: the address of the new segment, the recorded segment it opens and
    /// the bytes reserved.
    fn segment_alloc(&mut self, i: usize, e: &TraceEntry) {
        self.plan.malloc_addrs.push(e.addr);
        self.segment_lives.insert(e.addr, self.lives.len());
        self.lives.push(Life {
            base: e.addr,
            made: i,
            released: None,
        });
        self.segments_live
            .open(&mut self.plan.instances, e.addr, e.size);
        self.reserved += e.size;
        self.plan.capacity.reach(i as u32, self.reserved);
    }

    /// A `segment_map` event: the bytes reserved, and the expandable reservation it grows, or the
    /// new one it starts (its address, and the recorded segment it opens).
    fn segment_map(&mut self, i: usize, e: &TraceEntry) {
        // The allocator checked the request's segment size against the limit before mapping, and
        // maps whole chunks past the free tail: what was reserved before the first mapping of an
        // allocation plus that size was allowed (what it reserved after may exceed the limit).
        let first_of_run = !matches!(
            self.trace[..i].iter().rev().find(|e| !is_note(&e.action)),
            Some(prev) if prev.action == TraceAction::SegmentMap
        );
        if first_of_run {
            let checked = next_request_segment(self.trace, i).unwrap_or(e.size);
            self.plan.capacity.reach(i as u32, self.reserved + checked);
        }
        self.reserved += e.size;
        let end = e.addr + e.size;
        match self
            .reservations
            .iter_mut()
            .find(|r| !r.retired() && e.addr >= r.base() && e.addr <= r.extent)
        {
            Some(r) => {
                r.extent = r.extent.max(end);
                r.mapped += e.size;
                self.segments_live
                    .grow(&mut self.plan.instances, r.base(), r.extent);
            }
            None => {
                self.plan.reserve_addrs.push(e.addr);
                self.reservations.push(Reservation {
                    life: Life {
                        base: e.addr,
                        made: i,
                        released: None,
                    },
                    extent: end,
                    chunk: chunk_of_first_map(e.size),
                    mapped: e.size,
                });
                self.segments_live
                    .open(&mut self.plan.instances, e.addr, e.size);
            }
        }
    }

    /// A `segment_free` or `segment_unmap` event: the bytes reserved; at the start of a run of
    /// releases, the run's set ([`open_release_set`](Self::open_release_set)); the recorded
    /// segment released ([`release_segment`](Self::release_segment)); and, for a run that does
    /// not end in an `oom`, the release call ([`release_run`](Self::release_run)).
    fn release(&mut self, i: usize, e: &TraceEntry) {
        let before = self.reserved;
        self.reserved = self.reserved.saturating_sub(e.size);
        let starts = release_run_starts(self.trace, i);
        if starts {
            self.open_release_set(i as u32);
        }
        self.release_segment(i, e);
        if e.action == TraceAction::SegmentFree {
            if let Some(k) = self.segment_lives.remove(&e.addr) {
                self.lives[k].released = Some(i);
            }
        }
        if starts {
            self.release_run(i, before);
        }
    }

    /// The start of a run of releases: its (empty) set of segments, the segments (not expandable
    /// reservations) that held no block then, and the op that says the run starts.
    fn open_release_set(&mut self, event: u32) {
        let set = self.plan.release_sets.len() as u32;
        self.plan.release_sets.push(Vec::new());
        let idle = self
            .segments_live
            .by_addr
            .iter()
            .filter(|(base, _)| {
                !self
                    .reservations
                    .iter()
                    .any(|r| !r.retired() && r.base() == **base)
            })
            .map(|(_, &(_, id))| id)
            .filter(|id| self.busy.get(id).copied().unwrap_or(0) == 0)
            .collect();
        self.plan.idle_at_release.push(idle);
        self.plan.push(event, Op::ReleaseStarts { set });
    }

    /// One release of a run: the recorded segment at its address joins the run's set, and is
    /// closed (a segment), or the expandable reservation loses the mapping (and is released with
    /// its last one).
    fn release_segment(&mut self, i: usize, e: &TraceEntry) {
        let instance = self.segments_live.find(e.addr);
        if let Some(set) = self.plan.release_sets.last_mut() {
            if instance != NO_INSTANCE && !set.contains(&instance) {
                set.push(instance);
            }
        }
        if e.action == TraceAction::SegmentFree {
            self.segments_live.close(&mut self.plan.instances, e.addr);
        } else if let Some(r) = self
            .reservations
            .iter_mut()
            .find(|r| !r.retired() && e.addr >= r.base() && e.addr < r.extent)
        {
            // A reservation left with nothing mapped is released with its last mapping: a later
            // mapping at its address starts a new one.
            r.mapped = r.mapped.saturating_sub(e.size);
            if r.mapped == 0 {
                r.life.released = Some(i);
                self.segments_live.close(&mut self.plan.instances, r.base());
            }
        }
    }

    /// The run of releases starting at event `i` (with `before` bytes reserved before it), unless
    /// it ends in an `oom` (the failed request's own releases): what follows it, for the replay to
    /// decide whether it was `empty_cache()`, and the capacity fact of a run followed by a new
    /// segment.
    fn release_run(&mut self, i: usize, before: u64) {
        let set = self.plan.release_sets.len() as u32 - 1;
        let next_segment = match release_run_end(self.trace, i) {
            RunEnd::Oom => return,
            RunEnd::Segment(size) => {
                // A mapping is checked as the request's segment size, not as what it maps.
                let checked = self
                    .trace
                    .get(i..)
                    .and_then(|rest| {
                        rest.iter()
                            .find(|e| !is_release(&e.action) && !is_note(&e.action))
                    })
                    .filter(|e| e.action == TraceAction::SegmentMap)
                    .and_then(|_| next_request_segment(self.trace, i))
                    .unwrap_or(size);
                self.plan.capacity.retry(i as u32, before, checked);
                Some(checked)
            }
            RunEnd::Other => None,
        };
        let next_alloc = self.trace[i..]
            .iter()
            .find(|e| e.action == TraceAction::Alloc)
            .map(|e| (e.size, e.stream_id()));
        let run = self.plan.releases.len() as u32;
        self.plan.releases.push(ReleaseRun {
            next_segment,
            next_alloc,
            set,
        });
        self.plan.push(i as u32, Op::Release { run });
    }

    /// An `oom` event: the failed request, with the device memory it implies and whether
    /// segments were released right before; then the completions PyTorch saw by synchronizing
    /// inside it.
    fn oom(&mut self, i: usize, e: &TraceEntry) {
        let event = i as u32;
        let fact = OomFact {
            reserved: self.reserved,
            size: e.size,
            device_free: e.addr,
        };
        self.plan.capacity.oom(event, fact);
        self.plan.push(
            event,
            Op::Oom {
                size: e.size,
                stream: e.stream_id(),
                capacity: self.reserved + e.addr,
                device_had_room: fact.device_had_room(),
                after_releases: self.trace[..i]
                    .iter()
                    .rev()
                    .find(|e| !is_note(&e.action))
                    .is_some_and(|e| is_release(&e.action)),
            },
        );
        self.plan.flush(event, &mut self.synced);
    }

    /// The end of the trace: the completions still waiting for an allocation, the bound the
    /// layout of expandable reservations puts on the device's memory, and the pools the
    /// snapshot gives the segments alive at the end.
    fn finish(mut self) -> DevicePlan {
        let last = self.trace.len().saturating_sub(1) as u32;
        self.plan.flush(last, &mut self.synced);
        self.plan.capacity.layout_bound = capacity_bound(&self.reservations, &self.lives);
        self.segments_live
            .finish(&mut self.plan.instances, &self.plan.segments);
        self.plan
    }
}

/// The first synthetic stream id. Synthetic streams sort after every real one, in the order their
/// work completes in the trace, so that the allocator visits completed blocks in the order PyTorch
/// freed them.
fn synthetic_base(trace: &[TraceEntry]) -> Result<u64, PlanError> {
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
    Ok(synthetic_base)
}

/// A recorded expandable reservation, as far as the trace shows it.
struct Reservation {
    /// Its base, and when it was in use (released once everything was unmapped).
    life: Life,
    /// Highest end of any mapping in it so far.
    extent: u64,
    /// Chunk size of its pool (from the size of its first mapping).
    chunk: u64,
    /// Bytes mapped in it now.
    mapped: u64,
}

impl Reservation {
    fn base(&self) -> u64 {
        self.life.base
    }

    /// Everything was unmapped: the reservation was released.
    fn retired(&self) -> bool {
        self.life.released.is_some()
    }
}

/// When an address range (an expandable reservation or a segment) was in use: from the event
/// that made it to the one that released it.
#[derive(Clone, Copy, Debug)]
struct Life {
    base: u64,
    made: usize,
    released: Option<usize>,
}

impl Life {
    /// Whether both were in use at some point (the driver then gave them apart).
    fn overlaps(&self, other: &Life) -> bool {
        other.made <= self.released.unwrap_or(usize::MAX)
            && self.made <= other.released.unwrap_or(usize::MAX)
    }
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

/// Under which settings the release run right after the `free_completed` event at `done` can be
/// one that does not synchronize:
/// - with garbage collection, `garbage_collect_cached_blocks`: a request that finds no cached
///   block first releases old cached segments while the bytes reserved are above the threshold,
///   then makes a new segment;
/// - otherwise, under `max_split_size`, `release_available_cached_blocks`: a request that finds no
///   cached block and no room first releases just enough oversize cached blocks (each at least
///   `max_split_size`) and tries again.
///
/// A block freed right before such a run was free at once, not held back until a synchronization.
/// A run that ends in an `oom` (or, under `max_split_size` alone, also releases smaller segments)
/// was `release_cached_blocks`, which synchronizes first.
fn released_without_synchronizing(trace: &[TraceEntry], done: usize) -> AtOnce {
    let collecting = matches!(release_run_end(trace, done + 1), RunEnd::Segment(_));
    let mut smallest: Option<u64> = None;
    let mut splitting_from = 0;
    for e in trace[done + 1..].iter().filter(|e| !is_note(&e.action)) {
        if e.action != TraceAction::SegmentFree {
            if e.action == TraceAction::SegmentAlloc {
                splitting_from = smallest.unwrap_or(0);
            }
            break;
        }
        smallest = Some(smallest.map_or(e.size, |s| s.min(e.size)));
    }
    AtOnce::new(collecting, splitting_from)
}

/// The segment size (PyTorch's `get_allocation_size`) of the first request at or after event `i`.
fn next_request_segment(trace: &[TraceEntry], i: usize) -> Option<u64> {
    let request = trace[i..].iter().find(|e| e.action == TraceAction::Alloc)?;
    usize::try_from(request.size)
        .ok()
        .map(|size| allocation_size(size) as u64)
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
/// chunks, as the allocator reserves) ends before the next recorded address above it in use at the
/// same time; `None` when nothing lies above any reservation.
fn capacity_bound(reservations: &[Reservation], segments: &[Life]) -> Option<u64> {
    let mut bound: Option<u64> = None;
    for r in reservations {
        // Only ranges in use while this one was: a range made after it was released (the driver
        // reuses address space) says nothing of its size.
        let next = reservations
            .iter()
            .map(|o| &o.life)
            .chain(segments)
            .filter(|o| o.base > r.base() && r.life.overlaps(o))
            .map(|o| o.base)
            .min();
        let Some(next) = next else { continue };
        let room = (next - r.base()) / r.chunk * r.chunk;
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
