//! Sharing by name (PyTorch's `file_system` strategy): `_share_filename_cpu_`,
//! `_new_shared_filename_cpu`, `_new_using_filename_cpu`, `_shared_incref`, `_shared_decref`.
//!
//! # Who removes the name
//!
//! A named storage is a [`RefcountedRegion`]: PyTorch's `RefcountedMapAllocator` layout (an
//! atomic `i32` count at offset 0, data at offset 64), so PyTorch opens it as its own. The count
//! decides, as in PyTorch: every mapping adds one, every close subtracts one, the close that
//! reaches zero unlinks the name. [`Storage::shared_incref`] / [`Storage::shared_decref`] adjust
//! it by hand, for names in transit (the sender increfs before sending, the receiver decrefs once
//! it has opened the name, as `torch.multiprocessing` does), so the name survives its creator
//! dropping the storage before the receiver got there.
//!
//! A manager is the backstop for processes that die without closing. Which one depends on who
//! shared the name:
//!
//! - **Names tensormem creates** (empty manager handle) are registered with tensormem's daemon
//!   (`tensormem_shm::manager`) before the object exists; every tensormem process that opens
//!   one registers too. When a process closes a storage and the count reaches zero, it unlinks
//!   the name and tells the daemon to forget it; when the count stays above zero (others, or a
//!   name in transit, still count), the process keeps its hold until it exits, and the daemon
//!   unlinks the name once no live process holds it. So a name survives its creator exiting
//!   while another live tensormem process holds it, and nothing outlives all of them.
//! - **Names a PyTorch process shared** carry the socket of its `torch_shm_manager` as manager
//!   handle; opening one speaks that manager's protocol (`AllocInfo` records, see the
//!   `torch_manager` module) exactly as a PyTorch consumer does: register before mapping,
//!   deregister after closing. PyTorch's manager keeps the name until all its clients are gone.
//!
//! # PyTorch opening tensormem's names
//!
//! [`FilenameHandle::manager_handle`] is empty for names tensormem created: tensormem's daemon
//! speaks its own protocol (per-client holds, release and forget requests, uid checks), which
//! PyTorch's client cannot talk to, and tensormem does not start `torch_shm_manager` (a Rust
//! deployment has no PyTorch installation to take it from). Given an empty handle, PyTorch's
//! `_new_shared_filename_cpu(b"", name, size)` starts a manager of its own and registers the
//! name there, which works. One consequence to plan for: tensormem's daemon does not know about
//! PyTorch's users of a name, so when the last tensormem process holding it exits, the daemon
//! unlinks it, and a PyTorch process whose close later brings the count to zero fails to unlink
//! it ("could not unlink the shared memory file"). Keep a tensormem process holding the storage
//! until PyTorch is done with it, or share with PyTorch by descriptor.

use crate::copy::copy_host;
use crate::error::{Error, Result};
pub use crate::owner::named::FilenameHandle;
use crate::owner::named::NamedRegion;
use crate::owner::Owner;
use crate::storage::Storage;

#[cfg_attr(docsrs, doc(cfg(feature = "manager")))]
impl Storage {
    /// A new host storage of `size` zeroed bytes shared by name (PyTorch:
    /// `UntypedStorage._new_using_filename_cpu`).
    ///
    /// # Errors
    ///
    /// [`Error::Empty`] for `size == 0`; [`Error::Shm`] when the manager daemon cannot be
    /// reached or the object cannot be made.
    pub fn new_shared_filename_storage(size: u64) -> Result<Storage> {
        if size == 0 {
            return Err(Error::Empty {
                op: "new_shared_filename_storage",
            });
        }
        let named = NamedRegion::create(size)?;
        Ok(Self::with_owner(size as usize, Owner::Filename(named)))
    }

    /// Shares the storage by name (PyTorch: `_share_filename_cpu_`): unless it already is
    /// shared by name, its bytes move into a fresh refcounted, manager-held shm object (for
    /// every clone); returns what a consumer needs to open it.
    ///
    /// # Errors
    ///
    /// [`Error::WrongDevice`] for CUDA storages, [`Error::Empty`] for zero bytes,
    /// [`Error::Shm`] when the manager daemon cannot be reached or the object cannot be made
    /// (the storage is left as it was).
    pub fn share_filename(&self) -> Result<FilenameHandle> {
        let mut owner = self.owner_mut();
        owner.require_host("share_filename")?;
        if let Owner::Filename(named) = &*owner {
            return Ok(self.filename_handle(named));
        }
        if self.nbytes() == 0 {
            return Err(Error::Empty {
                op: "share_filename",
            });
        }
        let mut named = NamedRegion::create(self.nbytes() as u64)?;
        copy_host(&owner, named.mapping_mut(), self.nbytes())?;
        let handle = self.filename_handle(&named);
        tracing::debug!(name = %handle.name, size = handle.size, "storage moved into a named region");
        *owner = Owner::Filename(named);
        Ok(handle)
    }

    fn filename_handle(&self, named: &NamedRegion) -> FilenameHandle {
        FilenameHandle {
            manager_handle: named.manager_handle.clone(),
            name: named.name().clone(),
            size: self.nbytes() as u64,
        }
    }

    /// Opens a storage shared by name (PyTorch: `_new_shared_filename_cpu`): maps `size` bytes
    /// after the header, adds one to the count and registers this process as a holder.
    ///
    /// # Errors
    ///
    /// [`Error::Empty`] for size 0; [`Error::Shm`] wrapping `NotFound` (no such name, or its
    /// last user released it), `TooSmall` (the object holds fewer bytes than `size`),
    /// `RefcountGone`, `ForeignOwner`, `InvalidName`, or a manager failure.
    pub fn new_shared_filename(handle: &FilenameHandle) -> Result<Storage> {
        let named = NamedRegion::open(handle)?;
        tracing::debug!(name = %handle.name, size = handle.size, "opened a storage shared by name");
        Ok(Self::with_owner(
            handle.size as usize,
            Owner::Filename(named),
        ))
    }

    /// Adds one to the shared refcount of a storage shared by name (PyTorch: `_shared_incref`),
    /// so the name outlives every mapping until a matching [`shared_decref`](Self::shared_decref).
    /// Does nothing for other storages, as in PyTorch.
    ///
    /// # Errors
    ///
    /// [`Error::Shm`] when the name cannot be mapped any more (it was unlinked).
    pub fn shared_incref(&self) -> Result<()> {
        if let Owner::Filename(named) = &*self.owner() {
            let count = named.incref()?;
            tracing::trace!(name = %named.name(), count, "shared_incref");
        }
        Ok(())
    }

    /// Subtracts one from the shared refcount (PyTorch: `_shared_decref`, which the receiver
    /// calls after opening a name the sender increfed). Does nothing for other storages.
    ///
    /// # Errors
    ///
    /// [`Error::RefcountUnderflow`] when only this process's own mapping still counts (more
    /// decrefs than increfs); [`Error::Shm`] when the name cannot be mapped any more.
    pub fn shared_decref(&self) -> Result<()> {
        if let Owner::Filename(named) = &*self.owner() {
            let count = named.decref()?;
            tracing::trace!(name = %named.name(), count, "shared_decref");
        }
        Ok(())
    }

    /// The shared refcount of a storage shared by name (a snapshot; other processes change it).
    pub fn shared_refcount(&self) -> Option<i32> {
        match &*self.owner() {
            Owner::Filename(named) => Some(named.refcount()),
            _ => None,
        }
    }
}
