//! `release_lock_on_cudamalloc:True`: while the device allocates a new segment for one call, another
//! call on the same stream (a cache hit) goes ahead instead of waiting for the driver.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensormem_cuda_alloc::backend::sim::{SimChunk, SimDevice, SimEvent};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{
    CachingAllocator, CaptureStatus, Device, DeviceAddress, DeviceResult, MemInfo, StreamId,
};

/// A simulated device whose `malloc` of more than `GATED` bytes reports that it started and waits
/// for a go-ahead, like a slow `cuMemAlloc`.
struct GatedDevice {
    sim: SimDevice,
    started: Mutex<Sender<()>>,
    go: Mutex<Receiver<()>>,
}

const GATED: usize = 16 << 20;

// SAFETY: every method delegates to the simulated device, which upholds the obligations; `malloc`
// only waits on a channel before delegating, and calls nothing of the allocator.
unsafe impl Device for GatedDevice {
    type Event = SimEvent;
    type PhysicalChunk = SimChunk;

    fn index(&self) -> u32 {
        self.sim.index()
    }
    fn mem_info(&self) -> DeviceResult<MemInfo> {
        self.sim.mem_info()
    }
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        if size > GATED {
            self.started.lock().unwrap().send(()).unwrap();
            self.go.lock().unwrap().recv().unwrap();
        }
        self.sim.malloc(size)
    }
    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the simulated device's.
        unsafe { self.sim.free(ptr, size) }
    }
    fn create_event(&self) -> DeviceResult<SimEvent> {
        self.sim.create_event()
    }
    fn record_event(&self, event: &SimEvent, stream: StreamId) -> DeviceResult<()> {
        self.sim.record_event(event, stream)
    }
    fn query_event(&self, event: &SimEvent) -> DeviceResult<bool> {
        self.sim.query_event(event)
    }
    fn synchronize_event(&self, event: &SimEvent) -> DeviceResult<()> {
        self.sim.synchronize_event(event)
    }
    fn synchronize(&self) -> DeviceResult<()> {
        self.sim.synchronize()
    }
    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        self.sim.capture_status(stream)
    }
    fn vmm_granularity(&self) -> DeviceResult<usize> {
        self.sim.vmm_granularity()
    }
    fn reserve_address_range(&self, size: usize) -> DeviceResult<DeviceAddress> {
        self.sim.reserve_address_range(size)
    }
    unsafe fn release_address_range(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the simulated device's.
        unsafe { self.sim.release_address_range(ptr, size) }
    }
    fn create_physical(&self, size: usize) -> DeviceResult<SimChunk> {
        self.sim.create_physical(size)
    }
    unsafe fn map(&self, ptr: DeviceAddress, size: usize, chunk: &SimChunk) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the simulated device's.
        unsafe { self.sim.map(ptr, size, chunk) }
    }
    unsafe fn unmap(&self, ptr: DeviceAddress, size: usize, chunk: SimChunk) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the simulated device's.
        unsafe { self.sim.unmap(ptr, size, chunk) }
    }
}

/// An allocator with `release_lock_on_cudamalloc:True` on a 1 GiB gated device, with the receiver
/// told when a gated device allocation started and the sender that lets it go on.
fn gated_allocator() -> (Arc<CachingAllocator<GatedDevice>>, Receiver<()>, Sender<()>) {
    let (started_tx, started) = channel();
    let (go, go_rx) = channel();
    let device = GatedDevice {
        sim: SimDevice::new(1 << 30),
        started: Mutex::new(started_tx),
        go: Mutex::new(go_rx),
    };
    let config = AllocatorConfig::parse("release_lock_on_cudamalloc:True").unwrap();
    (
        Arc::new(CachingAllocator::with_config(device, config)),
        started,
        go,
    )
}

#[test]
fn a_cache_hit_on_the_same_stream_does_not_wait_for_a_device_allocation() {
    let (alloc, started, go) = gated_allocator();
    let s = StreamId(0);
    let warm = alloc.allocate(4096, s).unwrap();
    alloc.free(warm).unwrap(); // a cached small block on `s`

    let slow = {
        let alloc = Arc::clone(&alloc);
        std::thread::spawn(move || alloc.allocate(64 << 20, s).map(|a| a.size()))
    };
    started.recv().unwrap(); // the slow call is inside the device allocation now
    let (done_tx, done) = channel();
    let hit = {
        let alloc = Arc::clone(&alloc);
        std::thread::spawn(move || {
            let block = alloc.allocate(4096, s).unwrap();
            done_tx.send(()).unwrap();
            block
        })
    };
    // A deadlock guard, not a measurement: without the option the hit waits for the gate forever.
    let outcome = done.recv_timeout(Duration::from_secs(120));
    go.send(()).unwrap();
    assert_ne!(
        outcome,
        Err(RecvTimeoutError::Timeout),
        "a cache hit on the same stream waited for the device allocation"
    );
    let block = hit.join().unwrap();
    assert_eq!(slow.join().unwrap().unwrap(), 64 << 20);
    alloc.free(block).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.memory_stats().segment.all.current, 2);
}

#[test]
fn the_invariant_walk_allows_for_a_device_allocation_under_way() {
    let (alloc, started, go) = gated_allocator();
    let s = StreamId(0);
    let small = alloc.allocate(4096, s).unwrap();
    let slow = {
        let alloc = Arc::clone(&alloc);
        std::thread::spawn(move || alloc.allocate(64 << 20, s).map(|a| a.size()))
    };
    started.recv().unwrap(); // the budget is raised and the device is allocating, unlocked
    let during = alloc.check_invariants();
    go.send(()).unwrap();
    assert_eq!(slow.join().unwrap().unwrap(), 64 << 20);
    during.unwrap();
    alloc.check_invariants().unwrap();
    alloc.free(small).unwrap();
}
