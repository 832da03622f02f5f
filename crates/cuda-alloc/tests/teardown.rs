//! Dropping an allocator returns everything to the device, and keeps the errors met there.

mod common;

use std::sync::Arc;

use common::*;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, DeviceError};

fn shared(config: &str) -> (Arc<SimDevice>, CachingAllocator<Arc<SimDevice>>) {
    let device = Arc::new(SimDevice::new(8 * GIB as u64));
    let alloc =
        CachingAllocator::with_config(Arc::clone(&device), AllocatorConfig::parse(config).unwrap());
    (device, alloc)
}

/// Live, cached, split and pending blocks on two streams, in the small and large pools.
fn populate(alloc: &CachingAllocator<Arc<SimDevice>>) -> Vec<tensormem_cuda_alloc::Allocation> {
    let mut live = Vec::new();
    for (i, size) in [512, 3000, 600_000, 3 * MIB, 12 * MIB, 40 * MIB]
        .into_iter()
        .enumerate()
    {
        let stream = if i % 2 == 0 { S0 } else { S1 };
        live.push(alloc.allocate(size, stream).unwrap());
        let cached = alloc.allocate(size, stream).unwrap();
        alloc.free(cached).unwrap();
    }
    let pending = alloc.allocate(5 * MIB, S0).unwrap();
    alloc.record_stream(&pending, S2).unwrap();
    alloc.free(pending).unwrap();
    live
}

fn assert_device_empty(device: &SimDevice) {
    let c = device.counters();
    assert_eq!(c.live_allocations, 0, "{c:?}");
    assert_eq!(c.reserved_ranges, 0, "{c:?}");
    assert_eq!(c.live_chunks, 0, "{c:?}");
    assert_eq!(c.used_bytes, 0, "{c:?}");
}

#[test]
fn dropping_an_allocator_returns_every_segment() {
    let (device, alloc) = shared("");
    let live = populate(&alloc);
    assert!(device.counters().live_allocations > 0);
    drop(live); // Handles left unfreed: their memory goes back with the allocator.
    drop(alloc);
    assert_device_empty(&device);
    assert!(
        device.counters().device_synchronizes >= 1,
        "waited for the device"
    );
    assert_eq!(device.take_kept_errors(), Vec::new());
}

#[test]
fn dropping_an_allocator_unmaps_and_releases_expandable_segments() {
    let (device, alloc) = shared("expandable_segments:True");
    let _live = populate(&alloc);
    assert!(device.counters().reserved_ranges > 0);
    assert!(device.counters().live_chunks > 0);
    drop(alloc);
    assert_device_empty(&device);
    assert_eq!(device.take_kept_errors(), Vec::new());
}

#[test]
fn an_unused_allocator_drops_without_device_calls() {
    let (device, alloc) = shared("");
    let x = alloc.allocate(0, S0).unwrap();
    alloc.free(x).unwrap();
    drop(alloc);
    assert_eq!(device.counters().device_synchronizes, 0);
}

#[test]
fn errors_met_while_dropping_are_kept_and_the_rest_is_released() {
    let (device, alloc) = shared("");
    let _live = populate(&alloc);
    let segments = device.counters().live_allocations;
    device.fail_releases(true);
    drop(alloc);
    let errors = device.take_kept_errors();
    assert_eq!(errors.len(), segments, "one error per segment: {errors:?}");
    assert!(errors.iter().all(|e| matches!(
        e,
        DeviceError::Driver {
            call: "cuMemFree",
            ..
        }
    )));
    // Nothing was taken back (the device refused), and nothing panicked.
    assert_eq!(device.counters().live_allocations, segments);
}
