//! Sharing by file descriptor (PyTorch's `file_descriptor` strategy): `_share_fd_cpu_`,
//! `_new_shared_fd_cpu`, `_new_using_fd_cpu` (`new_shm_fd_storage`), `_get_shared_fd`.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use tensormem_shm::transfer::{self, SendOptions};
use tensormem_shm::{MapOptions, SharedRegion};

use crate::error::{check_size, Error, Result};
use crate::owner::Owner;
use crate::storage::Storage;

/// What a consumer needs to open an fd-shared storage: PyTorch's `(fd, size)` tuple, with the
/// descriptor owned (a duplicate of the storage's: closing it does not affect the storage).
///
/// Pass the descriptor to another process over a Unix socket ([`send`](Self::send), or any
/// `SCM_RIGHTS` sender, or `multiprocessing`'s reduction on the Python side); the receiver calls
/// [`Storage::new_shared_fd`].
pub struct FdHandle {
    fd: OwnedFd,
    size: u64,
}

impl FdHandle {
    /// A handle from a descriptor and the storage size it carries (for descriptors received by
    /// other means than [`FdHandle::recv`]).
    pub fn new(fd: OwnedFd, size: u64) -> Self {
        Self { fd, size }
    }

    /// The descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes of the storage.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Gives up the descriptor.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// Sends the descriptor and size over a Unix socket (`SCM_RIGHTS`, tensormem-shm's region
    /// message).
    ///
    /// # Errors
    ///
    /// [`Error::Shm`] when the socket fails.
    pub fn send(&self, socket: impl AsFd) -> Result<()> {
        transfer::send_fd(socket, self.fd(), self.size, 0, SendOptions::default())?;
        Ok(())
    }

    /// Receives a handle sent by [`send`](Self::send) or [`Storage::send_shared_fd`], without
    /// mapping it yet.
    ///
    /// # Errors
    ///
    /// [`Error::Shm`] for a broken socket or a malformed message, or a received object that
    /// fails the checks of [`Storage::new_shared_fd`].
    pub fn recv(socket: impl AsFd) -> Result<Self> {
        let received = transfer::recv_region(socket, &MapOptions::new().keep_fd(true))?;
        let size = received.region.len() as u64;
        let mut region = received.region;
        let fd = region.take_fd().ok_or_else(|| Error::NotShared {
            op: "FdHandle::recv",
            problem: "the received region kept no descriptor".to_owned(),
        })?;
        Ok(Self { fd, size })
    }
}

impl AsFd for FdHandle {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl fmt::Debug for FdHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FdHandle")
            .field("fd", &self.fd)
            .field("size", &self.size)
            .finish()
    }
}

impl Storage {
    /// A new fd-backed host storage of `size` zeroed bytes (PyTorch: `new_shm_fd_storage`,
    /// `UntypedStorage._new_using_fd_cpu`): a sealed memfd, or an immediately unlinked shm object
    /// where memfd is unavailable.
    ///
    /// # Errors
    ///
    /// [`Error::Empty`] for `size == 0`; [`Error::Shm`] when the memory cannot be made.
    pub fn new_shared_fd_storage(size: u64) -> Result<Storage> {
        if size == 0 {
            return Err(Error::Empty {
                op: "new_shared_fd_storage",
            });
        }
        Ok(Self::from_fd_region(SharedRegion::create_anonymous(size)?))
    }

    /// Shares the storage by file descriptor (PyTorch: `_share_fd_cpu_`): moves it into
    /// fd-backed shared memory first unless it already is (private and named storages, and
    /// leases received from a pool, are copied into a new memfd, for every clone; a pooled
    /// storage is detached from its pool, keeping its memory, and never reused), then returns a
    /// duplicate of its descriptor with its size.
    ///
    /// # Errors
    ///
    /// [`Error::WrongDevice`] for CUDA storages, [`Error::Empty`] for zero bytes,
    /// [`Error::Shm`] when shared memory cannot be made or the descriptor duplicated.
    pub fn share_fd(&self) -> Result<FdHandle> {
        self.move_to_fd("share_fd")?;
        Ok(FdHandle {
            fd: self.get_shared_fd()?,
            size: self.nbytes() as u64,
        })
    }

    /// [`share_fd`](Self::share_fd) and [`FdHandle::send`] in one step, without duplicating the
    /// descriptor: the storage's own descriptor is sent (a pooled storage is detached first, as
    /// for `share_fd`). For recycled regions, send with [`send_pooled`](Self::send_pooled).
    ///
    /// # Errors
    ///
    /// As [`share_fd`](Self::share_fd) and [`FdHandle::send`].
    pub fn send_shared_fd(&self, socket: impl AsFd) -> Result<()> {
        self.move_to_fd("send_shared_fd")?;
        let owner = self.owner();
        let region = fd_region(&owner, "send_shared_fd")?;
        transfer::send_fd(
            socket,
            region_fd(region, "send_shared_fd")?,
            self.nbytes() as u64,
            0,
            SendOptions::default(),
        )?;
        Ok(())
    }

    /// Opens a storage shared by descriptor (PyTorch: `_new_shared_fd_cpu(fd, size)`): maps
    /// `size` bytes of the object behind `fd`, keeping a duplicate of `fd` (the caller's stays
    /// the caller's).
    ///
    /// Before mapping, the descriptor is checked (`fstat`): it must be open, refer to a regular
    /// file, memfd or shm object owned by this user, and hold at least `size` bytes, so a wrong
    /// or truncated object is an error here rather than a `SIGBUS` later.
    ///
    /// # Errors
    ///
    /// [`Error::Empty`] for `size == 0`, [`Error::InvalidSize`] for a size beyond the address
    /// space; [`Error::Shm`] wrapping `InvalidFd` (closed), `WrongKind` (socket, pipe,
    /// directory...), `TooSmall` (the object holds fewer than `size` bytes), `ForeignOwner`.
    pub fn new_shared_fd(fd: impl AsFd, size: u64) -> Result<Storage> {
        if size == 0 {
            return Err(Error::Empty {
                op: "new_shared_fd",
            });
        }
        check_size(size, "new_shared_fd")?;
        let region = MapOptions::new().len(size).keep_fd(true).map_fd(fd)?;
        tracing::debug!(size, "opened a storage shared by descriptor");
        Ok(Self::from_fd_region(region))
    }

    /// Receives a storage sent by [`send_shared_fd`](Self::send_shared_fd) or
    /// [`FdHandle::send`] and opens it (the checks of [`new_shared_fd`](Self::new_shared_fd)).
    ///
    /// # Errors
    ///
    /// As [`FdHandle::recv`].
    pub fn recv_shared_fd(socket: impl AsFd) -> Result<Storage> {
        let received = transfer::recv_region(socket, &MapOptions::new().keep_fd(true))?;
        Ok(Self::from_fd_region(received.region))
    }

    /// A duplicate of the descriptor behind an fd-backed or file-backed storage (PyTorch:
    /// `_get_shared_fd`, which returns the descriptor itself; here the caller owns a duplicate,
    /// so the storage's cannot be closed behind its back). A pooled storage
    /// ([`share_memory_`](Self::share_memory_)) is detached from its pool first (it becomes
    /// `CpuFd`, same memory): whoever holds a raw descriptor can map the region at any time, so
    /// the pool can never prove it free again and does not reuse it.
    ///
    /// # Errors
    ///
    /// [`Error::NotShared`] for storages without a descriptor (private, named, CUDA);
    /// [`Error::Shm`] when `dup` fails.
    pub fn get_shared_fd(&self) -> Result<OwnedFd> {
        // The descriptor leaves the facade's accounting: never reuse the region.
        self.detach_from_pool("get_shared_fd");
        let owner = self.owner();
        let region = fd_region(&owner, "get_shared_fd")?;
        let fd = region_fd(region, "get_shared_fd")?;
        fd.try_clone_to_owned().map_err(|source| {
            Error::Shm(tensormem_shm::Error::Os {
                object: region.describe(),
                op: "fcntl(F_DUPFD_CLOEXEC)",
                source,
            })
        })
    }
}

/// The region of an fd-backed owner, or why there is none.
fn fd_region<'a>(owner: &'a Owner, op: &'static str) -> Result<&'a SharedRegion> {
    owner.fd_region().ok_or_else(|| Error::NotShared {
        op,
        problem: format!(
            "the storage is {:?}, which has no shared file descriptor; call share_fd() (or \
             share_memory_()) first",
            owner.kind()
        ),
    })
}

/// The descriptor a region kept.
fn region_fd<'a>(region: &'a SharedRegion, op: &'static str) -> Result<BorrowedFd<'a>> {
    region.fd().ok_or_else(|| Error::NotShared {
        op,
        problem: format!("{} kept no file descriptor", region.describe()),
    })
}
