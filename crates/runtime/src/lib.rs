//! The process's CUDA state, in one place.
//!
//! PyTorch answers "what serves device N" in one place, `c10::cuda::CUDACachingAllocator::allocator`:
//! one `CUDAAllocator` per process, native or `cudaMallocAsync`. This crate is that place for
//! tensormem. Per device it keeps the allocator the process's backend chose (as
//! [`DeviceAllocator`], which serves [`DeviceMemory`]), the pinned host allocator; beside them the
//! IPC producer and consumer, the allocator settings applied since start, history recording, the
//! out-of-memory observers, and the bad-fork guard. CUDA storages (`tensormem-storage`), the
//! `torch.cuda`-shaped device API (`tensormem::cuda`) and the PyTorch plugin all ask it; none keeps a
//! table of its own, so whichever touches a device first, every setting made through any of them
//! applies to the allocator all of them use.
//!
//! ```
//! use tensormem_runtime::{DeviceMemory, StreamId};
//!
//! // The allocator of device 0, as `PYTORCH_CUDA_ALLOC_CONF` (or `TENSORMEM_ALLOC_CONF`) chose it.
//! match tensormem_runtime::allocator(0) {
//!     Ok(memory) => {
//!         let ptr = memory.allocate(1 << 20, StreamId::DEFAULT)?;
//!         memory.free(ptr)?;
//!         println!("{}: {:?}", memory.backend(), memory.memory_stats()?.allocated_bytes.all);
//!     }
//!     Err(err) => println!("no CUDA device here: {err}"),
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! | what | here |
//! | --- | --- |
//! | `torch.cuda.get_allocator_backend()`, the backend chosen once | [`get_allocator_backend`], [`backend_supports`], [`AsyncUnsupported`] |
//! | the allocator of a device | [`allocator`] ([`DeviceAllocator`]), [`caching_allocator`], [`async_allocator`], [`device_state`] |
//! | `memory._set_allocator_settings`, history, OOM observers | [`apply_settings`], [`record_history`], [`attach_oom_observer`], [`on_caching_allocator`] |
//! | `CudaIPCGlobalEntities`, `torch.cuda.ipc_collect()` | [`producer`], [`consumer`], [`ipc_collect`] |
//! | `torch.cuda._is_in_bad_fork` | [`is_in_bad_fork`], [`check_not_forked`] |
//!
//! # Fork
//!
//! The CUDA driver does not survive `fork()`. As in PyTorch, the first call that initialises CUDA
//! arms a guard, and in a child forked after that every function here returns
//! [`Error::ForkedChild`] instead of touching the driver, whichever crate asked.

mod backend;
mod device_allocator;
mod devices;
mod error;
mod fork;
mod unsupported;

pub use backend::{backend_supports, check_unchanged, configured_backend, get_allocator_backend};
pub use device_allocator::DeviceAllocator;
pub use devices::{
    allocator, apply_settings, async_allocator, attach_oom_observer, caching_allocator,
    check_not_forked, check_ordinal, consumer, device_count, device_state, ipc_collect,
    on_caching_allocator, opened, opened_caching_allocators, producer, record_history, DeviceState,
    OpenObserver, Recorded, SharedOomObserver,
};
pub use error::{Error, Result};
pub use fork::{forked_child_message, is_in_bad_fork};
pub use tensormem_cuda_alloc::{DeviceMemory, StreamId};
pub use unsupported::AsyncUnsupported;
