//! `backend:cudaMallocAsync` beside the caching allocators: one [`AsyncAllocator`] per device, on the
//! device's default memory pool, made on first use and never dropped (like PyTorch's).
//!
//! The functions of the `torch.cuda` surface ([`memory_stats`](super::memory_stats),
//! [`empty_cache`](super::empty_cache), [`caching_allocator_alloc`](super::caching_allocator_alloc),
//! ...) stay on the caching allocator, which CUDA storages, CUDA IPC and the PyTorch plugin share; the
//! async allocator is asked for explicitly with [`async_allocator`], and
//! [`configured_backend`] tells which backend the environment asks for, so that a program can pick.

use std::sync::OnceLock;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::config::{AllocatorConfig, Backend};
use tensormem_cuda_alloc::AsyncAllocator;

use super::device::resolve;
use super::error::{Error, Result};
use super::registry;

/// The `backend:cudaMallocAsync` allocator of `device`, or of the current device, made on first use:
/// the device's default memory pool with PyTorch's settings (release threshold `u64::MAX`), shared
/// with every other user of that pool in the process.
///
/// # Errors
///
/// [`Error::ForkedChild`] in a bad fork; [`Error::InvalidDevice`]; the driver's errors (a device
/// without memory pools among them) as [`Error::Alloc`].
pub fn async_allocator(device: Option<u32>) -> Result<&'static AsyncAllocator> {
    static ALLOCATORS: OnceLock<Box<[OnceLock<AsyncAllocator>]>> = OnceLock::new();
    let count = registry::get()?.device_count();
    let device = resolve(device)?;
    let slots = ALLOCATORS.get_or_init(|| (0..count).map(|_| OnceLock::new()).collect());
    let Some(slot) = slots.get(device as usize) else {
        return Err(Error::InvalidDevice { device, count });
    };
    if let Some(allocator) = slot.get() {
        return Ok(allocator);
    }
    let made = AsyncAllocator::new(CudaBackend::new(device)?)?;
    // A thread that lost the race drops its allocator, which holds no memory yet.
    Ok(slot.get_or_init(|| made))
}

/// The backend the environment's allocator configuration asks for (`TENSORMEM_ALLOC_CONF`, else
/// PyTorch's variables; `backend:native` when none names one). Unlike the caching allocator, which
/// refuses a configuration asking for `backend:cudaMallocAsync`, this accepts both, so that a program
/// can serve [`Backend::CudaMallocAsync`] with [`async_allocator`].
///
/// # Errors
///
/// [`Error::Alloc`] when the variable holds a malformed configuration.
pub fn configured_backend() -> Result<Backend> {
    Ok(AllocatorConfig::read_env()?.backend)
}
