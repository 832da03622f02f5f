//! PyTorch's streams, as the allocator knows them.
//!
//! PyTorch hands the plugin raw `cudaStream_t` handles: its default stream (null), and streams from its
//! stream pools, which it creates lazily and never destroys. tensormem's CUDA backend accepts only
//! streams it made or was handed (a stream id is a number anyone could write, and the driver must only
//! see live handles), so the first time the allocator refuses a PyTorch stream, the plugin checks which
//! context the handle belongs to, wraps it as a borrowed cudarc stream, and registers it with the
//! device; the backend keeps it from then on. The fast path pays nothing: it tries the stream first.

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{check, CudaBackend};
use tensormem_cuda_alloc::{DeviceError, StreamId};

use crate::error::{Error, Result};

/// `cudaStreamLegacy`: the legacy default stream named explicitly; the allocator calls it 0.
const LEGACY_STREAM: u64 = 0x1;

/// The allocator's id of the raw handle `raw` (the legacy default stream spelled `0x1` becomes 0).
#[inline]
pub(crate) fn id_of(raw: sys::CUstream) -> StreamId {
    match raw as u64 {
        LEGACY_STREAM => StreamId::DEFAULT,
        other => StreamId(other),
    }
}

/// Whether `result` failed because the device does not know `stream` yet.
#[inline]
pub(crate) fn refused_stream<T>(result: &tensormem_cuda_alloc::Result<T>) -> bool {
    matches!(
        result,
        Err(tensormem_cuda_alloc::Error::Device(
            DeviceError::UnknownStream { .. }
        ))
    )
}

/// Runs `op` with the allocator's id of `raw`, registering the stream with `device` and running `op`
/// again if the allocator refused it as unknown.
///
/// # Safety
///
/// `raw` is null, `0x1`, `0x2`, or a live stream handle that stays alive for the rest of the process
/// (the backend keeps using it: it records events on it when memory used there is freed). PyTorch's
/// streams meet this: PyTorch never destroys the streams of its pools. A `torch.cuda.ExternalStream`
/// that its owner destroys while tensormem's allocator still has memory used on it does not.
#[inline]
pub(crate) unsafe fn with_stream<T>(
    device: &CudaBackend,
    raw: sys::CUstream,
    op: impl Fn(StreamId) -> tensormem_cuda_alloc::Result<T>,
) -> Result<T> {
    let id = id_of(raw);
    let first = op(id);
    if !refused_stream(&first) {
        return Ok(first?);
    }
    // SAFETY: the caller's obligations are `register`'s.
    unsafe { register(device, raw) }?;
    Ok(op(id)?)
}

/// Registers the live stream `raw` with `device`'s backend.
///
/// # Safety
///
/// As [`with_stream`].
#[cold]
unsafe fn register(device: &CudaBackend, raw: sys::CUstream) -> Result<StreamId> {
    let stream = raw as u64;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `raw` is a live stream handle (the caller's obligation); `ctx` is a valid out-parameter.
    check("cuStreamGetCtx", unsafe {
        sys::cuStreamGetCtx(raw, &mut ctx)
    })?;
    let context = device.cudarc_context();
    if ctx != context.cu_ctx() {
        return Err(Error::ForeignStream {
            stream,
            device: device.ordinal(),
        });
    }
    // SAFETY: `raw` is a live stream of this context (checked above) that stays alive for the rest of
    // the process (the caller's obligation), so the borrowed wrapper never outlives it; work submitted
    // through it is the allocator's events, ordered by the stream itself.
    let borrowed = unsafe { context.wrap_borrowed_stream(raw) };
    tracing::debug!(
        stream,
        device = device.ordinal(),
        "registered a PyTorch stream with the allocator"
    );
    Ok(device.register_stream(&borrowed)?)
}
