//! The crate's error type: what was wrong, with which storage, and what to do about it.

use std::io;

use crate::device::Device;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a storage operation can refuse or fail with.
///
/// Failures of the layers below keep their own error as the [`source`](std::error::Error::source):
/// the shared-memory layer's [`tensormem_shm::Error`] (which names the object and keeps OS error
/// codes) inside [`Error::Shm`]; with the `cuda` feature, the allocator's and driver's
/// `tensormem_cuda_alloc::Error` (CUDA result codes, out-of-memory figures) inside [`Error::Alloc`]
/// and CUDA IPC's `tensormem_ipc::Error` inside [`Error::Ipc`], so a caller can match on them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The shared-memory layer failed (creating, opening, checking or mapping an object, or
    /// reaching the manager daemon).
    #[error(transparent)]
    Shm(#[from] tensormem_shm::Error),

    /// A zero-byte storage cannot be put in shared memory (an empty mapping does not exist).
    #[error(
        "{op}: the storage holds 0 bytes, and an empty storage cannot be shared (PyTorch rebuilds \
         empty storages on the receiving side instead of sharing them); send its size and make a \
         new empty storage there"
    )]
    Empty {
        /// The operation refused.
        op: &'static str,
    },

    /// The operation works on another device than the storage's.
    #[error("{op} is only available for {expected} storages, and this one is on {actual}")]
    WrongDevice {
        /// The operation refused.
        op: &'static str,
        /// The kind of device the operation needs ("CPU" or "CUDA").
        expected: &'static str,
        /// Where the storage is.
        actual: Device,
    },

    /// The storage is not backed by the kind of shared memory the operation needs.
    #[error("{op}: {problem}")]
    NotShared {
        /// The operation refused.
        op: &'static str,
        /// What the storage is, and what to do.
        problem: String,
    },

    /// A byte range lies outside the storage.
    #[error(
        "range {offset}..{offset}+{len} is outside the storage of {nbytes} bytes; keep \
         offset + len <= nbytes()"
    )]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The storage's size.
        nbytes: usize,
    },

    /// A copy between storages of different sizes.
    #[error(
        "storage_copy needs storages of the same size: the destination holds {dst} bytes and the \
         source {src}; copy a sub-range with read_at/write_at instead"
    )]
    SizeMismatch {
        /// Bytes in the destination.
        dst: usize,
        /// Bytes in the source.
        src: usize,
    },

    /// A size does not fit this platform's address space or the storage it describes.
    #[error("invalid size {size} for {op}: {problem}")]
    InvalidSize {
        /// The operation.
        op: &'static str,
        /// The size given.
        size: u64,
        /// Why it cannot be used.
        problem: &'static str,
    },

    /// A weak reference was upgraded after the last strong reference was dropped.
    #[error(
        "the storage this weak reference pointed to has been freed (every Storage handle to it \
         was dropped); check expired() before upgrading, or keep a Storage alive"
    )]
    Expired,

    /// A shared refcount would have dropped below the references this process itself holds.
    #[error(
        "shared_decref on {object}: its refcount is {refcount}, and this process's own mapping \
         accounts for one of those; more decrefs than increfs were made. Pair every \
         shared_decref with an earlier shared_incref (PyTorch: the sender increfs, the receiver \
         decrefs once)"
    )]
    RefcountUnderflow {
        /// The shared memory object.
        object: String,
        /// The count found.
        refcount: i32,
    },

    /// A CUDA storage received from another process was asked to be shared again.
    #[error(
        "attempted to send a CUDA storage received from another process; this is not supported \
         (the producer's reference counting only knows its direct consumers). Clone it into a \
         storage of this process (storage_copy into a new CUDA storage) before sending"
    )]
    ReceivedCuda,

    /// PyTorch's `torch_shm_manager` (named by the manager handle of a PyTorch tuple) could
    /// not be reached or did not follow its protocol.
    #[error("PyTorch's shm manager at {}: {problem}", socket.display())]
    TorchManager {
        /// The manager's socket (the tuple's manager handle).
        socket: std::path::PathBuf,
        /// What went wrong.
        problem: String,
    },

    /// [`set_default_pool`](crate::set_default_pool) was called after the process-wide pool
    /// already existed.
    #[error(
        "the process-wide shared-memory pool exists already (installed earlier, or made by a \
         share_memory_); call set_default_pool before the first share_memory_, or use \
         Storage::share_memory_in with your pool"
    )]
    DefaultPoolSet,

    /// The caching allocator or the CUDA driver failed (out of memory, a driver error with its
    /// `CUresult` code, an invalid device).
    #[cfg(feature = "cuda")]
    #[error("{op}: {source}")]
    Alloc {
        /// The operation.
        op: &'static str,
        /// The allocator's or driver's error, codes kept.
        #[source]
        source: tensormem_cuda_alloc::Error,
    },

    /// CUDA IPC failed (sharing, opening or releasing memory of another process, a malformed
    /// handle, a ref-counter file gone).
    #[cfg(feature = "cuda")]
    #[error("{op}: {source}")]
    Ipc {
        /// The operation.
        op: &'static str,
        /// CUDA IPC's error, codes kept.
        #[source]
        source: tensormem_ipc::Error,
    },

    /// The process runtime (`tensormem-runtime`) refused: no driver or no such device, a
    /// malformed allocator configuration, a child forked after CUDA was initialised.
    #[cfg(feature = "cuda")]
    #[error("{op}: {source}")]
    Runtime {
        /// The operation.
        op: &'static str,
        /// The runtime's error, codes kept.
        #[source]
        source: tensormem_runtime::Error,
    },

    /// [`share_cuda_batch`](crate::cuda::share_cuda_batch) was given no storage.
    #[error("share_cuda_batch: no entries; a batch holds at least one storage")]
    EmptyBatch,
}

/// Wraps a CUDA layer's error (allocator, driver or IPC) in [`Error`], keeping it as the source.
#[cfg(feature = "cuda")]
macro_rules! cuda {
    ($op:expr, $result:expr) => {
        $result.map_err(|e| crate::error::CudaSource::during(e, $op))
    };
}
#[cfg(feature = "cuda")]
pub(crate) use cuda;

/// Wraps the CUDA layers' errors in [`Error`] with the operation that met them.
#[cfg(feature = "cuda")]
pub(crate) trait CudaSource {
    /// This error as a storage [`Error`] of operation `op`.
    fn during(self, op: &'static str) -> Error;
}

#[cfg(feature = "cuda")]
impl CudaSource for tensormem_cuda_alloc::Error {
    fn during(self, op: &'static str) -> Error {
        Error::Alloc { op, source: self }
    }
}

#[cfg(feature = "cuda")]
impl CudaSource for tensormem_cuda_alloc::DeviceError {
    fn during(self, op: &'static str) -> Error {
        Error::Alloc {
            op,
            source: self.into(),
        }
    }
}

#[cfg(feature = "cuda")]
impl CudaSource for tensormem_runtime::Error {
    fn during(self, op: &'static str) -> Error {
        match self {
            tensormem_runtime::Error::Alloc(source) => Error::Alloc { op, source },
            tensormem_runtime::Error::Device(source) => Error::Alloc {
                op,
                source: source.into(),
            },
            tensormem_runtime::Error::Ipc(source) => Error::Ipc { op, source },
            source => Error::Runtime { op, source },
        }
    }
}

#[cfg(feature = "cuda")]
impl CudaSource for tensormem_ipc::Error {
    fn during(self, op: &'static str) -> Error {
        Error::Ipc { op, source: self }
    }
}

impl Error {
    /// The [`io::ErrorKind`] closest to this error, used by `From<Error> for io::Error`.
    pub fn kind(&self) -> io::ErrorKind {
        use io::ErrorKind as K;
        match self {
            Self::Shm(e) => e.kind(),
            Self::Empty { .. }
            | Self::WrongDevice { .. }
            | Self::OutOfBounds { .. }
            | Self::SizeMismatch { .. }
            | Self::InvalidSize { .. }
            | Self::NotShared { .. }
            | Self::ReceivedCuda
            | Self::EmptyBatch => K::InvalidInput,
            Self::DefaultPoolSet => K::AlreadyExists,
            Self::Expired => K::NotFound,
            Self::RefcountUnderflow { .. } => K::InvalidData,
            #[cfg(feature = "cuda")]
            Self::Alloc { source, .. } => match source {
                tensormem_cuda_alloc::Error::OutOfMemory(_)
                | tensormem_cuda_alloc::Error::TooLarge { .. } => K::OutOfMemory,
                _ => K::Other,
            },
            #[cfg(feature = "cuda")]
            Self::Ipc { .. } => K::Other,
            #[cfg(feature = "cuda")]
            Self::Runtime { source, .. } => match source {
                tensormem_runtime::Error::InvalidDevice { .. } => K::InvalidInput,
                tensormem_runtime::Error::AsyncUnsupported(_) => K::Unsupported,
                _ => K::Other,
            },
            Self::TorchManager { .. } => K::Other,
        }
    }
}

/// Refuses sizes that cannot be mapped on this platform.
pub(crate) fn check_size(size: u64, op: &'static str) -> Result<usize> {
    usize::try_from(size)
        .ok()
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or(Error::InvalidSize {
            op,
            size,
            problem: "larger than the address space can map",
        })
}

/// For callers whose functions return `io::Result`: the kind is [`Error::kind`], and the typed
/// error stays reachable through `io::Error::get_ref` / `into_inner`.
impl From<Error> for io::Error {
    fn from(err: Error) -> Self {
        io::Error::new(err.kind(), err)
    }
}
