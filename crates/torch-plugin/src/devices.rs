//! From PyTorch's device index to the allocator that serves the device: tensormem's caching
//! allocator, or under `backend:cudaMallocAsync` the device's `AsyncAllocator`, as the device API
//! decides for the process ([`tensormem::cuda::get_allocator_backend`]).

use std::ffi::c_int;
use std::sync::OnceLock;

use tensormem::cuda::{self, AsyncUnsupported, DeviceAllocator};
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::CachingAllocator;

use crate::error::{Error, Result};

/// The caching allocator of one device.
pub(crate) type Allocator = CachingAllocator<CudaBackend>;

/// Devices whose allocator is remembered here (more are looked up in the device API each time).
const CACHED: usize = 64;

/// The allocators the plugin used, by ordinal: the hot path reads one slot instead of the device API's
/// table (and the devices touched are the ones to search for a pointer of unknown device).
static USED: [OnceLock<DeviceAllocator>; CACHED] = [const { OnceLock::new() }; CACHED];

/// The allocator serving device `device`, opened on first use (configured from
/// `TENSORMEM_ALLOC_CONF`, else PyTorch's variables).
///
/// # Errors
///
/// [`Error::InvalidDevice`] for a negative index; the device API's errors (bad fork, no driver, an
/// ordinal past the device count, a malformed configuration).
#[inline]
pub(crate) fn served(device: c_int) -> Result<DeviceAllocator> {
    let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
    if cuda::is_in_bad_fork() {
        return Err(cuda::Error::ForkedChild.into());
    }
    if let Some(slot) = USED.get(ordinal as usize) {
        if let Some(&allocator) = slot.get() {
            return Ok(allocator);
        }
        let allocator = cuda::device_allocator(Some(ordinal))?;
        let allocator = *slot.get_or_init(|| allocator);
        if let DeviceAllocator::Native(allocator) = allocator {
            crate::native::attach_hooks(allocator);
        }
        return Ok(allocator);
    }
    Ok(cuda::device_allocator(Some(ordinal))?)
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
    Ok(served(device)?.native(what)?)
}

/// The allocators the plugin has used so far (devices past the cache are not listed).
pub(crate) fn used() -> impl Iterator<Item = DeviceAllocator> {
    USED.iter().filter_map(|slot| slot.get().copied())
}

/// The caching allocators the plugin has used so far, after the check that the process runs them:
/// `what` names PyTorch's refusal under `backend:cudaMallocAsync`.
///
/// # Errors
///
/// [`tensormem::cuda::Error::AsyncUnsupported`] under `backend:cudaMallocAsync`.
pub(crate) fn used_native(
    what: AsyncUnsupported,
) -> Result<impl Iterator<Item = &'static Allocator>> {
    cuda::backend_supports(what)?;
    Ok(used().filter_map(|allocator| match allocator {
        DeviceAllocator::Native(allocator) => Some(allocator),
        DeviceAllocator::Async(_) => None,
    }))
}
