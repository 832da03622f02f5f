//! `backend:cudaMallocAsync` as a what-if: a native trace's requests through the model of the
//! driver's memory pool. The pool's used memory is the live requested bytes (exact figures); its
//! reserved memory only a lower bound (the used bytes rounded up to the pool's physical granularity,
//! held until an `empty_cache()`); requests the device has no room for are certain out-of-memory
//! errors.

use std::collections::HashMap;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction};
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_replay::{
    DeviceRun, Replay, ReplayRun, RunOptions, ASYNC_LOWER_BOUNDS, POOL_GRANULARITY,
};

mod common;

use common::traces_dir;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// A workload run on tensormem's allocator with its history on, on a simulated device of
/// `capacity` bytes.
fn record(capacity: u64, work: impl FnOnce(&CachingAllocator<SimDevice>)) -> Snapshot {
    let allocator = CachingAllocator::new(SimDevice::new(capacity));
    allocator.record_history(true, 10_000);
    work(&allocator);
    allocator.snapshot()
}

fn alloc(allocator: &CachingAllocator<SimDevice>, bytes: u64) -> tensormem_cuda_alloc::Allocation {
    allocator
        .allocate(usize::try_from(bytes).unwrap(), StreamId(0))
        .unwrap()
}

fn what_if(snapshot: &Snapshot) -> ReplayRun {
    Replay::new(snapshot)
        .unwrap()
        .run_with("backend:cudaMallocAsync")
        .unwrap()
}

fn rounded(bytes: u64) -> u64 {
    bytes.div_ceil(POOL_GRANULARITY) * POOL_GRANULARITY
}

/// The six figures PyTorch fills for this backend, and every other figure zero.
fn assert_async_stats(device: &DeviceRun, used: (u64, u64), reserved: (u64, u64)) {
    let flat = device.stats.to_flat();
    let figure = |key: &str| flat[key] as u64;
    assert_eq!(
        (
            figure("allocated_bytes.all.current"),
            figure("allocated_bytes.all.peak")
        ),
        used
    );
    assert_eq!(
        (
            figure("active_bytes.all.current"),
            figure("active_bytes.all.peak")
        ),
        used
    );
    assert_eq!(
        (
            figure("reserved_bytes.all.current"),
            figure("reserved_bytes.all.peak")
        ),
        reserved
    );
    for (key, value) in &flat {
        let filled = [
            "allocated_bytes.all.",
            "active_bytes.all.",
            "reserved_bytes.all.",
        ]
        .iter()
        .any(|p| key.starts_with(p))
            && (key.ends_with(".current") || key.ends_with(".peak"));
        if !filled {
            assert_eq!(
                *value, 0,
                "{key}: PyTorch leaves it zero under this backend"
            );
        }
    }
}

/// 3 MiB + 1000 B, 5 MiB and 700 KiB live at once, then the 5 MiB freed and 1 MiB allocated.
fn mixed() -> Snapshot {
    record(1 << 30, |allocator| {
        let a = alloc(allocator, 3 * MIB + 1000);
        let b = alloc(allocator, 5 * MIB);
        let _c = alloc(allocator, 700 * KIB);
        allocator.free(b).unwrap();
        let _d = alloc(allocator, MIB);
        let _ = a;
    })
}

#[test]
fn used_memory_is_the_live_requested_bytes_and_reserved_is_bounded_below() {
    let run = what_if(&mixed());
    assert!(!run.recorded);
    assert_eq!(run.lower_bounds(), ASYNC_LOWER_BOUNDS);
    let device = &run.devices[0];
    let peak = 3 * MIB + 1000 + 5 * MIB + 700 * KIB;
    let now = 3 * MIB + 1000 + 700 * KIB + MIB;
    // Nothing goes back to the device without `empty_cache()`: reserved stays at the peak's.
    assert_async_stats(device, (now, peak), (rounded(peak), rounded(peak)));
    assert_eq!(rounded(peak), 10 * MIB);
    let bounds = device
        .async_model
        .as_ref()
        .expect("the async model's bounds");
    assert_eq!(bounds.granularity, 2 * MIB);
    assert_eq!(bounds.reserved_peak_at_least, 10 * MIB);
    assert_eq!(bounds.reserved_current_at_least, 10 * MIB);
    assert_eq!((bounds.ooms, bounds.limit_ooms, device.refused), (0, 0, 0));
    assert_eq!(bounds.memory_limit, None);
    assert_eq!(bounds.requested_peak, peak);
    assert_eq!(bounds.headroom, device.capacity - 10 * MIB);
    // The timeline carries the same figures.
    let top = |f: fn(&tensormem_replay::TimelinePoint) -> u64| {
        device.timeline.points.iter().map(f).max().unwrap()
    };
    assert_eq!(top(|p| p.allocated), peak);
    assert_eq!(top(|p| p.reserved), 10 * MIB);
    // A native replay of the same trace reports the caching allocator's figures, no bounds.
    let native = Replay::new(&mixed()).unwrap().run_with("").unwrap();
    assert!(native.lower_bounds().is_empty());
    assert!(native.devices[0].async_model.is_none());
}

#[test]
fn empty_cache_brings_reserved_down_to_the_used_bytes_rounded_up() {
    let trimmed = |call_empty_cache: bool| {
        record(1 << 30, |allocator| {
            let a = alloc(allocator, 10 * MIB);
            let _b = alloc(allocator, MIB);
            allocator.free(a).unwrap();
            if call_empty_cache {
                allocator.empty_cache().unwrap();
            }
            // Served from the small segment that holds `b`: no new segment follows the releases.
            let _c = alloc(allocator, 512 * KIB);
        })
    };
    let snapshot = trimmed(true);
    assert!(snapshot
        .trace(0)
        .iter()
        .any(|e| e.action == TraceAction::SegmentFree));
    let run = what_if(&snapshot);
    let device = &run.devices[0];
    let used = MIB + 512 * KIB;
    // The peak is the 11 MiB live before the free; after the trim the pool holds at least 2 MiB.
    assert_async_stats(device, (used, 11 * MIB), (2 * MIB, 12 * MIB));
    assert_eq!(device.async_model.as_ref().unwrap().empty_cache_calls, 1);

    let kept = what_if(&trimmed(false));
    let device = &kept.devices[0];
    assert_async_stats(device, (used, 11 * MIB), (12 * MIB, 12 * MIB));
    assert_eq!(device.async_model.as_ref().unwrap().empty_cache_calls, 0);
}

#[test]
fn a_block_used_on_another_stream_is_used_memory_until_its_work_is_done() {
    let side = StreamId(1);
    let snapshot = record(1 << 30, |allocator| {
        let a = alloc(allocator, 4 * MIB);
        allocator.record_stream(&a, side).unwrap();
        allocator.free(a).unwrap();
        // The side stream's work is not done: `a`'s memory cannot serve `b`.
        let _b = alloc(allocator, 4 * MIB);
        allocator.device().complete_stream_work(side);
        let _c = alloc(allocator, KIB);
    });
    let run = what_if(&snapshot);
    let device = &run.devices[0];
    assert_async_stats(
        device,
        (4 * MIB + KIB, 8 * MIB),
        (rounded(8 * MIB), rounded(8 * MIB)),
    );
    // PyTorch's own count (checked against a memory fraction) drops when `free` is called.
    assert_eq!(
        device.async_model.as_ref().unwrap().requested_peak,
        4 * MIB + KIB
    );
}

#[test]
fn requests_the_device_has_no_room_for_are_certain_out_of_memory_errors() {
    // The recorded run failed a 40 MiB request with 40 MiB in use on a 64 MiB device: the pool
    // would need 80 MiB.
    let snapshot = record(64 * MIB, |allocator| {
        let a = alloc(allocator, 40 * MIB);
        assert!(allocator.allocate(40 * MIB as usize, StreamId(0)).is_err());
        allocator.free(a).unwrap();
        let _b = alloc(allocator, 8 * MIB);
    });
    let run = what_if(&snapshot);
    let device = &run.devices[0];
    let bounds = device.async_model.as_ref().unwrap();
    assert_eq!(
        bounds.capacity,
        64 * MIB,
        "the device memory the record implies"
    );
    assert_eq!((bounds.ooms, bounds.recorded_ooms_served), (1, 0));
    assert_eq!(device.refused, 1);
    assert_async_stats(device, (8 * MIB, 40 * MIB), (40 * MIB, 40 * MIB));
    assert_eq!(bounds.headroom, 24 * MIB);

    // On a device smaller than the trace's live bytes, ordinary requests fail too, and their frees
    // are skipped.
    let replay = Replay::new(&mixed()).unwrap();
    let mut options = RunOptions::new(replay.what_if_config("backend:cudaMallocAsync").unwrap());
    options.capacity = Some(6 * MIB);
    let run = replay.run(&options).unwrap();
    let device = &run.devices[0];
    let bounds = device.async_model.as_ref().unwrap();
    // 3 MiB + 1000 B live: the 5 MiB request needs 10 MiB of pool.
    assert_eq!((bounds.ooms, device.refused), (1, 1));
    let live = 3 * MIB + 1000 + 700 * KIB + MIB;
    assert_async_stats(device, (live, live), (6 * MIB, 6 * MIB));
    assert_eq!(bounds.headroom, 0);
}

fn load(name: &str) -> Snapshot {
    Snapshot::read_file(traces_dir().join(format!("{name}.pickle"))).unwrap()
}

/// The most bytes requested and not yet completed at once, read straight from the trace: each
/// `alloc` adds its size, the block's `free_completed` takes it off.
fn live_requested_peak(snapshot: &Snapshot, device: usize) -> u64 {
    let (mut live, mut freed) = (HashMap::new(), HashMap::new());
    let (mut now, mut peak) = (0u64, 0u64);
    for e in snapshot.trace(device) {
        match e.action {
            TraceAction::Alloc => {
                live.insert(e.addr, e.size);
                now += e.size;
                peak = peak.max(now);
            }
            TraceAction::FreeRequested => {
                if let Some(size) = live.remove(&e.addr) {
                    freed.insert(e.addr, size);
                }
            }
            TraceAction::FreeCompleted => {
                if let Some(size) = freed.remove(&e.addr) {
                    now -= size;
                }
            }
            _ => {}
        }
    }
    peak
}

#[test]
fn gpt2_train_under_cuda_malloc_async_uses_its_live_requested_bytes() {
    let snapshot = load("gpt2_train");
    let replay = Replay::new(&snapshot).unwrap();
    let run = replay.run_with("backend:cudaMallocAsync").unwrap();
    assert_eq!(run.label(), "backend:cudaMallocAsync");
    let device = &run.devices[0];
    let peak = live_requested_peak(&snapshot, 0);
    assert!(peak > 5 << 30, "{peak}");
    let flat = run.flat_stats();
    assert_eq!(flat["allocated_bytes.all.peak"] as u64, peak);
    assert_eq!(flat["active_bytes.all.peak"] as u64, peak);
    assert_eq!(flat["reserved_bytes.all.peak"] as u64, rounded(peak));
    assert_eq!(device.refused, 0);
    // The native replay's requested bytes agree, and its cache reserves more than the bound.
    let native = replay.run_recorded().unwrap();
    let native = native.flat_stats();
    assert_eq!(native["requested_bytes.all.peak"] as u64, peak);
    assert!(native["reserved_bytes.all.peak"] as u64 > rounded(peak));
}

/// A run on a nearly full GPU with 10 failed requests: under the async backend the one whose
/// live bytes exceed the device memory the record implies fails for certain; the others the
/// device had room for are served (whether the driver's fragmentation fails them is unknown).
#[test]
fn oom_pressure_reports_the_certain_out_of_memory_errors() {
    let snapshot = load("oom_pressure");
    let recorded_ooms = snapshot
        .trace(0)
        .iter()
        .filter(|e| e.action == TraceAction::Oom)
        .count() as u64;
    assert_eq!(recorded_ooms, 10);
    let run = what_if(&snapshot);
    let bounds = run.devices[0].async_model.as_ref().unwrap();
    assert!(bounds.ooms >= 1, "{bounds:?}");
    assert_eq!(bounds.limit_ooms, 0);
    assert_eq!(bounds.ooms + bounds.recorded_ooms_served, recorded_ooms);
    assert!(bounds.reserved_peak_at_least <= bounds.capacity);
    assert!(bounds.empty_cache_calls > 0);
}

/// A run under `torch.cuda.set_per_process_memory_fraction()` (implied by its `oom` events): under
/// the async backend the fraction is PyTorch's hard limit on the bytes it hands out, inside the
/// interval the trace allows, and requests past it are refused before the driver is asked.
#[test]
fn a_memory_fraction_set_in_the_program_limits_the_bytes_handed_out() {
    let snapshot = load("varlen_pressure2__fraction-0.004");
    let replay = Replay::new(&snapshot).unwrap();
    let inference = replay.capacity_inference(0).unwrap();
    assert!(inference.fraction_implied);
    let run = replay.run_with("backend:cudaMallocAsync").unwrap();
    let bounds = run.devices[0].async_model.as_ref().unwrap();
    let limit = bounds
        .memory_limit
        .expect("the program's fraction is a limit");
    assert!(limit >= inference.lower, "{limit} {inference:?}");
    assert!(
        inference.upper.is_none_or(|u| limit <= u),
        "{limit} {inference:?}"
    );
    assert!(bounds.limit_ooms > 0, "{bounds:?}");
    assert!(bounds.requested_peak <= limit);
    assert_eq!(bounds.ooms, 0);
}
