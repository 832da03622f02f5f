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
//! storage.share_memory_()?; // PyTorch: storage.share_memory_()
//! assert!(matches!(storage.kind(), StorageKind::CpuFd { sealed: true }));
//! storage.share_fd()?.send(&producer_end)?; // PyTorch: storage._share_fd_cpu_()
//!
//! // Consumer: open it (PyTorch: UntypedStorage._new_shared_fd_cpu(fd, size)) and write back.
//! let received = Storage::recv_shared_fd(&consumer_end)?;
//! assert_eq!(received.to_vec()?, b"hello, consumer");
//! received.write_at(0, b"H")?;
//! assert_eq!(&storage.to_vec()?[..5], b"Hello"); // the same memory
//! # Ok::<(), tensormem_storage::Error>(())
//! ```
//!
//! # PyTorch's names and ours
//!
//! | PyTorch (`torch.UntypedStorage`, `StorageSharing.cpp`, `StorageUtils.cpp`) | here |
//! | --- | --- |
//! | `UntypedStorage(n)`, `nbytes()`, `device`, `fill_`, `copy_` | [`Storage::new`], [`Storage::nbytes`], [`Storage::device`], [`Storage::fill`], [`storage_copy`] |
//! | `_share_fd_cpu_()` → `(fd, size)` | [`Storage::share_fd`] → [`FdHandle`] (or [`Storage::send_shared_fd`]) |
//! | `_new_shared_fd_cpu(fd, size)` | [`Storage::new_shared_fd`] (or [`Storage::recv_shared_fd`]) |
//! | `_new_using_fd_cpu(size)`, `at::new_shm_fd_storage` | [`Storage::new_shared_fd_storage`] |
//! | `_get_shared_fd()` | [`Storage::get_shared_fd`] (a duplicate) |
//! | `_share_filename_cpu_()` → `(manager, name, size)` | [`Storage::share_filename`] → [`FilenameHandle`] |
//! | `_new_shared_filename_cpu(manager, name, size)` | [`Storage::new_shared_filename`] |
//! | `_new_using_filename_cpu(size)` | [`Storage::new_shared_filename_storage`] |
//! | `_shared_incref()`, `_shared_decref()` | [`Storage::shared_incref`], [`Storage::shared_decref`] |
//! | `_weak_ref()`, `_new_with_weak_ptr(w)`, `_expired(w)`, `_free_weak_ref(w)` | [`Storage::weak_ref`], [`WeakStorage::upgrade`], [`WeakStorage::expired`], dropping the [`WeakStorage`] |
//! | `is_shared()` | [`Storage::is_shared`] |
//! | `from_file(filename, shared, nbytes)` | [`Storage::from_file`] |
//! | `share_memory_()`, `at::share_memory_` | [`Storage::share_memory_`] |
//! | `at::storage_copy(dst, src, non_blocking)` | [`storage_copy`] |
//! | `UntypedStorage(n, device="cuda")` | `Storage::new_cuda` (feature `cuda`, with a `CudaContext` per device) |
//! | `_share_cuda_()` → 8-tuple | `Storage::share_cuda` → `IpcHandle` (`to_torch()` gives the tuple) |
//! | `_new_shared_cuda(*tuple)` | `Storage::new_shared_cuda` |
//! | `_release_ipc_counter_cuda(ref_counter, offset)` | `release_ipc_counter` |
//!
//! # Same rules as PyTorch, and where tensormem is stricter
//!
//! - `share_fd` of a storage that is not fd-backed (private, or shared by name) moves it into a
//!   new memfd first, for every clone; `share_filename` likewise moves it into a named region;
//!   `share_memory_` does nothing to a storage already in shared memory or on a CUDA device.
//! - A storage shared by name survives its creator dropping it while the shared refcount or a
//!   live process holding it at the manager says so (see [`Storage::share_filename`]).
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
mod filename;
mod owner;
mod storage;
mod torch_manager;

pub use copy::storage_copy;
pub use device::Device;
pub use error::{Error, Result};
pub use fd::FdHandle;
pub use filename::FilenameHandle;
pub use owner::StorageKind;
pub use storage::{Storage, WeakStorage};

#[doc(no_inline)]
pub use tensormem_shm::ShmName;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cuda::{release_ipc_counter, CudaContext};
#[cfg(feature = "cuda")]
#[doc(no_inline)]
pub use tensormem_ipc::{IpcHandle, TorchShareTuple};
