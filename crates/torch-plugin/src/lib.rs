//! PyTorch on tensormem's CUDA caching allocator.
//!
//! This crate builds `libtensormem_torch.so`, through which PyTorch runs on tensormem's allocator
//! (which follows PyTorch's own caching rules), in one of two ways:
//!
//! - **The whole allocator** (the default of the Python package `tensormem_torch`): a small C++ layer,
//!   `csrc/tensormem_allocator.cpp`, compiled against the installed PyTorch on first use, implements
//!   PyTorch's `c10::cuda::CUDACachingAllocator::CUDAAllocator` interface and is installed as PyTorch's
//!   allocator. Each of its methods calls one function of [`native`], which reports failures through a
//!   status code so that the C++ can raise PyTorch's own exceptions (`torch.OutOfMemoryError` for an
//!   out-of-memory error). Every `torch.cuda` memory function then works on tensormem.
//! - **PyTorch's `CUDAPluggableAllocator`** (the fallback): PyTorch calls
//!   `void* alloc(size_t size, int device, cudaStream_t stream)` and
//!   `void free(void* ptr, size_t size, int device, cudaStream_t stream)` and a few optional hooks,
//!   exported below, with PyTorch's limits for pluggable allocators (no `memory_stats()`, no `MemPool`
//!   or graph trees, an out-of-memory error returns null).
//!
//! The pluggable functions:
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
//! | errors | [`tensormem_last_error`], [`tensormem_last_error_code`], [`tensormem_clear_last_error`] |
//!
//! [`weights`] exports the functions `tensormem_torch.weights` moves a model's weights between
//! processes with (a producer publishes its tensors once, consumers install each version into
//! their own tensors): `tensormem_weights_*`, on whichever allocator each process runs.
//! [`nccl_weights`] exports those `tensormem_torch.nccl_weights` moves them with from one rank into
//! other ranks' own tensors through NCCL, across GPUs and machines: `tensormem_nccl_*`.
//!
//! Where one of them does what a function of the C++ layer does, both call one implementation in
//! [`native`]; the pluggable function keeps PyTorch's signature and reports failure its way.
//! `csrc/tensormem_abi.h` declares every exported function for C and C++ (`tests/c_abi.rs` checks it
//! against these sources).
//!
//! `python/tensormem_torch/` (the Python package; `pip install crates/torch-plugin`) does the wiring:
//! `tensormem_torch.install()` builds the C++ layer if needed and installs the allocator, or falls back to
//! the pluggable functions. See `docs/torch-plugin.md`.
//!
//! No panic crosses the C boundary: each function catches it, and failures are reported by a null or
//! `-1` result plus a message kept per thread ([`tensormem_last_error`]). A failed allocation or free is
//! also printed on stderr, since PyTorch does not check the result of its pluggable allocator.
//! Each call leaves the calling thread's current CUDA context (PyTorch's current device) as it found it.
//!
//! The allocator of each device is the process's one ([`tensormem_runtime::allocator`], which the
//! device API and CUDA storages share), configured from `TENSORMEM_ALLOC_CONF`, else PyTorch's variables as PyTorch reads them: the
//! caching allocator, or, when the configuration asks for `backend:cudaMallocAsync`, the device's
//! `AsyncAllocator`, which serves every function as PyTorch's `CudaMallocAsyncAllocator` does, what
//! PyTorch refuses for that backend being refused with its message (see [`native`]).
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
mod args;
mod boundary;
mod capture_mode;
mod devices;
mod error;
mod handles;
mod hooks;
pub mod native;
pub mod nccl_weights;
mod stats;
mod status;
mod streams;
pub mod weights;

pub use allocate::{
    tensormem_alloc, tensormem_base_alloc, tensormem_free, tensormem_record_stream,
};
pub use error::{
    tensormem_clear_last_error, tensormem_last_error, tensormem_last_error_code, Error, Result,
};
pub use hooks::{
    tensormem_begin_allocate_to_pool, tensormem_empty_cache, tensormem_end_allocate_to_pool,
    tensormem_init, tensormem_release_pool, tensormem_set_memory_fraction, TorchMempoolId,
};
pub use stats::{
    tensormem_dump_snapshot, tensormem_memory_stats_json, tensormem_record_history,
    tensormem_reset_peak_stats, tensormem_string_free,
};
