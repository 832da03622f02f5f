//! The `torch.cuda` surface: devices, streams and the per-device caching allocators.
//!
//! PyTorch keeps, per process, a current device per thread, a current stream per device and thread, and
//! one caching allocator per device, created on the device's first use; `torch.cuda` exposes them
//! (`torch/csrc/cuda/Module.cpp`). This module is the same surface for Rust programs, on the CUDA driver
//! API ([`cuda_alloc::backend::cuda`](crate::cuda_alloc::backend::cuda)):
//!
//! | `torch.cuda` | here |
//! | --- | --- |
//! | `is_available`, `device_count` | [`is_available`], [`device_count`] |
//! | `current_device`, `set_device`, `_exchange_device`, `device(i)` | [`current_device`], [`set_device`], [`exchange_device`], [`device_guard`] |
//! | `can_device_access_peer` | [`can_device_access_peer`] (and [`enable_peer_access`]) |
//! | `get_device_properties`, `get_device_name`, `get_device_capability` | [`get_device_properties`], [`get_device_name`], [`get_device_capability`] |
//! | `Stream()`, `current_stream`, `default_stream`, `set_stream` | [`Stream::new`], [`current_stream`], [`default_stream`], [`set_stream`] |
//! | `is_current_stream_capturing` | [`is_current_stream_capturing`] |
//! | `synchronize`, `mem_get_info` | [`synchronize`], [`mem_get_info`] |
//! | `memory_stats`, `memory_allocated`, `memory_reserved`, `max_memory_allocated` | [`memory_stats`], [`memory_allocated`], [`memory_reserved`], [`max_memory_allocated`], [`max_memory_reserved`] |
//! | `reset_peak_memory_stats`, `reset_accumulated_memory_stats` | [`reset_peak_memory_stats`], [`reset_accumulated_memory_stats`] |
//! | `memory_snapshot`, `memory._record_memory_history`, `memory._dump_snapshot` | [`memory_snapshot`] / [`memory_snapshot_with`] (`mempool_id`, `include_traces`), [`record_memory_history`] / [`record_memory_history_with_context`] (stacks) / [`record_memory_history_in`] ([`HistoryScope`]: `record_cuda`, `record_pinned_host_memory`), [`dump_snapshot`] |
//! | `set_per_process_memory_fraction`, `empty_cache` | [`set_per_process_memory_fraction`], [`empty_cache`] |
//! | `ipc_collect` | [`ipc_collect`] |
//! | `memory._set_allocator_settings`, `get_allocator_backend` | [`set_allocator_settings`], [`allocator_settings`], [`get_allocator_backend`] |
//! | `PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync` | every function here serves memory from the device's [`async_allocator`] ([`device_allocator`] gives the one in use; the refusals are [`AsyncUnsupported`]) |
//! | `caching_allocator_alloc`, `caching_allocator_delete` | [`caching_allocator_alloc`], [`caching_allocator_delete`] |
//! | `_is_in_bad_fork` | [`is_in_bad_fork`] |
//! | `_cuda_cudaHostAllocator`, `host_memory_stats`, `_host_emptyCache` | [`host_allocator`], [`alloc_pinned`] / [`free_pinned`] / [`record_pinned_stream`], [`host_memory_stats`], [`host_empty_cache`] |
//! | `_cuda_hasPrimaryContext` | [`has_primary_context`] |
//! | `MemPool(allocator, use_on_oom, no_split)`, `use_mem_pool` | [`MemPool::new`] / [`MemPool::with_options`] ([`PoolOptions`], [`PoolAllocator`] / [`FnPoolAllocator`] for an allocator of its own), [`use_mem_pool`] |
//! | vLLM's `sleep`/`wake_up`, `torch_memory_saver`'s `pause`/`resume` | [`sleep_pool`], [`wake_pool`], [`is_pool_asleep`], [`asleep_bytes`] (private pools on expandable segments) |
//! | `_cuda_attach_out_of_memory_observer` | [`attach_out_of_memory_observer`] (every device, including those used later) |
//! | `PYTORCH_NO_CUDA_MEMORY_CACHING` | read with `TENSORMEM_NO_CUDA_MEMORY_CACHING` when a device is first used (see [`CachingAllocator::set_caching_disabled`](crate::cuda_alloc::CachingAllocator::set_caching_disabled)) |
//!
//! Functions that take `device: Option<u32>` act on the calling thread's current device for `None`.
//!
//! The allocator of a device is configured from `TENSORMEM_ALLOC_CONF`, else from PyTorch's
//! variables as PyTorch 2.11 reads them (`PYTORCH_CUDA_ALLOC_CONF` first, then `PYTORCH_ALLOC_CONF`;
//! see `tensormem_cuda_alloc::config::ENV_VARS`), read when the device is first used.
//!
//! # Backends
//!
//! As in PyTorch, the configuration's `backend` key picks the allocator of the whole process, once,
//! when the device API first needs one ([`get_allocator_backend`]): `backend:native` (the default)
//! is tensormem's caching allocator; `backend:cudaMallocAsync` is the driver's stream-ordered
//! allocator ([`AsyncAllocator`](crate::cuda_alloc::AsyncAllocator), one per device on its default
//! memory pool). Under the latter, raw allocation, `record_stream`, the statistics (PyTorch's six
//! figures), peak resets, [`empty_cache`] (the pool trimmed) and the memory fraction serve from it,
//! and what PyTorch's `cudaMallocAsync` backend refuses is refused with PyTorch's error in
//! [`Error::AsyncUnsupported`]: snapshots, memory history, out-of-memory observers, [`MemPool`]s,
//! CUDA IPC of its memory. The backend cannot change afterwards ([`Error::BackendChanged`]).
//!
//! There is one allocator per device in the process, as in PyTorch: the one the process runtime
//! (`tensormem-runtime`) keeps, which CUDA storages (`tensormem_storage::CudaContext::new`), CUDA
//! IPC and the PyTorch plugin use too; they all serve [`DeviceMemory`]. So
//! [`memory_stats`], [`empty_cache`], [`memory_snapshot`] and the settings cover the storages' memory,
//! whichever of them touched the device first.
//!
//! # Fork
//!
//! The CUDA driver does not survive `fork()`. As in PyTorch, the first call that initialises CUDA arms a
//! guard, and in a child forked after that every function here returns [`Error::ForkedChild`] instead of
//! touching the driver. Start CUDA workers as fresh processes.

mod backend;
mod device;
mod error;
mod host;
mod mem_pool;
mod memory;
mod sleep;
mod stream;

pub use backend::{
    async_allocator, backend_supports, configured_backend, device_allocator, get_allocator_backend,
    AsyncUnsupported, DeviceAllocator,
};
pub use device::{
    can_device_access_peer, current_device, device_count, device_guard, enable_peer_access,
    exchange_device, get_device_capability, get_device_name, get_device_properties,
    has_primary_context, is_available, mem_get_info, set_device, synchronize, DeviceGuard,
};
pub use error::{Error, Result};
pub use host::{
    alloc_pinned, free_pinned, host_allocator, host_empty_cache, host_memory_stats, host_stats,
    record_pinned_stream, reserve_backup_memory,
};
pub use mem_pool::{use_mem_pool, MemPool, MemPoolGuard};
pub use memory::{
    allocator_settings, attach_out_of_memory_observer, caching_allocator, caching_allocator_alloc,
    caching_allocator_delete, caching_allocator_record_stream, device_memory_stats, dump_snapshot,
    empty_cache, ipc_collect, max_memory_allocated, max_memory_reserved, memory_allocated,
    memory_reserved, memory_snapshot, memory_snapshot_with, memory_stats, record_memory_history,
    record_memory_history_in, record_memory_history_with_context, reset_accumulated_memory_stats,
    reset_peak_memory_stats, set_allocator_settings, set_per_process_memory_fraction, HistoryScope,
};
pub use sleep::{asleep_bytes, is_pool_asleep, sleep_pool, wake_pool};
pub use stream::{current_stream, default_stream, is_current_stream_capturing, set_stream, Stream};
pub use tensormem_cuda_alloc::backend::cuda::{DeviceProperties, DeviceUuid};
pub use tensormem_cuda_alloc::{
    DeviceAddress, FnPoolAllocator, MemInfo, MempoolId, PoolAllocator, PoolOptions, RecordContext,
    StreamId,
};
pub use tensormem_cuda_alloc::{SleepError, SleepReport, WakeReport};
pub use tensormem_runtime::{is_in_bad_fork, DeviceMemory};
