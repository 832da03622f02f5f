//! The C functions behind the plugin's C++ layer (`csrc/tensormem_allocator.cpp`), which implements
//! PyTorch's whole `c10::cuda::CUDACachingAllocator::CUDAAllocator` interface on them.
//!
//! Unlike the `CUDAPluggableAllocator` functions, every one of these reports failure through its
//! result, so that the C++ layer can raise PyTorch's own exception: [`TM_OK`] for success,
//! [`TM_OUT_OF_MEMORY`] for an out-of-memory error (raised as `torch.OutOfMemoryError`) and
//! [`TM_ERROR`] for anything else (raised as `RuntimeError`); the message is then the thread's
//! [`tensormem_last_error`](crate::tensormem_last_error), and
//! [`tensormem_last_error_code`](crate::tensormem_last_error_code) tells a refusal PyTorch's own
//! allocator makes ([`TM_UNSUPPORTED`], raised with PyTorch's message as its first line, as PyTorch
//! raises it) from tensormem's errors (raised naming the call). The C++ layer holds no policy: each of its
//! methods converts types, calls one function here and turns a failure into an exception.
//!
//! The structs here are `repr(C)`. `csrc/tensormem_abi.h`, which the C++ layer includes, declares them
//! field for field with every exported function (`tests/c_abi.rs` checks it against these sources);
//! the functions that fill a struct check the caller's size of it on every call.
//!
//! Each operation the `CUDAPluggableAllocator` functions share with these (allocation, free,
//! `record_stream`, empty-cache, the memory fraction, the pool hooks, history) is implemented once,
//! here, as a plain function that both sets of exports call.
//!
//! Each function serves from the device's allocator of the process's backend
//! ([`tensormem::cuda::get_allocator_backend`]). Under `backend:cudaMallocAsync` that is the device's
//! `AsyncAllocator`, as PyTorch's `CudaMallocAsyncAllocator` would serve it; what PyTorch refuses for
//! that backend (snapshots, history, private pools and their checkpoints, IPC, observers and trace
//! trackers, expandable segments) fails with [`TM_ERROR`] and PyTorch's message, before any device
//! is touched ([`tensormem_backend_supports`] for the C++ methods that call nothing else here).

mod hooks;
mod ipc;
mod pools;
mod sleep;
mod snapshot;

use std::ffi::{c_int, c_void};

use cudarc::driver::sys;
use tensormem::cuda::{self, AsyncUnsupported};
use tensormem_cuda_alloc::{DeviceAddress, Error as AllocError, MempoolId, StreamId};
use tensormem_runtime::{DeviceAllocator, DeviceMemory};

use crate::boundary::call;
use crate::capture_mode;
use crate::devices;
use crate::error::{Error, Result};
use crate::streams;

pub use crate::status::{TM_ERROR, TM_OK, TM_OUT_OF_MEMORY, TM_UNSUPPORTED};
pub use hooks::{
    tensormem_attach_trace_tracker, tensormem_set_free_memory_hook, tensormem_set_oom_observer,
    FreeMemoryFn, OomFn, TorchTraceEntry, TraceFn,
};
pub use ipc::{
    tensormem_ipc_close, tensormem_ipc_open, tensormem_ipc_share, EXPANDABLE_HANDLE_HEADER_LEN,
    HANDLE_LEN,
};
pub(crate) use pools::{begin as pool_begin, end as pool_end, release as pool_release};
pub use pools::{
    tensormem_checkpoint_free, tensormem_pool_begin, tensormem_pool_check_live,
    tensormem_pool_checkpoint, tensormem_pool_create_or_incref,
    tensormem_pool_create_with_allocator, tensormem_pool_end, tensormem_pool_end_on,
    tensormem_pool_release, tensormem_pool_restore, tensormem_pool_set_no_split,
    tensormem_pool_set_use_on_oom, tensormem_pool_use_count, DropFn, FilterFn, PointerFn,
    PoolFreeFn, PoolMallocFn, POOL_ALLOC_ERROR, POOL_ALLOC_OK, POOL_ALLOC_OUT_OF_MEMORY,
};
pub use sleep::{
    tensormem_host_empty_cache, tensormem_host_reserve, tensormem_pool_is_asleep,
    tensormem_pool_sleep, tensormem_pool_wake,
};
pub(crate) use snapshot::history;
pub use snapshot::{
    tensormem_history, tensormem_history_enabled, tensormem_snapshot_block,
    tensormem_snapshot_config, tensormem_snapshot_free, tensormem_snapshot_segment,
    tensormem_snapshot_segment_count, tensormem_snapshot_take, tensormem_snapshot_trace,
    tensormem_snapshot_trace_count, tensormem_snapshot_trace_devices, TorchBlockInfo,
    TorchConfigInfo, TorchSegmentInfo, TorchSnapshot,
};

/// Runs `body` at the C boundary, turning its result into a status code.
pub(crate) fn status(name: &'static str, body: impl FnOnce() -> Result<()>) -> c_int {
    let mut oom = false;
    let ok = call(name, false, || match body() {
        Ok(()) => Ok(true),
        Err(error) => {
            oom = error.is_out_of_memory();
            Err(error)
        }
    });
    match (ok, oom) {
        (true, _) => TM_OK,
        (false, true) => TM_OUT_OF_MEMORY,
        (false, false) => TM_ERROR,
    }
}

/// PyTorch's `MempoolId_t` halves as the allocator's pool id.
pub(crate) fn pool_id(first: u64, second: u64) -> MempoolId {
    MempoolId(first, second)
}

/// Allocates `size` bytes on `device` for use on `stream` into `*out` (PyTorch's `raw_alloc_with_stream`
/// and the allocation behind `allocate`). A `size` of 0 gives null, as in PyTorch.
///
/// Returns [`TM_OK`], [`TM_OUT_OF_MEMORY`] with PyTorch's out-of-memory message as the last error, or
/// [`TM_ERROR`]; `*out` is null on failure.
///
/// # Safety
///
/// `out` is valid for a write of one pointer; `stream` is as for [`crate::tensormem_alloc`].
#[no_mangle]
pub unsafe extern "C" fn tensormem_malloc(
    size: usize,
    device: c_int,
    stream: sys::CUstream,
    out: *mut *mut c_void,
) -> c_int {
    if out.is_null() {
        return status("tensormem_malloc", || {
            Err(Error::NullArgument { what: "out" })
        });
    }
    // SAFETY: `out` is non-null and valid for writes (the caller's obligation).
    unsafe { out.write(std::ptr::null_mut()) };
    status("tensormem_malloc", || {
        // SAFETY: `stream` is live and kept alive by its owner (the caller's obligation).
        let ptr = unsafe { malloc(size, device, stream) }?;
        // SAFETY: `out` is non-null and valid for writes (checked above; the caller's obligation).
        unsafe { out.write(ptr) };
        Ok(())
    })
}

/// `size` bytes from `device`'s allocator for use on the raw stream `stream` (registered with the
/// device the first time), or null for a `size` of 0 without touching a device (as PyTorch): from the
/// caching allocator with the thread in the relaxed capture mode while a capture is open, or under
/// `backend:cudaMallocAsync` a `cuMemAllocFromPoolAsync` on the stream (which a capture records as a
/// graph node). The allocation of [`tensormem_malloc`] and of the pluggable
/// [`tensormem_alloc`](crate::tensormem_alloc).
///
/// # Safety
///
/// `stream` is as for [`crate::tensormem_alloc`].
#[inline]
pub(crate) unsafe fn malloc(
    size: usize,
    device: c_int,
    stream: sys::CUstream,
) -> Result<*mut c_void> {
    if size == 0 {
        return Ok(std::ptr::null_mut());
    }
    let allocator = devices::served(device)?;
    // SAFETY: `stream` is live and kept alive by its owner (the caller's obligation).
    let ptr = unsafe {
        streams::with_stream(allocator.device(), stream, |id| {
            // The caching allocator may need new segments during a global-mode capture; the async
            // allocator's allocations are graph nodes of the capture, whose stream it notes.
            let _relaxed = allocator
                .caching()
                .and_then(|_| capture_mode::relaxed_while_capturing());
            let ptr = allocator.allocate(size, id)?;
            if allocator.as_async().is_some() {
                capture_mode::async_capture::allocated(allocator.device(), id);
            }
            Ok(ptr)
        })
    }?;
    Ok(ptr.0 as *mut c_void)
}

/// Frees `ptr`, handed out by [`tensormem_malloc`] on any device (PyTorch's `raw_delete` and the
/// deleter of the `DataPtr`s it hands out). Null is ignored.
///
/// Returns [`TM_OK`], or [`TM_ERROR`] for a pointer no device's allocator handed out (nothing is
/// freed then).
///
/// # Safety
///
/// No work still to be queued uses the memory.
#[no_mangle]
pub unsafe extern "C" fn tensormem_raw_delete(ptr: *mut c_void) -> c_int {
    if ptr.is_null() {
        return TM_OK;
    }
    status("tensormem_raw_delete", || raw_delete(ptr))
}

/// Frees non-null `ptr` through the allocator of whichever device handed it out, or
/// [`Error::UnknownPointer`] if none did: the free of [`tensormem_raw_delete`] and of the pluggable
/// [`tensormem_free`](crate::tensormem_free). The memory is reused only after the work queued on
/// the streams it was used on has finished.
pub(crate) fn raw_delete(ptr: *mut c_void) -> Result<()> {
    debug_assert!(!ptr.is_null(), "the exports ignore null");
    let ptr = DeviceAddress(ptr as u64);
    for allocator in devices::used()? {
        match allocator.free(ptr) {
            Err(AllocError::InvalidPointer { .. } | AllocError::ForeignAllocation { .. }) => {}
            other => return Ok(other?),
        }
    }
    Err(Error::UnknownPointer { ptr: ptr.0 })
}

/// Marks memory handed out by [`tensormem_malloc`] as used on `stream` too (PyTorch's `recordStream`).
///
/// # Safety
///
/// As [`crate::tensormem_record_stream`].
#[no_mangle]
pub unsafe extern "C" fn tensormem_record_stream_checked(
    ptr: *mut c_void,
    device: c_int,
    stream: sys::CUstream,
) -> c_int {
    status("tensormem_record_stream", || {
        // SAFETY: `stream` is live and kept alive (the caller's obligation).
        unsafe { record_stream(&devices::served(device)?, ptr, stream) }
    })
}

/// Marks `ptr`, handed out by `allocator`, as used on the raw stream `stream` too: once freed, it is not
/// reused before the work queued on `stream` until then has finished. The record of
/// [`tensormem_record_stream_checked`] and of the pluggable
/// [`tensormem_record_stream`](crate::tensormem_record_stream), which differ in how they find
/// `allocator`.
///
/// # Safety
///
/// `stream` is as for [`crate::tensormem_alloc`].
pub(crate) unsafe fn record_stream(
    allocator: &DeviceAllocator,
    ptr: *mut c_void,
    stream: sys::CUstream,
) -> Result<()> {
    let ptr = DeviceAddress(ptr as u64);
    // SAFETY: `stream` is live and kept alive (the caller's obligation).
    unsafe {
        streams::with_stream(allocator.device(), stream, |id| {
            allocator.record_stream(ptr, id)
        })
    }
}

/// The allocator that handed out `ptr` (live), among the devices the process opened.
pub(crate) fn owner(ptr: DeviceAddress) -> Result<DeviceAllocator> {
    for allocator in devices::used()? {
        match allocator.base_allocation(ptr) {
            Ok(_) | Err(AllocError::ExpandableNotShareable { .. }) => return Ok(allocator),
            Err(AllocError::InvalidPointer { .. }) => {}
            Err(other) => return Err(other.into()),
        }
    }
    Err(Error::UnknownPointer { ptr: ptr.0 })
}

/// One `Stat` of PyTorch's `DeviceStats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchStat {
    /// Now.
    pub current: i64,
    /// The most since the last peak reset.
    pub peak: i64,
    /// Added in all.
    pub allocated: i64,
    /// Taken away in all.
    pub freed: i64,
}

/// PyTorch's `StatArray`: all pools, the small pool, the large pool.
pub type TorchStatArray = [TorchStat; 3];

/// PyTorch's `c10::CachingDeviceAllocator::DeviceStats`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchDeviceStats {
    /// Allocations handed out.
    pub allocation: TorchStatArray,
    /// Segments from the device.
    pub segment: TorchStatArray,
    /// Active blocks.
    pub active: TorchStatArray,
    /// Inactive split blocks.
    pub inactive_split: TorchStatArray,
    /// Bytes handed out.
    pub allocated_bytes: TorchStatArray,
    /// Bytes reserved from the device.
    pub reserved_bytes: TorchStatArray,
    /// Bytes in active blocks.
    pub active_bytes: TorchStatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: TorchStatArray,
    /// Bytes asked for.
    pub requested_bytes: TorchStatArray,
    /// Device allocations retried after freeing the cache.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors.
    pub num_ooms: i64,
    /// Oversize blocks handed out from the cache.
    pub oversize_allocations: TorchStat,
    /// Oversize segments allocated.
    pub oversize_segments: TorchStat,
    /// Synchronisations of every stream.
    pub num_sync_all_streams: i64,
    /// Device allocations.
    pub num_device_alloc: i64,
    /// Device frees.
    pub num_device_free: i64,
    /// The largest block size that may be split.
    pub max_split_size: i64,
}

fn stat(s: tensormem_cuda_alloc::stats::Stat) -> TorchStat {
    TorchStat {
        current: s.current,
        peak: s.peak,
        allocated: s.allocated,
        freed: s.freed,
    }
}

fn array(a: tensormem_cuda_alloc::stats::StatArray) -> TorchStatArray {
    [stat(a.all), stat(a.small_pool), stat(a.large_pool)]
}

impl From<tensormem_cuda_alloc::stats::MemoryStats> for TorchDeviceStats {
    fn from(s: tensormem_cuda_alloc::stats::MemoryStats) -> Self {
        Self {
            allocation: array(s.allocation),
            segment: array(s.segment),
            active: array(s.active),
            inactive_split: array(s.inactive_split),
            allocated_bytes: array(s.allocated_bytes),
            reserved_bytes: array(s.reserved_bytes),
            active_bytes: array(s.active_bytes),
            inactive_split_bytes: array(s.inactive_split_bytes),
            requested_bytes: array(s.requested_bytes),
            num_alloc_retries: s.num_alloc_retries,
            num_ooms: s.num_ooms,
            oversize_allocations: stat(s.oversize_allocations),
            oversize_segments: stat(s.oversize_segments),
            num_sync_all_streams: s.num_sync_all_streams,
            num_device_alloc: s.num_device_alloc,
            num_device_free: s.num_device_free,
            max_split_size: s.max_split_size,
        }
    }
}

/// Writes `device`'s statistics into `*out` (PyTorch's `getDeviceStats`; under
/// `backend:cudaMallocAsync` its six figures of the device's memory pool, the rest 0). `size` is
/// `sizeof(TorchDeviceStats)` as the caller knows it, checked against this library's.
///
/// # Safety
///
/// `out` is valid for a write of `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn tensormem_device_stats(
    device: c_int,
    out: *mut TorchDeviceStats,
    size: usize,
) -> c_int {
    status("tensormem_device_stats", || {
        check_layout::<TorchDeviceStats>(out, size)?;
        let stats = TorchDeviceStats::from(device_stats(device)?);
        // SAFETY: `out` is non-null, of the right size (checked above) and valid for writes.
        unsafe { out.write(stats) };
        Ok(())
    })
}

/// `device`'s statistics, from the allocator that serves it.
pub(crate) fn device_stats(device: c_int) -> Result<tensormem_cuda_alloc::stats::MemoryStats> {
    Ok(devices::served(device)?.memory_stats()?)
}

/// `Ok` if `out` is non-null and the caller's struct has this library's size.
pub(crate) fn check_layout<T>(out: *const T, size: usize) -> Result<()> {
    if out.is_null() {
        return Err(Error::NullArgument { what: "out" });
    }
    if size != std::mem::size_of::<T>() {
        return Err(Error::LayoutMismatch {
            what: std::any::type_name::<T>(),
            expected: std::mem::size_of::<T>(),
            got: size,
        });
    }
    Ok(())
}

/// Resets `device`'s accumulated counts (`allocated`, `freed`, retries, OOMs) to 0 (PyTorch's
/// `resetAccumulatedStats`; no effect under `backend:cudaMallocAsync`, as in PyTorch).
#[no_mangle]
pub extern "C" fn tensormem_reset_accumulated_stats(device: c_int) -> c_int {
    status("tensormem_reset_accumulated_stats", || {
        devices::served(device)?.reset_accumulated_stats()?;
        Ok(())
    })
}

/// Returns the cached free blocks of private pool (`first`, `second`) to the device, or those of
/// every pool for `(0, 0)` (PyTorch's `emptyCache(mempool_id)`), on every device the process opened.
/// Under `backend:cudaMallocAsync` the pool is ignored, as in PyTorch: each device is synchronized
/// and its memory pool trimmed to nothing.
#[no_mangle]
pub extern "C" fn tensormem_empty_cache_pool(first: u64, second: u64) -> c_int {
    status("tensormem_empty_cache_pool", || {
        empty_cache(pool_id(first, second))
    })
}

/// The empty-cache of [`tensormem_empty_cache_pool`] and, for [`MempoolId::DEFAULT`] (every pool),
/// of the pluggable [`tensormem_empty_cache`](crate::tensormem_empty_cache).
pub(crate) fn empty_cache(pool: MempoolId) -> Result<()> {
    for allocator in devices::used()? {
        match allocator.caching() {
            // One private pool of the caching allocator, if it has it.
            Some(caching) if pool != MempoolId::DEFAULT => {
                if caching.private_pools().iter().any(|&(id, _)| id == pool) {
                    caching.empty_pool_cache(pool)?;
                }
            }
            _ => allocator.empty_cache()?,
        }
    }
    Ok(())
}

/// Writes into `*largest` the larger of `device`'s free memory and its largest cached block
/// (PyTorch's `cacheInfo`, which cuDNN uses to size its workspace). Under `backend:cudaMallocAsync`,
/// that backend's guess: the largest size, halving from what is free and allowed, that the pool can
/// allocate now on the legacy default stream.
///
/// # Safety
///
/// `largest` is valid for a write of one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_cache_info(device: c_int, largest: *mut usize) -> c_int {
    status("tensormem_cache_info", || {
        if largest.is_null() {
            return Err(Error::NullArgument { what: "largest" });
        }
        let bytes = devices::served(device)?.largest_available(StreamId::DEFAULT)?;
        // SAFETY: non-null (checked above) and valid for writes (the caller's obligation).
        unsafe { largest.write(usize::try_from(bytes).unwrap_or(usize::MAX)) };
        Ok(())
    })
}

/// Writes `device`'s memory fraction into `*fraction` (PyTorch's `getMemoryFraction`; 1.0 when none
/// was set, under either backend).
///
/// # Safety
///
/// `fraction` is valid for a write of one `double`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_get_memory_fraction(device: c_int, fraction: *mut f64) -> c_int {
    status("tensormem_get_memory_fraction", || {
        if fraction.is_null() {
            return Err(Error::NullArgument { what: "fraction" });
        }
        let value = devices::served(device)?.memory_fraction()?;
        // SAFETY: non-null (checked above) and valid for writes (the caller's obligation).
        unsafe { fraction.write(value) };
        Ok(())
    })
}

/// Limits `device`'s memory to `fraction` of it (PyTorch's `setMemoryFraction`).
#[no_mangle]
pub extern "C" fn tensormem_set_memory_fraction_checked(fraction: f64, device: c_int) -> c_int {
    status("tensormem_set_memory_fraction", || {
        set_memory_fraction(fraction, device)
    })
}

/// The limit of [`tensormem_set_memory_fraction_checked`] and of the pluggable
/// [`tensormem_set_memory_fraction`](crate::tensormem_set_memory_fraction): an error for a fraction
/// outside `[0, 1]`.
pub(crate) fn set_memory_fraction(fraction: f64, device: c_int) -> Result<()> {
    devices::served(device)?.set_memory_fraction(fraction)?;
    Ok(())
}

/// Writes `device`'s bytes handed out and reserved now into `*allocated` and `*reserved` (for
/// PyTorch's memory profiler, told after each allocation and free).
///
/// # Safety
///
/// Both pointers are valid for a write of one `int64_t`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_usage(
    device: c_int,
    allocated: *mut i64,
    reserved: *mut i64,
) -> c_int {
    status("tensormem_usage", || {
        if allocated.is_null() || reserved.is_null() {
            return Err(Error::NullArgument {
                what: "allocated or reserved",
            });
        }
        let stats = device_stats(device)?;
        // SAFETY: non-null (checked above) and valid for writes (the caller's obligation).
        unsafe {
            allocated.write(stats.allocated_bytes.all.current);
            reserved.write(stats.reserved_bytes.all.current);
        }
        Ok(())
    })
}

/// Applies a configuration string in PyTorch's grammar to every device's allocator, now and for devices
/// used later: the Python package routes here, after PyTorch's own settings, each way PyTorch offers to
/// change them at run time (`torch._C._accelerator_setAllocatorSettings` and
/// `torch.cuda.memory._set_allocator_settings`, which calls it). A string naming the other backend
/// than the process's is refused with PyTorch's message.
///
/// # Safety
///
/// `config` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tensormem_set_allocator_settings(
    config: *const std::ffi::c_char,
) -> c_int {
    status("tensormem_set_allocator_settings", || {
        if config.is_null() {
            return Err(Error::NullArgument { what: "config" });
        }
        // SAFETY: non-null and NUL-terminated (the caller's obligation).
        let text = unsafe { std::ffi::CStr::from_ptr(config) }
            .to_str()
            .map_err(|_| Error::SettingsNotUtf8)?;
        tensormem::cuda::set_allocator_settings(text)?;
        Ok(())
    })
}

/// Whether the process's backend supports PyTorch's `CUDAAllocator` method `method` (a NUL-terminated
/// name, as PyTorch spells it: `getExpandableSegmentSizes`, `isHistoryEnabled`,
/// `attachOutOfMemoryObserver`, ...): [`TM_OK`], or [`TM_ERROR`] with PyTorch's refusal as the last
/// error under `backend:cudaMallocAsync` (and for a name that is none of its refusals: every other
/// method is served). The C++ layer asks before the methods it serves without calling the library.
/// Reads no device.
///
/// # Safety
///
/// `method` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tensormem_backend_supports(method: *const std::ffi::c_char) -> c_int {
    status("tensormem_backend_supports", || {
        if method.is_null() {
            return Err(Error::NullArgument { what: "method" });
        }
        // SAFETY: non-null and NUL-terminated (the caller's obligation).
        let name = unsafe { std::ffi::CStr::from_ptr(method) }.to_string_lossy();
        let what = AsyncUnsupported::from_method(&name).ok_or_else(|| Error::UnknownMethod {
            method: name.into_owned(),
        })?;
        Ok(cuda::backend_supports(what)?)
    })
}

/// The name of the allocator PyTorch reports (`torch.cuda.get_allocator_backend()`, the C++ layer's
/// `name()`): `"tensormem"` under `backend:native`, `"cudaMallocAsync"` under
/// `backend:cudaMallocAsync` (PyTorch's name for it, which code that branches on the backend
/// compares with). A static NUL-terminated string; `"tensormem"` when the configuration is malformed
/// (the error then comes with the first allocation).
#[no_mangle]
pub extern "C" fn tensormem_allocator_name() -> *const std::ffi::c_char {
    let native = c"tensormem".as_ptr();
    call("tensormem_allocator_name", native, || {
        Ok(match cuda::get_allocator_backend() {
            Ok(tensormem_cuda_alloc::config::Backend::CudaMallocAsync) => {
                c"cudaMallocAsync".as_ptr()
            }
            _ => native,
        })
    })
}

/// Lets kernels on `device` access the memory pool of `peer` under `backend:cudaMallocAsync`
/// (PyTorch's `enablePeerAccess(dev, dev_to_access)` for that backend: `cuMemPoolSetAccess`, as
/// context peer access does not cover memory pools). Nothing under `backend:native`, whose memory the
/// C++ layer's `cudaDeviceEnablePeerAccess` covers.
#[no_mangle]
pub extern "C" fn tensormem_pool_peer_access(device: c_int, peer: c_int) -> c_int {
    status("tensormem_pool_peer_access", || {
        if cuda::get_allocator_backend()? == tensormem_cuda_alloc::config::Backend::Native {
            return Ok(());
        }
        let accessor = devices::served(device)?;
        devices::served(peer)?.enable_peer_access(accessor.device())?;
        Ok(())
    })
}

/// The stream id the allocator uses for PyTorch's raw handle (for filters handed a stream back).
pub(crate) fn raw_stream(id: StreamId) -> sys::CUstream {
    id.0 as sys::CUstream
}
