//! Pools that sleep and wake, for `tensormem_torch.sleep(pool, keep_contents)` and
//! `tensormem_torch.wake(pool)`: a private pool (`torch.cuda.MemPool`, a CUDA graph's pool) on
//! expandable segments releases its physical memory, keeping its addresses, so that tensors and
//! captured graphs stay valid; waking maps fresh memory at the same addresses and copies the
//! contents back from pinned host memory when they were kept.

use std::ffi::c_int;

use tensormem::cuda::{self, AsyncUnsupported};

use super::{pool_id, status};
use crate::devices;
use crate::error::Error;

/// Puts private pool (`first`, `second`) of `device` to sleep, copying its contents to pinned host
/// memory first when `keep_contents` is nonzero; writes the bytes released to the device into
/// `*released` (when not null).
///
/// Returns [`TM_OK`](super::TM_OK), or [`TM_ERROR`](super::TM_ERROR) with the reason as the last
/// error: the pool is not on expandable segments, was shared with another process, is being
/// captured or allocated to, is already asleep; or a driver call failed.
///
/// # Safety
///
/// `released` is null or valid for a write of one `u64`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_pool_sleep(
    device: c_int,
    first: u64,
    second: u64,
    keep_contents: c_int,
    released: *mut u64,
) -> c_int {
    status("tensormem_pool_sleep", || {
        let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
        devices::allocator(device, AsyncUnsupported::CachingAllocator)?;
        let report = cuda::sleep_pool(pool_id(first, second), keep_contents != 0, Some(ordinal))?;
        if !released.is_null() {
            // SAFETY: non-null, and valid for a write (the caller's obligation).
            unsafe { released.write(report.released_bytes) };
        }
        Ok(())
    })
}

/// Wakes private pool (`first`, `second`) of `device`: fresh memory at the same addresses, the
/// contents copied back if they were kept; writes the bytes mapped into `*mapped` (when not null).
///
/// Returns [`TM_OK`](super::TM_OK), [`TM_OUT_OF_MEMORY`](super::TM_OUT_OF_MEMORY) when the device has
/// no room for the pool's memory (the pool stays asleep), or [`TM_ERROR`](super::TM_ERROR) (the pool
/// is not asleep, or a driver call failed).
///
/// # Safety
///
/// `mapped` is null or valid for a write of one `u64`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_pool_wake(
    device: c_int,
    first: u64,
    second: u64,
    mapped: *mut u64,
) -> c_int {
    status("tensormem_pool_wake", || {
        let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
        devices::allocator(device, AsyncUnsupported::CachingAllocator)?;
        let report = cuda::wake_pool(pool_id(first, second), Some(ordinal))?;
        if !mapped.is_null() {
            // SAFETY: non-null, and valid for a write (the caller's obligation).
            unsafe { mapped.write(report.mapped_bytes) };
        }
        Ok(())
    })
}

/// Gives the pinned host memory cached by tensormem's host allocators (every opened device's)
/// back to the system: after a wake, the backup that was kept for the next sleep
/// (`tensormem_torch.wake(pool, release_host_memory=True)`). Returns [`TM_OK`](super::TM_OK), or
/// [`TM_ERROR`](super::TM_ERROR) if freeing failed.
#[no_mangle]
pub extern "C" fn tensormem_host_empty_cache() -> c_int {
    status("tensormem_host_empty_cache", || {
        Ok(cuda::host_empty_cache()?)
    })
}

/// Pins `bytes` of host memory for the backups of `device`'s sleeping pools ahead of the first
/// sleep, and keeps it cached (`tensormem_torch.reserve_backup_memory`); writes the bytes cached
/// into `*reserved` (when not null). Returns [`TM_OK`](super::TM_OK), or
/// [`TM_ERROR`](super::TM_ERROR) when the system cannot pin the memory (what was pinned stays
/// cached).
///
/// # Safety
///
/// `reserved` is null or valid for a write of one `u64`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_host_reserve(
    device: c_int,
    bytes: u64,
    reserved: *mut u64,
) -> c_int {
    status("tensormem_host_reserve", || {
        let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
        devices::allocator(device, AsyncUnsupported::CachingAllocator)?;
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        let cached = cuda::reserve_backup_memory(bytes, Some(ordinal))?;
        if !reserved.is_null() {
            // SAFETY: non-null, and valid for a write (the caller's obligation).
            unsafe { reserved.write(cached as u64) };
        }
        Ok(())
    })
}

/// Whether private pool (`first`, `second`) of `device` is asleep: 1 yes, 0 no, -1 on error.
#[no_mangle]
pub extern "C" fn tensormem_pool_is_asleep(device: c_int, first: u64, second: u64) -> c_int {
    crate::boundary::call("tensormem_pool_is_asleep", -1, || {
        Ok(c_int::from(
            devices::allocator(device, AsyncUnsupported::CachingAllocator)?
                .is_pool_asleep(pool_id(first, second)),
        ))
    })
}
