//! A CUDA caching allocator with PyTorch's semantics.

pub mod config;
pub mod device;
pub mod snapshot;

pub use device::{CaptureStatus, Device, DeviceError, DevicePtr, DeviceResult, MemInfo, StreamId};
