//! [`StorageKind`]: the public description of who owns a storage's bytes.

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
