//! Growing the cache while a CUDA graph is being captured: the thread's capture mode is switched to
//! relaxed around the driver calls that create memory (PyTorch's `cudaMallocMaybeCapturing`).
//!
//! Under a capture begun in `CU_STREAM_CAPTURE_MODE_GLOBAL` (PyTorch's default for
//! `torch.cuda.graph`) or `THREAD_LOCAL` by the calling thread, the driver refuses "potentially
//! unsafe" calls such as `cuMemAlloc` with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the
//! capture. A global-mode capture by *any* thread refuses them on every thread that is not relaxed.
//! Allocating memory does not enqueue work, so it is safe to do eagerly during a capture; the
//! allocator needs it when a capture asks for more memory than its pool caches.
//!
//! PyTorch switches to relaxed mode only when the current stream is capturing. Here the switch is made
//! around every segment creation whatever the stream's status: the two `cuThreadExchangeStreamCaptureMode`
//! calls are thread-local and cost nanoseconds next to a `cuMemAlloc`, the mode is restored on return,
//! and a segment created on a thread that is not capturing while another thread captures in global
//! mode succeeds too (in PyTorch it fails).

use cudarc::driver::sys;

use super::driver::check;
use crate::device::DeviceResult;

/// The calling thread in relaxed capture mode until dropped, when its previous mode is restored
/// (`cuThreadExchangeStreamCaptureMode`).
#[derive(Debug)]
#[must_use = "the mode is restored when the guard is dropped"]
pub(crate) struct RelaxedCapture {
    /// The mode the thread was in before.
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCapture {
    /// Switches the calling thread to `CU_STREAM_CAPTURE_MODE_RELAXED`.
    #[doc(alias = "cuThreadExchangeStreamCaptureMode")]
    pub(crate) fn enter() -> DeviceResult<Self> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out parameter holding a valid mode; the call touches only the
        // calling thread's capture mode. The driver is loaded: the backend's devices exist only after
        // `cuInit` succeeded.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        Ok(Self { previous: mode })
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; `mode` holds the mode the driver returned there.
        let result = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        if let Err(error) = check("cuThreadExchangeStreamCaptureMode", result) {
            tracing::warn!(%error, "restoring the thread's stream capture mode failed");
        }
    }
}
