//! tensormem: PyTorch's tensor-memory machinery in Rust.

#[doc(inline)]
pub use tensormem_shm as shm;

#[cfg(feature = "cuda")]
#[doc(inline)]
pub use tensormem_cuda_alloc as cuda_alloc;
