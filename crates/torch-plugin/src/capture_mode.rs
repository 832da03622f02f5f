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

/// Under `backend:cudaMallocAsync`, the capture stream when PyTorch does not name it.
///
/// That backend's end of a capture makes the capture stream wait for every stream a free was queued
/// on during the capture (`AsyncAllocator::end_capture`). PyTorch's own allocator takes the current
/// stream; the C++ layer passes it (`tensormem_pool_end_on`), but `CUDAPluggableAllocator`'s
/// `end_allocate_to_pool` hook has no stream. There, the capture stream is taken to be the stream
/// of the first allocation made on a capturing stream since the capture began: the stream the
/// capture allocates on first, usually the one it began on. Without such an allocation no free was
/// queued during the capture (frees of memory allocated before it are deferred), so no stream needs
/// joining and any stream does.
pub(crate) mod async_capture {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use tensormem_cuda_alloc::backend::cuda::CudaBackend;
    use tensormem_cuda_alloc::{CaptureStatus, Device, StreamId};

    /// No stream seen yet.
    const NONE: u64 = u64::MAX;

    /// Between the capture's beginning and its end.
    static OPEN: AtomicBool = AtomicBool::new(false);
    /// The first capturing stream allocated on since the beginning, or [`NONE`].
    static STREAM: AtomicU64 = AtomicU64::new(NONE);

    /// A capture's bookkeeping began.
    pub(crate) fn began() {
        STREAM.store(NONE, Ordering::Relaxed);
        OPEN.store(true, Ordering::Release);
    }

    /// An allocation was made on `stream` of `device`.
    #[inline]
    pub(crate) fn allocated(device: &CudaBackend, stream: StreamId) {
        if OPEN.load(Ordering::Acquire)
            && STREAM.load(Ordering::Relaxed) == NONE
            && matches!(
                device.capture_status(stream),
                Ok(CaptureStatus::Active { .. })
            )
        {
            let _ = STREAM.compare_exchange(NONE, stream.0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The capture ends: its stream as far as known (see the [module docs](self)).
    pub(crate) fn ended() -> StreamId {
        OPEN.store(false, Ordering::Release);
        match STREAM.swap(NONE, Ordering::Relaxed) {
            NONE => StreamId::DEFAULT,
            stream => StreamId(stream),
        }
    }
}
