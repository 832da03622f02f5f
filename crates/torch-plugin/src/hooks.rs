//! The optional hooks of PyTorch's `CUDAPluggableAllocator` that tensormem has the feature for:
//! initialisation, `torch.cuda.empty_cache`, `torch.cuda.set_per_process_memory_fraction`, and the
//! private pools of CUDA graph capture and `torch.cuda.MemPool`.
//!
//! PyTorch sets them through the `set_*` methods of its `_CUDAPluggableAllocator` object, each taking
//! the address of a C function (the Python helper does this). Under `backend:cudaMallocAsync` they do
//! what PyTorch's `CudaMallocAsyncAllocator` does: the empty-cache trims each device's memory pool,
//! the memory fraction limits what the allocator hands out, and the pool hooks are a capture's
//! bookkeeping (there are no private pools).
//!
//! Each is an adapter over the implementation the C++ layer's function of the same job calls
//! ([`native`]), keeping the pluggable signature and its way of failing (nothing returned, the error
//! kept).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use tensormem::cuda;
use tensormem_cuda_alloc::{CaptureStatus, Device, MempoolId, StreamId};
use tensormem_runtime::DeviceMemory;

use crate::boundary::call;
use crate::devices;
use crate::native;

/// PyTorch's `MempoolId_t` (`std::pair<unsigned long long, unsigned long long>`), passed by value: the
/// first half is set for pools made by graph capture, the second for `graph_pool_handle()` and
/// `torch.cuda.MemPool`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TorchMempoolId {
    /// The first half.
    pub first: u64,
    /// The second half.
    pub second: u64,
}

impl From<TorchMempoolId> for MempoolId {
    fn from(id: TorchMempoolId) -> Self {
        MempoolId(id.first, id.second)
    }
}

/// Initialises CUDA for the allocator (PyTorch's `init_fn`: `void init(int device_count)`, called when
/// PyTorch initialises CUDA). Devices are opened on their first allocation. Errors are kept (see
/// [`tensormem_last_error`](crate::tensormem_last_error)).
#[no_mangle]
pub extern "C" fn tensormem_init(device_count: c_int) {
    call("tensormem_init", (), || {
        let found = cuda::device_count()?;
        if i64::from(found) != i64::from(device_count) {
            tracing::warn!(
                found,
                device_count,
                "PyTorch and tensormem see different device counts"
            );
        }
        Ok(())
    });
}

/// Returns every cached, unused block of every device to the driver (PyTorch's `reset_fn`,
/// `void reset()`, called by `torch.cuda.empty_cache()`; under `backend:cudaMallocAsync` each device
/// is synchronized and its memory pool trimmed to nothing). Memory handed out stays. Errors are kept.
#[no_mangle]
pub extern "C" fn tensormem_empty_cache() {
    call("tensormem_empty_cache", (), || {
        native::empty_cache(MempoolId::DEFAULT)
    });
}

/// Limits how much of `device`'s memory tensormem may hold to `fraction` of it (PyTorch's
/// `memory_fraction_fn`: `void memory_fraction(double fraction, int device)`, called by
/// `torch.cuda.set_per_process_memory_fraction`). Errors (a fraction outside `[0, 1]`) are kept.
#[no_mangle]
pub extern "C" fn tensormem_set_memory_fraction(fraction: f64, device: c_int) {
    call("tensormem_set_memory_fraction", (), || {
        native::set_memory_fraction(fraction, device)
    });
}

/// Starts sending the allocations of a CUDA graph capture on `device` to private pool `pool` (PyTorch's
/// `begin_allocate_to_pool`: `void(int device, MempoolId_t pool, std::function<bool(cudaStream_t)>
/// filter)`, called by `CUDAGraph::capture_begin` and `torch.cuda.use_mem_pool`).
///
/// PyTorch's filter is a C++ object that Rust cannot call, so tensormem uses its own: an allocation
/// goes to the pool if its stream is capturing, under the capture id of the first capturing stream
/// that allocates while the pool is open (a capture's side streams share its id). Allocations outside
/// captures, including those in a `torch.cuda.use_mem_pool` block, come from the ordinary pools.
/// Until the pool is closed, allocations switch their thread to the relaxed capture mode, in which new
/// device memory may be had during a global-mode capture (as PyTorch's allocator does). Under
/// `backend:cudaMallocAsync` this begins the capture's bookkeeping instead
/// (`AsyncAllocator::begin_capture`; one capture at a time). Errors (the pool is already being
/// recorded to) are kept.
///
/// # Safety
///
/// `filter` is not used; any value is accepted (it is the address of PyTorch's `std::function`,
/// passed by reference as C++ passes objects with a destructor, which the caller destroys).
#[no_mangle]
pub unsafe extern "C" fn tensormem_begin_allocate_to_pool(
    device: c_int,
    pool: TorchMempoolId,
    filter: *mut c_void,
) {
    let _ = filter;
    call("tensormem_begin_allocate_to_pool", (), || {
        let allocator = devices::served(device)?;
        /// No capture bound yet (capture ids are never this).
        const UNBOUND: u64 = u64::MAX;
        let bound = AtomicU64::new(UNBOUND);
        // The caching allocator's filter (the async allocator ignores it: the driver captures every
        // allocation made on a capturing stream).
        let filter = move |stream: StreamId| match allocator.device().capture_status(stream) {
            Ok(CaptureStatus::Active { id }) => {
                match bound.compare_exchange(UNBOUND, id, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => true,
                    Err(current) => current == id,
                }
            }
            _ => false,
        };
        native::pool_begin(device, pool.into(), Box::new(filter))
    });
}

/// Stops sending allocations to private pool `pool` (PyTorch's `end_allocate_to_pool_fn`:
/// `void(int device, MempoolId_t pool)`, called when a capture ends). Under
/// `backend:cudaMallocAsync` this ends the capture's bookkeeping, joining the streams frees were
/// queued on into the capture stream (`AsyncAllocator::end_capture`; the hook is not told the capture
/// stream: see `capture_mode::async_capture`). Errors are kept.
#[no_mangle]
pub extern "C" fn tensormem_end_allocate_to_pool(device: c_int, pool: TorchMempoolId) {
    call("tensormem_end_allocate_to_pool", (), || {
        // SAFETY: no stream is given.
        unsafe { native::pool_end(device, pool.into(), None) }
    });
}

/// One user of private pool `pool` is done with it (PyTorch's `release_pool`: `void(int device,
/// MempoolId_t pool)`, called when a graph or `MemPool` is destroyed); once none is left, its free
/// memory goes back to the device with the next [`tensormem_empty_cache`]. Nothing under
/// `backend:cudaMallocAsync` (PyTorch's `releasePool` there does nothing). Errors are kept.
#[no_mangle]
pub extern "C" fn tensormem_release_pool(device: c_int, pool: TorchMempoolId) {
    call("tensormem_release_pool", (), || {
        native::pool_release(device, pool.into())
    });
}
