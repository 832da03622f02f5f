//! Recycled shared memory through the facade: `share_memory_` draws its region from a
//! [`ShmPool`], and a producer/consumer pair sends storages over a pool connection
//! ([`Storage::send_pooled`] / [`Storage::recv_pooled`]), so regions are reused, a region the
//! consumer has seen travels as an id, and a consumer killed with `kill -9` gives its leases back
//! (all of it is `tensormem_shm::pool`'s machinery; this module only ties it to [`Storage`]).
//!
//! # When a pooled region can be reused
//!
//! Only when nothing can reach it: every clone of the storage is dropped (the storage owns the
//! pool's `PoolBuffer`) and every lease sent over a `PoolSender` is released, or its consumer's
//! end of the connection closed. Weak references do not count (they cannot reach the bytes once
//! the last clone is gone). A raw descriptor is different: a process holding it may map the
//! region at any time, and nothing tells the pool when it stops. So a pooled storage whose
//! descriptor is handed out raw ([`Storage::share_fd`], [`Storage::get_shared_fd`],
//! [`Storage::send_shared_fd`]) is **detached**: it becomes `CpuFd` over the same memory, the
//! pool forgets the region (it is never lent again), and the memory is freed normally when the
//! last mapping goes. The region's bytes past the storage's end are cleared on detaching, so the
//! descriptor shows nothing of earlier uses of the region.
//!
//! `share_filename` moves a storage into a named refcounted region as before (PyTorch moves any
//! storage not shared by name); a pooled region never carries a name, so it returns to the pool
//! once its leases are released. Names stay off the pool: any process may open a name, so no
//! connection exists whose close would tell the pool that a killed opener is gone.

use std::fmt;
use std::sync::OnceLock;

use tensormem_shm::mapping_cache::{Lease, PoolReceiver};
use tensormem_shm::pool::{PoolConfig, PoolSender, ShmPool};

use crate::error::{Error, Result};
use crate::owner::Owner;
use crate::storage::Storage;

static DEFAULT_POOL: OnceLock<ShmPool> = OnceLock::new();

/// The process-wide pool that [`Storage::share_memory_`] draws from: made on first use with
/// [`PoolConfig::default`] (at most 4 GiB cached, regions idle for 60 s released by a background
/// thread), unless [`set_default_pool`] installed another first.
pub fn default_pool() -> &'static ShmPool {
    DEFAULT_POOL.get_or_init(|| {
        let pool = ShmPool::new(PoolConfig::default());
        start_trimmer(&pool);
        pool
    })
}

/// Installs `pool` as the process-wide pool of [`Storage::share_memory_`] (for other limits, or
/// to share one pool with `PoolSender`s made elsewhere). Call it before the first
/// `share_memory_`. No idle trimmer is started for it: call `pool.start_idle_trimmer()` if you
/// want one.
///
/// # Errors
///
/// [`Error::DefaultPoolSet`] if the default pool exists already (installed, or made by a
/// `share_memory_`); `pool` is dropped then.
pub fn set_default_pool(pool: ShmPool) -> Result<()> {
    DEFAULT_POOL.set(pool).map_err(|_| Error::DefaultPoolSet)
}

fn start_trimmer(pool: &ShmPool) {
    if let Err(err) = pool.start_idle_trimmer() {
        tracing::warn!(error = %err, "no idle trimmer for the default shared-memory pool; idle regions are released when the pool is next used");
    }
}

/// A storage received with [`Storage::recv_pooled`] and the application data sent beside it.
pub struct ReceivedStorage {
    /// The storage: a lease on the producer's region ([`StorageKind::CpuPooledLease`](crate::StorageKind::CpuPooledLease)).
    pub storage: Storage,
    /// What the producer passed as `metadata` to [`Storage::send_pooled`].
    pub metadata: Vec<u8>,
}

impl fmt::Debug for ReceivedStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceivedStorage")
            .field("storage", &self.storage)
            .field("metadata_len", &self.metadata.len())
            .finish()
    }
}

impl Storage {
    /// Moves the bytes into shared memory in place, for every clone (PyTorch: `share_memory_`):
    /// a private host storage becomes a pooled one
    /// ([`StorageKind::CpuPooled`](crate::StorageKind::CpuPooled)), its bytes copied into a region
    /// of the process-wide pool ([`default_pool`]).
    /// In steady state (a region of the same size class came back to the pool) that is a
    /// threaded copy into pages already faulted in, at memory bandwidth; the first region of a
    /// size is made as a fresh sealed memfd with a pre-faulted parallel copy. Nothing happens
    /// when the storage is already shared (pooled, fd-backed, file-backed, named, a received
    /// lease) or on a CUDA device.
    ///
    /// The region goes back to the pool only when nothing can reach it any more: every clone
    /// of the storage is dropped and every lease sent with
    /// [`send_pooled`](Self::send_pooled) is released (or its consumer died). Handing the
    /// descriptor out raw ([`share_fd`](Self::share_fd), [`get_shared_fd`](Self::get_shared_fd),
    /// [`send_shared_fd`](Self::send_shared_fd)) detaches the region from the pool for good.
    /// [`share_memory_in`](Self::share_memory_in) uses a pool of your choice.
    ///
    /// # Errors
    ///
    /// [`Error::Empty`] for a zero-byte private storage; [`Error::Shm`] when the memory cannot be
    /// made (nothing changes then).
    pub fn share_memory_(&self) -> Result<()> {
        if self.is_shared() {
            return Ok(());
        }
        self.share_memory_in(default_pool())
    }

    /// [`share_memory_`](Self::share_memory_) with a region of `pool` instead of the
    /// process-wide one. Does nothing to a storage already shared or on a CUDA device.
    ///
    /// # Errors
    ///
    /// [`Error::Empty`] for a zero-byte private storage; [`Error::Shm`] when the pool cannot make
    /// a region (nothing changes then).
    pub fn share_memory_in(&self, pool: &ShmPool) -> Result<()> {
        let mut owner = self.owner_mut();
        let Some(bytes) = owner.private_bytes() else {
            return Ok(()); // shared already, or on a device: as PyTorch
        };
        if bytes.is_empty() {
            return Err(Error::Empty {
                op: "share_memory_",
            });
        }
        let buffer = pool.copy_from_bytes(bytes)?;
        tracing::trace!(
            nbytes = self.nbytes(),
            region = buffer.id(),
            "storage moved into a pooled region"
        );
        *owner = Owner::Pooled(buffer);
        Ok(())
    }

    /// A new pooled storage of `nbytes` zeroed bytes from `pool` (a cached region when one of the
    /// size class is free, cleared; a new pre-faulted one otherwise).
    ///
    /// # Errors
    ///
    /// [`Error::Empty`] for `nbytes == 0`; [`Error::Shm`] when the pool cannot make a region.
    pub fn new_pooled(pool: &ShmPool, nbytes: usize) -> Result<Storage> {
        if nbytes == 0 {
            return Err(Error::Empty { op: "new_pooled" });
        }
        let buffer = pool.alloc_zeroed(nbytes as u64)?;
        Ok(Self::with_owner(nbytes, Owner::Pooled(buffer)))
    }

    /// Lends the storage to the consumer at the other end of `sender`, with `metadata` (dtype,
    /// shape, offset...: at most `tensormem_shm::pool::MAX_POOL_USER_DATA` = 216 bytes) beside
    /// it. A private storage is first moved into the sender's pool (as
    /// [`share_memory_in`](Self::share_memory_in)); the first send of a region carries its
    /// descriptor, later sends only its id. The lease keeps the region from being reused until
    /// the consumer drops its storage or dies. The same storage may be sent several times and
    /// to several consumers.
    ///
    /// # Errors
    ///
    /// [`Error::NotShared`] for storages whose memory is not the pool's: fd-backed, file-backed
    /// or named storages (their users cannot be accounted for: copy into a new storage and send
    /// that), storages of another pool, and storages received from a pool (a lease cannot be
    /// lent on); [`Error::WrongDevice`] for CUDA storages; [`Error::Empty`] for zero bytes;
    /// [`Error::Shm`] wrapping `Protocol` (metadata longer than 216 bytes, a misbehaving
    /// consumer) or `Disconnected` (the consumer is gone). Nothing is lent when it fails.
    pub fn send_pooled(&self, sender: &mut PoolSender, metadata: &[u8]) -> Result<()> {
        const OP: &str = "send_pooled";
        for attempt in 0..2 {
            {
                let owner = self.owner();
                owner.require_host(OP)?;
                let problem = match &*owner {
                    Owner::Pooled(buffer) if buffer.is_from(&sender.pool()) => {
                        sender.send(buffer, metadata)?;
                        return Ok(());
                    }
                    Owner::Pooled(_) => {
                        "the storage's region belongs to another pool than the sender's; make \
                         the sender from the storage's pool, or copy the bytes into a new \
                         storage and send that"
                    }
                    Owner::Private(_) if attempt == 0 => "",
                    Owner::Lease(_) => {
                        "the storage was received from a pool, and a lease cannot be lent on; \
                         copy it into a new storage (Storage::new + storage_copy) and send that"
                    }
                    _ => {
                        "the storage's shared memory is outside any pool (a descriptor handed \
                         out, a file or a name), so nothing could tell when its consumers are \
                         done; copy it into a new storage (Storage::new + storage_copy) and \
                         send that"
                    }
                };
                if !problem.is_empty() {
                    return Err(Error::NotShared {
                        op: OP,
                        problem: format!("{problem} (the storage is {:?})", owner.kind()),
                    });
                }
            }
            self.share_memory_in(&sender.pool())?;
        }
        Err(Error::NotShared {
            op: OP,
            problem: "the storage changed owner while being moved into the sender's pool; send \
                      it again"
                .to_owned(),
        })
    }

    /// Receives the next storage sent with [`send_pooled`](Self::send_pooled) (or any
    /// `PoolSender::send`) and wraps its lease: the storage reads and writes the producer's
    /// region (a region seen before is reached through the receiver's cached mapping: no `mmap`,
    /// no faults), and dropping it (every clone) gives the lease back.
    ///
    /// # Errors
    ///
    /// As `PoolReceiver::recv`, inside [`Error::Shm`]: `Disconnected` once the producer is gone,
    /// `Protocol` for a malformed or lying message, the attach checks of a received descriptor.
    pub fn recv_pooled(receiver: &mut PoolReceiver) -> Result<ReceivedStorage> {
        let lease = receiver.recv()?;
        let metadata = lease.user_data().to_vec();
        Ok(ReceivedStorage {
            storage: Self::from_lease(lease),
            metadata,
        })
    }

    /// Wraps a lease received with `PoolReceiver::recv` in a storage of its length
    /// ([`StorageKind::CpuPooledLease`](crate::StorageKind::CpuPooledLease)); dropping the storage
    /// (every clone) releases the lease.
    pub fn from_lease(lease: Lease) -> Storage {
        let nbytes = lease.len();
        Self::with_owner(nbytes, Owner::Lease(lease))
    }

    /// The id of the pooled region behind a pooled storage or a received lease (equal ids on
    /// one connection are the same region, reused), `None` for other storages.
    pub fn pooled_region_id(&self) -> Option<u64> {
        match &*self.owner() {
            Owner::Pooled(buffer) => Some(buffer.id()),
            Owner::Lease(lease) => Some(lease.id()),
            _ => None,
        }
    }
}
