//! PyTorch on tensormem's CUDA caching allocator.
//!
//! PyTorch lets a program replace its CUDA caching allocator, before the first CUDA allocation, with
//! any library that exports `void* alloc(size_t size, int device, cudaStream_t stream)` and
//! `void free(void* ptr, size_t size, int device, cudaStream_t stream)`
//! (`torch.cuda.memory.CUDAPluggableAllocator`, then `torch.cuda.memory.change_current_allocator`), or
//! use such a library for one `torch.cuda.MemPool` only. This crate builds that library
//! (`libtensormem_torch.so`) on tensormem's allocator, which follows PyTorch's own caching rules, so a
//! PyTorch user can run a real model on tensormem and compare.
//!
//! | PyTorch calls | exported here |
//! | --- | --- |
//! | `alloc_fn`, `free_fn` (required) | [`tensormem_alloc`], [`tensormem_free`] |
//! | `set_init_fn` | [`tensormem_init`] |
//! | `set_reset_fn` (`torch.cuda.empty_cache`) | [`tensormem_empty_cache`] |
//! | `set_memory_fraction_fn` (`torch.cuda.set_per_process_memory_fraction`) | [`tensormem_set_memory_fraction`] |
//! | `set_base_alloc_fn` (CUDA IPC sharing) | [`tensormem_base_alloc`] |
//! | `set_record_stream_fn` (`Tensor.record_stream`) | [`tensormem_record_stream`] |
//! | `set_begin_allocate_to_pool`, `set_end_allocate_to_pool_fn`, `set_release_pool` (CUDA graphs) | [`tensormem_begin_allocate_to_pool`], [`tensormem_end_allocate_to_pool`], [`tensormem_release_pool`] |
//! | (`torch.cuda.memory_stats`, which fails under a pluggable allocator) | [`tensormem_memory_stats_json`], [`tensormem_string_free`], [`tensormem_reset_peak_stats`] |
//! | (`torch.cuda.memory._record_memory_history`, `_dump_snapshot`) | [`tensormem_record_history`], [`tensormem_dump_snapshot`] |
//! | errors | [`tensormem_last_error`], [`tensormem_clear_last_error`] |
//!
//! `python/tensormem_torch.py`, beside this crate's sources, does the wiring from Python (no install
//! needed): `tensormem_torch.install(path_to_so)` switches PyTorch to tensormem and sets every hook this
//! PyTorch accepts; `tensormem_torch.stats()` reads the statistics. See `docs/torch-plugin.md`.
//!
//! No panic crosses the C boundary: each function catches it, and failures are reported by a null or
//! `-1` result plus a message kept per thread ([`tensormem_last_error`]). A failed allocation or free is
//! also printed on stderr, since PyTorch does not check the result of its pluggable allocator.
//! Each call leaves the calling thread's current CUDA context (PyTorch's current device) as it found it.
//!
//! The allocator of each device is the device API's ([`tensormem::cuda::caching_allocator`]),
//! configured from `TENSORMEM_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`.
//!
//! ```
//! use std::ffi::CStr;
//! use tensormem_torch::{tensormem_alloc, tensormem_free, tensormem_last_error};
//!
//! // SAFETY: null is the default stream.
//! let ptr = unsafe { tensormem_alloc(1 << 20, 0, std::ptr::null_mut()) };
//! if ptr.is_null() {
//!     // No GPU here: the reason is kept for the caller.
//!     // SAFETY: non-null after a failed call, valid until the next failure on this thread.
//!     let why = unsafe { CStr::from_ptr(tensormem_last_error()) };
//!     assert!(!why.to_bytes().is_empty());
//! } else {
//!     // SAFETY: nothing uses the memory any more.
//!     unsafe { tensormem_free(ptr, 1 << 20, 0, std::ptr::null_mut()) };
//! }
//! ```

mod allocate;
mod boundary;
mod capture_mode;
mod devices;
mod error;
mod hooks;
pub mod native;
mod stats;
mod streams;

pub use allocate::{
    tensormem_alloc, tensormem_base_alloc, tensormem_free, tensormem_record_stream,
};
pub use error::{tensormem_clear_last_error, tensormem_last_error, Error, Result};
pub use hooks::{
    tensormem_begin_allocate_to_pool, tensormem_empty_cache, tensormem_end_allocate_to_pool,
    tensormem_init, tensormem_release_pool, tensormem_set_memory_fraction, TorchMempoolId,
};
pub use stats::{
    tensormem_dump_snapshot, tensormem_memory_stats_json, tensormem_record_history,
    tensormem_reset_peak_stats, tensormem_string_free,
};
