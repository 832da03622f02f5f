//! [`ManagedRegion`]: a named shared region whose name the manager daemon unlinks once every
//! process holding it is gone.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::mapping::{Access, Mapping};
use crate::name::{NameGenerator, ShmName};
use crate::object::CreateMode;
use crate::region::{MapOptions, SharedRegion};

use super::client::Manager;
use super::error::ManagerError;

/// A POSIX shared memory region registered with the manager daemon (PyTorch's `file_system`
/// sharing strategy, where `torch_shm_manager` cleans up after dead processes).
///
/// Creating or opening one makes this process a holder of the name. The name is unlinked when
/// the last holder lets go, whether it [closes](Self::close) the region, drops it, or dies
/// (`kill -9` included: the daemon sees its connection close). Mappings stay valid after the
/// unlink; the memory is freed when the last mapping goes.
///
/// ```no_run
/// use tensormem_shm::manager::ManagedRegion;
///
/// let mut region = ManagedRegion::create(1 << 20)?;
/// region.write_at(0, b"tensor bytes")?;
/// let name = region.name().clone(); // send this to a peer, which calls ManagedRegion::open
/// # let _ = name;
/// # Ok::<(), tensormem_shm::Error>(())
/// ```
pub struct ManagedRegion {
    /// `None` only after `close` took it.
    region: Option<SharedRegion>,
    name: ShmName,
    manager: Arc<Manager>,
    /// Whether this handle still holds the name at the daemon.
    holding: bool,
}

impl ManagedRegion {
    /// Creates a region of `len` bytes under a fresh `/tensormem_<pid>_<random>_<counter>` name,
    /// registered with the process-wide manager ([`Manager::global`], started on demand).
    ///
    /// # Errors
    ///
    /// [`Error::Manager`] when the daemon cannot be reached or started; the errors of
    /// [`MapOptions::map_shm`] for the mapping.
    pub fn create(len: u64) -> Result<Self> {
        Self::create_with(&Manager::global()?, &NameGenerator::default(), len)
    }

    /// Creates a region of `len` bytes named by `names`, registered with `manager`.
    ///
    /// The name is registered before the object exists, so a crash at any point leaks nothing.
    ///
    /// # Errors
    ///
    /// As [`create`](Self::create).
    pub fn create_with(manager: &Arc<Manager>, names: &NameGenerator, len: u64) -> Result<Self> {
        let name = names.next_name();
        manager.register_new(name.as_str())?;
        let mapped = MapOptions::new()
            .create(CreateMode::CreateExclusive)
            .len(len)
            .map_shm(&name);
        match mapped {
            Ok(region) => Ok(Self::held(region, name, manager)),
            Err(err) => {
                // map_shm removed what it created; drop the registration.
                if let Err(e) = manager.release(name.as_str()) {
                    tracing::warn!(name = %name, error = %e, "cannot release a failed creation");
                }
                Err(err)
            }
        }
    }

    /// Opens the existing region `name`, read-write, and registers this process as a holder
    /// with the process-wide manager.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] when no such object exists (or its last holder released it while
    /// this call ran); the errors of [`MapOptions::map_shm`]; [`Error::Manager`] when the
    /// daemon cannot be reached.
    pub fn open(name: &ShmName) -> Result<Self> {
        Self::open_with(&Manager::global()?, name, Access::ReadWrite)
    }

    /// Opens the existing region `name` with `access`, registering with `manager`.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open).
    pub fn open_with(manager: &Arc<Manager>, name: &ShmName, access: Access) -> Result<Self> {
        let region = MapOptions::new().access(access).map_shm(name)?;
        match manager.register_existing(name.as_str()) {
            Ok(()) => Ok(Self::held(region, name.clone(), manager)),
            // Unlinked by its last holder between our open and the registration.
            Err(ManagerError::Refused { .. }) => Err(Error::NotFound {
                object: format!("shm {:?}", name.as_str()),
            }),
            Err(e) => Err(e.into()),
        }
    }

    fn held(region: SharedRegion, name: ShmName, manager: &Arc<Manager>) -> Self {
        tracing::debug!(name = %name, len = region.len(), "managed region held");
        Self {
            region: Some(region),
            name,
            manager: Arc::clone(manager),
            holding: true,
        }
    }

    /// The region's name, to hand to other processes.
    pub fn name(&self) -> &ShmName {
        &self.name
    }

    /// The manager connection this region is registered with.
    pub fn manager(&self) -> &Arc<Manager> {
        &self.manager
    }

    /// The underlying region.
    pub fn region(&self) -> &SharedRegion {
        self.region
            .as_ref()
            .expect("a ManagedRegion keeps its region until close or drop")
    }

    fn region_mut(&mut self) -> &mut SharedRegion {
        self.region
            .as_mut()
            .expect("a ManagedRegion keeps its region until close or drop")
    }

    /// Unlinks the name now (nobody can open it any more; mappings stay valid) and tells the
    /// daemon to forget it for every holder.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] if it was unlinked already; [`Error::Manager`] when the daemon is
    /// gone (the name is unlinked anyway).
    pub fn unlink(&mut self) -> Result<()> {
        self.region_mut().unlink()?;
        self.holding = false;
        self.manager.forget(self.name.as_str())?;
        Ok(())
    }

    /// Unmaps the region and drops this process's hold; returns whether that was the last hold,
    /// so the daemon unlinked the name. Dropping does the same but can only log errors.
    ///
    /// # Errors
    ///
    /// [`Error::Manager`] when the daemon is gone.
    pub fn close(mut self) -> Result<bool> {
        self.region.take();
        self.release()
    }

    fn release(&mut self) -> Result<bool> {
        if !std::mem::take(&mut self.holding) {
            return Ok(false);
        }
        let unlinked = self.manager.release(self.name.as_str())?;
        tracing::debug!(name = %self.name, unlinked, "managed region released");
        Ok(unlinked)
    }
}

impl Drop for ManagedRegion {
    fn drop(&mut self) {
        self.region.take();
        if let Err(e) = self.release() {
            tracing::warn!(
                name = %self.name,
                error = %e,
                "cannot release a managed region; the daemon unlinks it when this process exits"
            );
        }
    }
}

impl Deref for ManagedRegion {
    type Target = Mapping;

    fn deref(&self) -> &Mapping {
        self.region()
    }
}

impl DerefMut for ManagedRegion {
    fn deref_mut(&mut self) -> &mut Mapping {
        self.region_mut()
    }
}

impl fmt::Debug for ManagedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagedRegion")
            .field("name", &self.name)
            .field("region", &self.region)
            .field("holding", &self.holding)
            .field("daemon_pid", &self.manager.daemon_pid())
            .finish()
    }
}
