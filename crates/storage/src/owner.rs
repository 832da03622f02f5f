//! [`Owner`]: who owns a storage's bytes and how they are reached (PyTorch's `DataPtr` and its
//! deleter context), and [`StorageKind`], its public description.

use tensormem_shm::{Backing, SharedRegion, ShmName};

use crate::error::{Error, Result};
use crate::filename::NamedRegion;

/// What kind of memory holds a storage's bytes, and how it is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StorageKind {
    /// Private host memory of this process (PyTorch's default CPU allocator): not shared.
    CpuPrivate,
    /// Host shared memory reached through a file descriptor: a memfd or an unlinked shm object
    /// (PyTorch's `file_descriptor` strategy, `MapAllocator` with `KEEPFD`).
    CpuFd {
        /// Whether the object is sealed against shrinking, so no peer can truncate it.
        sealed: bool,
    },
    /// A regular file mapped `MAP_SHARED` ([`Storage::from_file`](crate::Storage::from_file)
    /// with `shared = true`).
    CpuFile,
    /// A named, refcounted shm object held through the manager daemon (PyTorch's `file_system`
    /// strategy, `THManagedMapAllocator`).
    CpuFilename,
    /// CUDA memory from this process's caching allocator.
    Cuda,
    /// CUDA memory received from another process (it cannot be shared again).
    CudaReceived,
}

impl StorageKind {
    /// Whether another process can reach the bytes (PyTorch's `is_shared()`: true for every
    /// CUDA storage and for host storages in shared memory).
    pub fn is_shared(self) -> bool {
        !matches!(self, Self::CpuPrivate)
    }
}

/// Who owns a host storage's bytes. Replaced in place by `share_memory_` / `share_fd` /
/// `share_filename` (PyTorch's `set_data_ptr`), never changed back.
#[derive(Debug)]
pub(crate) enum Owner {
    /// This process's heap. Its length is the storage's `nbytes`.
    Private(Vec<u8>),
    /// A shm object or memfd whose fd the region keeps (`Backing::Anonymous` or `Backing::Fd`).
    Fd(SharedRegion),
    /// A regular file mapped shared, fd kept.
    File(SharedRegion),
    /// A refcounted name held at the manager.
    Filename(NamedRegion),
    /// CUDA memory.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaOwner),
}

impl Owner {
    /// The public description.
    pub(crate) fn kind(&self) -> StorageKind {
        match self {
            Self::Private(_) => StorageKind::CpuPrivate,
            Self::Fd(region) => StorageKind::CpuFd {
                sealed: matches!(
                    region.backing(),
                    Backing::Anonymous { sealed: true } | Backing::Fd { sealed: true }
                ),
            },
            Self::File(_) => StorageKind::CpuFile,
            Self::Filename(_) => StorageKind::CpuFilename,
            #[cfg(feature = "cuda")]
            Self::Cuda(cuda) => cuda.kind(),
        }
    }

    /// The shm name of a filename storage.
    pub(crate) fn shm_name(&self) -> Option<&ShmName> {
        match self {
            Self::Filename(named) => Some(named.name()),
            _ => None,
        }
    }

    /// Copies `buf.len()` bytes at `offset` out of host memory; the caller checked the range.
    pub(crate) fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        match self {
            Self::Private(bytes) => {
                buf.copy_from_slice(&bytes[offset..offset + buf.len()]);
                Ok(())
            }
            Self::Fd(region) | Self::File(region) => Ok(region.read_at(offset, buf)?),
            Self::Filename(named) => Ok(named.mapping().read_at(offset, buf)?),
            #[cfg(feature = "cuda")]
            Self::Cuda(cuda) => cuda.read_at(offset, buf),
        }
    }

    /// Copies `data` into host memory at `offset`; the caller checked the range.
    pub(crate) fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        match self {
            Self::Private(bytes) => {
                bytes[offset..offset + data.len()].copy_from_slice(data);
                Ok(())
            }
            Self::Fd(region) | Self::File(region) => Ok(region.write_at(offset, data)?),
            Self::Filename(named) => Ok(named.mapping_mut().write_at(offset, data)?),
            #[cfg(feature = "cuda")]
            Self::Cuda(cuda) => cuda.write_at(offset, data),
        }
    }

    /// Sets every byte to `value`.
    pub(crate) fn fill(&mut self, value: u8) -> Result<()> {
        match self {
            Self::Private(bytes) => {
                bytes.fill(value);
                Ok(())
            }
            Self::Fd(region) | Self::File(region) => Ok(region.fill(value)?),
            Self::Filename(named) => Ok(named.mapping_mut().fill(value)?),
            #[cfg(feature = "cuda")]
            Self::Cuda(cuda) => cuda.fill(value),
        }
    }

    /// The private bytes, for operations that can skip a copy.
    pub(crate) fn private_bytes(&self) -> Option<&[u8]> {
        match self {
            Self::Private(bytes) => Some(bytes),
            _ => None,
        }
    }

    /// The private bytes, writable.
    pub(crate) fn private_bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            Self::Private(bytes) => Some(bytes),
            _ => None,
        }
    }

    /// The region of an fd-backed storage (memfd, shm object or shared file).
    pub(crate) fn fd_region(&self) -> Option<&SharedRegion> {
        match self {
            Self::Fd(region) | Self::File(region) => Some(region),
            _ => None,
        }
    }

    /// Whether the bytes are in host memory.
    pub(crate) fn is_host(&self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            Self::Cuda(_) => false,
            _ => true,
        }
    }

    /// An error for operations that need host memory.
    pub(crate) fn require_host(&self, op: &'static str) -> Result<()> {
        if self.is_host() {
            Ok(())
        } else {
            Err(Error::WrongDevice {
                op,
                expected: "CPU",
                actual: self.device(),
            })
        }
    }

    /// Where the bytes are.
    pub(crate) fn device(&self) -> crate::Device {
        match self {
            #[cfg(feature = "cuda")]
            Self::Cuda(cuda) => cuda.device(),
            _ => crate::Device::Cpu,
        }
    }
}
