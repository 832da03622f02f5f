//! The functions PyTorch's `CUDAPluggableAllocator` calls for every tensor: allocate and free, and its
//! optional `record_stream` and base-allocation hooks. Each serves from the device's allocator of the
//! process's backend: tensormem's caching allocator, or under `backend:cudaMallocAsync` the device's
//! `AsyncAllocator`.

use std::ffi::{c_int, c_void};

use cudarc::driver::sys;
use tensormem_cuda_alloc::{DeviceAddress, Error as AllocError};
use tensormem_runtime::{DeviceAllocator, DeviceMemory};

use crate::boundary::call;
use crate::capture_mode;
use crate::devices;
use crate::error::{Error, Result};
use crate::streams;

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
        let ptr = unsafe { allocate_on(device, size, stream) }?;
        Ok(ptr.0 as *mut c_void)
    });
    if ptr.is_null() && size != 0 {
        // PyTorch does not check for null here: say why before the first kernel trips over it.
        alloc_failed(size, device);
    }
    ptr
}

/// `size` bytes from `device`'s allocator for use on the raw stream `stream` (registered with the
/// device the first time): from the caching allocator with the thread in the relaxed capture mode
/// while a capture is open, or under `backend:cudaMallocAsync` a `cuMemAllocFromPoolAsync` on the
/// stream (which a capture records as a graph node).
///
/// # Safety
///
/// As [`tensormem_alloc`] for `stream`.
#[inline]
pub(crate) unsafe fn allocate_on(
    device: c_int,
    size: usize,
    stream: sys::CUstream,
) -> Result<DeviceAddress> {
    let allocator = devices::served(device)?;
    // SAFETY: `stream` is live and kept alive by its owner (the caller's obligation).
    unsafe {
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
    }
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
    let _ = (size, stream);
    if ptr.is_null() {
        return;
    }
    let freed = call("tensormem_free", false, || {
        let ptr = DeviceAddress(ptr as u64);
        devices::served(device)?.free(ptr)?;
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
        let ptr = DeviceAddress(ptr as u64);
        let allocator = owner(ptr)?;
        // SAFETY: `stream` is live and kept alive (our caller's obligation).
        unsafe {
            streams::with_stream(allocator.device(), stream, |id| {
                allocator.record_stream(ptr, id)
            })
        }
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
