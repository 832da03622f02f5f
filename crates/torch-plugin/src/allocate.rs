//! The functions PyTorch's `CUDAPluggableAllocator` calls for every tensor: allocate and free, and its
//! optional `record_stream` and base-allocation hooks. Each serves from the device's allocator of the
//! process's backend: tensormem's caching allocator, or under `backend:cudaMallocAsync` the device's
//! `AsyncAllocator`.
//!
//! Allocation, free and `record_stream` are adapters over the implementations the C++ layer's
//! functions call too ([`native`]): they keep the pluggable signatures and their way of failing (a
//! null result or nothing, the error kept and printed).

use std::ffi::{c_int, c_void};

use cudarc::driver::sys;
use tensormem_cuda_alloc::{DeviceAddress, Error as AllocError};
use tensormem_runtime::DeviceMemory;

use crate::boundary::call;
use crate::devices;
use crate::error::Error;
use crate::native;

/// Allocates `size` bytes on device `device` for use on `stream`, from tensormem's allocator
/// (PyTorch's `alloc_fn`: `void* alloc(size_t size, int device, cudaStream_t stream)`; PyTorch's
/// documentation spells the size `ssize_t`, which has the same size and passing).
///
/// Returns null when the memory cannot be had (tensormem's out-of-memory error, with PyTorch's
/// message, is then [`tensormem_last_error`](crate::tensormem_last_error) and is printed on stderr), and
/// for `size == 0`.
///
/// # Safety
///
/// `stream` is null (the default stream), `cudaStreamLegacy`, `cudaStreamPerThread`, or a live stream
/// of device `device` that stays alive for the rest of the process, as PyTorch's streams do.
#[no_mangle]
pub unsafe extern "C" fn tensormem_alloc(
    size: usize,
    device: c_int,
    stream: sys::CUstream,
) -> *mut c_void {
    let ptr = call("tensormem_alloc", std::ptr::null_mut(), || {
        // SAFETY: `stream` is a live stream of `device` kept alive by its owner (our caller's
        // obligation).
        unsafe { native::malloc(size, device, stream) }
    });
    if ptr.is_null() && size != 0 {
        // PyTorch does not check for null here: say why before the first kernel trips over it.
        alloc_failed(size, device);
    }
    ptr
}

#[cold]
fn alloc_failed(size: usize, device: c_int) {
    let reason = crate::error::last_error_string().unwrap_or_default();
    eprintln!("tensormem: allocating {size} bytes on CUDA device {device} failed: {reason}");
}

/// Frees `ptr`, handed out by [`tensormem_alloc`], back to tensormem's cache or the device's memory
/// pool (PyTorch's `free_fn`:
/// `void free(void* ptr, size_t size, int device, cudaStream_t stream)`). The memory is reused only
/// after the work queued on the streams it was used on (its allocation stream and those given to
/// [`tensormem_record_stream`]) has finished. `size` and `stream` are those of the allocation, which the
/// allocator knows already; a null `ptr` is ignored.
///
/// A pointer tensormem did not hand out is refused: nothing is freed, the error is kept (see
/// [`tensormem_last_error`](crate::tensormem_last_error)) and printed on stderr.
///
/// # Safety
///
/// No work that is still to be queued uses the memory (work already queued on its streams may still
/// run: the allocator waits for it).
#[no_mangle]
pub unsafe extern "C" fn tensormem_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: sys::CUstream,
) {
    // The allocator knows the allocation's size and stream, and which device's allocator handed it out.
    let _ = (size, stream);
    if ptr.is_null() {
        return;
    }
    let freed = call("tensormem_free", false, || {
        native::raw_delete(ptr)?;
        Ok(true)
    });
    if !freed {
        let reason = crate::error::last_error_string().unwrap_or_default();
        eprintln!("tensormem: freeing {ptr:p} on CUDA device {device} failed: {reason}");
    }
}

/// Marks memory from [`tensormem_alloc`] as used on `stream` too (PyTorch's `record_stream_fn`:
/// `void record_stream(void* ptr, cudaStream_t stream)`, called by `Tensor.record_stream`): once freed,
/// it is not reused before the work queued on `stream` until then has finished.
///
/// Errors (a pointer tensormem did not hand out, a stream of another device) are kept (see
/// [`tensormem_last_error`](crate::tensormem_last_error)) and logged; nothing changes then.
///
/// # Safety
///
/// As [`tensormem_alloc`] for `stream`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_record_stream(ptr: *mut c_void, stream: sys::CUstream) {
    call("tensormem_record_stream", (), || {
        let allocator = native::owner(DeviceAddress(ptr as u64))?;
        // SAFETY: `stream` is live and kept alive (our caller's obligation).
        unsafe { native::record_stream(&allocator, ptr, stream) }
    });
}

/// The start of the device allocation (segment) that holds `ptr`, and its size in `*size` (PyTorch's
/// `base_alloc_fn`: `void* base_alloc(void* ptr, size_t* size)`, used when sharing memory by CUDA IPC,
/// which works on whole driver allocations). Under `backend:cudaMallocAsync` every live pointer is
/// its own base, with the size it was allocated with (PyTorch's `getBaseAllocation` there). Returns
/// null, leaving `*size` alone, if `ptr` is not in memory tensormem's allocator holds.
///
/// # Safety
///
/// `size` is null or valid for a write of one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    call("tensormem_base_alloc", std::ptr::null_mut(), || {
        if size.is_null() {
            return Err(Error::NullArgument { what: "size" });
        }
        let ptr = DeviceAddress(ptr as u64);
        for allocator in devices::used()? {
            match allocator.base_allocation(ptr) {
                Ok((base, bytes)) => {
                    // SAFETY: `size` is non-null (checked above) and valid for writes (our caller's
                    // obligation).
                    unsafe { size.write(bytes) };
                    return Ok(base.0 as *mut c_void);
                }
                Err(AllocError::InvalidPointer { .. }) => {}
                Err(other) => return Err(other.into()),
            }
        }
        Err(Error::UnknownPointer { ptr: ptr.0 })
    })
}
