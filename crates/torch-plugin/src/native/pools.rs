//! Private pools for the C++ layer: CUDA graph capture, `torch.cuda.MemPool` and `use_mem_pool`, and the
//! checkpoints of Inductor's CUDA graph trees.
//!
//! PyTorch decides which allocations go to a pool with a filter (a C++ `std::function` taking the
//! allocation's stream): for a capture, "the stream is capturing this graph"; for `use_mem_pool`, "this
//! thread". The C++ layer hands the filter over as a function and a context; the allocator calls it on
//! the allocating thread while the pool is open and drops the context when the pool closes.
//!
//! Under `backend:cudaMallocAsync` there are no private pools, as in PyTorch: beginning and ending
//! "allocation to a pool" is a capture's bookkeeping (`AsyncAllocator::begin_capture` /
//! `end_capture`), releasing a pool does nothing, and making one (`torch.cuda.MemPool`), its options,
//! its use count, its live-allocation check and its checkpoints are refused with PyTorch's messages.

use std::collections::HashSet;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::sys;
use tensormem_cuda_alloc::{
    CaptureFilter, DeviceAddress, DeviceError, DeviceResult, MempoolId, PoolAllocator,
    PoolCheckpoint, StreamId,
};
use tensormem_runtime::DeviceMemory;

use tensormem::cuda::AsyncUnsupported;

use super::{pool_id, raw_stream, status};
use crate::capture_mode;
use crate::devices;
use crate::error::{Error, Result};

/// A pool filter: nonzero if an allocation on `stream` goes to the pool.
pub type FilterFn = unsafe extern "C" fn(context: *mut c_void, stream: sys::CUstream) -> c_int;
/// Destroys a filter's context.
pub type DropFn = unsafe extern "C" fn(context: *mut c_void);

/// The C++ layer's filter, owned by the allocator while the pool is open.
struct Filter {
    call: FilterFn,
    drop: Option<DropFn>,
    context: *mut c_void,
}

// SAFETY: the C++ layer's contexts are `std::function`s that PyTorch's own allocator calls from any
// allocating thread (they read the calling thread's id or the stream's capture state), and that are
// destroyed once, from whichever thread closes the pool; `tensormem_pool_begin` states this contract.
unsafe impl Send for Filter {}
// SAFETY: as above; calling the function concurrently is what PyTorch's allocator does too.
unsafe impl Sync for Filter {}

impl Filter {
    fn accepts(&self, stream: sys::CUstream) -> bool {
        // SAFETY: `call` and `context` come together from the C++ layer, and the context lives until
        // `drop` (below) runs.
        unsafe { (self.call)(self.context, stream) != 0 }
    }
}

impl Drop for Filter {
    fn drop(&mut self) {
        if let Some(drop) = self.drop {
            // SAFETY: the context is destroyed once, here, after its last call.
            unsafe { drop(self.context) };
        }
    }
}

/// Starts sending `device`'s allocations that `filter` accepts to private pool (`first`, `second`),
/// making the pool or adding a user to it (PyTorch's `beginAllocateToPool`).
///
/// On failure the filter's context is destroyed here.
///
/// # Safety
///
/// `filter(context, stream)` may be called from any thread, concurrently, until `drop(context)` is
/// called once (when the pool closes, or on failure); `drop` may be `None`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_pool_begin(
    device: c_int,
    first: u64,
    second: u64,
    filter: Option<FilterFn>,
    drop: Option<DropFn>,
    context: *mut c_void,
) -> c_int {
    let filter = filter.map(|call| Filter {
        call,
        drop,
        context,
    });
    status("tensormem_pool_begin", move || {
        let filter = filter.ok_or(Error::NullArgument { what: "filter" })?;
        begin(
            device,
            pool_id(first, second),
            Box::new(move |stream| filter.accepts(raw_stream(stream))),
        )
    })
}

/// Starts sending `device`'s allocations that `filter` accepts to private pool `pool`: the begin of
/// [`tensormem_pool_begin`] and of the pluggable
/// [`tensormem_begin_allocate_to_pool`](crate::tensormem_begin_allocate_to_pool), which differ in their
/// filter. Until the pool closes, allocations switch their thread to the relaxed capture mode; under
/// `backend:cudaMallocAsync` the capture's bookkeeping begins instead (the async allocator drops the
/// filter unasked: the driver captures every allocation made on a capturing stream). The filter is
/// dropped on failure.
pub(crate) fn begin(device: c_int, pool: MempoolId, filter: CaptureFilter) -> Result<()> {
    let allocator = devices::served(device)?;
    allocator.begin_capture(pool, filter)?;
    if allocator.as_async().is_some() {
        capture_mode::async_capture::began();
    } else {
        capture_mode::opened();
    }
    Ok(())
}

/// Stops sending allocations to the pool (PyTorch's `endAllocateToPool`), with `stream` the capture
/// stream (PyTorch's current stream of the device): under `backend:cudaMallocAsync` the capture's
/// bookkeeping ends, `stream` waiting for every stream a free was queued on during the capture.
///
/// # Safety
///
/// `stream` is as for [`crate::tensormem_alloc`].
#[no_mangle]
pub unsafe extern "C" fn tensormem_pool_end_on(
    device: c_int,
    first: u64,
    second: u64,
    stream: sys::CUstream,
) -> c_int {
    status("tensormem_pool_end", || {
        // SAFETY: `stream` is live and kept alive (the caller's obligation).
        unsafe { end(device, pool_id(first, second), Some(stream)) }
    })
}

/// [`tensormem_pool_end_on`] without the capture stream (under `backend:cudaMallocAsync` the stream
/// of the capture's first allocation stands for it: see `capture_mode::async_capture`).
#[no_mangle]
pub extern "C" fn tensormem_pool_end(device: c_int, first: u64, second: u64) -> c_int {
    status("tensormem_pool_end", || {
        // SAFETY: no stream is given.
        unsafe { end(device, pool_id(first, second), None) }
    })
}

/// The end of allocation to `pool`, on the capture stream `stream` when known: the end of
/// [`tensormem_pool_end_on`], [`tensormem_pool_end`] and the pluggable
/// [`tensormem_end_allocate_to_pool`](crate::tensormem_end_allocate_to_pool).
///
/// # Safety
///
/// `stream`, when given, is as for [`crate::tensormem_alloc`].
pub(crate) unsafe fn end(
    device: c_int,
    pool: MempoolId,
    stream: Option<sys::CUstream>,
) -> Result<()> {
    let allocator = devices::served(device)?;
    if allocator.as_async().is_none() {
        // The caching allocator needs no capture stream.
        allocator.end_capture(pool, StreamId::DEFAULT)?;
        capture_mode::closed();
        return Ok(());
    }
    let remembered = capture_mode::async_capture::ended();
    match stream {
        // SAFETY: `stream` is live and kept alive (the caller's obligation).
        Some(raw) => unsafe {
            crate::streams::with_stream(allocator.device(), raw, |id| {
                allocator.end_capture(pool, id)
            })
        },
        None => Ok(allocator.end_capture(pool, remembered)?),
    }
}

/// One user is done with the pool (PyTorch's `releasePool`); once none is left its free memory goes
/// back to the device with the next empty-cache. Nothing under `backend:cudaMallocAsync`, as in
/// PyTorch.
#[no_mangle]
pub extern "C" fn tensormem_pool_release(device: c_int, first: u64, second: u64) -> c_int {
    status("tensormem_pool_release", || {
        release(device, pool_id(first, second))
    })
}

/// The release of [`tensormem_pool_release`] and of the pluggable
/// [`tensormem_release_pool`](crate::tensormem_release_pool).
pub(crate) fn release(device: c_int, pool: MempoolId) -> Result<()> {
    devices::served(device)?.release_pool(pool)?;
    Ok(())
}

/// Makes the pool with one user or adds one (PyTorch's `createOrIncrefPool`, for `torch.cuda.MemPool`).
#[no_mangle]
pub extern "C" fn tensormem_pool_create_or_incref(device: c_int, first: u64, second: u64) -> c_int {
    status("tensormem_pool_create_or_incref", || {
        devices::allocator(device, AsyncUnsupported::CreateOrIncrefPool)?
            .create_or_incref_pool(pool_id(first, second))?;
        Ok(())
    })
}

/// A pool allocator's allocation: writes a segment of `size` bytes to `*out` and returns
/// [`POOL_ALLOC_OK`], or returns [`POOL_ALLOC_OUT_OF_MEMORY`] (PyTorch's `raw_alloc` giving null) or
/// [`POOL_ALLOC_ERROR`] (it raised; the C++ layer has said why).
pub type PoolMallocFn =
    unsafe extern "C" fn(context: *mut c_void, size: usize, out: *mut *mut c_void) -> c_int;
/// A pool allocator's release of a segment its allocation returned (PyTorch's `raw_delete`):
/// [`POOL_ALLOC_OK`] or [`POOL_ALLOC_ERROR`].
pub type PoolFreeFn =
    unsafe extern "C" fn(context: *mut c_void, ptr: *mut c_void, size: usize) -> c_int;

/// A [`PoolMallocFn`] or [`PoolFreeFn`] succeeded.
pub const POOL_ALLOC_OK: c_int = 0;
/// A [`PoolMallocFn`] found no room.
pub const POOL_ALLOC_OUT_OF_MEMORY: c_int = 1;
/// A [`PoolMallocFn`] or [`PoolFreeFn`] failed otherwise.
pub const POOL_ALLOC_ERROR: c_int = -1;

/// The C++ layer's allocator of a `MemPool(allocator=...)` (a `CUDAAllocator` such as a
/// `CUDAPluggableAllocator`), owned by the pool: its context is destroyed once, when the pool and
/// every handle to it are gone.
struct CppPoolAllocator {
    malloc: PoolMallocFn,
    free: PoolFreeFn,
    drop: Option<DropFn>,
    context: *mut c_void,
}

// SAFETY: the context is a `std::shared_ptr<CUDAAllocator>` that PyTorch's own allocator calls from
// any allocating thread and that is destroyed once; `tensormem_pool_create_with_allocator` states
// this contract.
unsafe impl Send for CppPoolAllocator {}
// SAFETY: as above; PyTorch calls `raw_alloc` and `raw_delete` concurrently too.
unsafe impl Sync for CppPoolAllocator {}

impl PoolAllocator for CppPoolAllocator {
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        let mut out = std::ptr::null_mut();
        // SAFETY: `malloc` and `context` come together from the C++ layer and the context lives
        // until `drop` runs (in this value's `Drop`); `out` is a valid out-parameter.
        let rc = unsafe { (self.malloc)(self.context, size, &mut out) };
        match rc {
            POOL_ALLOC_OK if !out.is_null() => Ok(DeviceAddress(out as u64)),
            POOL_ALLOC_OK | POOL_ALLOC_OUT_OF_MEMORY => {
                Err(DeviceError::OutOfMemory { bytes: size as u64 })
            }
            _ => Err(DeviceError::Driver {
                call: "MemPool allocator raw_alloc",
                code: rc,
                message: "the pool's allocator raised an error (PyTorch printed it as a warning); \
                          fix the allocator given to torch.cuda.MemPool"
                    .to_owned(),
            }),
        }
    }

    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: as in `malloc`; `ptr` came from this allocator's `malloc` (the caller's obligation).
        let rc = unsafe { (self.free)(self.context, ptr.0 as *mut c_void, size) };
        if rc == POOL_ALLOC_OK {
            Ok(())
        } else {
            Err(DeviceError::Driver {
                call: "MemPool allocator raw_delete",
                code: rc,
                message: "the pool's allocator raised an error while freeing a segment (PyTorch \
                          printed it as a warning)"
                    .to_owned(),
            })
        }
    }
}

impl Drop for CppPoolAllocator {
    fn drop(&mut self) {
        if let Some(drop) = self.drop {
            // SAFETY: the context is destroyed once, here, after its last call.
            unsafe { drop(self.context) };
        }
    }
}

/// Makes the pool with one user, its segments coming from the C++ layer's allocator rather than the
/// driver (PyTorch's `createOrIncrefPool(device, id, allocator)` for `torch.cuda.MemPool(allocator=
/// ...)`): `malloc(context, size, &out)` for each new segment, `free(context, ptr, size)` for each
/// segment returned. The pool never uses expandable segments; its segments count in the statistics
/// as `cudaMalloc`s do.
///
/// The pool owns the context from here on (and on failure destroys it here): `drop(context)` is
/// called once, when the pool and its last segment are gone.
///
/// # Safety
///
/// `malloc` and `free` may be called with `context` from any thread, concurrently, until
/// `drop(context)` is called; `drop` may be `None`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_pool_create_with_allocator(
    device: c_int,
    first: u64,
    second: u64,
    malloc: Option<PoolMallocFn>,
    free: Option<PoolFreeFn>,
    drop: Option<DropFn>,
    context: *mut c_void,
) -> c_int {
    // Made first so that every failure below destroys the context exactly once.
    let owned = DropGuard { drop, context };
    status("tensormem_pool_create_with_allocator", move || {
        let (Some(malloc), Some(free)) = (malloc, free) else {
            return Err(Error::NullArgument {
                what: "the pool allocator's malloc or free",
            });
        };
        let allocator = devices::allocator(device, AsyncUnsupported::CreateOrIncrefPool)?;
        let own: Arc<dyn PoolAllocator> = Arc::new(CppPoolAllocator {
            malloc,
            free,
            drop: owned.disarm(),
            context,
        });
        allocator.create_or_incref_pool_with(pool_id(first, second), Some(own))?;
        Ok(())
    })
}

/// Destroys a context on the failure paths of [`tensormem_pool_create_with_allocator`].
struct DropGuard {
    drop: Option<DropFn>,
    context: *mut c_void,
}

impl DropGuard {
    /// Hands the destructor on (to the allocator that owns the context from now on).
    fn disarm(mut self) -> Option<DropFn> {
        self.drop.take()
    }
}

impl Drop for DropGuard {
    fn drop(&mut self) {
        if let Some(drop) = self.drop {
            // SAFETY: the context was never handed on; it is destroyed once, here.
            unsafe { drop(self.context) };
        }
    }
}

/// Lets allocations outside any pool use the pool's free blocks as a last resort before
/// out-of-memory, or stops it (PyTorch's `setUseOnOOM`, for `torch.cuda.MemPool(use_on_oom=True)`).
/// Turning it off for a pool that is gone succeeds (PyTorch does it for every pool it destroys).
#[no_mangle]
pub extern "C" fn tensormem_pool_set_use_on_oom(
    device: c_int,
    first: u64,
    second: u64,
    use_on_oom: c_int,
) -> c_int {
    status("tensormem_pool_set_use_on_oom", || {
        devices::allocator(device, AsyncUnsupported::SetUseOnOom)?
            .set_use_on_oom(pool_id(first, second), use_on_oom != 0)?;
        Ok(())
    })
}

/// Stops the pool from splitting its blocks (PyTorch's `setNoSplit`, for
/// `torch.cuda.MemPool(no_split=True)`).
#[no_mangle]
pub extern "C" fn tensormem_pool_set_no_split(device: c_int, first: u64, second: u64) -> c_int {
    status("tensormem_pool_set_no_split", || {
        devices::allocator(device, AsyncUnsupported::SetNoSplit)?
            .set_no_split(pool_id(first, second))?;
        Ok(())
    })
}

/// The pool's users (PyTorch's `getPoolUseCount`), or -1 on error.
#[no_mangle]
pub extern "C" fn tensormem_pool_use_count(device: c_int, first: u64, second: u64) -> i64 {
    crate::boundary::call("tensormem_pool_use_count", -1, || {
        Ok(
            devices::allocator(device, AsyncUnsupported::GetPoolUseCount)?
                .pool_use_count(pool_id(first, second)),
        )
    })
}

/// Whether the pool's allocated blocks are exactly the `count` pointers at `ptrs` (PyTorch's
/// `checkPoolLiveAllocations`): 1 yes, 0 no, -1 on error.
///
/// # Safety
///
/// `ptrs` is valid for reads of `count` pointers (it may be null when `count` is 0).
#[no_mangle]
pub unsafe extern "C" fn tensormem_pool_check_live(
    device: c_int,
    first: u64,
    second: u64,
    ptrs: *const *mut c_void,
    count: usize,
) -> c_int {
    crate::boundary::call("tensormem_pool_check_live", -1, || {
        let allocator = devices::allocator(device, AsyncUnsupported::CheckPoolLiveAllocations)?;
        let expected: HashSet<DeviceAddress> = if count == 0 {
            HashSet::new()
        } else {
            if ptrs.is_null() {
                return Err(Error::NullArgument { what: "ptrs" });
            }
            // SAFETY: `ptrs` is non-null and valid for `count` reads (the caller's obligation).
            unsafe { std::slice::from_raw_parts(ptrs, count) }
                .iter()
                .map(|&p| DeviceAddress(p as u64))
                .collect()
        };
        let live = allocator.check_pool_live_allocations(pool_id(first, second), &expected)?;
        Ok(c_int::from(live))
    })
}

/// The state of the pool's blocks (PyTorch's `getCheckpointState`), or null on error. Free it with
/// [`tensormem_checkpoint_free`].
#[no_mangle]
pub extern "C" fn tensormem_pool_checkpoint(
    device: c_int,
    first: u64,
    second: u64,
) -> *mut PoolCheckpoint {
    crate::boundary::call("tensormem_pool_checkpoint", std::ptr::null_mut(), || {
        let checkpoint = devices::allocator(device, AsyncUnsupported::GetCheckpointState)?
            .get_checkpoint_state(pool_id(first, second))?;
        Ok(Box::into_raw(Box::new(checkpoint)))
    })
}

/// Frees a checkpoint. Null is ignored.
///
/// # Safety
///
/// `checkpoint` is null or from [`tensormem_pool_checkpoint`], not freed before.
#[no_mangle]
pub unsafe extern "C" fn tensormem_checkpoint_free(checkpoint: *mut PoolCheckpoint) {
    if !checkpoint.is_null() {
        // SAFETY: it came from `Box::into_raw` above and is freed once (the caller's obligation).
        drop(unsafe { Box::from_raw(checkpoint) });
    }
}

/// Called for each pointer a restore freed, and for each allocation it made again.
pub type PointerFn = unsafe extern "C" fn(context: *mut c_void, ptr: *mut c_void);

/// Returns the checkpoint's pool on `device` to the checkpoint's state (PyTorch's
/// `setCheckpointPoolState`): every block allocated now is freed (`freed(context, ptr)` for each), then
/// those allocated in the checkpoint are allocated again (`allocated(context, ptr)` for each; the C++
/// layer makes them PyTorch `DataPtr`s, freed with [`super::tensormem_raw_delete`]).
///
/// # Safety
///
/// `checkpoint` is from [`tensormem_pool_checkpoint`] and not freed; the callbacks may be called with
/// `context` during the call.
#[no_mangle]
pub unsafe extern "C" fn tensormem_pool_restore(
    device: c_int,
    checkpoint: *const PoolCheckpoint,
    freed: Option<PointerFn>,
    allocated: Option<PointerFn>,
    context: *mut c_void,
) -> c_int {
    status("tensormem_pool_restore", || {
        let allocator = devices::allocator(device, AsyncUnsupported::SetCheckpointPoolState)?;
        if checkpoint.is_null() {
            return Err(Error::NullArgument { what: "checkpoint" });
        }
        let (Some(freed), Some(allocated)) = (freed, allocated) else {
            return Err(Error::NullArgument {
                what: "freed or allocated",
            });
        };
        // SAFETY: a live checkpoint from `tensormem_pool_checkpoint` (the caller's obligation).
        let checkpoint = unsafe { &*checkpoint };
        let delta = allocator.set_checkpoint_pool_state(checkpoint)?;
        for ptr in delta.freed {
            // SAFETY: the caller's callback, with its context, during the call.
            unsafe { freed(context, ptr.0 as *mut c_void) };
        }
        for allocation in delta.created {
            let ptr = allocation.into_ptr();
            // SAFETY: as above.
            unsafe { allocated(context, ptr.0 as *mut c_void) };
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    unsafe extern "C" fn answer(context: *mut c_void, _: usize, out: *mut *mut c_void) -> c_int {
        // SAFETY: the test's context is a `c_int` status to answer with; `out` is valid.
        let rc = unsafe { *(context as *const c_int) };
        // SAFETY: as above.
        unsafe {
            *out = if rc == POOL_ALLOC_OK {
                0x1000 as *mut c_void
            } else {
                std::ptr::null_mut()
            }
        };
        rc
    }

    unsafe extern "C" fn answer_free(context: *mut c_void, _: *mut c_void, _: usize) -> c_int {
        // SAFETY: as in `answer`.
        unsafe { *(context as *const c_int) }
    }

    static DROPS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn count(_: *mut c_void) {
        DROPS.fetch_add(1, SeqCst);
    }

    fn with_status(rc: &mut c_int) -> CppPoolAllocator {
        CppPoolAllocator {
            malloc: answer,
            free: answer_free,
            drop: Some(count),
            context: std::ptr::from_mut(rc).cast(),
        }
    }

    #[test]
    fn the_cpp_allocator_s_status_codes_become_device_results() {
        let mut rc = POOL_ALLOC_OK;
        let a = with_status(&mut rc);
        assert_eq!(a.malloc(4096).unwrap(), DeviceAddress(0x1000));
        // SAFETY: the test's allocator frees nothing.
        assert!(unsafe { a.free(DeviceAddress(0x1000), 4096) }.is_ok());
        drop(a);
        let mut rc = POOL_ALLOC_OUT_OF_MEMORY;
        let a = with_status(&mut rc);
        assert!(matches!(
            a.malloc(4096),
            Err(DeviceError::OutOfMemory { bytes: 4096 })
        ));
        drop(a);
        let mut rc = POOL_ALLOC_ERROR;
        let a = with_status(&mut rc);
        let err = a.malloc(4096).unwrap_err();
        assert!(err.to_string().contains("raw_alloc"), "{err}");
        // SAFETY: as above.
        let err = unsafe { a.free(DeviceAddress(0x1000), 4096) }.unwrap_err();
        assert!(err.to_string().contains("raw_delete"), "{err}");
        drop(a);
        assert_eq!(DROPS.load(SeqCst), 3, "each context destroyed once");
    }
}
