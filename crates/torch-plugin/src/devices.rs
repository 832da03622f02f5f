//! From PyTorch's device index to the allocator that serves the device: tensormem's caching
//! allocator, or under `backend:cudaMallocAsync` the device's `AsyncAllocator`, as the process
//! runtime (`tensormem-runtime`) decided for the process. The runtime keeps the one table of
//! devices; the plugin keeps none, so an allocator opened first by a storage or the device API is
//! the one the plugin serves from, with the C++ layer's hooks attached all the same.

use std::ffi::c_int;

use tensormem::cuda::{self, AsyncUnsupported};
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::CachingAllocator;
use tensormem_runtime::DeviceAllocator;

use crate::error::{Error, Result};

/// The caching allocator of one device.
pub(crate) type Allocator = CachingAllocator<CudaBackend>;

/// The runtime's error as the device API reports it (PyTorch's messages and codes).
fn runtime_error(err: tensormem_runtime::Error) -> Error {
    cuda::Error::from(err).into()
}

/// The allocator serving device `device`, opened on first use (configured from
/// `TENSORMEM_ALLOC_CONF`, else PyTorch's variables).
///
/// # Errors
///
/// [`Error::InvalidDevice`] for a negative index; the runtime's errors (bad fork, no driver, an
/// ordinal past the device count, a malformed configuration).
#[inline]
pub(crate) fn served(device: c_int) -> Result<DeviceAllocator> {
    let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
    tensormem_runtime::allocator(ordinal).map_err(runtime_error)
}

/// The caching allocator of device `device`, for what only it does: `what` names PyTorch's refusal
/// under `backend:cudaMallocAsync`, which comes before the device is touched.
///
/// # Errors
///
/// [`tensormem::cuda::Error::AsyncUnsupported`] under `backend:cudaMallocAsync`; as [`served`].
#[inline]
pub(crate) fn allocator(device: c_int, what: AsyncUnsupported) -> Result<&'static Allocator> {
    cuda::backend_supports(what)?;
    served(device)?.native(what).map_err(runtime_error)
}

/// The allocators the process has opened so far (by the plugin or any other user of the runtime),
/// in ordinal order; none before the plugin served its first device (asking starts no CUDA: the
/// C++ layer sets its hooks when it is installed, before PyTorch initialises CUDA).
///
/// # Errors
///
/// [`tensormem::cuda::Error::ForkedChild`] in a bad fork.
#[inline]
pub(crate) fn used() -> Result<impl Iterator<Item = DeviceAllocator>> {
    let opened = tensormem_runtime::opened().map_err(runtime_error)?;
    Ok(opened.map(|(_, allocator)| allocator))
}

/// The caching allocators the process has opened so far, after the check that the process runs
/// them: `what` names PyTorch's refusal under `backend:cudaMallocAsync`.
///
/// # Errors
///
/// [`tensormem::cuda::Error::AsyncUnsupported`] under `backend:cudaMallocAsync`; as [`used`].
pub(crate) fn used_native(
    what: AsyncUnsupported,
) -> Result<impl Iterator<Item = &'static Allocator>> {
    cuda::backend_supports(what)?;
    Ok(used()?.filter_map(|allocator| match allocator {
        DeviceAllocator::Native(allocator) => Some(allocator),
        DeviceAllocator::Async(_) => None,
    }))
}
