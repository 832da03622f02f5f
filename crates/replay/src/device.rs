//! [`ReplayDevice`]: the simulated device, handing new segments the addresses the trace recorded.
//!
//! The allocator breaks ties between equally good free blocks by address, so a replay that wants
//! PyTorch's exact decisions must put every new segment where the real device put it. The trace
//! records those addresses (`segment_alloc` for `cudaMalloc`, the first `segment_map` of each
//! expandable segment for its reserved range); this device gives them out in order, one queue for
//! device allocations and one for address reservations.
//!
//! When a recorded address no longer fits (a what-if configuration asks for segments of other sizes,
//! so a recorded address may overlap a live one), the device invents one instead (the simulated
//! device's own, never overlapping anything live) and counts it. Under the recorded configuration a
//! faithful allocator never needs one.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::device::{
    CaptureStatus, Device, DeviceAddress, DeviceError, DeviceResult, MemInfo, StreamId,
};
use tensormem_cuda_alloc::PoolAllocator;

/// How the addresses of new segments were chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AddressUse {
    /// Segments and reservations placed at the address the trace recorded for them.
    pub recorded: u64,
    /// Segments and reservations placed at an invented address: the recorded ones were used up or
    /// did not fit.
    pub invented: u64,
}

#[derive(Debug, Default)]
struct Queues {
    /// Addresses for `malloc`, in the order the trace's `segment_alloc` events recorded them.
    mallocs: VecDeque<u64>,
    /// Addresses for `reserve_address_range`: the first mapping of each expandable segment.
    reservations: VecDeque<u64>,
    used: AddressUse,
}

/// The simulated device of a replay: a [`SimDevice`] whose new segments get the trace's addresses
/// while they fit. The allocator breaks ties by address, so the layout must be the real one for its
/// decisions to be; a recorded address that would overlap a live segment (under a what-if
/// configuration) is replaced by an invented one and counted in [`AddressUse`].
///
/// Clones are the same device (a memory pool with its own allocator takes its segments from it).
#[derive(Clone, Debug)]
pub struct ReplayDevice {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    sim: SimDevice,
    queues: Mutex<Queues>,
}

impl ReplayDevice {
    /// A device with the given ordinal and capacity, handing out `mallocs` to device allocations and
    /// `reservations` to address-range reservations, in order.
    #[must_use]
    pub fn new(
        index: u32,
        capacity: u64,
        mallocs: impl IntoIterator<Item = u64>,
        reservations: impl IntoIterator<Item = u64>,
    ) -> Self {
        ReplayDevice {
            inner: Arc::new(Inner {
                sim: SimDevice::with_fixed_addresses(index, capacity),
                queues: Mutex::new(Queues {
                    mallocs: mallocs.into_iter().collect(),
                    reservations: reservations.into_iter().collect(),
                    used: AddressUse::default(),
                }),
            }),
        }
    }

    /// The simulated device underneath (event completion, capacity, counters).
    #[must_use]
    pub fn sim(&self) -> &SimDevice {
        &self.inner.sim
    }

    /// An allocator of whole segments from this device, for a memory pool made with its own
    /// allocator (`torch.cuda.MemPool(allocator=...)`): its segments are device allocations at the
    /// recorded addresses, never expandable ones.
    #[must_use]
    pub fn pool_allocator(&self) -> Arc<dyn PoolAllocator> {
        Arc::new(SegmentsOf(self.clone()))
    }

    /// How the addresses of new segments were chosen so far.
    #[must_use]
    pub fn address_use(&self) -> AddressUse {
        self.inner.queues.lock().used
    }

    /// Bytes of capacity in use (device allocations plus physical chunks).
    #[must_use]
    pub fn used_bytes(&self) -> u64 {
        self.sim().counters().used_bytes
    }

    /// Places one new range: with the next recorded address when there is one and it fits, else with
    /// an invented one. `fits` says whether the device has the memory at all; when it has not, the
    /// recorded address stays queued for the retry that follows a release.
    fn place<T>(
        &self,
        pick: fn(&mut Queues) -> &mut VecDeque<u64>,
        fits: bool,
        call: impl Fn() -> DeviceResult<T>,
    ) -> DeviceResult<T> {
        let mut queues = self.inner.queues.lock();
        if fits {
            if let Some(addr) = pick(&mut queues).pop_front() {
                // The simulated device's own queue is empty here (everything pushed is taken by
                // the call right after), so it takes exactly this address.
                self.sim().push_addresses([addr]);
                match call() {
                    Err(DeviceError::Driver { .. }) => {
                        tracing::debug!(
                            addr = format_args!("{addr:#x}"),
                            "recorded address does not fit; inventing one"
                        );
                    }
                    Ok(value) => {
                        queues.used.recorded += 1;
                        return Ok(value);
                    }
                    Err(other) => return Err(other),
                }
            }
        }
        let result = call();
        if result.is_ok() {
            queues.used.invented += 1;
        }
        result
    }
}

// SAFETY: every obligation of `Device` is the simulated device's: each call is forwarded to
// `SimDevice`, which checks queued addresses for alignment and overlap with everything live before
// using them (so (1) and (2) hold whatever address this wrapper queues), completes events only when
// told (3), and never calls back into an allocator (4). This wrapper adds only the choice of which
// address to queue.
unsafe impl Device for ReplayDevice {
    type Event = <SimDevice as Device>::Event;
    type PhysicalChunk = <SimDevice as Device>::PhysicalChunk;

    fn index(&self) -> u32 {
        self.sim().index()
    }

    fn mem_info(&self) -> DeviceResult<MemInfo> {
        self.sim().mem_info()
    }

    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        let fits = size as u64 <= self.sim().mem_info()?.free;
        self.place(|q| &mut q.mallocs, fits, || self.sim().malloc(size))
    }

    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are forwarded unchanged.
        unsafe { self.sim().free(ptr, size) }
    }

    fn create_event(&self) -> DeviceResult<Self::Event> {
        self.sim().create_event()
    }

    fn record_event(&self, event: &Self::Event, stream: StreamId) -> DeviceResult<()> {
        self.sim().record_event(event, stream)
    }

    fn query_event(&self, event: &Self::Event) -> DeviceResult<bool> {
        self.sim().query_event(event)
    }

    fn synchronize_event(&self, event: &Self::Event) -> DeviceResult<()> {
        self.sim().synchronize_event(event)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        self.sim().synchronize()
    }

    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        self.sim().capture_status(stream)
    }

    fn vmm_granularity(&self) -> DeviceResult<usize> {
        self.sim().vmm_granularity()
    }

    fn reserve_address_range(&self, size: usize) -> DeviceResult<DeviceAddress> {
        self.place(
            |q| &mut q.reservations,
            true,
            || self.sim().reserve_address_range(size),
        )
    }

    unsafe fn release_address_range(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are forwarded unchanged.
        unsafe { self.sim().release_address_range(ptr, size) }
    }

    fn create_physical(&self, size: usize) -> DeviceResult<Self::PhysicalChunk> {
        self.sim().create_physical(size)
    }

    unsafe fn map(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: &Self::PhysicalChunk,
    ) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are forwarded unchanged.
        unsafe { self.sim().map(ptr, size, chunk) }
    }

    unsafe fn unmap(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: Self::PhysicalChunk,
    ) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are forwarded unchanged.
        unsafe { self.sim().unmap(ptr, size, chunk) }
    }
}

/// Whole segments from a replay device (see [`ReplayDevice::pool_allocator`]).
#[derive(Debug)]
struct SegmentsOf(ReplayDevice);

impl PoolAllocator for SegmentsOf {
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        self.0.malloc(size)
    }

    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller guarantees `ptr` and `size` are a segment `malloc` returned and no
        // queued work uses it: what the device's `free` asks.
        unsafe { self.0.free(ptr, size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_addresses_are_used_while_they_fit() {
        let d = ReplayDevice::new(0, 1 << 30, [0x1000_0000, 0x1000_0000, 0x3000_0000], []);
        assert_eq!(d.malloc(2 << 20).unwrap(), DeviceAddress(0x1000_0000));
        // The second recorded address overlaps the first segment: an invented one is used.
        let invented = d.malloc(2 << 20).unwrap();
        assert_ne!(invented, DeviceAddress(0x1000_0000));
        assert_eq!(d.malloc(2 << 20).unwrap(), DeviceAddress(0x3000_0000));
        assert_eq!(
            d.address_use(),
            AddressUse {
                recorded: 2,
                invented: 1
            }
        );
    }

    #[test]
    fn a_refused_malloc_keeps_its_recorded_address_for_the_retry() {
        let d = ReplayDevice::new(0, 4 << 20, [0x1000_0000, 0x2000_0000], []);
        assert_eq!(d.malloc(4 << 20).unwrap(), DeviceAddress(0x1000_0000));
        assert!(matches!(
            d.malloc(2 << 20),
            Err(DeviceError::OutOfMemory { .. })
        ));
        // SAFETY: the simulated device checks the pointer and size.
        unsafe { d.free(DeviceAddress(0x1000_0000), 4 << 20).unwrap() };
        assert_eq!(d.malloc(2 << 20).unwrap(), DeviceAddress(0x2000_0000));
    }

    #[test]
    fn reservations_have_their_own_queue() {
        let d = ReplayDevice::new(0, 1 << 30, [0x1000_0000], [0x4000_0000]);
        assert_eq!(
            d.reserve_address_range(64 << 20).unwrap(),
            DeviceAddress(0x4000_0000)
        );
        assert_eq!(d.malloc(2 << 20).unwrap(), DeviceAddress(0x1000_0000));
    }
}
