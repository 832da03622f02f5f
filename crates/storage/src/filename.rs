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

use std::fmt;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

use tensormem_shm::manager::{Manager, ManagerError};
use tensormem_shm::{MapOptions, Mapping, NameGenerator, RefcountedRegion, SharedRegion, ShmName};

use crate::error::{Error, Result};
use crate::fd::check_size;
use crate::owner::Owner;
use crate::storage::Storage;
use crate::torch_manager::TorchManager;

/// What a consumer needs to open a storage shared by name: PyTorch's
/// `(manager_handle, storage_handle, size)` tuple from `_share_filename_cpu_()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilenameHandle {
    /// PyTorch's manager handle: the socket of the `torch_shm_manager` the sharer registered
    /// with. Empty for storages tensormem created (they are registered with tensormem's own
    /// daemon, which PyTorch cannot talk to; PyTorch then starts its own manager). Passed on
    /// unchanged when a storage opened from a PyTorch tuple is shared again.
    pub manager_handle: Vec<u8>,
    /// The shm object's name.
    pub name: ShmName,
    /// Bytes of the storage (the object holds 64 more: the refcount header).
    pub size: u64,
}

impl FilenameHandle {
    /// The handle from the three items of PyTorch's tuple (bytes, bytes, int).
    ///
    /// # Errors
    ///
    /// [`Error::Shm`] (`InvalidName`) when `storage_handle` is not a valid shm name.
    pub fn from_torch(manager_handle: &[u8], storage_handle: &[u8], size: u64) -> Result<Self> {
        Ok(Self {
            manager_handle: manager_handle.to_vec(),
            name: ShmName::from_bytes(storage_handle)?,
            size,
        })
    }
}

/// Who keeps a name from leaking when its users die.
#[derive(Debug)]
enum Holder {
    /// tensormem's manager daemon (names tensormem created, or opened from a tensormem handle).
    Tensormem(Arc<Manager>),
    /// PyTorch's `torch_shm_manager` named by the tuple (names a PyTorch process shared).
    Torch(Arc<TorchManager>),
    /// Nobody: the name was unlinked before this process could register it.
    Unregistered,
}

/// A refcounted named region held at a manager (PyTorch's `THManagedMapAllocator`).
pub(crate) struct NamedRegion {
    /// The region; `None` only while dropping.
    region: Option<RefcountedRegion>,
    /// Where the name is registered.
    holder: Holder,
    /// The manager handle to hand on when sharing again.
    manager_handle: Vec<u8>,
    /// A second mapping of the object's first bytes, made on the first incref/decref, through
    /// which the count is adjusted by hand.
    header: OnceLock<SharedRegion>,
}

impl NamedRegion {
    /// Creates a fresh name of `size` data bytes with a refcount of 1, registered before it
    /// exists (so a crash at any point leaks nothing).
    pub(crate) fn create(size: u64) -> Result<Self> {
        check_size(size, "share_filename")?;
        let manager = Manager::global().map_err(tensormem_shm::Error::from)?;
        let name = NameGenerator::default().next_name();
        manager
            .register_new(name.as_str())
            .map_err(tensormem_shm::Error::from)?;
        match RefcountedRegion::create(&name, size) {
            Ok(region) => Ok(Self::held(region, Holder::Tensormem(manager), Vec::new())),
            Err(err) => {
                if matches!(err, tensormem_shm::Error::AlreadyExists { .. }) {
                    // Not ours: drop the registration without unlinking it.
                    let _ = manager.forget(name.as_str());
                } else if let Err(e) = manager.release(name.as_str()) {
                    tracing::warn!(name = %name, error = %e, "cannot release a failed creation");
                }
                Err(err.into())
            }
        }
    }

    /// Opens the name of `handle` and registers this process as a holder: with tensormem's
    /// daemon for tensormem handles (empty manager handle), with the PyTorch manager the handle
    /// names otherwise.
    pub(crate) fn open(handle: &FilenameHandle) -> Result<Self> {
        if handle.size == 0 {
            return Err(Error::Empty {
                op: "new_shared_filename",
            });
        }
        check_size(handle.size, "new_shared_filename")?;
        let name = &handle.name;
        let options = MapOptions::new().len(handle.size);
        if !handle.manager_handle.is_empty() {
            // PyTorch's order: register with its manager, then map.
            let torch = TorchManager::for_handle(&handle.manager_handle)?;
            torch.register(name)?;
            return match RefcountedRegion::open_with(name, options) {
                Ok(region) => Ok(Self::held(
                    region,
                    Holder::Torch(torch),
                    handle.manager_handle.clone(),
                )),
                Err(err) => {
                    let _ = torch.deregister(name);
                    Err(err.into())
                }
            };
        }
        let manager = Manager::global().map_err(tensormem_shm::Error::from)?;
        // Map (and count) first: a failed open then leaves no registration behind, and the
        // registration never makes the daemon unlink an object this process did not join.
        let region = RefcountedRegion::open_with(name, options)?;
        let holder = match manager.register_existing(name.as_str()) {
            Ok(()) => Holder::Tensormem(manager),
            Err(ManagerError::Refused { .. }) => {
                tracing::warn!(name = %name, "name unlinked while opening; the mapping stays valid");
                Holder::Unregistered
            }
            Err(e) => return Err(Error::Shm(e.into())),
        };
        Ok(Self::held(region, holder, Vec::new()))
    }

    fn held(region: RefcountedRegion, holder: Holder, manager_handle: Vec<u8>) -> Self {
        Self {
            region: Some(region),
            holder,
            manager_handle,
            header: OnceLock::new(),
        }
    }

    fn live(&self) -> &RefcountedRegion {
        // Invariant: `region` is `Some` until `Drop` takes it.
        self.region
            .as_ref()
            .expect("a NamedRegion keeps its region until dropped")
    }

    /// The name.
    pub(crate) fn name(&self) -> &ShmName {
        self.live().name()
    }

    /// The data bytes.
    pub(crate) fn mapping(&self) -> &Mapping {
        self.live()
    }

    /// The data bytes, writable.
    pub(crate) fn mapping_mut(&mut self) -> &mut Mapping {
        self.region
            .as_mut()
            .expect("a NamedRegion keeps its region until dropped")
    }

    /// The current count (a snapshot).
    pub(crate) fn refcount(&self) -> i32 {
        self.live().refcount()
    }

    /// The count word, through a mapping of the header.
    fn counter(&self) -> Result<&AtomicI32> {
        let header = match self.header.get() {
            Some(header) => header,
            None => {
                // The object holds the 64-byte header and data; map its first 4 bytes.
                let mapped = MapOptions::new().len(4).map_shm(self.name())?;
                self.header.get_or_init(|| mapped)
            }
        };
        Ok(header.atomic::<AtomicI32>(0)?)
    }

    /// Adds one to the count.
    pub(crate) fn incref(&self) -> Result<i32> {
        Ok(self.counter()?.fetch_add(1, Ordering::AcqRel) + 1)
    }

    /// Subtracts one from the count, refusing to take it below the one this mapping owns.
    pub(crate) fn decref(&self) -> Result<i32> {
        let counter = self.counter()?;
        let mut current = counter.load(Ordering::Acquire);
        loop {
            if current <= 1 {
                return Err(Error::RefcountUnderflow {
                    object: format!("shm {:?}", self.name().as_str()),
                    refcount: current,
                });
            }
            match counter.compare_exchange_weak(
                current,
                current - 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(current - 1),
                Err(found) => current = found,
            }
        }
    }
}

impl Drop for NamedRegion {
    fn drop(&mut self) {
        self.header.take();
        let Some(region) = self.region.take() else {
            return;
        };
        let name = region.name().clone();
        let unlinked = match region.close() {
            Ok(last) => last,
            // Someone unlinked it already (PyTorch's manager does when its clients are gone).
            Err(tensormem_shm::Error::NotFound { .. }) => true,
            Err(e) => {
                tracing::error!(name = %name, error = %e, "closing a named storage failed");
                false
            }
        };
        match &self.holder {
            Holder::Tensormem(manager) if unlinked => {
                if let Err(e) = manager.forget(name.as_str()) {
                    tracing::warn!(name = %name, error = %e, "cannot tell the shm manager");
                }
            }
            // Others still count: keep the hold, so the daemon unlinks the name only once no
            // live process holds it (see the module docs).
            Holder::Tensormem(_) => {
                tracing::trace!(name = %name, "named storage closed; the name lives on");
            }
            Holder::Torch(torch) => {
                if let Err(e) = torch.deregister(&name) {
                    tracing::warn!(name = %name, error = %e, "cannot tell torch_shm_manager");
                }
            }
            Holder::Unregistered => {}
        }
    }
}

impl fmt::Debug for NamedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NamedRegion")
            .field("region", &self.region)
            .field("holder", &self.holder)
            .field(
                "manager_handle",
                &String::from_utf8_lossy(&self.manager_handle),
            )
            .finish()
    }
}

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
        crate::copy::copy_host(&owner, named.mapping_mut(), self.nbytes())?;
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
