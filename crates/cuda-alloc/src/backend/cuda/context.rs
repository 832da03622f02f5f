//! Each device's primary context, retained once per process and made current on the calling thread
//! before the driver calls that act on "the current context".

use std::sync::OnceLock;

use cudarc::driver::sys;

use super::driver::{check, device_count, device_handle, no_such_device};
use crate::device::DeviceResult;

/// The primary context of one device (`cuDevicePrimaryCtxRetain`), retained on first use and never
/// released: like the CUDA runtime, tensormem keeps primary contexts for the life of the process.
///
/// Never releasing is what makes the handles made in a context (events, streams, memory) safe to drop
/// in any order: a released primary context whose count reaches zero is destroyed with everything in
/// it, and destroying an event of a destroyed context is undefined. The primary context is also the one
/// the CUDA runtime (and so PyTorch) uses, so memory and streams made here are usable by runtime-API code
/// in the same process and vice versa.
#[derive(Debug)]
pub(crate) struct PrimaryContext {
    /// The device handle (`CUdevice`), an ordinal-like integer.
    dev: sys::CUdevice,
    /// The retained context; non-null and valid for the rest of the process.
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread (the driver synchronises internally); this
// type only passes it to driver calls and never dereferences it.
unsafe impl Send for PrimaryContext {}
// SAFETY: as above; `&PrimaryContext` gives no mutable access.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    /// The primary context of device `ordinal`, retained on the first call for this device.
    pub(crate) fn get(ordinal: u32) -> DeviceResult<&'static PrimaryContext> {
        static CONTEXTS: OnceLock<Vec<OnceLock<PrimaryContext>>> = OnceLock::new();
        let count = device_count()?;
        let slots = CONTEXTS.get_or_init(|| (0..count).map(|_| OnceLock::new()).collect());
        let Some(slot) = slots.get(ordinal as usize) else {
            return Err(no_such_device(ordinal, count));
        };
        if let Some(ctx) = slot.get() {
            return Ok(ctx);
        }
        let retained = Self::retain(ordinal)?;
        // Two threads may race to retain; the loser's extra retain is harmless (the context is never
        // released anyway) and its value is dropped without a driver call.
        Ok(slot.get_or_init(|| retained))
    }

    fn retain(ordinal: u32) -> DeviceResult<Self> {
        let dev = device_handle(ordinal)?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device handle and `ctx` a valid out-parameter.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        debug_assert!(!ctx.is_null());
        Ok(Self { dev, ctx })
    }

    /// The device handle.
    #[inline]
    pub(crate) fn device(&self) -> sys::CUdevice {
        self.dev
    }

    /// The context handle.
    #[inline]
    pub(crate) fn raw(&self) -> sys::CUcontext {
        self.ctx
    }

    /// Makes this context current on the calling thread unless it already is.
    ///
    /// The check reads the driver's own thread-local current context (`cuCtxGetCurrent`, a few
    /// nanoseconds) rather than a cache of ours: code outside tensormem (the CUDA runtime's
    /// `cudaSetDevice`, PyTorch, another cudarc user) may switch the current context at any time, and a
    /// stale cache would make the next `cuMemAlloc` allocate on the wrong device.
    #[inline]
    pub(crate) fn make_current(&self) -> DeviceResult<()> {
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-parameter; the driver is initialised (a context exists).
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        if current != self.ctx {
            // SAFETY: `self.ctx` is a retained, live primary context.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        }
        Ok(())
    }
}

/// Whether device `ordinal`'s primary context is active (`cuDevicePrimaryCtxGetState`): some code in
/// the process (tensormem once the device is opened, the CUDA runtime, PyTorch) has retained it. Like
/// PyTorch's `torch._C._cuda_hasPrimaryContext`, this creates no context, so it can tell whether using
/// the device would.
///
/// # Errors
///
/// [`DeviceError`](crate::DeviceError) when there is no driver (code 100) or `ordinal` is past the
/// device count (code 101).
///
/// # References
///
/// - [`cuDevicePrimaryCtxGetState`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html) (Primary Context Management)
#[doc(alias = "cuDevicePrimaryCtxGetState")]
pub fn has_primary_context(ordinal: u32) -> DeviceResult<bool> {
    let dev = device_handle(ordinal)?;
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: `dev` is a valid device handle (checked against the device count by `device_handle`);
    // both out-parameters are valid.
    check("cuDevicePrimaryCtxGetState", unsafe {
        sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active)
    })?;
    Ok(active != 0)
}
