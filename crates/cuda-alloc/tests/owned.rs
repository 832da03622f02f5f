//! Allocations that free themselves (`allocate_owned`, `allocate_shared`) on the simulated device, and
//! how device addresses format.

use std::sync::Arc;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, Error, StreamId};

const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(7);

fn sim() -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::new(1 << 30))
}

fn allocated(alloc: &CachingAllocator<SimDevice>) -> i64 {
    alloc.memory_stats().allocated_bytes.all.current
}

#[test]
fn an_owned_allocation_is_freed_when_dropped() {
    let alloc = sim();
    let block = alloc.allocate_owned(3000, S0).unwrap();
    assert_eq!((block.size(), block.requested_size()), (3072, 3000));
    assert_eq!(block.stream(), S0);
    assert_eq!(block.allocator().id(), alloc.id());
    assert_eq!(allocated(&alloc), 3072);
    drop(block);
    assert_eq!(allocated(&alloc), 0);
    alloc.check_invariants().unwrap();
    // The block went back to the cache: the next request of its size reuses it.
    let again = alloc.allocate_owned(3000, S0).unwrap();
    assert_eq!(alloc.memory_stats().segment.all.allocated, 1);
    again.free().unwrap();
    assert_eq!(allocated(&alloc), 0);
}

#[test]
fn an_owned_allocation_waits_for_the_streams_recorded_on_it() {
    let alloc = sim();
    let block = alloc.allocate_owned(1 << 20, S0).unwrap();
    alloc.record_stream(&block, S1).unwrap();
    drop(block);
    // Freed, but not reusable until the other stream's work is done.
    assert_eq!(allocated(&alloc), 0);
    assert_eq!(alloc.memory_stats().active_bytes.all.current, 1 << 20);
    alloc.device().complete_stream_work(S1);
    let next = alloc.allocate_owned(1 << 20, S0).unwrap();
    assert_eq!(alloc.memory_stats().active_bytes.all.current, 1 << 20);
    drop(next);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_shared_owned_allocation_outlives_the_callers_handle_and_moves_between_threads() {
    let alloc = Arc::new(sim());
    let block = alloc.allocate_shared(1 << 20, S0).unwrap();
    let weak = Arc::downgrade(&alloc);
    let stats = Arc::clone(&alloc);
    drop(alloc);
    assert!(weak.upgrade().is_some(), "the block keeps its allocator");
    std::thread::spawn(move || drop(block)).join().unwrap();
    assert_eq!(stats.memory_stats().allocated_bytes.all.current, 0);
}

#[test]
fn into_raw_gives_up_ownership() {
    let alloc = sim();
    let raw = alloc.allocate_owned(4096, S0).unwrap().into_raw();
    assert_eq!(
        allocated(&alloc),
        4096,
        "still allocated after the owner went"
    );
    alloc.free(raw).unwrap();
    assert_eq!(allocated(&alloc), 0);
}

#[test]
fn a_zero_sized_owned_allocation_is_null_and_frees_quietly() {
    let alloc = sim();
    let block = alloc.allocate_owned(0, S0).unwrap();
    assert_eq!(block.ptr(), DeviceAddress(0));
    block.free().unwrap();
}

#[test]
fn a_handle_freed_on_another_allocator_names_raw_free_on_the_owner() {
    let (a, b) = (sim(), sim());
    let x = a.allocate(4096, S0).unwrap();
    let ptr = x.ptr();
    let message = b.free(x).unwrap_err().to_string();
    assert!(
        message.contains(&format!("raw_free({ptr})")) && message.contains(&format!("#{}", a.id())),
        "{message}"
    );
    a.raw_free(ptr).unwrap();
    assert_eq!(allocated(&a), 0);
    assert!(matches!(a.raw_free(ptr), Err(Error::InvalidPointer { .. })));
}

#[test]
fn device_addresses_format_as_hex() {
    let p = DeviceAddress(0x7f00_dead_beef);
    assert_eq!(format!("{p}"), "0x7f00deadbeef");
    assert_eq!(format!("{p:?}"), "0x7f00deadbeef");
    assert_eq!(format!("{p:x}"), "7f00deadbeef");
    assert_eq!(format!("{p:#x}"), "0x7f00deadbeef");
    assert_eq!(format!("{p:X}"), "7F00DEADBEEF");
    assert_eq!(format!("{p:#018x}"), "0x00007f00deadbeef");
    assert_eq!(format!("{:>14x}", DeviceAddress(0xab)), "            ab");
}
