//! Devices: how many, which one is current on this thread, what they are, peer access, synchronisation.

use std::cell::Cell;

use tensormem_cuda_alloc::backend::cuda::{self as backend, DeviceProperties};
use tensormem_cuda_alloc::{Device, MemInfo};

use tensormem_runtime::DeviceMemory;

use super::error::Result;

thread_local! {
    /// This thread's current device (`torch.cuda.current_device()`); 0 until set.
    static CURRENT_DEVICE: Cell<u32> = const { Cell::new(0) };
}

/// Whether CUDA can be used: a driver is installed and sees at least one device. Never fails; the
/// reason for `false` is what [`device_count`] returns as an error.
#[must_use]
pub fn is_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// The number of CUDA devices (`torch.cuda.device_count()`, `cuDeviceGetCount`).
///
/// # Errors
///
/// [`Error::ForkedChild`](super::Error::ForkedChild) in a bad fork; [`Error::Device`](super::Error::Device)
/// when there is no driver (code 100, with a message saying what is missing).
pub fn device_count() -> Result<u32> {
    Ok(tensormem_runtime::device_count()?)
}

/// Whether `device`'s primary context is active (`torch._C._cuda_hasPrimaryContext`,
/// `cuDevicePrimaryCtxGetState`): something in the process (this API once the device was used, the
/// CUDA runtime, PyTorch) created it. Asking creates no context.
///
/// # Errors
///
/// [`Error::InvalidDevice`](super::Error::InvalidDevice) for an ordinal past the device count; as
/// [`device_count`].
pub fn has_primary_context(device: u32) -> Result<bool> {
    tensormem_runtime::check_ordinal(device)?;
    Ok(backend::has_primary_context(device)?)
}

/// This thread's current device (`torch.cuda.current_device()`): the device that calls without an
/// explicit one use. 0 until [`set_device`] changes it.
///
/// # Errors
///
/// As [`device_count`]: using CUDA initialises it.
pub fn current_device() -> Result<u32> {
    tensormem_runtime::device_count()?;
    Ok(CURRENT_DEVICE.with(Cell::get))
}

/// Makes `device` this thread's current device (`torch.cuda.set_device`), and its primary context the
/// driver's current context on this thread, so that raw driver or runtime calls made afterwards on this
/// thread act on it too.
///
/// # Errors
///
/// [`Error::InvalidDevice`](super::Error::InvalidDevice) for an ordinal past the device count; the
/// errors of [`device_count`].
pub fn set_device(device: u32) -> Result<()> {
    device_of(device)?.make_current()?;
    CURRENT_DEVICE.with(|c| c.set(device));
    Ok(())
}

/// Makes `device` current and returns the device that was (`torch.cuda._exchange_device`).
///
/// # Errors
///
/// As [`set_device`]; on error the current device is unchanged.
pub fn exchange_device(device: u32) -> Result<u32> {
    let previous = current_device()?;
    if previous != device {
        set_device(device)?;
    }
    Ok(previous)
}

/// Makes `device` current until the guard is dropped, then restores the device that was current
/// (`with torch.cuda.device(i):`).
///
/// # Errors
///
/// As [`set_device`].
pub fn device_guard(device: u32) -> Result<DeviceGuard> {
    let previous = exchange_device(device)?;
    Ok(DeviceGuard {
        previous,
        _not_send: std::marker::PhantomData,
    })
}

/// Restores the previous current device when dropped; see [`device_guard`]. Bound to the thread that
/// made it (the current device is per thread).
#[derive(Debug)]
#[must_use = "the previous device is restored when the guard is dropped"]
pub struct DeviceGuard {
    previous: u32,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for DeviceGuard {
    fn drop(&mut self) {
        if let Err(err) = set_device(self.previous) {
            tracing::warn!(%err, device = self.previous, "restoring the current device failed");
        }
    }
}

/// The device a call acts on: `device`, or this thread's current device.
pub(crate) fn resolve(device: Option<u32>) -> Result<u32> {
    match device {
        Some(d) => Ok(d),
        None => current_device(),
    }
}

/// Whether `device` can access `peer`'s memory directly (`torch.cuda.can_device_access_peer`,
/// `cuDeviceCanAccessPeer`). A device is not its own peer.
///
/// # Errors
///
/// [`Error::InvalidDevice`](super::Error::InvalidDevice) for an ordinal past the device count; the
/// errors of [`device_count`].
pub fn can_device_access_peer(device: u32, peer: u32) -> Result<bool> {
    tensormem_runtime::check_ordinal(device)?;
    tensormem_runtime::check_ordinal(peer)?;
    Ok(backend::can_access_peer(device, peer)?)
}

/// Lets kernels and copies on `device` access `peer`'s memory directly, including `peer`'s expandable
/// segments (`cuCtxEnablePeerAccess` and `cuMemSetAccess`; what PyTorch does on the first copy between
/// two devices). Under `backend:cudaMallocAsync` also `peer`'s memory pool, which context peer access
/// does not cover (`cuMemPoolSetAccess`, PyTorch's `enablePeerAccess` for that backend). Enabling
/// twice is not an error.
///
/// # Errors
///
/// [`Error::Device`](super::Error::Device) with
/// [`DeviceError::Unsupported`](tensormem_cuda_alloc::DeviceError::Unsupported) when the hardware cannot;
/// the errors of [`set_device`].
pub fn enable_peer_access(device: u32, peer: u32) -> Result<()> {
    let (d, p) = (device_of(device)?, device_of(peer)?);
    d.enable_peer_access(p)?;
    Ok(tensormem_runtime::allocator(peer)?.enable_peer_access(d)?)
}

/// The properties of `device`, or of the current device (`torch.cuda.get_device_properties`): name,
/// compute capability, total memory, multiprocessor count, UUID, ...
///
/// # Errors
///
/// [`Error::InvalidDevice`](super::Error::InvalidDevice); the driver's errors.
pub fn get_device_properties(device: Option<u32>) -> Result<DeviceProperties> {
    let device = resolve(device)?;
    tensormem_runtime::check_ordinal(device)?;
    Ok(backend::device_properties(device)?)
}

/// The name of `device`, or of the current device (`torch.cuda.get_device_name`).
///
/// # Errors
///
/// As [`get_device_properties`].
pub fn get_device_name(device: Option<u32>) -> Result<String> {
    Ok(get_device_properties(device)?.name)
}

/// The compute capability `(major, minor)` of `device`, or of the current device
/// (`torch.cuda.get_device_capability`).
///
/// # Errors
///
/// As [`get_device_properties`].
pub fn get_device_capability(device: Option<u32>) -> Result<(i32, i32)> {
    let props = get_device_properties(device)?;
    Ok((props.major, props.minor))
}

/// Waits for all work on `device`, or on the current device, to finish (`torch.cuda.synchronize`,
/// `cuCtxSynchronize`).
///
/// # Errors
///
/// The driver's errors (an asynchronous error of earlier work surfaces here).
pub fn synchronize(device: Option<u32>) -> Result<()> {
    Ok(device_of(resolve(device)?)?.synchronize()?)
}

/// Free and total memory of `device`, or of the current device, as the driver sees it
/// (`torch.cuda.mem_get_info`, `cuMemGetInfo`). Memory cached by the allocator counts as used.
///
/// # Errors
///
/// The driver's errors.
pub fn mem_get_info(device: Option<u32>) -> Result<MemInfo> {
    Ok(device_of(resolve(device)?)?.mem_info()?)
}

/// The device `ordinal`, opened on first use (the process runtime's).
pub(crate) fn device_of(
    ordinal: u32,
) -> Result<&'static tensormem_cuda_alloc::backend::cuda::CudaBackend> {
    Ok(tensormem_runtime::device_state(ordinal)?.device()?)
}
