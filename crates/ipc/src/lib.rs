//! CUDA memory shared between processes, with PyTorch's reference counting and in its wire format.
//!
//! # The problem
//!
//! A CUDA allocation can be mapped into another process (`cuIpcGetMemHandle` /
//! `cuIpcOpenMemHandle`), but then two processes use one piece of memory that only the producer's
//! caching allocator manages: if the producer frees it while a consumer still reads it, the allocator
//! hands it out again and the consumer reads someone else's tensor. PyTorch (`CudaIPCTypes.cpp`,
//! `StorageSharing.cpp`) counts consumer references in shared *ref-counter files*, keeps freed memory
//! in a *limbo* until consumers released it, and passes an interprocess event so the consumer waits for
//! the producer's pending writes. This crate is that machinery:
//!
//! | PyTorch | here |
//! | --- | --- |
//! | `storage._share_cuda_()` | [`IpcProducer::share`] / [`SharedAllocation::share`] → [`IpcHandle`] |
//! | the 8-tuple it returns | [`TorchShareTuple`] ([`IpcHandle::to_torch`] / [`IpcHandle::from_torch`]) |
//! | `CudaIPCRefCountersFile` (10 000 `int64` slots, rotated) | ref-counter files, same layout ([`REF_COUNTER_FILE_SIZE`]) |
//! | `CudaIPCSentData`, `CudaIPCSentDataLimbo`, `CudaIPCCollect` | [`SharedAllocation`], the limbo, [`IpcProducer::collect`] |
//! | `REGISTER_FREE_MEMORY_CALLBACK("cuda_ipc_collect")` | registered on the allocator by [`IpcProducer::adopt`] |
//! | `CUDA_IPC_MAXIMUM_EVENTS_TO_USE` | [`MAXIMUM_EVENTS_TO_USE`] |
//! | `UntypedStorage._new_shared_cuda(*tuple)`, `getIpcDevPtr` | [`IpcConsumer::open`] (one open per base allocation) |
//! | the received storage's deleter | dropping [`ReceivedMemory`] |
//! | `_release_ipc_counter_cuda` | [`IpcConsumer::release`] (the counter file only) |
//! | a state dict sent tensor by tensor | [`IpcProducer::batch`] → [`BatchHandle`] → [`IpcConsumer::open_batch`] → [`ReceivedBatch`]: many tensors in one message, one slot, one memory handle (or range of expandable-segment chunks) per segment ([`batch`]) |
//! | `CudaIPCGlobalEntities` per process | one [`IpcProducer`] and one [`IpcConsumer`] per process: the process runtime's (`tensormem-runtime`) |
//! | `torch.cuda.ipc_collect()` | [`IpcProducer::collect`] (`tensormem_runtime::ipc_collect()` for the process's producer) |
//! | `~CudaIPCGlobalEntities` at static destruction | [`IpcProducer::close_at_exit`], run at exit for a producer that lives as long as the process ([`IpcProducer::register_exit_hook`]) |
//!
//! Where it goes beyond PyTorch: every field of a received handle is checked (device, slot inside the
//! file, `offset + size` inside the real base allocation, handle lengths) before anything is mapped or
//! written; a consumer that dies holding memory does not pin it forever (its slot records its pid and
//! start time, and `collect` reclaims it); a producer killed with files open has them removed by its
//! consumers; the producer caches memory handles per base allocation (checked against the driver's
//! buffer id) and the consumer can keep handles open between shares
//! ([`ConsumerConfig::idle_mem_handles`]), so a round trip costs a slot and a small message.
//!
//! # Example
//!
//! Without a GPU, on the simulated device and the [`driver::fake`] driver (both sides in one process
//! here; normally the handle's bytes travel over a socket):
//!
//! ```
//! use std::sync::Arc;
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{CachingAllocator, StreamId};
//! use tensormem_ipc::driver::fake::FakeDriver;
//! use tensormem_ipc::{IpcConsumer, IpcHandle, IpcProducer};
//!
//! let driver = Arc::new(FakeDriver::default());
//! let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
//! let producer = IpcProducer::new(Arc::clone(&driver));
//!
//! // Producer: share a 4 KiB allocation.
//! let allocation = allocator.allocate(4096, StreamId(0))?;
//! let (shared, handle) = producer.share(&allocator, allocation, StreamId(0))?;
//! let wire: Vec<u8> = handle.encode();
//!
//! // Consumer: open it, use it, let go.
//! let consumer = IpcConsumer::new(Arc::clone(&driver));
//! let received = consumer.open(&IpcHandle::decode(&wire)?, StreamId(0))?;
//! assert_eq!(received.view::<f32>()?.len(), 1024);
//!
//! drop(shared); // the producer frees while the consumer holds it: into the limbo
//! assert_eq!(producer.stats().limbo, 1);
//! drop(received); // the consumer synchronizes and releases its slot
//! assert!(producer.collect()); // the memory goes back to the allocator
//! assert_eq!(producer.stats().limbo, 0);
//! # Ok::<(), tensormem_ipc::Error>(())
//! ```
//!
//! On a GPU, use `driver::cuda::CudaIpcDriver` (feature `cuda`, on by default) and an allocator on
//! `tensormem_cuda_alloc::backend::cuda::CudaBackend`.
//!
//! # Features
//!
//! - `cuda` (default): `driver::cuda::CudaIpcDriver`, the driver calls through `cudarc` with the
//!   driver loaded at run time (no CUDA toolkit needed to build). Without it the crate has no CUDA
//!   code and no `cudarc` in its dependency tree; [`driver::fake::FakeDriver`] and any other
//!   [`IpcDriver`] still work.
//!
//! # Beyond PyTorch, in numbers
//!
//! On an H100 the round trip of `torch_sharing_bench.py`'s `cuda_ipc` rows takes PyTorch 594 to 825 µs;
//! with the consumer's handle cache warm and an idle producer stream (no event needed) tensormem takes
//! 24 to 45 µs, 12 to 15 µs with both sides spinning on their pipe (`docs/performance.md`).

mod at_exit;
pub mod batch;
mod byte_lock;
mod cache;
pub mod chunks;
pub mod driver;
mod error;
pub mod handle;
mod opened;
pub mod process;
pub mod producer;
mod reader;
pub mod received;
mod refcounter;
mod segment;
mod view;
pub mod weights;

pub use batch::{
    BatchBuilder, BatchHandle, BatchSegment, BatchView, ReceivedBatch, ReceivedView,
    BATCH_ENCODING_VERSION,
};
pub use chunks::{ChunkFdRoutes, ChunkHandle, FdRoute, DEFAULT_CHUNK_FD_TIMEOUT};
pub use driver::{DeviceCopy, EventHandle, ExportedMapping, IpcDriver, MemHandle, IPC_HANDLE_SIZE};
pub use error::{Error, Result, RECEIVED_MEMORY_MESSAGE};
pub use handle::{IpcHandle, SegmentMemory, TorchShareTuple};
pub use producer::{
    IpcProducer, ProducerConfig, ProducerStats, SharedAllocation, DEFAULT_BATCH_EXPIRY,
    MAXIMUM_EVENTS_TO_USE, PRODUCER_TERMINATED_WARNING, WARN_AFTER_X_BLOCKS_IN_LIMBO,
};
pub use received::{ConsumerConfig, DeviceElement, DeviceView, IpcConsumer, ReceivedMemory};
pub use refcounter::REF_COUNTER_FILE_SIZE;
