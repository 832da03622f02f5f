//! Storages: bytes on a device, who owns them, and every way PyTorch shares them.
//!
//! # The problem
//!
//! PyTorch's tensors sit on an `UntypedStorage`: a fixed number of bytes on a device, plus a
//! `DataPtr` whose deleter says who owns them (the CPU allocator, a shared memory mapping, a
//! named refcounted region held by `torch_shm_manager`, the CUDA caching allocator, a CUDA IPC
//! mapping received from another process). Every sharing operation of `torch.multiprocessing`
//! works on that one object and its owner: `share_memory_` swaps the owner in place for every
//! tensor viewing the storage, `_share_fd_cpu_` first moves a storage that is not fd-backed,
//! `_share_cuda_` refuses a storage that was itself received. The pieces of tensormem
//! (`tensormem-shm` regions, the CUDA allocator, `tensormem-ipc`) each do one part; a
//! [`Storage`] ties them together the way `StorageSharing.cpp` and `StorageUtils.cpp` do.
//!
//! # Example: share by file descriptor
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use tensormem_storage::{Storage, StorageKind};
//!
//! // Normally two processes, connected by a UnixListener.
//! let (producer_end, consumer_end) = UnixStream::pair().unwrap();
//!
//! // Producer: a private storage, moved into shared memory in place and sent.
//! let storage = Storage::from_vec(b"hello, consumer".to_vec());
//! storage.share_memory_()?; // PyTorch: storage.share_memory_() (a region of the pool)
//! assert_eq!(storage.kind(), StorageKind::CpuPooled);
//! storage.share_fd()?.send(&producer_end)?; // PyTorch: storage._share_fd_cpu_()
//! // A raw descriptor's users cannot be counted: the region left the pool for good.
//! assert!(matches!(storage.kind(), StorageKind::CpuFd { sealed: true }));
//!
//! // Consumer: open it (PyTorch: UntypedStorage._new_shared_fd_cpu(fd, size)) and write back.
//! let received = Storage::recv_shared_fd(&consumer_end)?;
//! assert_eq!(received.to_vec()?, b"hello, consumer");
//! received.write_at(0, b"H")?;
//! assert_eq!(&storage.to_vec()?[..5], b"Hello"); // the same memory
//! # Ok::<(), tensormem_storage::Error>(())
//! ```
//!
//! # Example: recycled regions between a producer and a consumer (the pooled path)
//!
//! Sharing buffer after buffer (a data loader), send over a pool connection instead: regions
//! come back to the pool when the consumer drops its storage (or dies), a region the consumer
//! has seen travels as an id and is reached through its cached mapping, and the producer's next
//! `share_memory_in` of the same size reuses the warm region.
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use tensormem_storage::{PoolReceiver, PoolSender, ReceiverOptions, ShmPool, Storage, StorageKind};
//!
//! let (producer_end, consumer_end) = UnixStream::pair()?;
//! let mut receiver = PoolReceiver::new(consumer_end, ReceiverOptions::default())?; // consumer
//! let pool = ShmPool::default();                                                 // producer
//! let mut sender = PoolSender::new(&pool, producer_end)?;
//!
//! for step in 0..3u8 {
//!     // Producer: a fresh private batch, moved into the pool and lent to the consumer.
//!     let batch = Storage::from_vec(vec![step; 1 << 20]);
//!     batch.send_pooled(&mut sender, b"float32 [512, 512]")?; // moves it into `pool` first
//!     drop(batch);
//!
//!     // Consumer: a storage over the producer's region (no copy).
//!     let received = Storage::recv_pooled(&mut receiver)?;
//!     assert_eq!(received.storage.kind(), StorageKind::CpuPooledLease);
//!     assert_eq!(received.metadata, b"float32 [512, 512]");
//!     assert_eq!(received.storage.to_vec()?[0], step);
//!     drop(received); // the lease goes back to the producer
//!     sender.wait_release(None)?; // (the pool would also read it on its own when needed)
//! }
//! assert_eq!(pool.stats().regions.allocated, 1); // one region served every step
//! assert_eq!(receiver.stats().mapped, 1); // mapped once, then reached by id
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # PyTorch's names and ours
//!
//! | PyTorch (`torch.UntypedStorage`, `StorageSharing.cpp`, `StorageUtils.cpp`) | here |
//! | --- | --- |
//! | `UntypedStorage(n)`, `nbytes()`, `device`, `fill_`, `copy_` | [`Storage::new`], [`Storage::nbytes`], [`Storage::device`], [`Storage::fill`], [`storage_copy`] |
//! | `_share_fd_cpu_()` → `(fd, size)` | [`Storage::share_fd`] → [`FdHandle`] (or [`Storage::send_shared_fd`]); a pooled storage is detached from its pool (same memory, never reused) |
//! | `_new_shared_fd_cpu(fd, size)` | [`Storage::new_shared_fd`] (or [`Storage::recv_shared_fd`]) |
//! | `_new_using_fd_cpu(size)`, `at::new_shm_fd_storage` | [`Storage::new_shared_fd_storage`] |
//! | `_get_shared_fd()` | [`Storage::get_shared_fd`] (a duplicate; detaches a pooled storage) |
//! | `_share_filename_cpu_()` → `(manager, name, size)` | `Storage::share_filename` → `FilenameHandle` (feature `manager`; refcounted named regions and the manager, never the pool: a name can be opened by any process, so no connection's close tells the pool that a killed opener is done) |
//! | `_new_shared_filename_cpu(manager, name, size)` | `Storage::new_shared_filename` |
//! | `_new_using_filename_cpu(size)` | `Storage::new_shared_filename_storage` |
//! | `_shared_incref()`, `_shared_decref()` | `Storage::shared_incref`, `Storage::shared_decref` |
//! | `_weak_ref()`, `_new_with_weak_ptr(w)`, `_expired(w)`, `_free_weak_ref(w)` | [`Storage::weak_ref`], [`WeakStorage::upgrade`], [`WeakStorage::expired`], dropping the [`WeakStorage`] |
//! | `is_shared()` | [`Storage::is_shared`] |
//! | `from_file(filename, shared, nbytes)` | [`Storage::from_file`] |
//! | `share_memory_()`, `at::share_memory_` | [`Storage::share_memory_`] (a region of the process-wide [`ShmPool`], [`default_pool`]; recycled once the storage and every lease are gone), [`Storage::share_memory_in`] (a pool of yours) |
//! | none (PyTorch makes a new object per share) | [`Storage::send_pooled`] / [`Storage::recv_pooled`] ([`StorageKind::CpuPooledLease`]), [`Storage::new_pooled`]: recycled regions, ids for regions the consumer knows, leases reclaimed from a consumer killed with `kill -9` |
//! | `at::storage_copy(dst, src, non_blocking)` | [`storage_copy`] |
//! | `UntypedStorage(n, device="cuda")` | `Storage::new_cuda` (feature `cuda`, with a `CudaContext` per device) |
//! | `_share_cuda_()` → 8-tuple | `Storage::share_cuda` → `IpcHandle` (`to_torch()` gives the tuple) |
//! | `_new_shared_cuda(*tuple)` | `Storage::new_shared_cuda` |
//! | `_release_ipc_counter_cuda(ref_counter, offset)` | `release_ipc_counter` |
//! | a `state_dict()` of CUDA tensors on a `torch.multiprocessing` Queue (one handle per tensor) | `share_cuda_batch` → `BatchHandle` → `new_shared_cuda_batch`: the whole state dict in one message, one reference, one memory handle per segment (feature `cuda`) |
//!
//! # Pooled regions: when they are reused
//!
//! A pooled storage ([`StorageKind::CpuPooled`]) returns its region to the pool only when it
//! provably has no other user: every clone dropped, and every lease sent with
//! [`Storage::send_pooled`] released or reclaimed (the consumer's connection closed: a consumer
//! killed with `kill -9` gives its leases back). A raw descriptor cannot be accounted for, so
//! [`Storage::share_fd`], [`Storage::get_shared_fd`] and [`Storage::send_shared_fd`] **detach**
//! a pooled storage: it becomes [`StorageKind::CpuFd`] over the same memory, the pool never lends
//! the region again, and the memory is freed normally with its last mapping (the region's bytes
//! past the storage are cleared first). `Storage::share_filename` (feature `manager`) moves the
//! bytes into a named region, as for any storage not shared by name; the pooled region, never
//! exposed, then returns to the pool. A storage received from a pool ([`StorageKind::CpuPooledLease`]) releases its
//! lease when its last clone drops; sharing it again by descriptor or name moves its bytes (as
//! PyTorch moves any storage that is not of the right kind), and it cannot be sent pooled again.
//!
//! # Same rules as PyTorch, and where tensormem is stricter
//!
//! - `share_fd` of a storage that is not fd-backed (private, or shared by name) moves it into a
//!   new memfd first, for every clone; `share_filename` likewise moves it into a named region;
//!   `share_memory_` does nothing to a storage already in shared memory or on a CUDA device.
//! - A storage shared by name survives its creator dropping it while the shared refcount or a
//!   live process holding it at the manager says so (see `Storage::share_filename`).
//! - A CUDA storage received from another process cannot be shared again.
//! - Stricter: a zero-byte storage cannot be shared ([`Error::Empty`]; PyTorch special-cases
//!   empty storages in its reductions too); received descriptors and names are checked
//!   (`fstat`: kind, owner, size) before mapping, so a wrong size, a closed or wrong-kind
//!   descriptor, a missing or foreign name is a typed [`Error`], never a `SIGBUS`;
//!   `shared_decref` refuses to drop the count below this process's own mapping; weak
//!   references are typed handles, not integers.
//!
//! # Threads
//!
//! [`Storage`] and [`WeakStorage`] are `Send + Sync`. Each storage has one lock: reads share it,
//! writes and the sharing operations that replace the owner take it exclusively. Shared bytes
//! are reached by copies ([`Storage::read_at`], [`Storage::write_at`], [`Storage::to_vec`]),
//! never by references, because other processes may write them at any time.
//!
//! # Features
//!
//! - `manager` (off by default): sharing by name, PyTorch's `file_system` strategy
//!   (`Storage::share_filename`, `new_shared_filename`, `new_shared_filename_storage`,
//!   `shared_incref` / `shared_decref`, `FilenameHandle`). It turns on tensormem-shm's `manager`
//!   feature, whose start-up hook runs before `main` in every program that links it (it returns
//!   at once unless the daemon is being started). Without it those methods do not exist ("no
//!   method named `share_filename`": add `features = ["manager"]`), and no code of tensormem runs
//!   before `main`.
//! - `cuda` (off by default): CUDA storages (the caching allocator, CUDA IPC).

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]

mod copy;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
mod device;
mod error;
mod fd;
mod file;
#[cfg(feature = "manager")]
mod filename;
mod owner;
mod pooled;
mod storage;
#[cfg(feature = "manager")]
mod torch_manager;

pub use copy::storage_copy;
pub use device::Device;
pub use error::{Error, Result};
pub use fd::FdHandle;
#[cfg(feature = "manager")]
#[cfg_attr(docsrs, doc(cfg(feature = "manager")))]
pub use filename::FilenameHandle;
pub use owner::StorageKind;
pub use pooled::{default_pool, set_default_pool, ReceivedStorage};
pub use storage::{Storage, WeakStorage};

#[doc(no_inline)]
pub use tensormem_shm::mapping_cache::{Lease, PoolReceiver, ReceiverOptions};
#[doc(no_inline)]
pub use tensormem_shm::pool::{PoolConfig, PoolSender, PoolStats, ShmPool};
#[doc(no_inline)]
pub use tensormem_shm::ShmName;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cuda::{
    ipc_collect, new_shared_cuda_batch, release_ipc_counter, release_ipc_counter_batch,
    share_cuda_batch, BatchEntry, CudaContext,
};
#[cfg(feature = "cuda")]
#[doc(no_inline)]
pub use tensormem_ipc::{BatchHandle, IpcHandle, TorchShareTuple};
