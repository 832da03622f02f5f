//! The allocator's error type.

use crate::config::ConfigError;
use crate::device::{DeviceAddress, DeviceError, StreamId};
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
        ptr: DeviceAddress,
    },
    /// An [`Allocation`](crate::Allocation) handed to an allocator other than the one that made it
    /// (nothing was freed or recorded).
    #[error(
        "allocation {ptr} belongs to allocator #{owner}, not to this one (#{this}); nothing was freed or \
         recorded. Use allocator #{owner} (the one whose id() is {owner}): raw_free({ptr}) there frees \
         the memory (free used up the handle); record_stream there records its streams"
    )]
    ForeignAllocation {
        /// The allocation's pointer.
        ptr: DeviceAddress,
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
        ptr: DeviceAddress,
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
    /// A private pool could not be checkpointed or returned to a checkpoint (nothing was changed).
    #[error("private pool {pool}: {reason}")]
    Checkpoint {
        /// The pool named.
        pool: MempoolId,
        /// What was wrong, and what to do.
        reason: String,
    },
    /// A private pool could not sleep or wake, or was asked for memory while asleep.
    #[error(transparent)]
    Sleep(#[from] SleepError),
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
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a pool could not sleep or wake (nothing was changed unless said otherwise).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SleepError {
    /// No private pool of that id exists (the default pools never sleep).
    #[error("pool {pool} is not a private pool of this allocator; only private pools (MemPool, graph pools) sleep")]
    NoSuchPool {
        /// The pool named.
        pool: MempoolId,
    },
    /// The pool has a segment that is not expandable: its memory cannot be released at a kept
    /// address.
    #[error(
        "pool {pool} has a segment at {segment} that is not expandable; only pools on expandable \
         segments sleep (set expandable_segments:True before the pool allocates)"
    )]
    NotExpandable {
        /// The pool named.
        pool: MempoolId,
        /// The start of a segment that is not expandable.
        segment: DeviceAddress,
    },
    /// A chunk of the pool was exported to another process, which may be using it.
    #[error(
        "pool {pool} has memory shared with another process (the chunk at {chunk} was exported); \
         it cannot sleep until the shared allocation is freed and its chunks released (empty_cache)"
    )]
    Shared {
        /// The pool named.
        pool: MempoolId,
        /// The start of an exported chunk.
        chunk: DeviceAddress,
    },
    /// A capture or a `MemPool` context is allocating to the pool.
    #[error(
        "pool {pool} is being allocated to (a graph capture or a MemPool context is underway); end \
         it before the pool sleeps"
    )]
    AllocatingTo {
        /// The pool named.
        pool: MempoolId,
    },
    /// A stream of this allocator is being captured into a graph: sleeping waits for the device,
    /// which a capture forbids.
    #[error("stream {stream} is being captured into a CUDA graph; pool {pool} cannot sleep during a capture")]
    Capturing {
        /// The pool named.
        pool: MempoolId,
        /// A stream being captured.
        stream: StreamId,
    },
    /// The pool is asleep (or on its way to sleep or to wake): allocating to it, or putting it to
    /// sleep again, is refused.
    #[error("pool {pool} is asleep; wake it before allocating from it or putting it to sleep")]
    Asleep {
        /// The pool named.
        pool: MempoolId,
    },
    /// The pool is not asleep: there is nothing to wake.
    #[error("pool {pool} is not asleep; there is nothing to wake")]
    NotAsleep {
        /// The pool named.
        pool: MempoolId,
    },
}

impl From<DeviceError> for std::io::Error {
    /// The device's error as an I/O error of the closest kind (out of memory, unsupported, invalid
    /// input for an unknown stream, other), keeping it as the source.
    fn from(error: DeviceError) -> Self {
        use std::io::ErrorKind;
        let kind = match &error {
            DeviceError::OutOfMemory { .. } => ErrorKind::OutOfMemory,
            DeviceError::Unsupported { .. } => ErrorKind::Unsupported,
            DeviceError::UnknownStream { .. } => ErrorKind::InvalidInput,
            DeviceError::Driver { .. } => ErrorKind::Other,
        };
        std::io::Error::new(kind, error)
    }
}

impl From<Error> for std::io::Error {
    /// The allocator's error as an I/O error of the closest kind (out of memory for `OutOfMemory` and
    /// `TooLarge`, invalid input for bad pointers, handles, settings and pools, the device error's kind
    /// for device errors), keeping it as the source.
    fn from(error: Error) -> Self {
        use std::io::ErrorKind;
        let kind = match &error {
            Error::OutOfMemory(_) | Error::TooLarge { .. } => ErrorKind::OutOfMemory,
            Error::InvalidPointer { .. }
            | Error::ForeignAllocation { .. }
            | Error::Pool { .. }
            | Error::Checkpoint { .. }
            | Error::Config(_)
            | Error::InvalidFraction { .. } => ErrorKind::InvalidInput,
            Error::ExpandableNotShareable { .. } => ErrorKind::Unsupported,
            Error::Sleep(_) => ErrorKind::InvalidInput,
            Error::TooManyStreams { .. } => ErrorKind::Other,
            Error::Device(device) => std::io::Error::from(device.clone()).kind(),
        };
        std::io::Error::new(kind, error)
    }
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use super::*;

    #[test]
    fn io_errors_have_the_closest_kind_and_keep_the_message() {
        let bad = Error::InvalidPointer {
            ptr: DeviceAddress(0x1234),
        };
        let message = bad.to_string();
        let io = std::io::Error::from(bad);
        assert_eq!(io.kind(), ErrorKind::InvalidInput);
        assert_eq!(io.to_string(), message);
        assert!(io.get_ref().is_some_and(|e| e.is::<Error>()));
        let oom = Error::Device(DeviceError::OutOfMemory { bytes: 1 });
        assert_eq!(std::io::Error::from(oom).kind(), ErrorKind::OutOfMemory);
        let unknown = Error::Device(DeviceError::UnknownStream {
            stream: StreamId(7),
            device: 0,
        });
        assert_eq!(
            std::io::Error::from(unknown).kind(),
            ErrorKind::InvalidInput
        );
        let large = Error::TooLarge { bytes: usize::MAX };
        assert_eq!(std::io::Error::from(large).kind(), ErrorKind::OutOfMemory);
    }
}
