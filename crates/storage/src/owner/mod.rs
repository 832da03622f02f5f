//! [`Owner`]: who owns a storage's bytes and how they are reached (PyTorch's `DataPtr` and its
//! deleter context), and [`StorageKind`], its public description.
//!
//! The owners' types live here and below: `cuda` (CUDA memory and the context it is used on)
//! and `named` (a refcounted name held at a manager). The operations that make and share
//! storages of each kind sit above, in the crate's modules of each sharing strategy.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod kind;
#[cfg(feature = "manager")]
pub(crate) mod named;

use tensormem_shm::mapping_cache::Lease;
use tensormem_shm::pool::PoolBuffer;
use tensormem_shm::{Backing, SharedRegion, ShmName};

#[cfg(feature = "cuda")]
use self::cuda::CudaOwner;
pub use self::kind::StorageKind;
#[cfg(feature = "manager")]
use self::named::NamedRegion;
use crate::error::{Error, Result};

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
    /// A region lent by a pool; back to the pool when dropped (and every lease is released).
    Pooled(PoolBuffer),
    /// A lease on another process's pooled region; released when dropped.
    Lease(Lease),
    /// A refcounted name held at the manager.
    #[cfg(feature = "manager")]
    Filename(NamedRegion),
    /// CUDA memory.
    #[cfg(feature = "cuda")]
    Cuda(CudaOwner),
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
            Self::Pooled(_) => StorageKind::CpuPooled,
            Self::Lease(_) => StorageKind::CpuPooledLease,
            #[cfg(feature = "manager")]
            Self::Filename(_) => StorageKind::CpuFilename,
            #[cfg(feature = "cuda")]
            Self::Cuda(cuda) => cuda.kind(),
        }
    }

    /// The shm name of a filename storage.
    pub(crate) fn shm_name(&self) -> Option<&ShmName> {
        match self {
            #[cfg(feature = "manager")]
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
            Self::Pooled(buffer) => Ok(buffer.read_at(offset, buf)?),
            Self::Lease(lease) => Ok(lease.read_at(offset, buf)?),
            #[cfg(feature = "manager")]
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
            Self::Pooled(buffer) => Ok(buffer.write_at(offset, data)?),
            Self::Lease(lease) => Ok(lease.write_at(offset, data)?),
            #[cfg(feature = "manager")]
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
            Self::Pooled(buffer) => Ok(buffer.fill(value)?),
            Self::Lease(lease) => {
                let chunk = vec![value; lease.len().min(1 << 20)];
                let mut at = 0;
                while at < lease.len() {
                    let n = chunk.len().min(lease.len() - at);
                    lease.write_at(at, &chunk[..n])?;
                    at += n;
                }
                Ok(())
            }
            #[cfg(feature = "manager")]
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
