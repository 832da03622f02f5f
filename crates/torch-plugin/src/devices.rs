//! From PyTorch's device index to tensormem's per-device caching allocator.

use std::ffi::c_int;
use std::sync::OnceLock;

use tensormem::cuda;
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::CachingAllocator;

use crate::error::{Error, Result};

/// The allocator of one device.
pub(crate) type Allocator = CachingAllocator<CudaBackend>;

/// Devices whose allocator is remembered here (more are looked up in the device API each time).
const CACHED: usize = 64;

/// The allocators the plugin used, by ordinal: the hot path reads one slot instead of the device API's
/// table (and the devices touched are the ones to search for a pointer of unknown device).
static USED: [OnceLock<&'static Allocator>; CACHED] = [const { OnceLock::new() }; CACHED];

/// The caching allocator of device `device`, opened on first use (configured from
/// `TENSORMEM_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`).
///
/// # Errors
///
/// [`Error::InvalidDevice`] for a negative index; the device API's errors (bad fork, no driver, an
/// ordinal past the device count, a malformed configuration).
#[inline]
pub(crate) fn allocator(device: c_int) -> Result<&'static Allocator> {
    let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
    if cuda::is_in_bad_fork() {
        return Err(cuda::Error::ForkedChild.into());
    }
    if let Some(slot) = USED.get(ordinal as usize) {
        if let Some(&allocator) = slot.get() {
            return Ok(allocator);
        }
        let allocator = cuda::caching_allocator(Some(ordinal))?;
        let allocator = *slot.get_or_init(|| allocator);
        crate::native::attach_hooks(allocator);
        return Ok(allocator);
    }
    Ok(cuda::caching_allocator(Some(ordinal))?)
}

/// The allocators the plugin has used so far (devices past the cache are not listed).
pub(crate) fn used() -> impl Iterator<Item = &'static Allocator> {
    USED.iter().filter_map(|slot| slot.get().copied())
}
