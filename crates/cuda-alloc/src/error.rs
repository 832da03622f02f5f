//! The allocator's error type.

use crate::config::ConfigError;
use crate::device::{DeviceError, DevicePtr, StreamId};
use crate::oom::OutOfMemory;
use crate::pool_id::MempoolId;

/// Why an allocator call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The device could not satisfy a request even after the allocator returned every cached block it
    /// could (PyTorch's `torch.OutOfMemoryError`). The report carries PyTorch's message and the figures
    /// it is built from.
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// A request of one exabyte or more, refused before anything was tried (PyTorch's message).
    #[error("CUDA out of memory. Tried to allocate more than 1EB memory.")]
    TooLarge {
        /// The size asked for, in bytes.
        bytes: usize,
    },
    /// A pointer this allocator did not hand out, or one already freed.
    #[error(
        "invalid device pointer: {ptr} (not an allocation of this allocator, or already freed); pass \
         the pointer an allocation returned, once"
    )]
    InvalidPointer {
        /// The pointer given.
        ptr: DevicePtr,
    },
    /// An [`Allocation`](crate::Allocation) handed to an allocator other than the one that made it
    /// (nothing was freed or recorded).
    #[error(
        "allocation {ptr} belongs to allocator #{owner}, not to this one (#{this}); free it (or record \
         its streams) on the allocator that handed it out"
    )]
    ForeignAllocation {
        /// The allocation's pointer.
        ptr: DevicePtr,
        /// The id of the allocator that handed it out.
        owner: u32,
        /// The id of the allocator it was given to.
        this: u32,
    },
    /// The pointer is inside an expandable segment, whose memory cannot be shared between processes.
    #[error(
        "Tensors allocated with expandable_segments:True cannot be shared between processes. Consider \
         using expandable_segments:False in data loading workers via \
         torch.cuda.memory._set_allocator_settings('expandable_segments:False')"
    )]
    ExpandableNotShareable {
        /// The pointer given.
        ptr: DevicePtr,
    },
    /// More distinct streams than the allocator's stream table holds.
    #[error(
        "stream {stream} is one more than the {capacity} distinct streams this allocator can serve; \
         reuse streams (a stream pool) or build the allocator with a larger stream capacity"
    )]
    TooManyStreams {
        /// The stream that did not fit.
        stream: StreamId,
        /// The table's capacity.
        capacity: usize,
    },
    /// A private-pool call named a pool in the wrong state (PyTorch's messages where it has one).
    #[error("{message} (pool {pool})")]
    Pool {
        /// The pool named.
        pool: MempoolId,
        /// What was wrong.
        message: &'static str,
    },
    /// A device call failed for a reason other than running out of memory.
    #[error("device call failed: {0}")]
    Device(#[from] DeviceError),
    /// A configuration string did not parse.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A memory fraction outside `[0, 1]`.
    #[error("invalid fraction: {fraction}. Please set within [0, 1].")]
    InvalidFraction {
        /// The fraction given.
        fraction: f64,
    },
}

/// `Result` with the allocator's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
