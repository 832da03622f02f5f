//! Implementations of [`Device`](crate::Device): the memory providers the allocator runs on.
//!
//! | backend | feature | what it is |
//! | --- | --- | --- |
//! | [`sim::SimDevice`] | always | a deterministic simulated device: capacity, events that complete when told to, virtual memory, replayable addresses |
//! | `cuda` | `cuda` | a real GPU through the CUDA driver API (`cudarc`, loaded at run time) |

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod sim;
