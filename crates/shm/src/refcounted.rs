//! Refcounted named regions, laid out exactly like PyTorch's `RefcountedMapAllocator`.
//!
//! ```text
//! offset 0        4                         64                          64 + len
//!        | refcount (atomic i32) | padding  | data ...                  |
//! ```
//!
//! The object is a POSIX shared memory object of `64 + len` bytes. Its creator sets the refcount
//! to 1; every process that opens it adds 1; every close subtracts 1, and the close that brings it
//! to 0 unlinks the name. A PyTorch process that opens the same name with
//! `RefcountedMapAllocator` sees the same counter and the same data (PyTorch's CUDA IPC
//! ref-counter files are such regions whose data is an array of `int64` counters).
//!
//! The refcount is a native-endian `i32` updated with atomic read-modify-write instructions, as
//! `std::atomic<int>` is; the header is 64 bytes (`TH_ALLOC_ALIGNMENT`) so the data stays
//! cache-line aligned.
//!
//! Unlike PyTorch, opening checks the count it found: a count of 0 or less means the last user
//! is tearing the region down (or its creator has not initialised it yet), and the open fails with
//! [`Error::RefcountGone`] instead of resurrecting a region whose name is about to disappear.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicI32, Ordering};

use crate::error::{Error, Result};
use crate::mapping::{Access, Mapping};
use crate::name::ShmName;
use crate::object::{self, CreateMode};
use crate::region::{MapOptions, SharedRegion};

/// Bytes before the data in a refcounted region (PyTorch's `map_alloc_alignment`).
pub const REFCOUNT_HEADER_LEN: usize = 64;

/// The header of a refcounted region, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RefcountHeader {
    /// How many mappings (across all processes) hold the region.
    pub refcount: i32,
}

impl RefcountHeader {
    /// The 64 header bytes: the refcount in native byte order, then zeros.
    pub fn encode(&self) -> [u8; REFCOUNT_HEADER_LEN] {
        let mut bytes = [0u8; REFCOUNT_HEADER_LEN];
        bytes[..4].copy_from_slice(&self.refcount.to_ne_bytes());
        bytes
    }

    /// Reads a header from the first 64 bytes of `bytes` (the padding is ignored, as PyTorch does).
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if `bytes` is shorter than [`REFCOUNT_HEADER_LEN`].
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        match bytes.get(..REFCOUNT_HEADER_LEN) {
            Some(header) => {
                let mut refcount = [0u8; 4];
                refcount.copy_from_slice(&header[..4]);
                Ok(Self {
                    refcount: i32::from_ne_bytes(refcount),
                })
            }
            None => Err(Error::OutOfBounds {
                offset: 0,
                len: REFCOUNT_HEADER_LEN,
                region_len: bytes.len(),
            }),
        }
    }
}

/// A named shared region whose users are counted in its header; the last one to close it unlinks
/// the name (PyTorch's `RefcountedMapAllocator`).
///
/// Dereferences to the [`Mapping`] of the data bytes (the header is not part of them).
///
/// ```
/// use tensormem_shm::{NameGenerator, RefcountedRegion};
///
/// let name = NameGenerator::default().next_name();
/// let mut first = RefcountedRegion::create(&name, 1024)?;
/// first.write_at(0, &[42])?;
/// let second = RefcountedRegion::open(&name)?; // normally in another process
/// assert_eq!(first.refcount(), 2);
/// assert_eq!(second.read_volatile(0)?, 42);
/// assert!(!second.close()?); // 2 -> 1: the name stays
/// assert!(first.close()?); // 1 -> 0: unlinked
/// assert!(!name.path().exists());
/// # Ok::<(), tensormem_shm::Error>(())
/// ```
pub struct RefcountedRegion {
    /// The mapping of header + data; its exposed bytes start after the header. `None` once closed.
    region: Option<SharedRegion>,
    name: ShmName,
}

impl RefcountedRegion {
    /// Creates the region `name` with `len` data bytes (exclusively: the name must be free) and a
    /// refcount of 1 (PyTorch: `ALLOCATOR_MAPPED_SHAREDMEM | ALLOCATOR_MAPPED_EXCLUSIVE`).
    ///
    /// # Errors
    ///
    /// [`Error::AlreadyExists`], [`Error::InvalidSize`], and the errors of
    /// [`MapOptions::map_shm`].
    pub fn create(name: &ShmName, len: u64) -> Result<Self> {
        let region = MapOptions::new()
            .create(CreateMode::CreateExclusive)
            .len(len)
            .map_named(name, REFCOUNT_HEADER_LEN)?;
        // The object was just sized by ftruncate, so the counter reads 0 and adding 1 stores 1.
        // Adding (rather than storing, as PyTorch does) keeps the count right if an early opener
        // incremented and then backed off in between.
        counter(&region).fetch_add(1, Ordering::AcqRel);
        tracing::debug!(name = %name, len, "created refcounted region");
        Ok(Self {
            region: Some(region),
            name: name.clone(),
        })
    }

    /// Opens the existing region `name`, mapping all its data, and adds 1 to its refcount
    /// (PyTorch: `ALLOCATOR_MAPPED_SHAREDMEM | ALLOCATOR_MAPPED_NOCREATE`).
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`], [`Error::RefcountGone`], [`Error::ForeignOwner`], [`Error::TooSmall`]
    /// (an object without room for the header and one byte), and the errors of
    /// [`MapOptions::map_shm`].
    pub fn open(name: &ShmName) -> Result<Self> {
        Self::open_with(name, MapOptions::new())
    }

    /// [`open`](Self::open) with options: `len` (data bytes to map; the object must hold at least
    /// that many after the header), `allow_foreign_owner`, `populate` and `huge_pages` are
    /// honoured; the region is always opened read-write without creating it, and its fd is not
    /// kept.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open).
    pub fn open_with(name: &ShmName, options: MapOptions) -> Result<Self> {
        let region = options
            .create(CreateMode::OpenExisting)
            .access(Access::ReadWrite)
            .keep_fd(false)
            .unlink_after_map(false)
            .map_named(name, REFCOUNT_HEADER_LEN)?;
        // The counter is an atomic in a page a peer could have truncated away: check first (a
        // truncation in between still faults; see the crate docs).
        region.mapping().probe_start(REFCOUNT_HEADER_LEN)?;
        let refcount = counter(&region);
        let before = refcount.fetch_add(1, Ordering::AcqRel);
        if before <= 0 {
            refcount.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::RefcountGone {
                object: name.describe(),
                refcount: before,
            });
        }
        tracing::debug!(name = %name, refcount = before + 1, "attached refcounted region");
        Ok(Self {
            region: Some(region),
            name: name.clone(),
        })
    }

    /// The region's name.
    pub fn name(&self) -> &ShmName {
        &self.name
    }

    /// The current refcount (a snapshot: other processes may change it at any time); 0 when a
    /// peer truncated the header away.
    pub fn refcount(&self) -> i32 {
        let region = self.live();
        if region.mapping().probe_start(REFCOUNT_HEADER_LEN).is_err() {
            return 0;
        }
        counter(region).load(Ordering::Acquire)
    }

    /// Drops this process's reference now and reports whether it was the last, in which case the
    /// name has been unlinked. Dropping does the same but can only log failures.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] if the count reached 0 but the name was already gone (someone unlinked
    /// it behind the region's back); [`Error::Truncated`] if a peer truncated the object below
    /// its header (nothing left to decrement). The mapping is released regardless.
    pub fn close(mut self) -> Result<bool> {
        self.release()
    }

    fn release(&mut self) -> Result<bool> {
        let Some(region) = self.region.take() else {
            return Ok(false);
        };
        // A peer truncated the header away: there is no count left to decrement (touching it
        // would raise SIGBUS), so only unmap.
        region.mapping().probe_start(REFCOUNT_HEADER_LEN)?;
        let before = counter(&region).fetch_sub(1, Ordering::AcqRel);
        drop(region);
        if before == 1 {
            object::unlink_shm(&self.name)?;
            tracing::debug!(name = %self.name, "last user closed refcounted region; unlinked");
            Ok(true)
        } else {
            tracing::trace!(name = %self.name, refcount = before - 1, "closed refcounted region");
            Ok(false)
        }
    }

    fn live(&self) -> &SharedRegion {
        // Invariant: `region` is `Some` until `release`, which only `close(self)` and `Drop` call.
        self.region
            .as_ref()
            .expect("a RefcountedRegion is live until closed")
    }
}

/// The refcount in a mapped refcounted region's header.
fn counter(region: &SharedRegion) -> &AtomicI32 {
    let map = region.mapping();
    debug_assert!(map.map_len() >= REFCOUNT_HEADER_LEN);
    // SAFETY: the mapping is read-write (enforced by `map_named`'s callers here), page aligned
    // (so aligned for i32), at least REFCOUNT_HEADER_LEN bytes long, and outlives the borrow.
    // Other processes update the word only through atomic instructions.
    unsafe { &*map.base_ptr().cast::<AtomicI32>() }
}

impl Deref for RefcountedRegion {
    type Target = Mapping;

    fn deref(&self) -> &Mapping {
        self.live().mapping()
    }
}

impl DerefMut for RefcountedRegion {
    fn deref_mut(&mut self) -> &mut Mapping {
        self.region
            .as_mut()
            .expect("a RefcountedRegion is live until closed")
            .mapping_mut()
    }
}

impl Drop for RefcountedRegion {
    fn drop(&mut self) {
        if let Err(err) = self.release() {
            tracing::error!(name = %self.name, error = %err, "closing refcounted region failed");
        }
    }
}

impl fmt::Debug for RefcountedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RefcountedRegion")
            .field("name", &self.name)
            .field("region", &self.region)
            .finish()
    }
}
