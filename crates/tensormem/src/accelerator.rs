//! The `torch.accelerator` surface: PyTorch's device-generic names for devices and their memory.
//!
//! PyTorch 2.6 and later has a device-generic API beside `torch.cuda` (`torch.accelerator`, and
//! `torch.accelerator.memory` for the allocator), which programs written for several kinds of device
//! use. tensormem's only accelerator is CUDA, so each function here is the [`cuda`]
//! function PyTorch's maps to:
//!
//! | `torch.accelerator` | here |
//! | --- | --- |
//! | `is_available`, `device_count`, `current_accelerator` | [`is_available`], [`device_count`], [`current_accelerator`] |
//! | `current_device_index`, `set_device_index`, `device_index(i)`, `synchronize` | [`current_device_index`], [`set_device_index`], [`device_index`], [`synchronize`] |
//! | `memory.get_memory_info` | [`get_memory_info`] |
//! | `memory.memory_stats`, `memory_allocated`, `max_memory_allocated`, `memory_reserved`, `max_memory_reserved` | [`memory_stats`], [`memory_allocated`], [`max_memory_allocated`], [`memory_reserved`], [`max_memory_reserved`] |
//! | `memory.reset_peak_memory_stats`, `reset_accumulated_memory_stats`, `empty_cache` | [`reset_peak_memory_stats`], [`reset_accumulated_memory_stats`], [`empty_cache`] |
//! | `memory.host_memory_stats` (pinned host memory) | [`host_memory_stats`] |
//!
//! ```
//! use tensormem::accelerator;
//!
//! if accelerator::is_available() {
//!     let (free, total) = accelerator::get_memory_info(None)?;
//!     assert!(free <= total);
//!     let stats = accelerator::memory_stats(None)?; // torch.cuda.memory_stats()'s keys
//!     assert!(stats.contains_key("reserved_bytes.all.current"));
//! } else {
//!     assert_eq!(accelerator::current_accelerator(), None);
//! }
//! # Ok::<(), tensormem::cuda::Error>(())
//! ```

use std::collections::BTreeMap;

use crate::cuda::{self, DeviceGuard, Result};

/// The kind of accelerator this process would use (`torch.accelerator.current_accelerator()`):
/// `Some("cuda")` where a CUDA device is usable, `None` otherwise.
#[must_use]
pub fn current_accelerator() -> Option<&'static str> {
    is_available().then_some("cuda")
}

/// Whether an accelerator is usable (`torch.accelerator.is_available()`).
#[must_use]
pub fn is_available() -> bool {
    cuda::is_available()
}

/// How many devices there are (`torch.accelerator.device_count()`).
///
/// # Errors
///
/// As [`cuda::device_count`].
pub fn device_count() -> Result<u32> {
    cuda::device_count()
}

/// The calling thread's current device (`torch.accelerator.current_device_index()`).
///
/// # Errors
///
/// As [`cuda::current_device`].
pub fn current_device_index() -> Result<u32> {
    cuda::current_device()
}

/// Makes `device` the calling thread's current device (`torch.accelerator.set_device_index`).
///
/// # Errors
///
/// As [`cuda::set_device`].
pub fn set_device_index(device: u32) -> Result<()> {
    cuda::set_device(device)
}

/// `device` current until the guard drops (`with torch.accelerator.device_index(i):`).
///
/// # Errors
///
/// As [`cuda::device_guard`].
pub fn device_index(device: u32) -> Result<DeviceGuard> {
    cuda::device_guard(device)
}

/// Waits for the work queued on `device` (`torch.accelerator.synchronize`).
///
/// # Errors
///
/// As [`cuda::synchronize`].
pub fn synchronize(device: Option<u32>) -> Result<()> {
    cuda::synchronize(device)
}

/// `(free, total)` bytes of `device` (`torch.accelerator.memory.get_memory_info`).
///
/// # Errors
///
/// As [`cuda::mem_get_info`].
pub fn get_memory_info(device: Option<u32>) -> Result<(u64, u64)> {
    let info = cuda::mem_get_info(device)?;
    Ok((info.free, info.total))
}

/// `device`'s allocator statistics under PyTorch's flat keys (`torch.accelerator.memory.memory_stats`).
///
/// # Errors
///
/// As [`cuda::memory_stats`].
pub fn memory_stats(device: Option<u32>) -> Result<BTreeMap<String, i64>> {
    cuda::memory_stats(device)
}

/// Bytes handed out on `device` now (`torch.accelerator.memory.memory_allocated`).
///
/// # Errors
///
/// As [`cuda::memory_allocated`].
pub fn memory_allocated(device: Option<u32>) -> Result<u64> {
    cuda::memory_allocated(device)
}

/// The most bytes handed out on `device` since the last peak reset
/// (`torch.accelerator.memory.max_memory_allocated`).
///
/// # Errors
///
/// As [`cuda::max_memory_allocated`].
pub fn max_memory_allocated(device: Option<u32>) -> Result<u64> {
    cuda::max_memory_allocated(device)
}

/// Bytes reserved from `device` now (`torch.accelerator.memory.memory_reserved`).
///
/// # Errors
///
/// As [`cuda::memory_reserved`].
pub fn memory_reserved(device: Option<u32>) -> Result<u64> {
    cuda::memory_reserved(device)
}

/// The most bytes reserved from `device` since the last peak reset
/// (`torch.accelerator.memory.max_memory_reserved`).
///
/// # Errors
///
/// As [`cuda::max_memory_reserved`].
pub fn max_memory_reserved(device: Option<u32>) -> Result<u64> {
    cuda::max_memory_reserved(device)
}

/// Resets `device`'s peaks to the current figures (`torch.accelerator.memory.reset_peak_memory_stats`).
///
/// # Errors
///
/// As [`cuda::reset_peak_memory_stats`].
pub fn reset_peak_memory_stats(device: Option<u32>) -> Result<()> {
    cuda::reset_peak_memory_stats(device)
}

/// Resets `device`'s accumulated counts
/// (`torch.accelerator.memory.reset_accumulated_memory_stats`).
///
/// # Errors
///
/// As [`cuda::reset_accumulated_memory_stats`].
pub fn reset_accumulated_memory_stats(device: Option<u32>) -> Result<()> {
    cuda::reset_accumulated_memory_stats(device)
}

/// Returns every device's cached, unused memory (`torch.accelerator.memory.empty_cache`).
///
/// # Errors
///
/// As [`cuda::empty_cache`].
pub fn empty_cache() -> Result<()> {
    cuda::empty_cache()
}

/// The pinned host allocator's statistics under PyTorch's flat keys
/// (`torch.accelerator.memory.host_memory_stats`).
///
/// # Errors
///
/// As [`cuda::host_memory_stats`].
pub fn host_memory_stats() -> Result<BTreeMap<String, i64>> {
    cuda::host_memory_stats()
}
