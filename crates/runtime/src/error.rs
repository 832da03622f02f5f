//! The runtime's error type.

use tensormem_cuda_alloc::config::Backend;
use tensormem_cuda_alloc::DeviceError;

use crate::unsupported::AsyncUnsupported;

/// Why asking the runtime for a device's state failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// This process is a `fork()` child of a process that had initialised CUDA: the driver's state
    /// is not usable here (PyTorch's bad-fork guard). The message says when the parent's only
    /// attempt to initialise CUDA had failed.
    #[error("{}", crate::fork::forked_child_message())]
    ForkedChild,
    /// A device ordinal past the devices this process sees.
    #[error("invalid device ordinal {device}: this process sees {count} CUDA device(s), numbered from 0")]
    InvalidDevice {
        /// The ordinal given.
        device: u32,
        /// How many devices there are.
        count: u32,
    },
    /// A driver call failed (no driver, no device, or the driver's error code and name).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The allocator refused (out of memory with PyTorch's message, a bad configuration, ...).
    #[error(transparent)]
    Alloc(#[from] tensormem_cuda_alloc::Error),
    /// The process runs `backend:cudaMallocAsync`, which refuses this (PyTorch's error for it, then
    /// what to do).
    #[error("{0}")]
    AsyncUnsupported(AsyncUnsupported),
    /// A configuration string given at run time names another backend than the one the process
    /// chose when it first used CUDA (PyTorch's error for it, then what to do).
    #[error(
        "Allocator async backend parsed at runtime != allocator async backend parsed at load time, \
         {} != {}: this process runs backend:{running}, chosen from the environment's allocator \
         configuration when it first used CUDA, and the backend cannot change afterwards; to run \
         backend:{asked}, set it in TENSORMEM_ALLOC_CONF (or PYTORCH_ALLOC_CONF) before the process \
         starts",
        u8::from(*asked != Backend::Native),
        u8::from(*running != Backend::Native)
    )]
    BackendChanged {
        /// The backend the string names.
        asked: Backend,
        /// The backend the process runs.
        running: Backend,
    },
    /// The process-wide CUDA IPC layer failed (other than a driver or allocator error, which are
    /// [`Error::Device`] and [`Error::Alloc`]).
    #[error(transparent)]
    Ipc(tensormem_ipc::Error),
}

impl From<tensormem_ipc::Error> for Error {
    fn from(err: tensormem_ipc::Error) -> Self {
        match err {
            tensormem_ipc::Error::Driver(err) => Error::Device(err),
            tensormem_ipc::Error::Allocator(err) => Error::Alloc(err),
            tensormem_ipc::Error::InvalidDevice { device, count } => Error::InvalidDevice {
                device: u32::try_from(device).unwrap_or(u32::MAX),
                count,
            },
            other => Error::Ipc(other),
        }
    }
}

impl From<tensormem_cuda_alloc::config::ConfigError> for Error {
    fn from(err: tensormem_cuda_alloc::config::ConfigError) -> Self {
        Error::Alloc(err.into())
    }
}

/// `Result` with the runtime's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
