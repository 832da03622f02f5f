//! Private pools for the C++ layer: CUDA graph capture, `torch.cuda.MemPool` and `use_mem_pool`, and the
//! checkpoints of Inductor's CUDA graph trees.
//!
//! PyTorch decides which allocations go to a pool with a filter (a C++ `std::function` taking the
//! allocation's stream): for a capture, "the stream is capturing this graph"; for `use_mem_pool`, "this
//! thread". The C++ layer hands the filter over as a function and a context; the allocator calls it on
//! the allocating thread while the pool is open and drops the context when the pool closes.

use std::collections::HashSet;
use std::ffi::{c_int, c_void};

use cudarc::driver::sys;
use tensormem_cuda_alloc::{DeviceAddress, PoolCheckpoint};

use super::{pool_id, raw_stream, status};
use crate::capture_mode;
use crate::devices;
use crate::error::Error;

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
        let allocator = devices::allocator(device)?;
        allocator.begin_allocate_to_pool(pool_id(first, second), move |stream| {
            filter.accepts(raw_stream(stream))
        })?;
        capture_mode::opened();
        Ok(())
    })
}

/// Stops sending allocations to the pool (PyTorch's `endAllocateToPool`).
#[no_mangle]
pub extern "C" fn tensormem_pool_end(device: c_int, first: u64, second: u64) -> c_int {
    status("tensormem_pool_end", || {
        devices::allocator(device)?.end_allocate_to_pool(pool_id(first, second))?;
        capture_mode::closed();
        Ok(())
    })
}

/// One user is done with the pool (PyTorch's `releasePool`); once none is left its free memory goes
/// back to the device with the next empty-cache.
#[no_mangle]
pub extern "C" fn tensormem_pool_release(device: c_int, first: u64, second: u64) -> c_int {
    status("tensormem_pool_release", || {
        devices::allocator(device)?.release_pool(pool_id(first, second))?;
        Ok(())
    })
}

/// Makes the pool with one user or adds one (PyTorch's `createOrIncrefPool`, for `torch.cuda.MemPool`).
#[no_mangle]
pub extern "C" fn tensormem_pool_create_or_incref(device: c_int, first: u64, second: u64) -> c_int {
    status("tensormem_pool_create_or_incref", || {
        devices::allocator(device)?.create_or_incref_pool(pool_id(first, second))?;
        Ok(())
    })
}

/// The pool's users (PyTorch's `getPoolUseCount`), or -1 on error.
#[no_mangle]
pub extern "C" fn tensormem_pool_use_count(device: c_int, first: u64, second: u64) -> i64 {
    crate::boundary::call("tensormem_pool_use_count", -1, || {
        Ok(devices::allocator(device)?.pool_use_count(pool_id(first, second)))
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
        let live = devices::allocator(device)?
            .check_pool_live_allocations(pool_id(first, second), &expected)?;
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
        let checkpoint =
            devices::allocator(device)?.get_checkpoint_state(pool_id(first, second))?;
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
        let delta = devices::allocator(device)?.set_checkpoint_pool_state(checkpoint)?;
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
