//! [`Owner`]: who owns a storage's bytes and how they are reached (PyTorch's `DataPtr` and its
//! deleter context), and [`StorageKind`], its public description.

use tensormem_shm::mapping_cache::Lease;
use tensormem_shm::pool::PoolBuffer;
use tensormem_shm::{Backing, SharedRegion, ShmName};

use crate::error::{Error, Result};
#[cfg(feature = "manager")]
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
    /// Host shared memory lent by a pool (`tensormem_shm::pool::ShmPool`): what
    /// [`Storage::share_memory_`](crate::Storage::share_memory_) makes. A sealed memfd whose
    /// region goes back to its pool for reuse once the storage (every clone) and every consumer
    /// lease on it are gone. Handing its descriptor out raw
    /// ([`share_fd`](crate::Storage::share_fd), [`get_shared_fd`](crate::Storage::get_shared_fd))
    /// detaches it from the pool: it becomes [`CpuFd`](Self::CpuFd) and is never reused.
    CpuPooled,
    /// Host shared memory received from another process's pool
    /// ([`Storage::recv_pooled`](crate::Storage::recv_pooled)): a lease on the producer's region,
    /// given back to the producer when the storage (every clone) is dropped.
    CpuPooledLease,
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
    /// A region lent by a pool; back to the pool when dropped (and every lease is released).
    Pooled(PoolBuffer),
    /// A lease on another process's pooled region; released when dropped.
    Lease(Lease),
    /// A refcounted name held at the manager.
    #[cfg(feature = "manager")]
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
