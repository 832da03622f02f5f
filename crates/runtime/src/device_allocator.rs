//! [`DeviceAllocator`]: the allocator that serves one device, as the process's backend says.

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::config::Backend;
use tensormem_cuda_alloc::stats::MemoryStats;
use tensormem_cuda_alloc::{
    AsyncAllocator, CachingAllocator, CaptureFilter, DeviceAddress, DeviceMemory, MempoolId,
    StreamId,
};

use crate::error::{Error, Result};
use crate::unsupported::AsyncUnsupported;

/// The allocator that serves one device: the process's caching allocator of the device
/// (`backend:native`) or the device's [`AsyncAllocator`] (`backend:cudaMallocAsync`). Both live for
/// the rest of the process. It serves [`DeviceMemory`] by dispatching on the two (no virtual call);
/// [`native`](Self::native) gives the caching allocator for what only it does.
#[derive(Clone, Copy, Debug)]
pub enum DeviceAllocator {
    /// tensormem's caching allocator (`backend:native`).
    Native(&'static CachingAllocator<CudaBackend>),
    /// The driver's stream-ordered allocator (`backend:cudaMallocAsync`).
    Async(&'static AsyncAllocator),
}

/// Calls `$call` on whichever allocator `$self` is, through [`DeviceMemory`].
macro_rules! each {
    ($self:expr, $a:ident => $call:expr) => {
        match $self {
            DeviceAllocator::Native($a) => $call,
            DeviceAllocator::Async($a) => $call,
        }
    };
}

impl DeviceAllocator {
    /// The caching allocator, for what only it can do.
    ///
    /// # Errors
    ///
    /// [`Error::AsyncUnsupported`] with `what` under `backend:cudaMallocAsync`.
    #[inline]
    pub fn native(self, what: AsyncUnsupported) -> Result<&'static CachingAllocator<CudaBackend>> {
        match self {
            DeviceAllocator::Native(allocator) => Ok(allocator),
            DeviceAllocator::Async(_) => Err(Error::AsyncUnsupported(what)),
        }
    }

    /// The device's async allocator, when it serves the device.
    #[must_use]
    pub fn as_async(self) -> Option<&'static AsyncAllocator> {
        match self {
            DeviceAllocator::Native(_) => None,
            DeviceAllocator::Async(allocator) => Some(allocator),
        }
    }
}

impl DeviceMemory for DeviceAllocator {
    type Device = CudaBackend;

    #[inline]
    fn device(&self) -> &CudaBackend {
        each!(self, a => DeviceMemory::device(*a))
    }

    fn backend(&self) -> Backend {
        each!(self, a => DeviceMemory::backend(*a))
    }

    #[inline]
    fn allocate(
        &self,
        size: usize,
        stream: StreamId,
    ) -> tensormem_cuda_alloc::Result<DeviceAddress> {
        each!(self, a => DeviceMemory::allocate(*a, size, stream))
    }

    #[inline]
    fn free(&self, ptr: DeviceAddress) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::free(*a, ptr))
    }

    #[inline]
    fn record_stream(
        &self,
        ptr: DeviceAddress,
        stream: StreamId,
    ) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::record_stream(*a, ptr, stream))
    }

    fn memory_stats(&self) -> tensormem_cuda_alloc::Result<MemoryStats> {
        each!(self, a => DeviceMemory::memory_stats(*a))
    }

    fn reset_peak_stats(&self) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::reset_peak_stats(*a))
    }

    fn reset_accumulated_stats(&self) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::reset_accumulated_stats(*a))
    }

    fn empty_cache(&self) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::empty_cache(*a))
    }

    fn set_memory_fraction(&self, fraction: f64) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::set_memory_fraction(*a, fraction))
    }

    fn memory_fraction(&self) -> tensormem_cuda_alloc::Result<f64> {
        each!(self, a => DeviceMemory::memory_fraction(*a))
    }

    fn base_allocation(
        &self,
        ptr: DeviceAddress,
    ) -> tensormem_cuda_alloc::Result<(DeviceAddress, usize)> {
        each!(self, a => DeviceMemory::base_allocation(*a, ptr))
    }

    fn largest_available(&self, stream: StreamId) -> tensormem_cuda_alloc::Result<u64> {
        each!(self, a => DeviceMemory::largest_available(*a, stream))
    }

    fn begin_capture(
        &self,
        pool: MempoolId,
        filter: CaptureFilter,
    ) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::begin_capture(*a, pool, filter))
    }

    fn end_capture(
        &self,
        pool: MempoolId,
        capture_stream: StreamId,
    ) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::end_capture(*a, pool, capture_stream))
    }

    fn release_pool(&self, pool: MempoolId) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::release_pool(*a, pool))
    }

    fn enable_peer_access(&self, peer: &CudaBackend) -> tensormem_cuda_alloc::Result<()> {
        each!(self, a => DeviceMemory::enable_peer_access(*a, peer))
    }

    fn caching(&self) -> Option<&CachingAllocator<CudaBackend>> {
        match self {
            DeviceAllocator::Native(allocator) => Some(allocator),
            DeviceAllocator::Async(_) => None,
        }
    }
}
