//! Which allocator serves the process (`backend:native|cudaMallocAsync`), as the process runtime
//! (`tensormem-runtime`) decided it once, with the device API's errors.

use tensormem_cuda_alloc::config::Backend;
use tensormem_cuda_alloc::AsyncAllocator;
pub use tensormem_runtime::{AsyncUnsupported, DeviceAllocator};

use super::device::resolve;
use super::error::Result;

/// The name of the allocator backend that serves device memory in this process
/// (`torch.cuda.get_allocator_backend()`): [`Backend::Native`] (`"native"`, tensormem's caching
/// allocator) or [`Backend::CudaMallocAsync`] (`"cudaMallocAsync"`, [`AsyncAllocator`]), as the
/// allocator configuration in the environment asks ([`tensormem_runtime::get_allocator_backend`]).
/// Read once; it cannot change afterwards ([`set_allocator_settings`](super::set_allocator_settings)
/// refuses another backend). Needs no driver.
///
/// # Errors
///
/// [`Error::Alloc`](super::Error::Alloc) with the configuration error when the variable holds a
/// malformed configuration.
pub fn get_allocator_backend() -> Result<Backend> {
    Ok(tensormem_runtime::get_allocator_backend()?)
}

/// `Ok` when the process's backend supports `what`;
/// [`Error::AsyncUnsupported`](super::Error::AsyncUnsupported) when the process runs
/// `backend:cudaMallocAsync`, which refuses it. Reads no device: a refusal needs no driver.
///
/// # Errors
///
/// As said; the configuration's error when it is malformed.
pub fn backend_supports(what: AsyncUnsupported) -> Result<()> {
    Ok(tensormem_runtime::backend_supports(what)?)
}

/// The allocator serving `device`, or the current device, as the process's backend says (see
/// [`get_allocator_backend`]); made on the device's first use, the same one every user of the
/// device gets ([`tensormem_runtime::allocator`]).
///
/// # Errors
///
/// [`Error::InvalidDevice`](super::Error::InvalidDevice); the errors of opening the device (the
/// driver's, a malformed configuration, a device without memory pools under
/// `backend:cudaMallocAsync`).
pub fn device_allocator(device: Option<u32>) -> Result<DeviceAllocator> {
    Ok(tensormem_runtime::allocator(resolve(device)?)?)
}

/// The `backend:cudaMallocAsync` allocator of `device`, or of the current device, made on first
/// use: the device's default memory pool with PyTorch's settings (release threshold `u64::MAX`).
/// Under `backend:cudaMallocAsync` it is the allocator the device API serves `device` with.
///
/// # Errors
///
/// [`Error::ForkedChild`](super::Error::ForkedChild) in a bad fork;
/// [`Error::InvalidDevice`](super::Error::InvalidDevice); the driver's errors (a device without
/// memory pools among them).
pub fn async_allocator(device: Option<u32>) -> Result<&'static AsyncAllocator> {
    Ok(tensormem_runtime::async_allocator(resolve(device)?)?)
}

/// The backend the environment's allocator configuration asks for now, read again at each call.
/// The backend the process runs is [`get_allocator_backend`], read once.
///
/// # Errors
///
/// [`Error::Alloc`](super::Error::Alloc) when the variable holds a malformed configuration.
pub fn configured_backend() -> Result<Backend> {
    Ok(tensormem_runtime::configured_backend()?)
}
