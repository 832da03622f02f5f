//! Pools that sleep and wake (what vLLM's sleep mode and SGLang's `torch_memory_saver` do to
//! PyTorch's memory): a private pool on expandable segments releases its physical memory while its
//! addresses stay reserved, tensors and captured CUDA graphs keep their pointers, and it later gets
//! fresh memory at the same addresses, with its contents copied back from host memory when asked.
//!
//! ```no_run
//! use tensormem::cuda;
//! # fn main() -> cuda::Result<()> {
//! cuda::set_allocator_settings("expandable_segments:True")?;
//! let pool = cuda::MempoolId(0, 1);
//! // ... a graph captured into `pool`, or tensors allocated under a MemPool context ...
//! let slept = cuda::sleep_pool(pool, true, None)?; // contents kept in host memory
//! println!("{} bytes back to the device", slept.released_bytes);
//! cuda::wake_pool(pool, None)?; // same addresses, same contents
//! # Ok(())
//! # }
//! ```
//!
//! While a pool sleeps, [`memory_reserved`](super::memory_reserved) drops by the memory released
//! (as when expandable segments' chunks are unmapped) and comes back on wake;
//! [`memory_allocated`](super::memory_allocated) does not change (the pool keeps its blocks). The
//! memory returned also shows in [`mem_get_info`](super::mem_get_info) and [`asleep_bytes`].

use tensormem_cuda_alloc::{MempoolId, SleepReport, WakeReport};

use super::error::Result;
use super::host::host_allocator;
use super::memory::caching_allocator;

/// Puts private pool `pool` of `device` (or of the current device) to sleep: its physical memory
/// is released, its addresses kept; with `keep_contents`, its bytes are first copied to host
/// memory: pinned memory the device's host allocator ([`host_allocator`](super::host_allocator))
/// has cached (a [`reserve_backup_memory`](super::reserve_backup_memory), or an earlier backup
/// kept pinned), the rest through a ring of pinned staging buffers into ordinary memory. See
/// [`CachingAllocator::sleep_pool`](crate::cuda_alloc::CachingAllocator::sleep_pool).
///
/// # Errors
///
/// As [`caching_allocator`](super::caching_allocator); [`Error::Alloc`](super::Error::Alloc) with
/// [`SleepError`](crate::cuda_alloc::SleepError) when the pool cannot sleep (not on expandable
/// segments, shared with another process, being captured or allocated to, already asleep), or
/// with the device's error.
pub fn sleep_pool(
    pool: MempoolId,
    keep_contents: bool,
    device: Option<u32>,
) -> Result<SleepReport> {
    let allocator = caching_allocator(device)?;
    let keep: Option<Box<dyn tensormem_cuda_alloc::HostBackup>> = if keep_contents {
        Some(Box::new(host_allocator(device)?))
    } else {
        None
    };
    Ok(allocator.sleep_pool(pool, keep)?)
}

/// Wakes private pool `pool` of `device` (or of the current device): fresh physical memory at the
/// same addresses, the contents copied back if they were kept. See
/// [`CachingAllocator::wake_pool`](crate::cuda_alloc::CachingAllocator::wake_pool).
///
/// # Errors
///
/// As [`caching_allocator`](super::caching_allocator); [`Error::Alloc`](super::Error::Alloc) when
/// the pool is not asleep, or the device has no room for its memory (the pool stays asleep).
pub fn wake_pool(pool: MempoolId, device: Option<u32>) -> Result<WakeReport> {
    Ok(caching_allocator(device)?.wake_pool(pool)?)
}

/// Whether private pool `pool` of `device` (or of the current device) is asleep.
///
/// # Errors
///
/// As [`caching_allocator`](super::caching_allocator).
pub fn is_pool_asleep(pool: MempoolId, device: Option<u32>) -> Result<bool> {
    Ok(caching_allocator(device)?.is_pool_asleep(pool))
}

/// Bytes of physical memory released by the sleeping pools of `device` (or of the current device):
/// of `pool`, or of all of them.
///
/// # Errors
///
/// As [`caching_allocator`](super::caching_allocator).
pub fn asleep_bytes(pool: Option<MempoolId>, device: Option<u32>) -> Result<u64> {
    Ok(caching_allocator(device)?.asleep_bytes(pool))
}
