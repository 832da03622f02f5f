//! A CUDA caching allocator with PyTorch's semantics.

mod allocator;
pub mod backend;
mod block;
pub mod config;
pub mod device;
mod error;
mod events;
mod expandable;
mod free_set;
pub mod oom;
mod pool;
mod pool_id;
pub mod replay;
mod settings;
mod shard;
pub mod size;
pub mod snapshot;
pub mod stats;
mod trace;

pub use allocator::{Allocation, CachingAllocator, InvariantViolation, DEFAULT_STREAM_CAPACITY};
pub use device::{CaptureStatus, Device, DeviceError, DevicePtr, DeviceResult, MemInfo, StreamId};
pub use error::{Error, Result};
pub use pool_id::MempoolId;
