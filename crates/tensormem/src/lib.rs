//! tensormem: PyTorch's tensor-memory machinery in Rust.
//!
//! PyTorch moves tensors between processes through shared memory and CUDA IPC, and hands out GPU memory
//! through a caching allocator that avoids the driver's slow `cudaMalloc`/`cudaFree` on every tensor.
//! tensormem rebuilds those pieces as small crates that Rust programs can use one at a time, with
//! PyTorch's formats and numbers (so the two can share memory and read each other's snapshots). This crate
//! is the umbrella: it re-exports them behind features and adds the `torch.cuda`-like device API.
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `cuda` | yes | [`cuda`]: the device API (devices, streams, per-device caching allocators, memory statistics and snapshots) and [`cuda_alloc`], the allocator crate. Loads `libcuda.so` at run time; building needs no CUDA toolkit. Turn it off to embed only the CPU layer: no CUDA code (and no `cudarc`) is compiled then. |
//!
//! Always there: [`shm`], CPU shared memory (PyTorch's `file_descriptor` and `file_system` sharing).
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

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
#[doc(inline)]
pub use tensormem_cuda_alloc as cuda_alloc;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
