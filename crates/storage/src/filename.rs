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
//! The manager daemon (`tensormem_shm::manager`) is the backstop for processes that die without
//! closing: each process registers every name it creates or opens. When a process closes a
//! storage and the count reaches zero, it unlinks the name and tells the daemon to forget it;
//! when the count stays above zero (others, or a name in transit, still count), the process keeps
//! its hold until it exits, and the daemon unlinks the name once no live process holds it. So a
//! name shared by a process that exits survives while another live process holds it (PyTorch:
//! while `torch_shm_manager` has clients), and nothing outlives all of them.

use std::fmt;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

use tensormem_shm::manager::{Manager, ManagerError};
use tensormem_shm::{MapOptions, Mapping, NameGenerator, RefcountedRegion, ShmName, SharedRegion};

use crate::error::{Error, Result};
use crate::fd::check_size;
use crate::owner::Owner;
use crate::storage::Storage;

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

/// A refcounted named region held at the manager daemon (PyTorch's `THManagedMapAllocator`).
pub(crate) struct NamedRegion {
    /// The region; `None` only while dropping.
    region: Option<RefcountedRegion>,
    /// The connection the name is registered with.
    manager: Arc<Manager>,
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
            Ok(region) => Ok(Self::held(region, manager, Vec::new())),
            Err(err) => {
                release_quietly(&manager, &name);
                Err(err.into())
            }
        }
    }

    /// Opens the name of `handle` (registered first: the daemon refuses names that are gone).
    pub(crate) fn open(handle: &FilenameHandle) -> Result<Self> {
        if handle.size == 0 {
            return Err(Error::Empty {
                op: "new_shared_filename",
            });
        }
        check_size(handle.size, "new_shared_filename")?;
        let manager = Manager::global().map_err(tensormem_shm::Error::from)?;
        let name = &handle.name;
        match manager.register_existing(name.as_str()) {
            Ok(()) => {}
            Err(ManagerError::Refused { .. }) => {
                return Err(Error::Shm(tensormem_shm::Error::NotFound {
                    object: format!("shm {:?}", name.as_str()),
                }))
            }
            Err(e) => return Err(Error::Shm(e.into())),
        }
        match RefcountedRegion::open_with(name, MapOptions::new().len(handle.size)) {
            Ok(region) => Ok(Self::held(region, manager, handle.manager_handle.clone())),
            Err(err) => {
                release_quietly(&manager, name);
                Err(err.into())
            }
        }
    }

    fn held(region: RefcountedRegion, manager: Arc<Manager>, manager_handle: Vec<u8>) -> Self {
        Self {
            region: Some(region),
            manager,
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

/// Drops a registration after a failed create/open; the daemon unlinks at exit anyway.
fn release_quietly(manager: &Manager, name: &ShmName) {
    if let Err(e) = manager.release(name.as_str()) {
        tracing::warn!(name = %name, error = %e, "cannot release a failed registration");
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
        if unlinked {
            if let Err(e) = self.manager.forget(name.as_str()) {
                tracing::warn!(name = %name, error = %e, "cannot tell the shm manager");
            }
        } else {
            // Others still count: keep the hold, so the daemon unlinks the name only once no
            // live process holds it (see the module docs).
            tracing::trace!(name = %name, "named storage closed; the name lives on");
        }
    }
}

impl fmt::Debug for NamedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NamedRegion")
            .field("region", &self.region)
            .field("manager_handle", &String::from_utf8_lossy(&self.manager_handle))
            .finish()
    }
}

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
        Ok(Self::with_owner(handle.size as usize, Owner::Filename(named)))
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
