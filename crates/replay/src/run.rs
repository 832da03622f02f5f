//! Running one device's plan through a fresh allocator.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::check::{Check, DivergenceKind, ExpectedStats, SegmentCheck, StatsCheck};
use super::device::{AddressUse, ReplayDevice};
use super::plan::{DevicePlan, Op, ReleaseRun, RestorePlan};
use super::pools::PoolRun;
use super::timeline::{Sampler, Timeline};
use super::{Error, Result, RunOptions};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::device::{Device, DeviceAddress};
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::stats::MemoryStats;
use tensormem_cuda_alloc::Error as AllocError;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, PoolCheckpoint, DEFAULT_STREAM_CAPACITY};

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
/// before the run.
fn release_was_external(
    allocator: &CachingAllocator<ReplayDevice>,
    config: &AllocatorConfig,
    run: ReleaseRun,
) -> bool {
    let Some(segment) = run.next_segment else {
        return true;
    };
    let gc = config.garbage_collection_threshold > 0.0 && config.per_process_memory_fraction < 1.0;
    if gc {
        return false;
    }
    if room(allocator, config) >= segment {
        return true;
    }
    run.next_alloc.is_some_and(|(size, stream)| {
        usize::try_from(size).is_ok_and(|size| allocator.would_serve_from_cache(size, stream))
    })
}

/// Bytes the allocator could obtain from the device right now: the device's free memory, within
/// the memory fraction's limit when one is set.
fn room(allocator: &CachingAllocator<ReplayDevice>, config: &AllocatorConfig) -> u64 {
    let Ok(info) = allocator.device().mem_info() else {
        return 0;
    };
    let mut room = info.free;
    if config.per_process_memory_fraction < 1.0 {
        let allowed = (config.per_process_memory_fraction * info.total as f64) as u64;
        room = room.min(allowed.saturating_sub(allocator.reserved_bytes()));
    }
    room
}

/// Replays `plan` under `options`; `events_before` is the number of events of earlier devices (for
/// progress); `expected` the statistics to compare with, for this device.
pub(crate) fn run_device(
    plan: &DevicePlan,
    options: &RunOptions<'_>,
    default_capacity: u64,
    events_before: u64,
    expected: Option<&ExpectedStats>,
    pools: &mut PoolRun,
) -> Result<DeviceRun> {
    let device_index = plan.device;
    let capacity = options.capacity.unwrap_or(default_capacity);
    let device = ReplayDevice::new(
        u32::try_from(device_index).unwrap_or(u32::MAX),
        capacity,
        plan.malloc_addrs.iter().copied(),
        plan.reserve_addrs.iter().copied(),
    );
    let allocator = CachingAllocator::with_stream_capacity(
        device,
        options.config.clone(),
        DEFAULT_STREAM_CAPACITY.max(plan.streams + 1),
    );
    if options.record_history {
        allocator.record_history(true, plan.events.saturating_mul(2).max(1));
    }
    let fail = |event: u32, source: AllocError| Error::Allocator {
        device: device_index,
        event: event as usize,
        source,
    };

    let mut slots: Vec<Option<Allocation>> = Vec::with_capacity(plan.slots);
    slots.resize_with(plan.slots, || None);
    let mut check = options.check.then(Check::default);
    let mut sampler = Sampler::new(plan.ops.len(), options.timeline_points);
    let mut figures = Figures::default();
    let mut refused = 0u64;
    let mut allocs = 0usize;
    let mut checkpoints: Vec<Vec<PoolCheckpoint>> = vec![Vec::new(); plan.restores.len()];
    let mut restoring: Option<Restoring> = None;
    let mut restores = RestoreCount::default();
    // Handles of restored blocks no recorded allocation claimed (a restore that differed).
    let mut strays: Vec<Allocation> = Vec::new();

    let started = Instant::now();
    for (i, (op, &event)) in plan.ops.iter().zip(&plan.op_events).enumerate() {
        match *op {
            Op::Alloc {
                size,
                stream,
                slot,
                instance,
            } => {
                let expected = plan.expected[allocs];
                let pool = pools.pool_for(plan, &allocator, instance, allocs, size, stream);
                allocs += 1;
                let restored = restoring
                    .as_mut()
                    .filter(|r| event < r.end)
                    .map(|r| r.take(expected.addr));
                let landed = match restored {
                    // A block the restore made: live in the checkpoint (its handle), or free in it
                    // (made and freed again by the restore).
                    Some(Restored::Live(a)) => {
                        figures.allocated += a.size() as u64;
                        figures.requested += a.requested_size() as u64;
                        let ptr = a.ptr().0;
                        slots[slot as usize] = Some(a);
                        ptr
                    }
                    Some(Restored::Free) => expected.addr,
                    Some(Restored::Missing) => 0,
                    None => {
                        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
                        match pools.allocate(&allocator, pool, bytes, stream) {
                            Ok(a) => {
                                figures.allocated += a.size() as u64;
                                figures.requested += a.requested_size() as u64;
                                let ptr = a.ptr().0;
                                slots[slot as usize] = Some(a);
                                ptr
                            }
                            Err(AllocError::OutOfMemory(_) | AllocError::TooLarge { .. }) => {
                                refused += 1;
                                0
                            }
                            Err(e) => return Err(fail(event, e)),
                        }
                    }
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
                    pools.landed_elsewhere(pool, landed);
                    if pools.stopped() {
                        break;
                    }
                }
                if let Some(check) = &mut check {
                    check.allocations += 1;
                    if landed != expected.addr {
                        check.address_mismatches += 1;
                        check.diverged(
                            device_index,
                            event as usize,
                            DivergenceKind::Address {
                                size,
                                stream,
                                recorded: expected.addr,
                                replayed: landed,
                            },
                        );
                    }
                    let reserved = allocator.reserved_bytes();
                    if reserved != expected.reserved {
                        check.reserved_mismatches += 1;
                        check.diverged(
                            device_index,
                            event as usize,
                            DivergenceKind::Reserved {
                                recorded: expected.reserved,
                                replayed: reserved,
                            },
                        );
                    }
                }
            }
            Op::Free { slot, held_on } => {
                if let Some(a) = slots[slot as usize].take() {
                    let (size, requested) = (a.size() as u64, a.requested_size() as u64);
                    if let Some(stream) = held_on {
                        allocator
                            .record_stream(&a, stream)
                            .map_err(|e| fail(event, e))?;
                        figures.held.insert(stream.0, requested);
                    } else {
                        figures.requested -= requested;
                    }
                    allocator.free(a).map_err(|e| fail(event, e))?;
                    figures.allocated -= size;
                }
            }
            Op::Complete { stream, .. } => {
                allocator.device().sim().complete_stream_work(stream);
                if let Some(requested) = figures.held.remove(&stream.0) {
                    figures.requested -= requested;
                }
            }
            Op::Oom {
                size,
                stream,
                capacity: recorded_capacity,
                device_had_room,
                after_releases,
            } => {
                // Under a memory fraction, a failure the device had room for was the fraction's:
                // the device's size is the inferred one, not what was free at that moment.
                let fraction_failure =
                    device_had_room && options.config.per_process_memory_fraction < 1.0;
                if options.capacity.is_none() && !fraction_failure {
                    allocator.device().sim().set_capacity(recorded_capacity);
                }
                let bytes = usize::try_from(size).unwrap_or(usize::MAX);
                let pool = pools.oom_pool(&allocator, bytes, stream, after_releases);
                match pools.request(&allocator, pool, bytes, stream) {
                    Ok(a) => {
                        // The program went on without this memory: give it back at once.
                        allocator.free(a).map_err(|e| fail(event, e))?;
                        if let Some(check) = &mut check {
                            check.diverged(
                                device_index,
                                event as usize,
                                DivergenceKind::OomNotReproduced { size },
                            );
                        }
                    }
                    Err(AllocError::OutOfMemory(_) | AllocError::TooLarge { .. }) => refused += 1,
                    Err(e) => return Err(fail(event, e)),
                }
            }
            Op::Checkpoint { restore } => {
                let restore = restore as usize;
                if let Some(pool) = pools.restored_pool(&plan.restores[restore]) {
                    if let Ok(checkpoint) = allocator.get_checkpoint_state(pool) {
                        checkpoints[restore].push(checkpoint);
                    }
                }
            }
            Op::Restore { restore } => {
                if let Some(mut done) = restoring.take() {
                    strays.extend(done.live.drain().map(|(_, a)| a));
                }
                let restore = restore as usize;
                let candidates = std::mem::take(&mut checkpoints[restore]);
                restoring = apply_restore(&allocator, pools, &plan.restores[restore], &candidates);
                match (&restoring, pools.restored_pool(&plan.restores[restore])) {
                    (Some(_), _) => restores.applied += 1,
                    (None, Some(_)) => restores.not_applied += 1,
                    // Graph trees restore private pools only: blocks cut like a restore's in
                    // segments of the default pools were ordinary requests.
                    (None, None) => {}
                }
            }
            Op::ReleaseStarts { set } => {
                pools.release_starts(plan, &allocator, &plan.release_sets[set as usize]);
            }
            Op::Release { run } => {
                let run = plan.releases[run as usize];
                if release_was_external(&allocator, &options.config, run) {
                    match pools.only_private(&plan.release_sets[run.set as usize]) {
                        // Only private pools' segments: `empty_cache` of those pools (a
                        // `MemPool` emptied or destroyed).
                        Some(private) => {
                            for pool in private {
                                allocator
                                    .empty_pool_cache(pool)
                                    .map_err(|e| fail(event, e))?;
                            }
                        }
                        None => allocator.empty_cache().map_err(|e| fail(event, e))?,
                    }
                }
            }
        }
        sampler.observe(
            u64::from(event),
            figures.allocated,
            allocator.reserved_bytes(),
            figures.requested,
        );
        if i % PROGRESS_EVERY == 0 {
            if let Some(progress) = options.progress {
                progress(events_before + u64::from(event));
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();

    let stats = allocator.memory_stats();
    let want_segments = check.is_some() || options.snapshot;
    let snapshot = want_segments.then(|| allocator.snapshot());
    if let (Some(check), Some(snapshot)) = (&mut check, &snapshot) {
        check.segments = Some(SegmentCheck::compare(&snapshot.segments, &plan.segments));
        if let Some(expected) = expected {
            check.stats = Some(StatsCheck::compare(&stats.to_flat(), expected));
        }
    }
    allocator
        .check_invariants()
        .map_err(|source| Error::Invariant {
            device: device_index,
            source,
        })?;
    // Blocks the trace never freed were live when it ended; the allocator (dropped with this
    // function) returns their memory, so their handles are given up rather than freed.
    if let Some(mut done) = restoring.take() {
        strays.extend(done.live.drain().map(|(_, a)| a));
    }
    for allocation in slots.into_iter().flatten().chain(strays) {
        let _ = allocation.into_ptr();
    }
    Ok(DeviceRun {
        device: device_index,
        stats,
        capacity,
        addresses: allocator.device().address_use(),
        refused,
        unmatched_frees: plan.unmatched_frees,
        timeline: sampler.finish(),
        check,
        snapshot: if options.snapshot { snapshot } else { None },
        seconds,
        restores,
        async_model: None,
    })
}

/// Checkpoint restores of CUDA graph trees (`setCheckpointPoolState`) a device's trace shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreCount {
    /// Restores the replay made through the allocator's checkpoint API.
    pub applied: u64,
    /// Restores replayed as ordinary allocations: no checkpoint the replay took agreed with the
    /// trace (or the pool could not be checkpointed: expandable segments). Runs of events shaped
    /// like a restore in segments that are not one private pool's are not counted.
    pub not_applied: u64,
}

/// A restore in progress: the blocks it made, claimed by the recorded allocations of its events.
struct Restoring {
    /// One past its last event.
    end: u32,
    /// Blocks live in the checkpoint, by address.
    live: HashMap<u64, Allocation>,
    /// The blocks free in the checkpoint, by address (made and freed again by the restore).
    free: HashSet<u64>,
}

/// What a restore made at one recorded allocation's address.
enum Restored {
    Live(Allocation),
    Free,
    Missing,
}

impl Restoring {
    fn take(&mut self, addr: u64) -> Restored {
        if let Some(a) = self.live.remove(&addr) {
            Restored::Live(a)
        } else if self.free.contains(&addr) {
            Restored::Free
        } else {
            Restored::Missing
        }
    }
}

/// Restores the pool of `restore` to the latest of `candidates` that agrees with it: the same
/// pool, as many segments, the same live blocks. Only a private pool with nothing allocated is
/// restored (its blocks were freed by the events before the restore, as PyTorch frees them).
/// `None` when none applies: the restore's events are then replayed as requests.
fn apply_restore(
    allocator: &CachingAllocator<ReplayDevice>,
    pools: &PoolRun,
    restore: &RestorePlan,
    candidates: &[PoolCheckpoint],
) -> Option<Restoring> {
    let pool = pools.restored_pool(restore)?;
    if !allocator
        .check_pool_live_allocations(pool, &HashSet::new())
        .unwrap_or(false)
    {
        return None;
    }
    let live: Vec<DeviceAddress> = restore
        .live
        .iter()
        .map(|&(addr, _)| DeviceAddress(addr))
        .collect();
    let checkpoint = candidates.iter().rev().find(|c| {
        c.pool() == pool
            && c.segment_count() == restore.instances.len()
            && c.live_allocations() == live
    })?;
    let delta = match allocator.set_checkpoint_pool_state(checkpoint) {
        Ok(delta) => delta,
        Err(e) => {
            tracing::debug!(%pool, error = %e, "a checkpoint restore was refused");
            return None;
        }
    };
    let live: HashMap<u64, Allocation> =
        delta.created.into_iter().map(|a| (a.ptr().0, a)).collect();
    let exact = live.len() == restore.live.len()
        && restore
            .live
            .iter()
            .all(|&(addr, size)| live.get(&addr).is_some_and(|a| a.size() as u64 == size));
    Some(Restoring {
        end: restore.end,
        live,
        // Blocks free in the checkpoint are known to sit where the trace has them only when the
        // live ones do.
        free: if exact {
            restore.free.iter().copied().collect()
        } else {
            HashSet::new()
        },
    })
}
