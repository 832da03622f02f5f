//! Allocating while a CUDA graph is being captured.
//!
//! PyTorch captures graphs in the driver's *global* capture mode, in which `cuMemAlloc` fails with
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` on every thread while the capture lasts. A capture's private
//! pool still needs new segments, so, as PyTorch's own allocator does around its `cudaMalloc`, the
//! plugin switches the calling thread to the *relaxed* mode for the length of an allocation while any
//! capture it was told about is open (`cuThreadExchangeStreamCaptureMode`). Allocating new device memory
//! during capture is safe as long as it is not freed before the graph's replays are done, which the
//! private pools guarantee.

use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys;

/// Captures begun through the plugin's `begin_allocate_to_pool` hook and not yet ended.
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// A capture began.
pub(crate) fn opened() {
    OPEN.fetch_add(1, Ordering::Relaxed);
}

/// A capture ended.
pub(crate) fn closed() {
    // Never below zero, even if PyTorch ends a pool it did not begin through the plugin.
    let _ = OPEN.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
}

/// The calling thread in the relaxed capture mode until dropped, if a capture is open; `None` (no
/// driver call) otherwise.
#[inline]
pub(crate) fn relaxed_while_capturing() -> Option<RelaxedCaptureMode> {
    if OPEN.load(Ordering::Relaxed) == 0 {
        return None;
    }
    RelaxedCaptureMode::enter()
}

/// The calling thread's capture mode set to relaxed; the previous mode is put back on drop.
#[derive(Debug)]
pub(crate) struct RelaxedCaptureMode {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCaptureMode {
    fn enter() -> Option<Self> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out parameter; the call only changes this thread's mode. The
        // driver is loaded: a capture was begun through it.
        let result = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        if result != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?result, "could not relax the thread's stream capture mode");
            return None;
        }
        Some(Self { previous: mode })
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; puts back the mode that was current before it.
        let result = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        if result != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(
                ?result,
                "could not restore the thread's stream capture mode"
            );
        }
    }
}
