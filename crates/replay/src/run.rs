//! Running one device's plan through a fresh allocator.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::time::Instant;

use super::capacity::LimitPhase;
use super::check::{Check, DivergenceKind, ExpectedStats, SegmentCheck, StatsCheck};
use super::device::{AddressUse, ReplayDevice};
use super::plan::{AtOnce, DevicePlan, Expected, Op, ReleaseRun};
use super::pools::PoolRun;
use super::settings_phases::SettingsPhase;
use super::timeline::{Sampler, Timeline};

mod restoring;

use super::{Error, Result, RunOptions};
pub use restoring::RestoreCount;
use restoring::{Restored, Restoring};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::device::{Device, StreamId};
use tensormem_cuda_alloc::size::allocation_size;
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::stats::MemoryStats;
use tensormem_cuda_alloc::Error as AllocError;
use tensormem_cuda_alloc::{
    Allocation, CachingAllocator, MempoolId, PoolCheckpoint, DEFAULT_STREAM_CAPACITY,
};

/// How often (in operations) the progress callback is called.
const PROGRESS_EVERY: usize = 1 << 13;

/// What one device's replay produced.
#[derive(Clone, Debug)]
pub struct DeviceRun {
    /// The device index (position in the snapshot's `device_traces`).
    pub device: usize,
    /// The allocator's statistics at the end (`torch.cuda.memory_stats(device)`).
    pub stats: MemoryStats,
    /// The simulated device's memory, in bytes.
    pub capacity: u64,
    /// How new segments were placed: at recorded or invented addresses.
    pub addresses: AddressUse,
    /// Allocations the replay could not make (out of memory); their frees are skipped.
    pub refused: u64,
    /// Frees of blocks the trace never allocated (it starts mid-run); skipped.
    pub unmatched_frees: usize,
    /// Allocated, reserved and requested bytes over the trace.
    pub timeline: Timeline,
    /// The comparison with the record (runs under the recorded configuration).
    pub check: Option<Check>,
    /// The allocator's final snapshot, when asked for.
    pub snapshot: Option<Snapshot>,
    /// Seconds spent replaying the events (the allocator's work, without setup and checks).
    pub seconds: f64,
    /// Checkpoint restores of CUDA graph trees found in the trace, and how they were replayed.
    pub restores: RestoreCount,
    /// For a run under `backend:cudaMallocAsync` (the driver's pool modelled, not replayed; see
    /// [`crate::async_model`]): which figures are bounds, and what the model found about running
    /// out of memory. `None` for replays of the native allocator.
    pub async_model: Option<crate::AsyncBounds>,
    /// Per recorded run of releases ([`DevicePlan::releases`]), whether this replay made it as
    /// the program's `empty_cache()` (else it was left to the allocator).
    pub(crate) releases_external: Vec<bool>,
}

/// Running figures for the timeline.
#[derive(Default)]
struct Figures {
    allocated: u64,
    requested: u64,
    /// Requested bytes of blocks held back on a synthetic stream, by stream.
    held: HashMap<u64, u64>,
}

/// Whether a recorded run of releases was `torch.cuda.empty_cache()` rather than the allocator's own
/// doing inside the allocation that follows (see [`ReleaseRun`]), judged on the replay's state
/// before the run, under the garbage collection `threshold` and the memory fraction `fraction` in
/// force then.
fn release_was_external(
    allocator: &CachingAllocator<ReplayDevice>,
    threshold: f64,
    fraction: f64,
    run: ReleaseRun,
) -> bool {
    let gc = threshold > 0.0 && fraction < 1.0;
    let Some(segment) = run.next_segment else {
        // Nothing mapped after the releases: the program's, unless the next request's first look
        // in the cache failed and its segment size did not fit under the memory fraction. The
        // allocator checks the limit before it looks at expandable segments, so it releases the
        // cache and retries even where the request then takes memory already mapped.
        let retried = !gc
            && fraction < 1.0
            && run.next_alloc.is_some_and(|(size, stream)| {
                usize::try_from(size).is_ok_and(|bytes| {
                    !allocator.would_serve_from_cache(bytes, stream)
                        && room(allocator, fraction) < allocation_size(bytes) as u64
                })
            });
        return !retried;
    };
    if gc {
        return false;
    }
    if room(allocator, fraction) >= segment {
        return true;
    }
    run.next_alloc.is_some_and(|(size, stream)| {
        usize::try_from(size).is_ok_and(|size| allocator.would_serve_from_cache(size, stream))
    })
}

/// Bytes the allocator could obtain from the device right now: the device's free memory, within
/// the memory fraction's limit when one is set.
fn room(allocator: &CachingAllocator<ReplayDevice>, fraction: f64) -> u64 {
    let Ok(info) = allocator.device().mem_info() else {
        return 0;
    };
    let mut room = info.free;
    if fraction < 1.0 {
        let allowed = (fraction * info.total as f64) as u64;
        room = room.min(allowed.saturating_sub(allocator.reserved_bytes()));
    }
    room
}

/// The settings the recorded program ran under, by which its frees are read ([`AtOnce`]): each
/// phase's from its first event, the recorded configuration's before the first (or throughout,
/// without phases). A what-if run keeps them: they are facts about the recorded run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProgramSettings<'a> {
    pub(crate) recorded: &'a AllocatorConfig,
    pub(crate) phases: &'a [SettingsPhase],
}

/// How a configuration reads a free completed right before a run of releases: its
/// `max_split_size` and whether it collects garbage (see [`AtOnce::holds`]).
fn reading(config: &AllocatorConfig) -> (usize, bool) {
    (
        config.max_split_size,
        config.garbage_collection_threshold > 0.0,
    )
}

/// What the program changed while it ran, as the replay infers it, and how far to replay.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule<'a> {
    /// The memory fraction, changed at each phase's first event (empty when the program set
    /// none, or the run names its own fraction).
    pub(crate) limits: &'a [LimitPhase],
    /// The allocator settings, changed at each phase's first event (empty when they did not
    /// change, or the run names its own).
    pub(crate) settings: &'a [SettingsPhase],
    /// Stop at the first allocation that departs from the record (a run that only asks how far
    /// a hypothesis explains the trace).
    pub(crate) stop_at_divergence: bool,
    /// Per recorded run of releases, whether it was the program's `empty_cache()`, as the replay
    /// under the recorded configuration judged it: a fact about the recorded run, which a what-if
    /// run keeps (under other settings the replay's own state would judge it otherwise). `None`:
    /// judged by this replay.
    pub(crate) releases_external: Option<&'a [bool]>,
    /// The settings the program ran under.
    pub(crate) program: ProgramSettings<'a>,
}

/// Replays `plan` under `options`, with what the program changed while it ran applied where
/// `schedule` says; `events_before` is the number of events of earlier devices (for progress);
/// `expected` the statistics to compare with, for this device.
pub(crate) fn run_device(
    plan: &DevicePlan,
    options: &RunOptions<'_>,
    default_capacity: u64,
    schedule: Schedule<'_>,
    events_before: u64,
    expected: Option<&ExpectedStats>,
    pools: &mut PoolRun,
) -> Result<DeviceRun> {
    let capacity = options.capacity.unwrap_or(default_capacity);
    // Settings in force from the start make the allocator (some figures keep the settings it was
    // made with, as PyTorch's do).
    let config = match schedule.settings.first() {
        Some(phase) if phase.from_event == 0 => &phase.config,
        _ => &options.config,
    };
    let mut replayer = Replayer::new(plan, options, config, capacity, pools);
    replayer.pools.make_pools(&replayer.allocator);
    replayer.limits = schedule.limits;
    replayer.settings = schedule.settings;
    replayer.stop_at_divergence = schedule.stop_at_divergence;
    replayer.releases_external = schedule.releases_external;
    replayer.program = schedule.program.phases;
    replayer.read_as = reading(schedule.program.recorded);
    let started = Instant::now();
    replayer.replay_ops(events_before)?;
    let seconds = started.elapsed().as_secs_f64();
    replayer.finish(capacity, seconds, expected)
}

/// The allocator `plan` is replayed through: fresh, on a simulated device of `capacity` bytes
/// that gives new segments and expandable reservations the recorded addresses, with room for
/// every stream of the trace, recording its history when `options` asks.
fn new_allocator(
    plan: &DevicePlan,
    options: &RunOptions<'_>,
    config: &AllocatorConfig,
    capacity: u64,
) -> CachingAllocator<ReplayDevice> {
    let device = ReplayDevice::new(
        u32::try_from(plan.device).unwrap_or(u32::MAX),
        capacity,
        plan.malloc_addrs.iter().copied(),
        plan.reserve_addrs.iter().copied(),
    );
    let allocator = CachingAllocator::with_stream_capacity(
        device,
        config.clone(),
        DEFAULT_STREAM_CAPACITY.max(plan.streams + 1),
    );
    if options.record_history {
        allocator.record_history(true, plan.events.saturating_mul(2).max(1));
    }
    allocator
}

/// One device's replay in progress: its allocator, and what the ops replayed so far left.
struct Replayer<'a, 'o> {
    plan: &'a DevicePlan,
    options: &'a RunOptions<'o>,
    pools: &'a mut PoolRun,
    allocator: CachingAllocator<ReplayDevice>,
    /// The live allocations, by slot.
    slots: Vec<Option<Allocation>>,
    check: Option<Check>,
    sampler: Sampler,
    figures: Figures,
    refused: u64,
    /// Allocations replayed so far (the index of the next one in [`DevicePlan::expected`]).
    allocs: usize,
    /// Per restore, the checkpoints taken of its pool.
    checkpoints: Vec<Vec<PoolCheckpoint>>,
    restoring: Option<Restoring>,
    restores: RestoreCount,
    /// Handles of restored blocks no recorded allocation claimed (a restore that differed).
    strays: Vec<Allocation>,
    /// The memory fraction in force.
    fraction: f64,
    /// The garbage collection threshold in force.
    garbage_collection_threshold: f64,
    /// The limits the program set while it ran, by the event they start at; the next one to
    /// apply is the first.
    limits: &'a [LimitPhase],
    /// The settings the program set while it ran, likewise.
    settings: &'a [SettingsPhase],
    /// Whether to stop at the first divergence from the record.
    stop_at_divergence: bool,
    /// How the recorded runs of releases were judged, when given (see [`Schedule`]).
    releases_external: Option<&'a [bool]>,
    /// How this replay judged them.
    judged: Vec<bool>,
    /// The settings the program ran under from the next phase on (see [`ProgramSettings`]).
    program: &'a [SettingsPhase],
    /// How frees are read at this point ([`reading`]).
    read_as: (usize, bool),
}

impl<'a, 'o> Replayer<'a, 'o> {
    /// A replay of `plan` about to start under `config`: a fresh allocator ([`new_allocator`]), every slot
    /// empty, nothing checked or sampled yet.
    fn new(
        plan: &'a DevicePlan,
        options: &'a RunOptions<'o>,
        config: &AllocatorConfig,
        capacity: u64,
        pools: &'a mut PoolRun,
    ) -> Self {
        let mut slots: Vec<Option<Allocation>> = Vec::with_capacity(plan.slots);
        slots.resize_with(plan.slots, || None);
        Replayer {
            plan,
            options,
            pools,
            allocator: new_allocator(plan, options, config, capacity),
            slots,
            check: options.check.then(Check::default),
            sampler: Sampler::new(plan.ops.len(), options.timeline_points),
            figures: Figures::default(),
            refused: 0,
            allocs: 0,
            checkpoints: vec![Vec::new(); plan.restores.len()],
            restoring: None,
            restores: RestoreCount::default(),
            strays: Vec::new(),
            fraction: options.config.per_process_memory_fraction,
            garbage_collection_threshold: config.garbage_collection_threshold,
            limits: &[],
            settings: &[],
            stop_at_divergence: false,
            releases_external: None,
            judged: vec![false; plan.releases.len()],
            program: &[],
            read_as: reading(config),
        }
    }

    /// The allocator's failure at `event`, other than running out of memory.
    fn fail(&self, event: u32, source: AllocError) -> Error {
        Error::Allocator {
            device: self.plan.device,
            event: event as usize,
            source,
        }
    }

    /// Replays the plan's ops in order, sampling the timeline after each and reporting progress
    /// now and then; stops early when the pool inference has seen enough.
    fn replay_ops(&mut self, events_before: u64) -> Result<()> {
        let plan = self.plan;
        for (i, (op, &event)) in plan.ops.iter().zip(&plan.op_events).enumerate() {
            self.follow_program(event)?;
            if self.op(*op, event)?.is_break() {
                break;
            }
            if self.stop_at_divergence
                && self.check.as_ref().is_some_and(|c| c.divergence.is_some())
            {
                break;
            }
            self.sampler.observe(
                u64::from(event),
                self.figures.allocated,
                self.allocator.reserved_bytes(),
                self.figures.requested,
            );
            if i % PROGRESS_EVERY == 0 {
                if let Some(progress) = self.options.progress {
                    progress(events_before + u64::from(event));
                }
            }
        }
        Ok(())
    }

    /// Replays one op (of trace event `event`).
    fn op(&mut self, op: Op, event: u32) -> Result<ControlFlow<()>> {
        match op {
            Op::Alloc {
                size,
                stream,
                slot,
                instance,
            } => return self.alloc(event, size, stream, slot, instance),
            Op::Free {
                slot,
                held_on,
                at_once,
            } => {
                let held_on = held_on.filter(|_| !self.completed_at_once(at_once));
                self.free(event, slot, held_on)?;
            }
            Op::Complete { stream, .. } => self.complete(stream),
            Op::Oom {
                size,
                stream,
                capacity,
                device_had_room,
                after_releases,
            } => {
                self.follow_recorded_capacity(capacity, device_had_room);
                self.oom(event, size, stream, after_releases)?;
            }
            Op::Checkpoint { restore } => self.checkpoint(restore as usize),
            Op::Restore { restore } => self.restore(restore as usize),
            Op::ReleaseStarts { set } => {
                let plan = self.plan;
                self.pools
                    .release_starts(plan, &self.allocator, &plan.release_sets[set as usize]);
            }
            Op::Release { run } => self.release(event, run as usize)?,
        }
        Ok(ControlFlow::Continue(()))
    }

    /// An allocation of `size` bytes on `stream` into `slot` (landing in the recorded segment
    /// `instance` in the record): in the pool the inference gives it, made by the restore in
    /// progress or by the allocator; where it landed is compared with the record. Breaks when
    /// the pool inference stops at a contradiction.
    fn alloc(
        &mut self,
        event: u32,
        size: u64,
        stream: StreamId,
        slot: u32,
        instance: u32,
    ) -> Result<ControlFlow<()>> {
        let expected = self.plan.expected[self.allocs];
        let pool = self.pools.pool_for(
            self.plan,
            &self.allocator,
            instance,
            self.allocs,
            size,
            stream,
        );
        self.allocs += 1;
        let restored = self
            .restoring
            .as_mut()
            .filter(|r| event < r.end)
            .map(|r| r.take(expected.addr));
        let landed = match restored {
            // A block the restore made: live in the checkpoint (its handle), or free in it (made
            // and freed again by the restore).
            Some(Restored::Live(a)) => self.keep(slot, a),
            Some(Restored::Free) => expected.addr,
            Some(Restored::Missing) => 0,
            None => self.allocate(event, pool, size, stream, slot)?,
        };
        if landed != expected.addr && landed != 0 {
            tracing::trace!(
                event,
                size,
                %pool,
                recorded = format_args!("{:#x}", expected.addr),
                replayed = format_args!("{landed:#x}"),
                "allocation landed elsewhere than recorded"
            );
            self.pools.landed_elsewhere(pool, landed);
            if self.pools.stopped() {
                return Ok(ControlFlow::Break(()));
            }
        }
        self.check_alloc(event, size, stream, expected, landed);
        Ok(ControlFlow::Continue(()))
    }

    /// Keeps `a` in `slot`; its address.
    fn keep(&mut self, slot: u32, a: Allocation) -> u64 {
        self.figures.allocated += a.size() as u64;
        self.figures.requested += a.requested_size() as u64;
        let ptr = a.ptr().0;
        self.slots[slot as usize] = Some(a);
        ptr
    }

    /// Asks the allocator for `size` bytes on `stream` in `pool`, kept in `slot`: the address, or 0
    /// when the device has no memory for them (counted as refused).
    fn allocate(
        &mut self,
        event: u32,
        pool: MempoolId,
        size: u64,
        stream: StreamId,
        slot: u32,
    ) -> Result<u64> {
        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
        match self.pools.allocate(&self.allocator, pool, bytes, stream) {
            Ok(a) => Ok(self.keep(slot, a)),
            Err(AllocError::OutOfMemory(_) | AllocError::TooLarge { .. }) => {
                self.refused += 1;
                Ok(0)
            }
            Err(e) => Err(self.fail(event, e)),
        }
    }

    /// Compares the allocation of `event` (landed at `landed`, 0: nowhere) and the bytes reserved
    /// after it with what the trace recorded, when the run is checked.
    fn check_alloc(
        &mut self,
        event: u32,
        size: u64,
        stream: StreamId,
        expected: Expected,
        landed: u64,
    ) {
        let Some(check) = &mut self.check else {
            return;
        };
        let device = self.plan.device;
        check.allocations += 1;
        if landed != expected.addr {
            check.address_mismatches += 1;
            check.diverged(
                device,
                event as usize,
                DivergenceKind::Address {
                    size,
                    stream,
                    recorded: expected.addr,
                    replayed: landed,
                },
            );
        }
        let reserved = self.allocator.reserved_bytes();
        if reserved != expected.reserved {
            check.reserved_mismatches += 1;
            check.diverged(
                device,
                event as usize,
                DivergenceKind::Reserved {
                    recorded: expected.reserved,
                    replayed: reserved,
                },
            );
        }
    }

    /// Frees the allocation in `slot` (nothing when it was refused), first recorded as used on the
    /// synthetic stream `held_on` when the trace held it back.
    fn free(&mut self, event: u32, slot: u32, held_on: Option<StreamId>) -> Result<()> {
        let Some(a) = self.slots[slot as usize].take() else {
            return Ok(());
        };
        let (size, requested) = (a.size() as u64, a.requested_size() as u64);
        if let Some(stream) = held_on {
            self.allocator
                .record_stream(&a, stream)
                .map_err(|e| self.fail(event, e))?;
            self.figures.held.insert(stream.0, requested);
        } else {
            self.figures.requested -= requested;
        }
        self.allocator.free(a).map_err(|e| self.fail(event, e))?;
        self.figures.allocated -= size;
        Ok(())
    }

    /// The work of synthetic stream `stream` completes: the block it held back returns to its pool
    /// at the next allocation.
    fn complete(&mut self, stream: StreamId) {
        self.allocator.device().sim().complete_stream_work(stream);
        if let Some(requested) = self.figures.held.remove(&stream.0) {
            self.figures.requested -= requested;
        }
    }

    /// Before the op of trace event `event`: the memory fraction and the settings of the phases
    /// that start by then, as the program set them.
    fn follow_program(&mut self, event: u32) -> Result<()> {
        while let Some((phase, rest)) = self.program.split_first() {
            if phase.from_event > event as usize {
                break;
            }
            self.program = rest;
            self.read_as = reading(&phase.config);
        }
        while let Some((phase, rest)) = self.limits.split_first() {
            if phase.from_event > event as usize {
                break;
            }
            self.limits = rest;
            self.allocator
                .set_memory_fraction(phase.fraction)
                .map_err(|e| self.fail(event, e))?;
            self.fraction = phase.fraction;
        }
        while let Some((phase, rest)) = self.settings.split_first() {
            if phase.from_event > event as usize {
                break;
            }
            self.settings = rest;
            self.allocator
                .set_settings(&phase.config)
                .map_err(|e| self.fail(event, e))?;
            self.garbage_collection_threshold = phase.config.garbage_collection_threshold;
        }
        Ok(())
    }

    /// Whether a free the trace holds until the next release run completed at once, under the
    /// settings the program ran under then.
    fn completed_at_once(&self, at_once: AtOnce) -> bool {
        let (max_split_size, collects) = self.read_as;
        at_once.holds(max_split_size, collects)
    }

    /// Before a recorded `oom`: the device's memory becomes what the record implies
    /// (`recorded_capacity`), unless the caller set it or the failure was the memory fraction's
    /// (under a fraction, a failure the device had room for says nothing of the device's size).
    fn follow_recorded_capacity(&mut self, recorded_capacity: u64, device_had_room: bool) {
        let fraction_failure = device_had_room && self.fraction < 1.0;
        if self.options.capacity.is_none() && !fraction_failure {
            self.allocator
                .device()
                .sim()
                .set_capacity(recorded_capacity);
        }
    }

    /// A request that failed in the recorded run, made in the pool it was likely for: refused as
    /// recorded, or (a divergence) served and given back at once.
    fn oom(&mut self, event: u32, size: u64, stream: StreamId, after_releases: bool) -> Result<()> {
        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
        let pool = self
            .pools
            .oom_pool(&self.allocator, bytes, stream, after_releases);
        match self.pools.request(&self.allocator, pool, bytes, stream) {
            Ok(a) => {
                // The program went on without this memory: give it back at once.
                self.allocator.free(a).map_err(|e| self.fail(event, e))?;
                if let Some(check) = &mut self.check {
                    check.diverged(
                        self.plan.device,
                        event as usize,
                        DivergenceKind::OomNotReproduced { size },
                    );
                }
            }
            Err(AllocError::OutOfMemory(_) | AllocError::TooLarge { .. }) => self.refused += 1,
            Err(e) => return Err(self.fail(event, e)),
        }
        Ok(())
    }

    /// A run of releases that did not end in an `oom`: `empty_cache()` (of the private pools
    /// whose segments it released, when those are all it released) if it was the program's, else
    /// nothing (the replayed allocator makes the releases itself).
    fn release(&mut self, event: u32, index: usize) -> Result<()> {
        let run = self.plan.releases[index];
        let external = match self.releases_external.and_then(|judged| judged.get(index)) {
            Some(&external) => external,
            None => release_was_external(
                &self.allocator,
                self.garbage_collection_threshold,
                self.fraction,
                run,
            ),
        };
        if let Some(judged) = self.judged.get_mut(index) {
            *judged = external;
        }
        if !external {
            return Ok(());
        }
        match self
            .pools
            .only_private(&self.plan.release_sets[run.set as usize])
        {
            // Only private pools' segments: `empty_cache` of those pools (a `MemPool` emptied or
            // destroyed).
            Some(private) => {
                for pool in private {
                    self.allocator
                        .empty_pool_cache(pool)
                        .map_err(|e| self.fail(event, e))?;
                }
            }
            None => self
                .allocator
                .empty_cache()
                .map_err(|e| self.fail(event, e))?,
        }
        Ok(())
    }

    /// The end of the replay: the allocator's statistics and snapshot, compared with the record
    /// when checked, its invariants checked, the handles of blocks still live given up.
    fn finish(
        mut self,
        capacity: u64,
        seconds: f64,
        expected: Option<&ExpectedStats>,
    ) -> Result<DeviceRun> {
        let stats = self.allocator.memory_stats();
        let want_segments = self.check.is_some() || self.options.snapshot;
        let snapshot = want_segments.then(|| self.allocator.snapshot());
        if let (Some(check), Some(snapshot)) = (&mut self.check, &snapshot) {
            check.segments = Some(SegmentCheck::compare(
                &snapshot.segments,
                &self.plan.segments,
            ));
            if let Some(expected) = expected {
                check.stats = Some(StatsCheck::compare(&stats.to_flat(), expected));
            }
        }
        self.allocator
            .check_invariants()
            .map_err(|source| Error::Invariant {
                device: self.plan.device,
                source,
            })?;
        // Blocks the trace never freed were live when it ended; the allocator (dropped with this
        // function) returns their memory, so their handles are given up rather than freed.
        if let Some(mut done) = self.restoring.take() {
            self.strays.extend(done.live.drain().map(|(_, a)| a));
        }
        for allocation in self.slots.drain(..).flatten().chain(self.strays.drain(..)) {
            let _ = allocation.into_ptr();
        }
        Ok(DeviceRun {
            device: self.plan.device,
            stats,
            capacity,
            addresses: self.allocator.device().address_use(),
            refused: self.refused,
            unmatched_frees: self.plan.unmatched_frees,
            timeline: self.sampler.finish(),
            check: self.check,
            snapshot: if self.options.snapshot {
                snapshot
            } else {
                None
            },
            seconds,
            restores: self.restores,
            async_model: None,
            releases_external: self.judged,
        })
    }
}
