//! The device API's error type.

use tensormem_cuda_alloc::DeviceError;

/// Why a call of the device API failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// This process is a `fork()` child of a process that had initialised CUDA: the driver's state is not
    /// usable here (PyTorch's bad-fork guard).
    /// The message says when the parent's only attempt to initialise CUDA had failed.
    #[error("{}", tensormem_runtime::forked_child_message())]
    ForkedChild,
    /// A device ordinal past the devices this process sees (the runtime's words).
    #[error("{}", tensormem_runtime::Error::InvalidDevice { device: *device, count: *count })]
    InvalidDevice {
        /// The ordinal given.
        device: u32,
        /// How many devices there are.
        count: u32,
    },
    /// A stream of one device was used where another device's was needed.
    #[error(
        "stream {stream} belongs to device {stream_device}, not to device {device}; use a stream of the \
         device the memory is on"
    )]
    WrongStreamDevice {
        /// The stream's id.
        stream: tensormem_cuda_alloc::StreamId,
        /// The device the stream belongs to.
        stream_device: u32,
        /// The device the call was about.
        device: u32,
    },
    /// A driver call failed (no driver, no device, or the driver's error code and name).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A snapshot could not be written.
    #[error("could not write the memory snapshot to {path}: {source}")]
    Snapshot {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: tensormem_cuda_alloc::snapshot::SnapshotError,
    },
    /// The allocator refused (out of memory with PyTorch's message, a bad configuration, ...).
    #[error(transparent)]
    Alloc(#[from] tensormem_cuda_alloc::Error),
    /// The process runs `backend:cudaMallocAsync`, which refuses this (PyTorch's error for it, then
    /// what to do).
    #[error("{0}")]
    AsyncUnsupported(super::AsyncUnsupported),
    /// A configuration string given at run time names another backend than the one the process
    /// chose when it first used the device API (PyTorch's error for it, then what to do; the
    /// runtime's words).
    #[error("{}", tensormem_runtime::Error::BackendChanged { asked: *asked, running: *running })]
    BackendChanged {
        /// The backend the string names.
        asked: tensormem_cuda_alloc::config::Backend,
        /// The backend the process runs.
        running: tensormem_cuda_alloc::config::Backend,
    },
    /// The process-wide CUDA IPC layer failed (other than a driver or allocator error, which are
    /// [`Error::Device`] and [`Error::Alloc`]).
    #[error(transparent)]
    Ipc(tensormem_ipc::Error),
    /// Another failure of the process runtime (`tensormem-runtime`).
    #[error(transparent)]
    Runtime(tensormem_runtime::Error),
}

impl From<tensormem_ipc::Error> for Error {
    /// As the runtime sorts them: driver and allocator errors as such, an invalid device as one.
    fn from(err: tensormem_ipc::Error) -> Self {
        tensormem_runtime::Error::from(err).into()
    }
}

impl From<tensormem_runtime::Error> for Error {
    fn from(err: tensormem_runtime::Error) -> Self {
        use tensormem_runtime::Error as R;
        match err {
            R::ForkedChild => Error::ForkedChild,
            R::InvalidDevice { device, count } => Error::InvalidDevice { device, count },
            R::Device(err) => Error::Device(err),
            R::Alloc(err) => Error::Alloc(err),
            R::AsyncUnsupported(what) => Error::AsyncUnsupported(what),
            R::BackendChanged { asked, running } => Error::BackendChanged { asked, running },
            R::Ipc(err) => Error::Ipc(err),
            other => Error::Runtime(other),
        }
    }
}

impl From<tensormem_cuda_alloc::config::ConfigError> for Error {
    fn from(err: tensormem_cuda_alloc::config::ConfigError) -> Self {
        Error::Alloc(err.into())
    }
}

/// `Result` with the device API's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
