//! [`DeviceMemory`]: what both of a device's allocators serve, under one name per operation.

use crate::config::Backend;
use crate::device::{Device, DeviceAddress, StreamId};
use crate::error::Result;
use crate::pool_id::MempoolId;
use crate::stats::MemoryStats;
use crate::CachingAllocator;

/// Decides, for the caching allocator, which allocations of a capture go to its private pool: it
/// is asked with the stream of each allocation while the capture lasts (PyTorch's filter of
/// `beginAllocateToPool`).
pub type CaptureFilter = Box<dyn Fn(StreamId) -> bool + Send + Sync>;

/// [`DeviceMemory`]: what both of a device's allocators serve, under one name per operation.
///
/// PyTorch answers every `torch.cuda` memory call through one interface, `CUDAAllocator`, with two
/// implementations: the caching allocator (`backend:native`) and `CudaMallocAsyncAllocator`
/// (`backend:cudaMallocAsync`). [`DeviceMemory`] is the part of that interface both of
/// tensormem's allocators serve: [`CachingAllocator`] and, with feature `cuda`,
/// [`AsyncAllocator`](crate::AsyncAllocator). What only the caching allocator does (snapshots,
/// history, private pools, checkpoints, sleep) stays on its own type, reached through
/// [`DeviceMemory::caching`].
///
/// Memory is named by pointer here, as in PyTorch's interface; [`CachingAllocator`]'s own
/// [`Allocation`](crate::Allocation) handles remain the faster way for callers that keep them.
/// Each implementation keeps its hot path statically dispatched; the trait is the seam callers use.
///
/// ```
/// use tensormem_cuda_alloc::backend::sim::SimDevice;
/// use tensormem_cuda_alloc::{CachingAllocator, DeviceMemory, StreamId};
///
/// fn churn(memory: &impl DeviceMemory) -> tensormem_cuda_alloc::Result<()> {
///     let ptr = memory.allocate(1 << 20, StreamId::DEFAULT)?;
///     memory.free(ptr)?;
///     memory.empty_cache()
/// }
///
/// let allocator = CachingAllocator::new(SimDevice::new(1 << 30));
/// churn(&allocator)?;
/// assert_eq!(DeviceMemory::memory_stats(&allocator)?.reserved_bytes.all.current, 0);
/// # Ok::<(), tensormem_cuda_alloc::Error>(())
/// ```
pub trait DeviceMemory: Send + Sync {
    /// The device the memory is on.
    type Device: Device;

    /// The device.
    fn device(&self) -> &Self::Device;

    /// Which implementation this is (`backend:native` or `backend:cudaMallocAsync`).
    fn backend(&self) -> Backend;

    /// `size` bytes for work on `stream` (PyTorch's `raw_alloc_with_stream`).
    ///
    /// # Errors
    /// Out of memory (PyTorch's message), or the device's errors.
    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddress>;

    /// Frees memory from [`allocate`](Self::allocate) (PyTorch's `raw_delete`): reused once the
    /// work queued on its streams has finished.
    ///
    /// # Errors
    /// [`Error::InvalidPointer`](crate::Error::InvalidPointer) for a pointer not handed out here.
    fn free(&self, ptr: DeviceAddress) -> Result<()>;

    /// Marks memory at `ptr` as used by work on `stream` too (PyTorch's `recordStream`).
    ///
    /// # Errors
    /// A pointer not handed out here; a stream the device does not know.
    fn record_stream(&self, ptr: DeviceAddress, stream: StreamId) -> Result<()>;

    /// The statistics of `torch.cuda.memory_stats()` (under `backend:cudaMallocAsync`, the six
    /// figures PyTorch fills from the driver's pool).
    ///
    /// # Errors
    /// The driver's, where the figures come from it.
    fn memory_stats(&self) -> Result<MemoryStats>;

    /// Resets the peaks to the current values (`torch.cuda.reset_peak_memory_stats`).
    ///
    /// # Errors
    /// The driver's, where the figures come from it.
    fn reset_peak_stats(&self) -> Result<()>;

    /// Resets the accumulated counts (`torch.cuda.reset_accumulated_memory_stats`).
    ///
    /// # Errors
    /// The driver's, where the figures come from it.
    fn reset_accumulated_stats(&self) -> Result<()>;

    /// Returns unused cached memory to the device (`torch.cuda.empty_cache`).
    ///
    /// # Errors
    /// The device's.
    fn empty_cache(&self) -> Result<()>;

    /// Limits this allocator to `fraction` of the device's memory
    /// (`torch.cuda.set_per_process_memory_fraction`).
    ///
    /// # Errors
    /// [`Error::InvalidFraction`](crate::Error::InvalidFraction) outside `[0, 1]`; the device's.
    fn set_memory_fraction(&self, fraction: f64) -> Result<()>;

    /// The fraction in force (1.0 when none was set; `torch.cuda.get_per_process_memory_fraction`).
    ///
    /// # Errors
    /// The device's.
    fn memory_fraction(&self) -> Result<f64>;

    /// The allocation `ptr` lies in, and its size (PyTorch's `getBaseAllocation`).
    ///
    /// # Errors
    /// A pointer not handed out here.
    fn base_allocation(&self, ptr: DeviceAddress) -> Result<(DeviceAddress, usize)>;

    /// About the largest block that can be had now for work on `stream` (PyTorch's `cacheInfo`,
    /// which sizes cuDNN's workspace).
    ///
    /// # Errors
    /// The device's.
    fn largest_available(&self, stream: StreamId) -> Result<u64>;

    /// A graph capture into private pool `pool` begins (PyTorch's `beginAllocateToPool`); the
    /// caching allocator asks `filter` which allocations go to the pool, the async allocator keeps
    /// its capture bookkeeping (one capture at a time) and ignores both.
    ///
    /// # Errors
    /// A pool or capture that cannot begin (asleep, already capturing).
    fn begin_capture(&self, pool: MempoolId, filter: CaptureFilter) -> Result<()>;

    /// The capture into `pool` ends (PyTorch's `endAllocateToPool`); `capture_stream` is the stream
    /// it ran on (the async allocator joins the streams it freed on into it).
    ///
    /// # Errors
    /// No such capture underway; the device's.
    fn end_capture(&self, pool: MempoolId, capture_stream: StreamId) -> Result<()>;

    /// One user of private pool `pool` is done with it (PyTorch's `releasePool`; nothing under
    /// `backend:cudaMallocAsync`).
    ///
    /// # Errors
    /// A pool that does not exist or was released by every user.
    fn release_pool(&self, pool: MempoolId) -> Result<()>;

    /// Lets kernels on `peer` reach this allocator's memory (PyTorch's `enablePeerAccess`: nothing
    /// more for the caching allocator once the contexts have peer access; the pool's access for
    /// the async one).
    ///
    /// # Errors
    /// The driver's.
    fn enable_peer_access(&self, peer: &Self::Device) -> Result<()>;

    /// The caching allocator, when this is one: for what only it does.
    fn caching(&self) -> Option<&CachingAllocator<Self::Device>>;
}

impl<D: Device> DeviceMemory for CachingAllocator<D> {
    type Device = D;

    fn device(&self) -> &D {
        CachingAllocator::device(self)
    }

    fn backend(&self) -> Backend {
        Backend::Native
    }

    #[inline]
    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddress> {
        self.raw_alloc(size, stream)
    }

    #[inline]
    fn free(&self, ptr: DeviceAddress) -> Result<()> {
        self.raw_free(ptr)
    }

    fn record_stream(&self, ptr: DeviceAddress, stream: StreamId) -> Result<()> {
        self.record_stream_ptr(ptr, stream)
    }

    fn memory_stats(&self) -> Result<MemoryStats> {
        Ok(CachingAllocator::memory_stats(self))
    }

    fn reset_peak_stats(&self) -> Result<()> {
        CachingAllocator::reset_peak_stats(self);
        Ok(())
    }

    fn reset_accumulated_stats(&self) -> Result<()> {
        CachingAllocator::reset_accumulated_stats(self);
        Ok(())
    }

    fn empty_cache(&self) -> Result<()> {
        CachingAllocator::empty_cache(self)
    }

    fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        CachingAllocator::set_memory_fraction(self, fraction)
    }

    fn memory_fraction(&self) -> Result<f64> {
        CachingAllocator::memory_fraction(self)
    }

    fn base_allocation(&self, ptr: DeviceAddress) -> Result<(DeviceAddress, usize)> {
        CachingAllocator::base_allocation(self, ptr)
    }

    fn largest_available(&self, _stream: StreamId) -> Result<u64> {
        self.cache_info()
    }

    fn begin_capture(&self, pool: MempoolId, filter: CaptureFilter) -> Result<()> {
        self.begin_allocate_to_pool(pool, filter)
    }

    fn end_capture(&self, pool: MempoolId, _capture_stream: StreamId) -> Result<()> {
        self.end_allocate_to_pool(pool)
    }

    fn release_pool(&self, pool: MempoolId) -> Result<()> {
        CachingAllocator::release_pool(self, pool)
    }

    fn enable_peer_access(&self, _peer: &D) -> Result<()> {
        Ok(())
    }

    fn caching(&self) -> Option<&CachingAllocator<D>> {
        Some(self)
    }
}

#[cfg(feature = "cuda")]
impl DeviceMemory for crate::AsyncAllocator {
    type Device = crate::backend::cuda::CudaBackend;

    fn device(&self) -> &Self::Device {
        crate::AsyncAllocator::device(self)
    }

    fn backend(&self) -> Backend {
        Backend::CudaMallocAsync
    }

    #[inline]
    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddress> {
        crate::AsyncAllocator::allocate(self, size, stream)
    }

    #[inline]
    fn free(&self, ptr: DeviceAddress) -> Result<()> {
        crate::AsyncAllocator::free(self, ptr)
    }

    fn record_stream(&self, ptr: DeviceAddress, stream: StreamId) -> Result<()> {
        crate::AsyncAllocator::record_stream(self, ptr, stream)
    }

    fn memory_stats(&self) -> Result<MemoryStats> {
        crate::AsyncAllocator::memory_stats(self)
    }

    fn reset_peak_stats(&self) -> Result<()> {
        crate::AsyncAllocator::reset_peak_stats(self)
    }

    fn reset_accumulated_stats(&self) -> Result<()> {
        crate::AsyncAllocator::reset_accumulated_stats(self);
        Ok(())
    }

    fn empty_cache(&self) -> Result<()> {
        crate::AsyncAllocator::empty_cache(self)
    }

    fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        crate::AsyncAllocator::set_memory_fraction(self, fraction)
    }

    fn memory_fraction(&self) -> Result<f64> {
        match self.memory_limit() {
            None => Ok(1.0),
            Some(limit) => Ok(limit as f64 / self.mem_info()?.total.max(1) as f64),
        }
    }

    fn base_allocation(&self, ptr: DeviceAddress) -> Result<(DeviceAddress, usize)> {
        self.allocation_size(ptr)
            .map(|size| (ptr, size))
            .ok_or(crate::Error::InvalidPointer { ptr })
    }

    fn largest_available(&self, stream: StreamId) -> Result<u64> {
        self.cache_info(stream)
    }

    fn begin_capture(&self, _pool: MempoolId, _filter: CaptureFilter) -> Result<()> {
        crate::AsyncAllocator::begin_capture(self)
    }

    fn end_capture(&self, _pool: MempoolId, capture_stream: StreamId) -> Result<()> {
        crate::AsyncAllocator::end_capture(self, capture_stream)
    }

    fn release_pool(&self, _pool: MempoolId) -> Result<()> {
        Ok(())
    }

    fn enable_peer_access(&self, peer: &Self::Device) -> Result<()> {
        crate::AsyncAllocator::enable_peer_access(self, peer)
    }

    fn caching(&self) -> Option<&CachingAllocator<Self::Device>> {
        None
    }
}
