//! CUDA events: the allocator's completion markers, and the interprocess flavour the IPC layer sends.

use cudarc::driver::sys;

use super::driver::check;
use crate::device::{DeviceError, DeviceResult};

/// The size of an interprocess event handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_SIZE: usize = 64;

/// An owned CUDA event (`CUevent`), created with timing disabled, destroyed on drop.
///
/// The allocator records one on every stream a freed block was used on and reuses the block once all of
/// them have completed. An *interprocess* event ([`CudaBackend::create_interprocess_event`]) can also be
/// exported with [`BackendEvent::ipc_handle`] and opened in another process with
/// [`BackendEvent::open_ipc_handle`] (what PyTorch's CUDA IPC sends beside a tensor).
///
/// [`CudaBackend::create_interprocess_event`]: super::CudaBackend::create_interprocess_event
#[derive(Debug)]
pub struct BackendEvent {
    /// Non-null, owned by this value, destroyed in `drop`.
    raw: sys::CUevent,
    /// Created with `CU_EVENT_INTERPROCESS`.
    interprocess: bool,
}

// SAFETY: CUDA event handles may be used from any thread; this type only passes the handle to driver
// calls, which synchronise internally.
unsafe impl Send for BackendEvent {}
// SAFETY: as above; no method takes `&mut self` except `drop`.
unsafe impl Sync for BackendEvent {}

impl BackendEvent {
    /// Creates an event in the current context (`cuEventCreate`). The caller made the right context current.
    pub(crate) fn create_in_current_context(interprocess: bool) -> DeviceResult<Self> {
        let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        if interprocess {
            flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        }
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-parameter; a context is current (the caller's obligation, checked
        // by the driver, which reports CUDA_ERROR_INVALID_CONTEXT otherwise).
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Self { raw, interprocess })
    }

    /// The raw handle, for driver calls this crate does not wrap. It stays owned by `self`.
    #[inline]
    #[must_use]
    pub fn as_raw(&self) -> sys::CUevent {
        self.raw
    }

    /// Whether the event was created interprocess-capable.
    #[inline]
    #[must_use]
    pub fn is_interprocess(&self) -> bool {
        self.interprocess
    }

    /// Records the event on the stream with handle value `stream` (`cuEventRecord`).
    ///
    /// # Safety
    ///
    /// `stream` is `0` (the legacy default stream of the current context, which must then be the
    /// event's context) or the handle of a live stream of the event's context.
    ///
    /// # References
    ///
    /// - [`cuEventRecord`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html) (Event Management)
    #[doc(alias = "cuEventRecord")]
    pub unsafe fn record_raw(&self, stream: sys::CUstream) -> DeviceResult<()> {
        // SAFETY: the event is live; the stream's validity is the caller's obligation.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream)
        })
    }

    /// Whether all work captured by the last record has completed (`cuEventQuery`), without blocking. An
    /// event never recorded counts as complete.
    ///
    /// # References
    ///
    /// - [`cuEventQuery`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html) (Event Management)
    #[doc(alias = "cuEventQuery")]
    pub fn query(&self) -> DeviceResult<bool> {
        // SAFETY: the event is live.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|()| false),
        }
    }

    /// Blocks the calling thread until the event has completed (`cuEventSynchronize`).
    ///
    /// # References
    ///
    /// - [`cuEventSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html) (Event Management)
    #[doc(alias = "cuEventSynchronize")]
    pub fn synchronize(&self) -> DeviceResult<()> {
        // SAFETY: the event is live.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// The handle another process opens this event with (`cuIpcGetEventHandle`).
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] if the event was not created interprocess-capable; the driver's error
    /// otherwise.
    ///
    /// # References
    ///
    /// - [`cuIpcGetEventHandle`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuIpcGetEventHandle")]
    pub fn ipc_handle(&self) -> DeviceResult<[u8; IPC_HANDLE_SIZE]> {
        if !self.interprocess {
            return Err(DeviceError::Unsupported {
                what: "exporting an event that was not created interprocess-capable",
            });
        }
        let mut handle = sys::CUipcEventHandle {
            reserved: [0; IPC_HANDLE_SIZE],
        };
        // SAFETY: the event is live and interprocess-capable; `handle` is a valid out-parameter.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut handle, self.raw)
        })?;
        Ok(handle.reserved.map(|b| b as u8))
    }

    /// Opens an event exported by another process (`cuIpcOpenEventHandle`) in the current context. The
    /// returned event is interprocess-capable and destroyed on drop like any other.
    ///
    /// # Safety
    ///
    /// A context of the device the event was created on is current on this thread (make one current with
    /// [`CudaBackend::make_current`](super::CudaBackend::make_current)).
    ///
    /// # References
    ///
    /// - [`cuIpcOpenEventHandle`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuIpcOpenEventHandle")]
    pub unsafe fn open_ipc_handle(handle: &[u8; IPC_HANDLE_SIZE]) -> DeviceResult<Self> {
        let handle = sys::CUipcEventHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-parameter; the handle is plain bytes the driver validates; the
        // current context is the caller's obligation.
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut raw, handle)
        })?;
        Ok(Self {
            raw,
            interprocess: true,
        })
    }
}

impl Drop for BackendEvent {
    fn drop(&mut self) {
        // SAFETY: the event is owned by this value and destroyed exactly once. The driver defers the
        // destruction of an event that is still pending until it completes.
        let result = unsafe { sys::cuEventDestroy_v2(self.raw) };
        if let Err(err) = check("cuEventDestroy", result) {
            tracing::warn!(%err, "destroying a CUDA event failed");
        }
    }
}
