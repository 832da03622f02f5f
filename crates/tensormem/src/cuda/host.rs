//! Pinned host memory (`torch.cuda`'s host allocator, `torch.cuda.host_memory_stats`).
//!
//! Each device has a pinned host caching allocator
//! ([`HostCachingAllocator`](tensormem_cuda_alloc::host::HostCachingAllocator)) whose blocks wait for
//! that device's streams before reuse; the blocks themselves are portable (usable for copies to any
//! device). PyTorch keeps one host allocator for the process; here the cache is per device, so a
//! block used with streams of two devices should be recorded on the device whose allocator made it.

use std::collections::BTreeMap;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::host::{HostCachingAllocator, HostStats, PinnedBuffer};

use super::device::resolve;
use super::error::Result;
use super::stream::Stream;

/// The pinned host allocator of `device`, or of the current device, made on first use with the
/// device allocator's settings (`pinned_use_cuda_host_register`, `pinned_num_register_threads`).
///
/// # Errors
///
/// As [`caching_allocator`](super::caching_allocator).
pub fn host_allocator(device: Option<u32>) -> Result<&'static HostCachingAllocator<CudaBackend>> {
    Ok(tensormem_runtime::device_state(resolve(device)?)?.host()?)
}

/// Allocates `size` bytes of pinned host memory (`torch.empty(size, pin_memory=True)`'s storage)
/// from the current device's host allocator. Give it back with [`free_pinned`].
///
/// # Errors
///
/// As [`host_allocator`]; [`Error::Alloc`](super::Error::Alloc) when the system cannot pin the memory.
pub fn alloc_pinned(size: usize) -> Result<PinnedBuffer> {
    Ok(host_allocator(None)?.allocate(size)?)
}

/// Marks `buffer` as used by work queued on `stream` (a copy from or to it): once freed it is not
/// reused before that work has finished.
///
/// # Errors
///
/// [`Error::Alloc`](super::Error::Alloc) when `buffer` is not from `stream`'s device's host allocator.
pub fn record_pinned_stream(buffer: &PinnedBuffer, stream: &Stream) -> Result<()> {
    Ok(host_allocator(Some(stream.device_index()))?.record_stream(buffer, stream.id())?)
}

/// Gives back memory from [`alloc_pinned`] (to the current device's host allocator).
///
/// # Errors
///
/// [`Error::Alloc`](super::Error::Alloc) when `buffer` is another allocator's.
pub fn free_pinned(buffer: PinnedBuffer) -> Result<()> {
    Ok(host_allocator(None)?.free(buffer)?)
}

/// The statistics of the current device's host allocator under the keys of
/// `torch.cuda.host_memory_stats()`.
///
/// # Errors
///
/// As [`host_allocator`].
pub fn host_memory_stats() -> Result<BTreeMap<String, i64>> {
    Ok(host_stats(None)?.to_flat())
}

/// The statistics of `device`'s host allocator, typed.
///
/// # Errors
///
/// As [`host_allocator`].
pub fn host_stats(device: Option<u32>) -> Result<HostStats> {
    Ok(host_allocator(device)?.stats())
}

/// Pins `bytes` of host memory for the backups of sleeping pools of `device` (or of the current
/// device) ahead of the first sleep, in the pieces a backup takes
/// ([`BACKUP_PIECE_BYTES`](crate::cuda_alloc::BACKUP_PIECE_BYTES)), several threads at once, and
/// keeps it cached in that device's host allocator: a sleep with contents then copies straight
/// into it at the device's full bandwidth, instead of staging through pinned buffers into
/// ordinary memory. Returns the bytes of such pieces cached. Call it while the program does other
/// things (a thread of its own): it takes as long as pinning does.
///
/// # Errors
///
/// As [`host_allocator`]; [`Error::Alloc`](super::Error::Alloc) when the system cannot pin the
/// memory (what was pinned before stays cached).
pub fn reserve_backup_memory(bytes: usize, device: Option<u32>) -> Result<usize> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(8);
    Ok(
        host_allocator(device)?.reserve(
            bytes,
            tensormem_cuda_alloc::BACKUP_PIECE_BYTES,
            threads,
        )?,
    )
}

/// Returns the cached pinned blocks of every opened device's host allocator to the system
/// (`torch._C._host_emptyCache`).
///
/// # Errors
///
/// The driver's errors while freeing.
pub fn host_empty_cache() -> Result<()> {
    for (state, _) in tensormem_runtime::opened()? {
        state.host()?.empty_cache()?;
    }
    Ok(())
}
