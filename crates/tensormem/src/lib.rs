//! tensormem: PyTorch's tensor-memory machinery in Rust.
//!
//! PyTorch moves tensors between processes through shared memory and CUDA IPC, and hands out GPU memory
//! through a caching allocator that avoids the driver's slow `cudaMalloc`/`cudaFree` on every tensor.
//! tensormem rebuilds those pieces as small crates that Rust programs can use one at a time, with
//! PyTorch's formats and numbers (so the two can share memory and read each other's snapshots). This crate
//! is the umbrella: it re-exports them behind features and adds the `torch.cuda`-like device API.
//!
//! # Sharing a storage, one example per strategy
//!
//! A [`Storage`] is PyTorch's `UntypedStorage`: bytes on a device and how they are owned
//! ([`storage`] has the full API and the table of PyTorch names).
//!
//! **By file descriptor** (PyTorch's `file_descriptor` strategy): the storage moves into a sealed
//! memfd and its descriptor travels over a Unix socket. Nothing to clean up: the memory goes when
//! the last process closes it.
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use tensormem::Storage;
//!
//! let (producer_end, consumer_end) = UnixStream::pair().unwrap(); // two processes, normally
//!
//! let weights = Storage::from_vec(vec![7u8; 1 << 20]);
//! weights.send_shared_fd(&producer_end)?; // share_memory_ + _share_fd_cpu_ + send
//!
//! let received = Storage::recv_shared_fd(&consumer_end)?; // _new_shared_fd_cpu
//! assert_eq!(received.nbytes(), 1 << 20);
//! received.write_at(0, &[1])?;
//! assert_eq!(weights.to_vec()?[0], 1); // one memory
//! # Ok::<(), tensormem::storage::Error>(())
//! ```
//!
//! **Recycled regions** (no PyTorch equivalent: PyTorch makes a new shared object per share). A
//! producer sharing buffer after buffer (a data loader) sends over a pool connection: the region
//! of a dropped batch goes back to the pool once the consumer let go (or died: a consumer killed
//! with `kill -9` gives its leases back), the next batch of that size reuses it warm, and a region
//! the consumer has seen travels as an id, reached through its cached mapping (no `mmap`, no page
//! faults). `share_memory_` itself draws from a process-wide pool
//! ([`storage::default_pool`]); handing a pooled storage's descriptor out raw (`share_fd`)
//! takes its region out of the pool for good.
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use tensormem::storage::{PoolReceiver, PoolSender, ReceiverOptions, ShmPool, Storage};
//!
//! let (producer_end, consumer_end) = UnixStream::pair()?; // two processes, normally
//! let mut receiver = PoolReceiver::new(consumer_end, ReceiverOptions::default())?; // consumer
//! let pool = ShmPool::default(); // producer: one pool, one sender per consumer
//! let mut sender = PoolSender::new(&pool, producer_end)?;
//!
//! for step in 0..4u8 {
//!     let batch = Storage::from_vec(vec![step; 1 << 20]); // a fresh private batch
//!     batch.send_pooled(&mut sender, b"uint8 [1048576]")?; // into the pool, then lent
//!     drop(batch);
//!
//!     let received = Storage::recv_pooled(&mut receiver)?; // consumer: no copy, no mmap after the first
//!     assert_eq!(received.metadata, b"uint8 [1048576]");
//!     assert_eq!(received.storage.to_vec()?, vec![step; 1 << 20]);
//!     drop(received); // the lease goes back to the producer
//!     sender.wait_release(None)?;
//! }
//! assert_eq!(pool.stats().regions.allocated, 1); // one region served all four batches
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **By name** (PyTorch's `file_system` strategy, feature `manager`): the storage moves into a
//! refcounted shm object laid out as PyTorch's, held through the shm manager daemon (started on
//! demand), so no name leaks even when processes are killed. The name is a string you can send
//! any way you like.
//!
//! ```no_run
//! # #[cfg(feature = "manager")]
//! # fn main() -> Result<(), tensormem::storage::Error> {
//! use tensormem::storage::{FilenameHandle, Storage};
//!
//! let weights = Storage::from_vec(vec![7u8; 1 << 20]);
//! let handle: FilenameHandle = weights.share_filename()?; // _share_filename_cpu_
//! weights.shared_incref()?; // keep it alive while the name is in transit
//! // ... send handle.name and handle.size to the consumer, which does:
//! let received = Storage::new_shared_filename(&handle)?; // _new_shared_filename_cpu
//! received.shared_decref()?; // it took over the sender's reference
//! assert_eq!(received.to_vec()?, vec![7u8; 1 << 20]);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "manager"))]
//! # fn main() {}
//! ```
//!
//! **CUDA memory** (CUDA IPC, feature `cuda`): a storage from the caching allocator is shared by
//! an IPC handle carrying a slot of a ref-counter file, so the producer frees the memory only once
//! every consumer let go (PyTorch's `_share_cuda_` / `_new_shared_cuda`). Handles cannot be opened
//! by the process that made them, so this sketch's two halves run in two processes:
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tensormem::storage::{CudaContext, IpcHandle, Storage};
//!
//! // producer
//! let ctx = CudaContext::new(0)?; // device 0: allocator, stream, IPC producer and consumer
//! let weights = Storage::new_cuda(&ctx, 1 << 20)?;
//! weights.fill(7)?;
//! let wire: Vec<u8> = weights.share_cuda()?.encode(); // or .to_torch() for PyTorch's 8-tuple
//!
//! // consumer (another process, its own CudaContext)
//! let handle = IpcHandle::decode(&wire)?; // tensormem::ipc::Error, its own type
//! let received = Storage::new_shared_cuda(&ctx, &handle)?;
//! let mut first = [0u8; 1];
//! received.read_at(0, &mut first)?;
//! assert_eq!(first, [7]);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cuda"))]
//! # fn main() {}
//! ```
//!
//! Runnable producer/consumer programs, each a producer that starts itself again as the
//! consumer: `cargo run -p tensormem --example share_fd`, `--features manager --example
//! share_filename`, `--example share_cuda`, `--example share_pooled` (recycled regions).
//!
//! # Features
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `cuda` | yes | [`cuda`]: the device API (devices, streams, per-device caching allocators, memory statistics and snapshots), [`cuda_alloc`], the allocator crate, [`ipc`], CUDA IPC with PyTorch's reference counting, and CUDA storages in [`storage`]. Loads `libcuda.so` at run time; building needs no CUDA toolkit. Turn it off to embed only the CPU layer: no CUDA code (and no `cudarc`) is compiled then. |
//!
//! | `manager` | no | Sharing by name (`Storage::share_filename`, PyTorch's `file_system` strategy) and [`shm`]'s managed names, held by tensormem-shm's manager daemon. **Runs code before `main`**: it links a start-up hook (`.init_array`) that returns at once unless `TENSORMEM_SHM_MANAGER_ROLE` is set, and lets the first name start the daemon from the program's own image with no setup. Without it no code of tensormem runs before `main`. |
//!
//! Always there: [`shm`], CPU shared memory (PyTorch's `file_descriptor` sharing; `file_system` with `manager`), and
//! [`storage`], the storage facade over it.
//!
//! # The device API
//!
//! ```
//! # #[cfg(feature = "cuda")]
//! # fn main() -> Result<(), tensormem::cuda::Error> {
//! use tensormem::cuda;
//!
//! if !cuda::is_available() {
//!     return Ok(()); // no driver or no GPU here
//! }
//! let block = cuda::caching_allocator_alloc(1 << 20, None)?; // 1 MiB on the current stream
//! let stats = cuda::memory_stats(None)?;
//! assert_eq!(stats["allocated_bytes.all.current"], 1 << 20);
//! cuda::caching_allocator_delete(block)?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cuda"))]
//! # fn main() {}
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(inline)]
pub use tensormem_shm as shm;

#[doc(inline)]
pub use tensormem_storage as storage;

#[doc(no_inline)]
pub use tensormem_storage::{storage_copy, Storage};

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
#[doc(inline)]
pub use tensormem_cuda_alloc as cuda_alloc;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
#[doc(inline)]
pub use tensormem_ipc as ipc;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod accelerator;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
