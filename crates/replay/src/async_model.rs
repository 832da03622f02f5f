//! What a recorded run's memory would look like under `backend:cudaMallocAsync`: a model of the
//! driver's memory pool, not a replay.
//!
//! PyTorch's `cudaMallocAsync` backend (`c10/cuda/CUDAMallocAsyncAllocator.cpp`; tensormem's
//! `AsyncAllocator`) keeps no cache of its own: each request is a `cuMemAllocFromPoolAsync` of exactly
//! the requested size from the device's default memory pool, on the request's stream, and each free
//! a `cuMemFreeAsync` (on the allocation stream, or on a unifying stream made to wait for every
//! `record_stream`'d stream). Its `memory_stats()` has six figures, the rest zero:
//! `allocated_bytes.all` and `active_bytes.all` (current and peak) are the pool's *used* memory
//! (`cudaMemPoolAttrUsedMemCurrent` / `High`), `reserved_bytes.all` its *reserved* memory
//! (`ReservedMemCurrent` / `High`).
//!
//! A native trace records the program's requests, which do not depend on the backend; which free
//! range serves which request is the driver's decision, recorded nowhere. So, per device:
//!
//! - **used memory** is the live requested bytes: each `alloc` event's size, from the event to the
//!   block's `free_completed` (the work of every stream that used it done). The driver's
//!   documentation states no rounding of an allocation's size for these figures; the model takes the
//!   requested size;
//! - **reserved memory** is bounded from below only. The pool's backing is made of physical
//!   allocations ([`POOL_GRANULARITY`], 2 MiB on current GPUs, assumed: the documentation says only
//!   that they "may happen at different granularity from the user allocations"), so it holds at
//!   least the used memory rounded up to that. PyTorch sets the pool's release threshold to
//!   `u64::MAX`, so nothing goes back to the device at synchronisations: between two `empty_cache()`
//!   calls the pool holds at least the most it ever used. `empty_cache()` (a run of releases in the
//!   trace that no new segment follows, or one that the device had room for) trims the pool
//!   (`cudaMemPoolTrimTo(pool, 0)`), after which it holds at least the used memory rounded up. What
//!   it holds beyond that (fragmentation, memory kept for reuse across streams) is the driver's;
//! - **out of memory** is certain where the pool would need more than the device memory the record
//!   implies ([`Replay::default_capacity`](crate::Replay::default_capacity)) for the used memory
//!   rounded up; below that the driver's fragmentation decides, and the least room left
//!   ([`AsyncBounds::headroom`]) says how much it may take. A memory fraction set in the program
//!   (`torch.cuda.set_per_process_memory_fraction()`, implied by the trace's `oom` events) is
//!   PyTorch's own hard limit on the bytes it hands out, checked before the driver is called (freed
//!   bytes count off when `free` is called): its refusals are exact given the limit. The
//!   `per_process_memory_fraction` key of `PYTORCH_CUDA_ALLOC_CONF` is ignored by this backend;
//! - requests that failed in the recorded run (`oom` events) are tried again: one the device has
//!   room for is served and given back at once (the program went on without it), else refused;
//! - private pools: allocations of CUDA graph captures are the pool's like any other (PyTorch 2.11
//!   reports the default pool only, where a captured graph's memory is the graph-memory pool's once
//!   instantiated; later releases add it). `torch.cuda.MemPool` is refused by this backend.
//!
//! The result is a [`DeviceRun`] with these figures in its statistics, and what the model could not
//! know in [`DeviceRun::async_model`]:
//!
//! ```
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{CachingAllocator, StreamId};
//! use tensormem_replay::{Replay, ASYNC_LOWER_BOUNDS};
//!
//! // A native run with its history on: 3 MiB and 5 MiB live at once.
//! let allocator = CachingAllocator::new(SimDevice::new(1 << 30));
//! allocator.record_history(true, 100);
//! let a = allocator.allocate(3 << 20, StreamId(0))?;
//! let b = allocator.allocate(5 << 20, StreamId(0))?;
//! allocator.free(b)?;
//! allocator.free(a)?;
//!
//! let run = Replay::new(&allocator.snapshot())?.run_with("backend:cudaMallocAsync")?;
//! let stats = run.flat_stats();
//! assert_eq!(stats["allocated_bytes.all.peak"], 8 << 20); // the live requested bytes
//! assert_eq!(stats["reserved_bytes.all.peak"], 8 << 20); // at least this: the driver decides
//! assert_eq!(run.lower_bounds(), ASYNC_LOWER_BOUNDS);
//! assert_eq!(run.devices[0].async_model.as_ref().map(|b| b.ooms), Some(0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::time::Instant;

use crate::capacity::CapacityInference;
use crate::plan::{DevicePlan, Op};
use crate::run::{DeviceRun, RestoreCount};
use crate::timeline::Sampler;
use crate::{AddressUse, RunOptions};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::{TraceAction, TraceEntry};
use tensormem_cuda_alloc::stats::MemoryStats;

/// The granularity of the physical memory behind the driver's pool, assumed: 2 MiB, the minimum
/// allocation granularity `cuMemGetAllocationGranularity` reports for device memory on current
/// NVIDIA GPUs (the driver does not document the pool's own).
pub const POOL_GRANULARITY: u64 = 2 << 20;

/// The figures of an async-model run's statistics that are lower bounds (the driver decides the
/// rest); the other figures PyTorch fills (`allocated_bytes.all`, `active_bytes.all`) are the live
/// requested bytes.
pub const ASYNC_LOWER_BOUNDS: [&str; 2] = ["reserved_bytes.all.current", "reserved_bytes.all.peak"];

/// How often (in operations) the progress callback is called.
const PROGRESS_EVERY: usize = 1 << 13;

/// What the model of `backend:cudaMallocAsync` could not know about one device, and what it found
/// about running out of memory.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AsyncBounds {
    /// The physical granularity assumed for the pool ([`POOL_GRANULARITY`]).
    pub granularity: u64,
    /// `reserved_bytes.all.peak` is at least this (the peak of used memory rounded up to the
    /// granularity); the statistics carry this value.
    pub reserved_peak_at_least: u64,
    /// `reserved_bytes.all.current` at the end is at least this (the most used since the last
    /// `empty_cache()` the trace shows, rounded up); the statistics carry this value.
    pub reserved_current_at_least: u64,
    /// The device memory the model ran on at the end (the caller's, or what the record implies).
    pub capacity: u64,
    /// Whether the caller gave the device memory or the record implies it; `false`: nothing does,
    /// and the model ran on [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY), where nothing fails.
    pub capacity_known: bool,
    /// The least room left between the reserved lower bound and the device memory over the run:
    /// what the driver's fragmentation may take before a request fails.
    pub headroom: u64,
    /// Requests refused because the pool would need more than the device memory for the used bytes
    /// (certain out-of-memory errors); their frees are skipped.
    pub ooms: u64,
    /// Requests refused by PyTorch's memory-fraction limit ([`memory_limit`](Self::memory_limit)).
    pub limit_ooms: u64,
    /// PyTorch's hard limit on the bytes it hands out, when the program set a memory fraction.
    pub memory_limit: Option<u64>,
    /// Requests that failed in the recorded run and that the device had room for here: served and
    /// given back at once; whether the driver's fragmentation would have failed them is unknown.
    pub recorded_ooms_served: u64,
    /// `empty_cache()` calls the trace shows (each trims the pool).
    pub empty_cache_calls: u64,
    /// The peak of the bytes PyTorch counts as handed out (`pytorch_used_bytes`: frees count off when
    /// `free` is called, not when the streams' work is done): at most the used-memory peak.
    pub requested_peak: u64,
}

/// One step of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AsyncOp {
    /// `cuMemAllocFromPoolAsync` of allocation `id` (its size in [`AsyncPlan::sizes`]).
    Alloc { id: u32 },
    /// `free` of allocation `id` is called: PyTorch's own count drops.
    FreeCall { id: u32 },
    /// Allocation `id`'s memory is free for reuse (its `free_completed`): used memory drops.
    Done { id: u32 },
    /// `torch.cuda.empty_cache()`: the pool is trimmed. With `needed`, a run of releases that a new
    /// segment followed: it was `empty_cache()` if the recorded allocator had room for that segment
    /// (`needed`: the bytes it reserved before the run plus the segment), else the recorded
    /// allocator's own release before a retry.
    EmptyCache { needed: Option<u64> },
    /// A request that failed in the recorded run. `capacity`: the device memory the record implies
    /// from then on; `device_had_room`: the failure was a memory fraction's.
    Oom {
        size: u64,
        capacity: u64,
        device_had_room: bool,
    },
}

/// One device's trace as steps of the model, prepared once per [`Replay`](crate::Replay).
#[derive(Clone, Debug, Default)]
pub(crate) struct AsyncPlan {
    ops: Vec<AsyncOp>,
    /// For each op, the index of the trace event it came from.
    events: Vec<u32>,
    /// The size of each allocation, by id.
    sizes: Vec<u64>,
    /// Frees of blocks the trace never allocated (it starts mid-run): skipped.
    unmatched_frees: usize,
}

impl AsyncPlan {
    /// Reads `trace` (device `plan.device`'s events); `plan` says which runs of releases were
    /// `empty_cache()` calls and where requests failed.
    pub(crate) fn build(trace: &[TraceEntry], plan: &DevicePlan) -> AsyncPlan {
        // The plan's reading of releases and failures, by trace event.
        let mut marks: Vec<(u32, AsyncOp)> = Vec::new();
        let mut release_sizes: HashMap<u32, u64> = HashMap::new();
        for (op, &event) in plan.ops.iter().zip(&plan.op_events) {
            match *op {
                Op::Release { run } => {
                    let run = plan.releases[run as usize];
                    if let Some(segment) = run.next_segment {
                        release_sizes.insert(event, segment);
                    }
                    marks.push((event, AsyncOp::EmptyCache { needed: None }));
                }
                Op::Oom {
                    size,
                    capacity,
                    device_had_room,
                    ..
                } => marks.push((
                    event,
                    AsyncOp::Oom {
                        size,
                        capacity,
                        device_had_room,
                    },
                )),
                _ => {}
            }
        }
        marks.sort_by_key(|&(event, _)| event);
        let mut marks = marks.into_iter().peekable();

        let mut out = AsyncPlan {
            unmatched_frees: plan.unmatched_frees,
            ..AsyncPlan::default()
        };
        let mut live: HashMap<u64, u32> = HashMap::new();
        let mut freed: HashMap<u64, u32> = HashMap::new();
        // Bytes the recorded allocator held from the device, as the plan counts them.
        let mut reserved = 0u64;
        for (i, e) in trace.iter().enumerate() {
            let Ok(event) = u32::try_from(i) else { break };
            match e.action {
                TraceAction::Alloc => {
                    let id = out.sizes.len() as u32;
                    out.sizes.push(e.size);
                    live.insert(e.addr, id);
                    out.push(event, AsyncOp::Alloc { id });
                }
                TraceAction::FreeRequested => {
                    if let Some(id) = live.remove(&e.addr) {
                        freed.insert(e.addr, id);
                        out.push(event, AsyncOp::FreeCall { id });
                    }
                }
                TraceAction::FreeCompleted => {
                    if let Some(id) = freed.remove(&e.addr) {
                        out.push(event, AsyncOp::Done { id });
                    }
                }
                TraceAction::SegmentAlloc | TraceAction::SegmentMap => reserved += e.size,
                TraceAction::SegmentFree | TraceAction::SegmentUnmap => {
                    // Marks of a run of releases sit at its first event, before its bytes go.
                    while let Some((_, mut op)) = marks.next_if(|&(at, _)| at == event) {
                        if let (AsyncOp::EmptyCache { needed }, Some(&segment)) =
                            (&mut op, release_sizes.get(&event))
                        {
                            *needed = Some(reserved + segment);
                        }
                        out.push(event, op);
                    }
                    reserved = reserved.saturating_sub(e.size);
                }
                _ => {}
            }
            while let Some((at, op)) = marks.next_if(|&(at, _)| at <= event) {
                out.push(at, op);
            }
        }
        out
    }

    fn push(&mut self, event: u32, op: AsyncOp) {
        self.ops.push(op);
        self.events.push(event);
    }
}

/// `bytes` rounded up to whole physical chunks of the pool.
fn physical(bytes: u64) -> u64 {
    bytes
        .div_ceil(POOL_GRANULARITY)
        .saturating_mul(POOL_GRANULARITY)
}

/// Why the model refused a request.
enum Refusal {
    /// PyTorch's memory-fraction limit.
    Limit,
    /// The device has no room for the pool to grow to the used bytes.
    Device,
}

/// The model's running figures for one device.
struct Pool {
    /// The device memory.
    capacity: u64,
    /// PyTorch's limit on the bytes it hands out.
    limit: Option<u64>,
    /// Live requested bytes (the pool's used memory).
    used: u64,
    used_peak: u64,
    /// Bytes PyTorch counts as handed out (frees count off at the call).
    handed_out: u64,
    handed_out_peak: u64,
    /// The least the pool reserves now, and its peak.
    reserved: u64,
    reserved_peak: u64,
    /// The least room left on the device.
    headroom: u64,
}

impl Pool {
    /// Whether a request of `size` bytes can be served; `None` when it can.
    fn refuses(&self, size: u64) -> Option<Refusal> {
        if self
            .limit
            .is_some_and(|limit| self.handed_out.saturating_add(size) > limit)
        {
            return Some(Refusal::Limit);
        }
        (physical(self.used.saturating_add(size)) > self.capacity).then_some(Refusal::Device)
    }

    fn take(&mut self, size: u64) {
        self.used += size;
        self.handed_out += size;
        self.used_peak = self.used_peak.max(self.used);
        self.handed_out_peak = self.handed_out_peak.max(self.handed_out);
        // Nothing goes back to the device between trims: the pool keeps the most it held.
        self.reserved = self.reserved.max(physical(self.used));
        self.reserved_peak = self.reserved_peak.max(self.reserved);
        self.headroom = self
            .headroom
            .min(self.capacity.saturating_sub(self.reserved));
    }
}

/// Runs `plan` (device `device`'s trace) through the model under `options` (its capacity, timeline
/// points, progress); `default_capacity` is the device memory the record implies, `inference` how
/// it was inferred (a memory fraction the program set) and `recorded` the recorded configuration;
/// `events_before` counts the events of earlier devices, for progress.
pub(crate) fn run_device(
    device: usize,
    plan: &AsyncPlan,
    options: &RunOptions<'_>,
    default_capacity: u64,
    inference: &CapacityInference,
    recorded: &AllocatorConfig,
    events_before: u64,
) -> DeviceRun {
    let capacity = options.capacity.unwrap_or(default_capacity);
    // `set_per_process_memory_fraction()` in the program: PyTorch's hard limit on this backend.
    let limit = inference
        .fraction
        .filter(|_| inference.fraction_implied)
        .map(|f| (f * capacity as f64) as u64);
    let mut pool = Pool {
        capacity,
        limit,
        used: 0,
        used_peak: 0,
        handed_out: 0,
        handed_out_peak: 0,
        reserved: 0,
        reserved_peak: 0,
        headroom: capacity,
    };
    let mut bounds = AsyncBounds {
        granularity: POOL_GRANULARITY,
        memory_limit: limit,
        capacity_known: options.capacity.is_some() || inference.capacity.is_some(),
        ..AsyncBounds::default()
    };
    // Per allocation: served (not refused) and not yet free for reuse; `free` called.
    let mut alive = vec![false; plan.sizes.len()];
    let mut called = vec![false; plan.sizes.len()];
    let mut sampler = Sampler::new(plan.ops.len(), options.timeline_points);
    let recorded_fraction = recorded.per_process_memory_fraction;
    let recorded_collects = recorded.garbage_collection_threshold > 0.0 && recorded_fraction < 1.0;

    let started = Instant::now();
    for (i, (op, &event)) in plan.ops.iter().zip(&plan.events).enumerate() {
        match *op {
            AsyncOp::Alloc { id } => {
                let size = plan.sizes[id as usize];
                match pool.refuses(size) {
                    None => {
                        pool.take(size);
                        alive[id as usize] = true;
                    }
                    Some(Refusal::Limit) => bounds.limit_ooms += 1,
                    Some(Refusal::Device) => bounds.ooms += 1,
                }
            }
            AsyncOp::FreeCall { id } => {
                let id = id as usize;
                if alive[id] && !called[id] {
                    called[id] = true;
                    pool.handed_out -= plan.sizes[id];
                }
            }
            AsyncOp::Done { id } => {
                let id = id as usize;
                if alive[id] {
                    alive[id] = false;
                    pool.used -= plan.sizes[id];
                    if !called[id] {
                        called[id] = true;
                        pool.handed_out -= plan.sizes[id];
                    }
                }
            }
            AsyncOp::EmptyCache { needed } => {
                // As the recorded allocator judged it: a release with room for the segment that
                // followed was the program's (garbage collection releases on its own).
                let allowed = if recorded_fraction < 1.0 {
                    (recorded_fraction * pool.capacity as f64) as u64
                } else {
                    pool.capacity
                };
                let program = match needed {
                    None => true,
                    Some(needed) => !recorded_collects && needed <= allowed,
                };
                if program {
                    bounds.empty_cache_calls += 1;
                    pool.reserved = physical(pool.used);
                }
            }
            AsyncOp::Oom {
                size,
                capacity: recorded_capacity,
                device_had_room,
            } => {
                // As the native replay does: without a fraction, the record tells the device's
                // memory from here on (other processes may have taken some).
                let fraction_failure = device_had_room && recorded_fraction < 1.0;
                if options.capacity.is_none() && !fraction_failure {
                    pool.capacity = recorded_capacity;
                    bounds.capacity_known = true;
                }
                match pool.refuses(size) {
                    None => {
                        // Given back at once; the pool keeps what it grew to for it.
                        pool.take(size);
                        pool.used -= size;
                        pool.handed_out -= size;
                        bounds.recorded_ooms_served += 1;
                    }
                    Some(Refusal::Limit) => bounds.limit_ooms += 1,
                    Some(Refusal::Device) => bounds.ooms += 1,
                }
            }
        }
        sampler.observe(u64::from(event), pool.used, pool.reserved, pool.used);
        if i % PROGRESS_EVERY == 0 {
            if let Some(progress) = options.progress {
                progress(events_before + u64::from(event));
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();

    bounds.reserved_peak_at_least = pool.reserved_peak;
    bounds.reserved_current_at_least = pool.reserved;
    bounds.capacity = pool.capacity;
    bounds.headroom = pool.headroom;
    bounds.requested_peak = pool.handed_out_peak;
    DeviceRun {
        device,
        stats: stats(&pool),
        capacity: pool.capacity,
        addresses: AddressUse::default(),
        refused: bounds.ooms + bounds.limit_ooms,
        unmatched_frees: plan.unmatched_frees,
        timeline: sampler.finish(),
        check: None,
        snapshot: None,
        seconds,
        restores: RestoreCount::default(),
        async_model: Some(bounds),
        releases_external: Vec::new(),
    }
}

/// `memory_stats()` as PyTorch's async backend fills it from the pool's figures: used memory as
/// `allocated_bytes.all` and `active_bytes.all`, reserved memory as `reserved_bytes.all`, the rest 0.
fn stats(pool: &Pool) -> MemoryStats {
    MemoryStats::from_pool_usage(
        (pool.used, pool.used_peak),
        (pool.reserved, pool.reserved_peak),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn physical_memory_is_whole_chunks() {
        assert_eq!(physical(0), 0);
        assert_eq!(physical(1), 2 << 20);
        assert_eq!(physical(2 << 20), 2 << 20);
        assert_eq!(physical((2 << 20) + 1), 4 << 20);
    }
}
