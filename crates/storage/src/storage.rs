//! [`Storage`] (PyTorch's `UntypedStorage` / `c10::StorageImpl`) and [`WeakStorage`].

use std::fmt;
use std::sync::{Arc, Weak};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use tensormem_shm::{SharedRegion, ShmName};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::owner::{Owner, StorageKind};

/// A fixed number of bytes on a device, with a typed owner that says how they are shared.
///
/// Cloning a `Storage` shares it (PyTorch's `intrusive_ptr<StorageImpl>`): every clone sees the
/// same bytes, and an operation that moves the bytes into shared memory
/// ([`share_memory_`](Self::share_memory_), [`share_fd`](Self::share_fd),
/// `share_filename` (feature `manager`)) moves them for every clone at once.
/// [`weak_ref`](Self::weak_ref) gives a [`WeakStorage`] that does not keep the bytes alive.
///
/// The size never changes (PyTorch's shared storages are not resizable either).
///
/// # Reaching the bytes
///
/// Shared bytes can be written by other processes at any time, so the safe access path copies:
/// [`read_at`](Self::read_at), [`write_at`](Self::write_at), [`to_vec`](Self::to_vec),
/// [`fill`](Self::fill). They take a lock of this storage (shared for reads, exclusive for
/// writes) for the duration of the copy; the lock orders accesses of this process only.
#[derive(Clone)]
pub struct Storage {
    inner: Arc<Inner>,
}

/// The shared state of all clones of one storage.
pub(crate) struct Inner {
    /// Bytes in the storage; fixed for its life.
    nbytes: usize,
    /// Who owns the bytes. Swapped (never shrunk or grown) by the sharing operations.
    owner: RwLock<Owner>,
}

/// `Storage` is `Send + Sync`: every owner is (`Vec<u8>`; shm regions, whose mappings are
/// `Send + Sync` and reached only through copies and atomics; manager handles), and all mutation
/// goes through the `RwLock`.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Storage>();
    assert_send_sync::<WeakStorage>();
};

impl Storage {
    /// A storage of `nbytes` zeroed bytes of private host memory (PyTorch:
    /// `torch.UntypedStorage(nbytes)`).
    pub fn new(nbytes: usize) -> Self {
        Self::from_vec(vec![0; nbytes])
    }

    /// A private host storage holding `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let nbytes = bytes.len();
        Self::with_owner(nbytes, Owner::Private(bytes))
    }

    /// A private host storage holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self::from_vec(bytes.to_vec())
    }

    /// Wraps an owner whose bytes number `nbytes`.
    pub(crate) fn with_owner(nbytes: usize, owner: Owner) -> Self {
        Self {
            inner: Arc::new(Inner {
                nbytes,
                owner: RwLock::new(owner),
            }),
        }
    }

    /// Wraps a shared region: an fd-backed storage (memfd, shm object or received fd).
    pub(crate) fn from_fd_region(region: SharedRegion) -> Self {
        Self::with_owner(region.len(), Owner::Fd(region))
    }

    /// Bytes in the storage (PyTorch: `nbytes()`).
    pub fn nbytes(&self) -> usize {
        self.inner.nbytes
    }

    /// Where the bytes live.
    pub fn device(&self) -> Device {
        self.owner().device()
    }

    /// What kind of memory holds the bytes.
    pub fn kind(&self) -> StorageKind {
        self.owner().kind()
    }

    /// Whether another process can reach the bytes (PyTorch: `is_shared()`): CUDA storages and
    /// host storages in shared memory (fd-backed, file-backed or named).
    pub fn is_shared(&self) -> bool {
        self.kind().is_shared()
    }

    /// The shm name of a storage shared by name (`share_filename`, feature `manager`).
    pub fn shared_name(&self) -> Option<ShmName> {
        self.owner().shm_name().cloned()
    }

    /// Whether `self` and `other` are the same storage (clones of one another).
    pub fn ptr_eq(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// How many `Storage` handles share these bytes (PyTorch: `use_count()`).
    pub fn use_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// A weak reference: it does not keep the bytes alive (PyTorch: `_weak_ref`).
    pub fn weak_ref(&self) -> WeakStorage {
        WeakStorage {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// Copies `buf.len()` bytes starting at `offset` into `buf`.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if the range does not fit; CUDA errors for device storages.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len())?;
        self.owner().read_at(offset, buf)
    }

    /// Copies `data` into the storage at `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if the range does not fit; [`Error::Shm`] for a read-only mapping.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        self.owner_mut().write_at(offset, data)
    }

    /// A copy of all bytes.
    ///
    /// # Errors
    ///
    /// As [`read_at`](Self::read_at).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut bytes = vec![0; self.nbytes()];
        self.read_at(0, &mut bytes)?;
        Ok(bytes)
    }

    /// Sets every byte to `value` (PyTorch: `fill_`).
    ///
    /// # Errors
    ///
    /// As [`write_at`](Self::write_at).
    pub fn fill(&self, value: u8) -> Result<()> {
        self.owner_mut().fill(value)
    }

    /// Gives the storage a descriptor that may be handed out raw: a host owner that is not
    /// fd-backed moves into a new memfd holding the same bytes (PyTorch's `share_fd` rule: a
    /// storage that is not fd-backed, private or named, is moved first), and a pooled one is
    /// detached from its pool (same memory, never reused: a raw descriptor's users cannot be
    /// accounted for). Already fd-backed storages are left alone.
    pub(crate) fn move_to_fd(&self, op: &'static str) -> Result<()> {
        let mut owner = self.owner_mut();
        owner.require_host(op)?;
        if owner.fd_region().is_some() {
            return Ok(());
        }
        if detach_from_pool(&mut owner, op, self.nbytes()) {
            return Ok(());
        }
        if self.nbytes() == 0 {
            return Err(Error::Empty { op });
        }
        let region = match owner.private_bytes() {
            Some(bytes) => SharedRegion::copy_from_bytes(bytes)?,
            None => {
                let mut bytes = vec![0; self.nbytes()];
                owner.read_at(0, &mut bytes)?;
                SharedRegion::copy_from_bytes(&bytes)?
            }
        };
        tracing::debug!(
            op,
            nbytes = self.nbytes(),
            "storage moved into fd-backed shared memory"
        );
        // The old owner (heap bytes, a named region whose hold is released, or a pool lease that
        // goes back to its producer) drops here.
        *owner = Owner::Fd(region);
        Ok(())
    }

    /// Detaches a pooled storage from its pool (see [`move_to_fd`](Self::move_to_fd)); other
    /// owners are left alone.
    pub(crate) fn detach_from_pool(&self, op: &'static str) {
        let mut owner = self.owner_mut();
        detach_from_pool(&mut owner, op, self.nbytes());
    }

    /// Checks that `offset..offset + len` lies inside the storage.
    pub(crate) fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.nbytes() => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                nbytes: self.nbytes(),
            }),
        }
    }

    /// The owner, shared.
    pub(crate) fn owner(&self) -> RwLockReadGuard<'_, Owner> {
        self.inner.owner.read()
    }

    /// The owner, exclusive.
    pub(crate) fn owner_mut(&self) -> RwLockWriteGuard<'_, Owner> {
        self.inner.owner.write()
    }

    /// An address that orders storages for taking two locks without deadlock.
    pub(crate) fn lock_order(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }
}

/// Turns a pooled owner into an fd-backed one over the same memory, taken out of its pool for
/// good; `false` (and nothing done) for other owners.
fn detach_from_pool(owner: &mut Owner, op: &'static str, nbytes: usize) -> bool {
    if !matches!(owner, Owner::Pooled(_)) {
        return false;
    }
    let Owner::Pooled(buffer) = std::mem::replace(owner, Owner::Private(Vec::new())) else {
        unreachable!("matched above")
    };
    tracing::debug!(
        op,
        nbytes,
        "pooled storage detached from its pool: its descriptor is handed out"
    );
    *owner = Owner::Fd(buffer.detach());
    true
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let owner = self.owner();
        f.debug_struct("Storage")
            .field("nbytes", &self.nbytes())
            .field("device", &owner.device())
            .field("kind", &owner.kind())
            .field("name", &owner.shm_name())
            .finish()
    }
}

/// A weak reference to a [`Storage`] (PyTorch's `_weak_ref` / `_new_with_weak_ptr` / `_expired`
/// / `_free_weak_ref`, as a typed handle instead of an integer): it does not keep the bytes
/// alive, and [`upgrade`](Self::upgrade) fails with [`Error::Expired`] once they are gone.
/// Dropping it is `_free_weak_ref`.
#[derive(Clone)]
pub struct WeakStorage {
    inner: Weak<Inner>,
}

impl WeakStorage {
    /// Whether every `Storage` handle is gone (PyTorch: `_expired`).
    pub fn expired(&self) -> bool {
        self.inner.strong_count() == 0
    }

    /// A strong handle again (PyTorch: `_new_with_weak_ptr`).
    ///
    /// # Errors
    ///
    /// [`Error::Expired`] when the storage has been freed.
    pub fn upgrade(&self) -> Result<Storage> {
        self.inner
            .upgrade()
            .map(|inner| Storage { inner })
            .ok_or(Error::Expired)
    }

    /// Whether this weak reference points to `storage`.
    pub fn points_to(&self, storage: &Storage) -> bool {
        std::ptr::eq(self.inner.as_ptr(), Arc::as_ptr(&storage.inner))
    }
}

impl fmt::Debug for WeakStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakStorage")
            .field("expired", &self.expired())
            .finish()
    }
}
