//! [`NamedRegion`]: the owner of a storage shared by name (PyTorch's `THManagedMapAllocator`), a
//! refcounted named region held at a manager, and [`FilenameHandle`], what a consumer needs to
//! open one. Sharing by name itself is `crate::filename`'s (see its module docs for who removes
//! the name).

use std::fmt;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

use tensormem_shm::manager::{Manager, ManagerError};
use tensormem_shm::{MapOptions, Mapping, NameGenerator, RefcountedRegion, SharedRegion, ShmName};

use crate::error::{check_size, Error, Result};
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
    pub(crate) manager_handle: Vec<u8>,
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
