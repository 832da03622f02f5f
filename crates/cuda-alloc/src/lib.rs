//! A CUDA caching allocator with PyTorch's semantics.
//!
//! # The problem
//!
//! Allocating device memory directly (`cudaMalloc`, `cudaFree`) is slow (it can take milliseconds)
//! and synchronizes the device, so a framework that creates and drops tensors thousands of times per
//! step cannot afford it. PyTorch's answer is its *caching allocator*: memory obtained from the device
//! is kept after it is freed and handed out again. Doing that well is subtle:
//!
//! - **Streams.** GPU work is asynchronous and ordered per stream. Memory freed on the host may still
//!   be in use by queued kernels, so a freed block may be reused only on the stream it was allocated
//!   on (whose later work is ordered after the earlier uses), or, if other streams used it
//!   (`record_stream`), only once their work recorded so far has completed.
//! - **Fragmentation.** Requests are rounded (512 B granularity, optional power-of-two divisions),
//!   served from two pools (requests up to 1 MiB share 2 MiB segments; larger ones come from 20 MiB
//!   segments or segments of their own size), split and merged again on free, with limits on
//!   splitting large blocks (`max_split_size`). Expandable segments map physical memory into one
//!   reserved range per stream instead.
//! - **Running out.** Before reporting out of memory, the allocator asks registered callbacks to free
//!   memory, releases cached blocks, and retries.
//! - **Observability.** `memory_stats()` counters, memory snapshots and a trace of every event.
//!
//! This crate rebuilds that allocator ([`CachingAllocator`]) decision for decision: replayed with the
//! addresses the device returned, recorded PyTorch 2.11 traces make the same decisions and end with the
//! same `memory_stats()`. It is generic over a [`Device`] (the memory provider: allocation, streams,
//! events, virtual memory), with two backends: a deterministic [simulated device](backend::sim) for
//! tests and trace replay, and the CUDA driver (feature `cuda`).
//!
//! Beyond PyTorch, calls on different streams do not contend: the allocator keeps its state per stream
//! (blocks never move between streams), each behind its own lock, with device-wide statistics kept
//! exact without a device-wide lock (see [`stats`]). A stream's lock is biased towards the thread
//! that uses it: that thread takes and releases it without a locked instruction, and another thread
//! revokes the bias with Linux's `membarrier` (elsewhere, or where `membarrier` is filtered, it is a
//! plain mutex). A caller on one thread sees exactly PyTorch's behaviour.
//!
//! # Example
//!
//! ```
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{CachingAllocator, StreamId};
//!
//! // A simulated 1 GiB device; settings as PYTORCH_CUDA_ALLOC_CONF would give them.
//! let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
//! let (compute, copy) = (StreamId(0), StreamId(7));
//!
//! let x = alloc.allocate(3000, compute)?; // rounded to 3072 bytes, in a new 2 MiB segment
//! assert_eq!(x.size(), 3072);
//! alloc.record_stream(&x, copy)?; // also used by work queued on another stream
//! alloc.free(x)?; // not reusable until that work is done
//! assert_eq!(alloc.memory_stats().active_bytes.all.current, 3072);
//!
//! alloc.device().complete_stream_work(copy); // the simulated copy finishes
//! let y = alloc.allocate(3000, compute)?; // the next allocation reclaims the block first
//! let stats = alloc.memory_stats().to_flat(); // torch.cuda.memory_stats() key names
//! assert_eq!(stats["active_bytes.all.current"], 3072);
//! assert_eq!(stats["segment.small_pool.current"], 1);
//!
//! alloc.free(y)?;
//! alloc.empty_cache()?; // every unused segment goes back to the device
//! assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 0);
//! # Ok::<(), tensormem_cuda_alloc::Error>(())
//! ```
//!
//! Every [`allocate`](CachingAllocator::allocate) needs a [`free`](CachingAllocator::free): a raw
//! [`Allocation`] dropped without one keeps its memory until the allocator is dropped.
//! [`CachingAllocator::allocate_owned`] and [`allocate_shared`](CachingAllocator::allocate_shared)
//! return an [`OwnedAllocation`] instead, which frees itself when dropped, on every backend.
//!
//! # With cudarc
//!
//! The CUDA backend shares cudarc's context and streams (`CudaBackend::from_context`,
//! `CudaBackend::register_stream`), and `CachedSlice<T>` is a buffer from the cache that cudarc's
//! copies and kernels take and that frees itself to the cache when dropped (example:
//! `examples/cudarc_kernel.rs`).
//!
//! # Features
//!
//! - `cuda` (default): the CUDA backend, `backend::cuda`, through `cudarc` with the driver loaded at
//!   run time (no CUDA toolkit needed to build).
//! - `snapshot-io` (default): snapshot files, [`snapshot::Snapshot::read_file`] and the writers: the
//!   pickle reader and writer, gzip (`flate2`) and JSON (`serde_json`). Without it the snapshot model
//!   stays ([`CachingAllocator::snapshot`], [`snapshot::Snapshot::to_value`]) and the crate depends on
//!   neither `flate2` nor `serde_json`.
//!
//! Not features: the `--cfg tensormem_ab_*` compiler flags (in `RUSTFLAGS`) each switch one speed trick
//! off, for A/B timing builds only (`benches/gpu/ab_builds.sh`); no crate that depends on this one can
//! turn them on, and nothing else should.
//!
//! # Map
//!
//! | item | PyTorch |
//! | --- | --- |
//! | [`CachingAllocator`] | `DeviceCachingAllocator` (one per device) |
//! | [`Allocation`] | a `Block*` handed out (a `DataPtr`) |
//! | [`OwnedAllocation`] | a `DataPtr` whose deleter frees the block |
//! | [`config::AllocatorConfig`] | `CUDAAllocatorConfig`, the `PYTORCH_CUDA_ALLOC_CONF` grammar |
//! | [`stats::MemoryStats`] | `DeviceStats` / `torch.cuda.memory_stats()` |
//! | [`snapshot::Snapshot`] | `torch.cuda.memory._snapshot()` / `_dump_snapshot` pickles |
//! | [`oom::FreeMemoryCallback`] | `FreeCudaMemoryCallbacksRegistry` |
//! | [`host::HostCachingAllocator`] | `CachingHostAllocator` (pinned host memory, `torch.cuda.host_memory_stats`) |
//! | [`MempoolId`] | `MempoolId_t` (private pools for CUDA graphs) |
//! | [`PoolCheckpoint`] | `PrivatePoolState` (`getCheckpointState` / `setCheckpointPoolState`) |

mod allocator;
#[cfg(feature = "cuda")]
mod async_allocator;
pub mod backend;
mod biased_lock;
mod block;
#[cfg(feature = "cuda")]
mod cached_slice;
pub mod config;
pub mod device;
mod error;
mod events;
mod expandable;
mod free_set;
pub mod host;
#[cfg(loom)]
mod loom_sync;
mod memory;
pub mod oom;
mod owned;
mod pointer_index;
mod pool;
mod pool_id;
mod pool_options;
mod settings;
pub mod size;
pub mod snapshot;
mod stack;
pub mod stats;
mod trace;

pub use allocator::{
    Allocation, AlwaysPinned, CachingAllocator, CheckpointDelta, HostBackup, InvariantViolation,
    PoolCheckpoint, ShareableSegment, SleepReport, WakeReport, BACKUP_PIECE_BYTES,
    DEFAULT_STREAM_CAPACITY, FAST_PATH_ENV,
};
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use async_allocator::{AsyncAllocator, AsyncPoolStats, PoolUsage};
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cached_slice::CachedSlice;
pub use device::{
    CaptureStatus, Device, DeviceAddress, DeviceError, DeviceResult, MemInfo, ProcessMemory,
    StreamId,
};
pub use error::{Error, Result, SleepError};
pub use expandable::ChunkExport;
pub use memory::{CaptureFilter, DeviceMemory};
pub use owned::OwnedAllocation;
pub use pool_id::MempoolId;
pub use pool_options::{FnPoolAllocator, PoolAllocator, PoolOptions};
pub use stack::RecordContext;
pub use trace::TraceTracker;
