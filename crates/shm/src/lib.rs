//! CPU shared memory for tensors: mappings, fd passing, refcounted regions, PyTorch-compatible.
//!
//! # The problem
//!
//! Handing a large buffer (a tensor's storage) to another process should not copy it: both
//! processes should map the same physical pages. That takes an object the kernel can map into
//! several address spaces (a POSIX shared memory object, a memfd, a file), a way to name it or to
//! pass its descriptor, and rules for who removes it. Every step can go wrong in ways a plain
//! `mmap` wrapper ignores: a name another user planted, a peer that truncates the object so the
//! next read raises `SIGBUS`, a descriptor that is really a socket, a creator that dies and leaks
//! the object in `/dev/shm` until reboot.
//!
//! # The PyTorch concepts it mirrors
//!
//! `torch.multiprocessing` shares CPU storages through ATen's `MapAllocator` family
//! (`StorageSharing.cpp`, `StorageUtils.cpp`):
//!
//! | PyTorch | here |
//! | --- | --- |
//! | `MapAllocator` and its `ALLOCATOR_MAPPED_*` flags | [`MapOptions`] → [`SharedRegion`] |
//! | `new_shm_fd_storage` (fd strategy: shm object unlinked at once, fd kept) | [`SharedRegion::create_anonymous`] (memfd, sealed) |
//! | sending `(fd, size)` through `multiprocessing` | [`transfer::send_region`] / [`transfer::recv_region`] (`SCM_RIGHTS`) |
//! | `RefcountedMapAllocator` (64-byte header, atomic refcount, last closer unlinks) | [`RefcountedRegion`], same layout: PyTorch can open it |
//! | `NewProcessWideShmHandle` (`/torch_<pid>_<random>_<counter>`) | [`NameGenerator`] (prefix `tensormem`, or `torch`) |
//! | `share_memory_` / `storage_copy` | [`SharedRegion::copy_from_bytes`] (pre-faulted, huge pages, threads) |
//! | `THManagedMapAllocator` + `torch_shm_manager` (file_system strategy) | the [`manager`] module and the `tensormem-shm-manager` daemon |
//! | (none: every share makes and maps a fresh object) | [`pool`]: cached, pre-faulted regions lent over a connection; [`mapping_cache`]: the consumer keeps its mappings, a known region travels as an id |
//! | (none: `multiprocessing` queues are pipes and sockets) | [`channel`]: small messages in shared-memory rings with `futex` doorbells, fds on the socket beside them |
//! | (none: leaked objects stay in `/dev/shm` until reboot) | [`housekeeping`]: list objects, unlink those whose creator died (`tensormem shm list/gc`) |
//!
//! Where this crate is stricter than PyTorch: names are validated ([`ShmName`]); objects are
//! created `0600` with `O_EXCL` and objects owned by another user are refused unless asked for
//! ([`MapOptions::allow_foreign_owner`]); a received descriptor is `fstat`ed before mapping, so a
//! truncated object or a descriptor of the wrong kind is an [`Error`] at attach;
//! anonymous regions are sealed so no peer can shrink them (see "Truncation and `SIGBUS`"); every failure is a typed [`Error`]
//! naming the object and saying what to do. Creating, attaching and unlinking emit `tracing`
//! events (target `tensormem_shm`, level `debug`).
//!
//! # Pick a way to share
//!
//! | you want | use | PyTorch equivalent |
//! | --- | --- | --- |
//! | hand a buffer to a process you are connected to | [`SharedRegion::create_anonymous`] or [`SharedRegion::copy_from_bytes`], then [`transfer::send_region`] / [`transfer::recv_region`] | `file_descriptor` strategy |
//! | a name any process can open, freed when the last user closes it | [`RefcountedRegion::create`] / [`RefcountedRegion::open`] | `RefcountedMapAllocator` (file_system strategy storages) |
//! | a name that survives its creator being killed | `manager::ManagedRegion` (the manager daemon; feature `manager`) | `file_system` strategy + `torch_shm_manager` |
//! | full control of the flags | [`MapOptions`] + [`map_shm`](MapOptions::map_shm) / [`map_path`](MapOptions::map_path) / [`map_fd`](MapOptions::map_fd) | `MapAllocator` flags |
//! | share buffer after buffer with connected consumers (data loaders, steady state) | [`ShmPool`] + [`PoolSender`] / [`PoolReceiver`]: the [`pool`] module walks through it | none: PyTorch makes a new object per share |
//! | small messages between two processes, a few microseconds a round trip | [`channel::Channel`] | none: `multiprocessing` queues are pipes and sockets |
//!
//! Runnable two-process programs are in the crate's `examples/`: `pass_fd` (a region by
//! descriptor), `pool_batches` (the pool, batch after batch) and `channel` (messages and a
//! descriptor beside them), each a producer that starts itself again as the consumer
//! (`cargo run -p tensormem-shm --example pool_batches`).
//!
//! # Example: a producer hands a region to a consumer
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use tensormem_shm::transfer::{recv_region, send_region, SendOptions};
//! use tensormem_shm::{MapOptions, SharedRegion};
//!
//! // Normally the two ends live in two processes, connected by a UnixListener.
//! let (producer_end, consumer_end) = UnixStream::pair().unwrap();
//!
//! // Producer: move a buffer into shared memory and send it.
//! let tensor: Vec<u8> = (0..=255).cycle().take(1 << 20).collect();
//! let shared = SharedRegion::copy_from_bytes(&tensor)?;
//! send_region(&producer_end, &shared, SendOptions { user: b"weights", ..Default::default() })?;
//!
//! // Consumer: receive, check and map it; then write into the same memory.
//! let mut received = recv_region(&consumer_end, &MapOptions::new())?;
//! assert_eq!(received.user_data(), b"weights");
//! assert_eq!(received.region.to_vec()?, tensor); // a copy: safe whatever the peer does
//! received.region.write_at(0, &[42])?;
//! let mut first = [0u8; 1];
//! shared.read_at(0, &mut first)?;
//! assert_eq!(first, [42]); // the producer sees the consumer's write
//! # Ok::<(), tensormem_shm::Error>(())
//! ```
//!
//! # Memory a peer can write is reached by copies, atomics, or `unsafe`
//!
//! A `&[u8]` over shared memory would promise that no other process writes those bytes while it
//! lives, which no library can check. So the safe surface copies ([`Mapping::read_at`],
//! [`Mapping::write_at`], [`Mapping::to_vec`], [`Mapping::fill`]) or uses atomics
//! ([`Mapping::atomic`]); [`Mapping::as_slice`] / [`Mapping::as_mut_slice`] are `unsafe fn`s whose
//! `# Safety` sections state the obligation (no concurrent writer, no truncation while the slice
//! lives). The [`mapping`] module explains the split.
//!
//! # Truncation and `SIGBUS`
//!
//! Touching a page of a mapping beyond the end of its object raises `SIGBUS`, and any process
//! holding a writable descriptor of an unsealed object can `ftruncate` it at any time. What each
//! access does then:
//!
//! | region | can a peer shrink it? | `read_at` / `write_at` / `to_vec` / `fill` / volatile | `atomic`, `unsafe` slices, raw pointers |
//! | --- | --- | --- | --- |
//! | anonymous memfd ([`SharedRegion::create_anonymous`], `copy_from_bytes`), sealed fds received | no (`F_SEAL_SHRINK`) | plain copies, never fault | never fault |
//! | named ([`MapOptions::map_shm`]), refcounted, managed, file-backed, unsealed fds, the unlinked-shm fallback | yes | copied through the kernel (`process_vm_readv`/`writev` on this process): lost pages give [`Error::Truncated`] | fault (`SIGBUS`), as in PyTorch |
//!
//! [`Mapping::is_truncatable`] tells which case a region is in. The kernel-mediated copy costs a
//! system call per access (bulk copies run at memory speed); where seccomp forbids it, copies fall
//! back to plain ones, which fault like the rest. The refcount word of a [`RefcountedRegion`] is
//! an atomic in the object's first page: `open`, `close` and `refcount` first check through the
//! kernel that the header is still there (a truncated header is [`Error::Truncated`] or
//! [`Error::TooSmall`]), which leaves only a truncation racing that check to fault, as every
//! access does in PyTorch. Share shrinkable objects only with processes you trust; prefer sealed
//! anonymous regions where the peer is not trusted.
//!
//! Linux only (memfd, `/dev/shm`, `MADV_POPULATE_WRITE`); no CUDA anywhere in the dependency tree.
//!
//! # Features
//!
//! - `manager` (off by default): managed names and their daemon ([`manager`]: `ManagedRegion`,
//!   `Manager`, PyTorch's `torch_shm_manager` for the `file_system` strategy) and the
//!   `tensormem-shm-manager` binary. **It runs code before `main`**: a start-up hook in
//!   `.init_array`, run in every program that links this crate with the feature on, returns at once
//!   unless `TENSORMEM_SHM_MANAGER_ROLE` is set; when a managed region starts the daemon, the
//!   program's own image is re-run with that variable and becomes the daemon without reaching
//!   `main`. That is what lets managed names work with no binary and no setup. Programs that pass
//!   descriptors, use named, refcounted or pooled regions or the channel do not need it; without it
//!   no code of this crate runs before `main`. `tensormem-storage`'s `manager` feature (sharing by
//!   name) turns it on.
//!
//! From a clone of the repository beside your project (the crates are not on crates.io;
//! `git = "https://github.com/tensormem/tensormem"` in place of `path` works too):
//!
//! ```toml
//! [dependencies]
//! # everything but managed names; no code runs before main
//! tensormem-shm = { path = "../tensormem/crates/shm" }
//! # with managed names and the daemon (and its start-up hook)
//! # tensormem-shm = { path = "../tensormem/crates/shm", features = ["manager"] }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod anon;
pub mod channel;
pub mod copy;
mod error;
#[cfg(all(test, not(loom)))]
mod hostile_peer_tests;
pub mod housekeeping;
#[cfg(feature = "manager")]
#[cfg_attr(docsrs, doc(cfg(feature = "manager")))]
pub mod manager;
pub mod mapping;
pub mod mapping_cache;
pub mod name;
mod object;
pub mod pool;
pub mod refcounted;
mod region;
pub mod transfer;
mod wire;

pub use anon::AnonymousKind;
pub use copy::{copy_prefaulted, CopyMethod, CopyPlan};
pub use error::{Error, NameProblem, ObjectKind, Result, SizeProblem};
pub use mapping::{Access, Mapping, SharedAtomic};
pub use name::{GeneratedName, NameGenerator, ShmName, DEFAULT_PREFIX, TORCH_PREFIX};
pub use object::{unlink_shm, CreateMode};
pub use pool::{Lease, PoolBuffer, PoolConfig, PoolReceiver, PoolSender, ReceiverOptions, ShmPool};
pub use refcounted::{RefcountHeader, RefcountedRegion, REFCOUNT_HEADER_LEN};
pub use region::{Backing, MapOptions, SharedRegion};
pub use wire::WireFormat;
