//! `backend:cudaMallocAsync`: one [`AsyncAllocator`] per device, on the device's default memory pool,
//! made on first use and never dropped (like PyTorch's).
//!
//! When the allocator configuration asks for `backend:cudaMallocAsync` (see
//! [`get_allocator_backend`](super::get_allocator_backend)), these are the allocators every function
//! of the device API serves memory from ([`memory_stats`](super::memory_stats),
//! [`empty_cache`](super::empty_cache), [`caching_allocator_alloc`](super::caching_allocator_alloc),
//! ...), and the PyTorch plugin's. Under `backend:native` a program may still ask for one with
//! [`async_allocator`].

use std::sync::OnceLock;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::config::{AllocatorConfig, Backend};
use tensormem_cuda_alloc::AsyncAllocator;

use super::device::resolve;
use super::error::{Error, Result};
use super::registry;

/// One slot per device ordinal, filled on the device's first use.
static ALLOCATORS: OnceLock<Box<[OnceLock<AsyncAllocator>]>> = OnceLock::new();

/// The `backend:cudaMallocAsync` allocator of `device`, or of the current device, made on first use:
/// the device's default memory pool with PyTorch's settings (release threshold `u64::MAX`), shared
/// with every other user of that pool in the process. Under `backend:cudaMallocAsync` it is the
/// allocator the device API serves `device` with.
///
/// # Errors
///
/// [`Error::ForkedChild`] in a bad fork; [`Error::InvalidDevice`]; the driver's errors (a device
/// without memory pools among them) as [`Error::Alloc`].
pub fn async_allocator(device: Option<u32>) -> Result<&'static AsyncAllocator> {
    async_allocator_of(resolve(device)?)
}

/// [`async_allocator`] of device `ordinal`.
pub(crate) fn async_allocator_of(ordinal: u32) -> Result<&'static AsyncAllocator> {
    let count = registry::get()?.device_count();
    let slots = ALLOCATORS.get_or_init(|| (0..count).map(|_| OnceLock::new()).collect());
    let Some(slot) = slots.get(ordinal as usize) else {
        return Err(Error::InvalidDevice {
            device: ordinal,
            count,
        });
    };
    if let Some(allocator) = slot.get() {
        return Ok(allocator);
    }
    let made = AsyncAllocator::new(CudaBackend::new(ordinal)?)?;
    // A thread that lost the race drops its allocator, which holds no memory yet.
    Ok(slot.get_or_init(|| made))
}

/// The devices whose async allocator was made, in ordinal order.
pub(crate) fn made() -> impl Iterator<Item = u32> {
    ALLOCATORS
        .get()
        .into_iter()
        .flat_map(|slots| slots.iter().enumerate())
        .filter(|(_, slot)| slot.get().is_some())
        .map(|(ordinal, _)| ordinal as u32)
}

/// The backend the environment's allocator configuration asks for now (`TENSORMEM_ALLOC_CONF`, else
/// PyTorch's variables; `backend:native` when none names one), read again at each call. The backend
/// the process runs is [`get_allocator_backend`](super::get_allocator_backend), read once.
///
/// # Errors
///
/// [`Error::Alloc`] when the variable holds a malformed configuration.
pub fn configured_backend() -> Result<Backend> {
    Ok(AllocatorConfig::read_env()?.backend)
}
