//! Memory of tensormem's CUDA caching allocator registered with an NCCL communicator: every
//! segment (and every mapped range of an expandable segment) registered with `ncclCommRegister`
//! as the allocator makes it and deregistered with `ncclCommDeregister` when the allocator lets it
//! go, so that collectives on tensors from the allocator take NCCL's registered (zero-copy) paths.
//! This is what PyTorch's `ProcessGroupNCCL` does through the allocator's trace tracker; here it
//! works for a Rust program that drives NCCL through `cudarc::nccl`.
//!
//! ```no_run
//! use std::sync::Arc;
//! use cudarc::nccl::{result, sys};
//! use tensormem_cuda_alloc::backend::cuda::CudaBackend;
//! use tensormem_cuda_alloc::{CachingAllocator, StreamId};
//! use tensormem_nccl::Registration;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Two devices driven from one process: one communicator and one allocator each.
//! let mut comms = vec![std::ptr::null_mut(); 2];
//! // SAFETY: `comms` has room for two communicators; devices 0 and 1 exist.
//! unsafe { result::comm_init_all(comms.as_mut_ptr(), 2, [0, 1].as_ptr()) }
//!     .map_err(|e| format!("ncclCommInitAll: {e:?}"))?;
//! let mut registrations = Vec::new();
//! for (device, &comm) in comms.iter().enumerate() {
//!     let allocator = Arc::new(CachingAllocator::new(CudaBackend::new(device as u32)?));
//!     // SAFETY: `comm` is a live communicator of `device`, destroyed only after the registration.
//!     registrations.push(unsafe { Registration::new(&allocator, comm)? });
//!     let buffer = allocator.allocate(64 << 20, StreamId::DEFAULT)?; // registered with NCCL
//!     // ... ncclAllReduce on `buffer` through cudarc::nccl::result::all_reduce ...
//!     allocator.free(buffer)?;
//! }
//! # Ok(()) }
//! ```
//!
//! # What is registered, and when
//!
//! - On [`Registration::new`]: every segment the allocator holds (each run of mapped blocks of an
//!   expandable segment), then every segment made later: `segment_alloc` and `segment_map` trace
//!   events. A failed registration is kept as an error ([`Registration::errors`]) and logged; the
//!   memory is still usable, on NCCL's unregistered path.
//! - `segment_free` and `segment_unmap` deregister what they release; the allocator records
//!   `segment_free` before it frees the memory (as PyTorch does), so NCCL lets go of a registration
//!   before its memory goes back to the driver. A registration of which only part is unmapped is
//!   deregistered and its remaining parts registered again.
//! - Dropping the [`Registration`] deregisters everything it registered; the allocator then
//!   carries on without registering (its tracker stays attached and does nothing).
//!
//! The tracker runs on the allocating thread with the allocator's locks held (PyTorch's contract):
//! NCCL's registration calls do not call back into the allocator.
//!
//! # One pool instead of the whole allocator
//!
//! [`NcclPoolAllocator`] is the per-pool form (PyTorch's `MemPool` backed by NCCL's allocator): a
//! private pool made with it as its own allocator
//! (`PoolOptions { allocator: Some(..), .. }`, `CachingAllocator::create_pool`) takes its segments
//! from `ncclMemAlloc` and registers each with the communicator as it is made; only the tensors
//! allocated to that pool are registered, the rest of the allocator is not.
//!
//! # Weights through NCCL
//!
//! [`weights`] moves a model's weights from one rank into the other ranks' own tensors (a trainer
//! into inference engines on other GPUs or machines, after every optimizer step): the layout
//! agreed once, tensors bucketed into broadcasts of staging buffers registered with the
//! communicator, packing and unpacking pipelined with the transfers.

pub use error::{Error, Mismatch, Result};
pub use registration::{NcclPoolAllocator, Registration};

mod error;
mod registration;
pub mod weights;
