//! [`SharedRegion`]: a mapped shared object together with what backs it, and [`MapOptions`], the
//! builder that makes one (PyTorch's `MapAllocator` and its flags).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::error::{Error, Result, SizeProblem};
use crate::mapping::{Access, Mapping};
use crate::name::ShmName;
use crate::object::{self, CreateMode};

/// What a [`SharedRegion`] maps.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backing {
    /// A POSIX shared memory object.
    Shm {
        /// Its name.
        name: ShmName,
        /// Whether this process has unlinked the name (the memory lives on while mapped).
        unlinked: bool,
    },
    /// A file.
    File {
        /// Its path.
        path: PathBuf,
        /// Whether this process has removed the path.
        unlinked: bool,
    },
    /// An object reached through a file descriptor (given by the caller or received from a peer).
    Fd {
        /// Whether the object is sealed against shrinking (`F_SEAL_SHRINK`): no process can
        /// truncate it under this mapping. Unsealed objects can be truncated by any process
        /// holding a writable fd, after which touching the lost pages raises SIGBUS.
        sealed: bool,
    },
    /// An anonymous object made by this process (memfd, or an immediately unlinked shm object).
    Anonymous {
        /// Whether the object is sealed against shrinking (`F_SEAL_SHRINK`), so no process holding
        /// its fd can truncate it under a mapping.
        sealed: bool,
    },
}

/// Shared memory mapped into this process: a [`Mapping`] plus, optionally, the descriptor of the
/// object behind it.
///
/// Dereferences to [`Mapping`] for data access (`read_at`, `write_at`, `atomic`, ...). `Drop`
/// unmaps and closes; it never unlinks a name (use [`SharedRegion::unlink`], or a
/// [`RefcountedRegion`](crate::RefcountedRegion) whose last user unlinks it).
pub struct SharedRegion {
    map: Mapping,
    fd: Option<OwnedFd>,
    /// Whether [`take_fd`](Self::take_fd) gave the kept descriptor away (so a send can say so).
    fd_taken: bool,
    backing: Backing,
}

impl SharedRegion {
    pub(crate) fn from_parts(mut map: Mapping, fd: Option<OwnedFd>, backing: Backing) -> Self {
        let truncatable = match backing {
            Backing::Shm { .. } | Backing::File { .. } => true,
            Backing::Fd { sealed } | Backing::Anonymous { sealed } => !sealed,
        };
        map.set_truncatable(truncatable);
        Self {
            map,
            fd,
            fd_taken: false,
            backing,
        }
    }

    /// What the region maps.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// The shared memory name, for regions mapped by name.
    pub fn name(&self) -> Option<&ShmName> {
        match &self.backing {
            Backing::Shm { name, .. } => Some(name),
            _ => None,
        }
    }

    /// The descriptor kept with the mapping (`keep_fd`, anonymous regions, received regions).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(AsFd::as_fd)
    }

    /// Gives up the kept descriptor, leaving the mapping in place. The region cannot be sent
    /// afterwards ([`Error::FdTaken`](crate::Error::FdTaken)); send the descriptor itself with
    /// [`transfer::send_fd`](crate::transfer::send_fd).
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        let fd = self.fd.take();
        self.fd_taken |= fd.is_some();
        fd
    }

    /// The error for a send of this region when it holds no descriptor.
    pub(crate) fn no_fd_error(&self) -> Error {
        if self.fd_taken {
            Error::FdTaken {
                object: self.describe(),
            }
        } else {
            Error::NoFd {
                object: self.describe(),
            }
        }
    }

    /// The underlying mapping.
    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// The underlying mapping, mutably.
    pub fn mapping_mut(&mut self) -> &mut Mapping {
        &mut self.map
    }

    /// The kept fd and the mapping at once (for filling the object through both).
    pub(crate) fn fd_and_mapping_mut(&mut self) -> (Option<BorrowedFd<'_>>, &mut Mapping) {
        (self.fd.as_ref().map(AsFd::as_fd), &mut self.map)
    }

    /// Removes the region's name (`shm_unlink`, or `unlink` for files) while keeping the mapping:
    /// nobody can open it by name any more, and the memory is freed once every mapping and
    /// descriptor of it is gone. Does nothing for anonymous regions or if already unlinked.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] if someone else unlinked the name first.
    pub fn unlink(&mut self) -> Result<()> {
        match &mut self.backing {
            Backing::Shm { name, unlinked } if !*unlinked => {
                object::unlink_shm(name)?;
                *unlinked = true;
            }
            Backing::File { path, unlinked } if !*unlinked => {
                rustix::fs::unlink(path.as_path())
                    .map_err(Error::os("unlink", &object::describe_path(path)))?;
                tracing::debug!(path = %path.display(), "removed shared file");
                *unlinked = true;
            }
            _ => {}
        }
        Ok(())
    }

    /// A description for messages: `shm "/name"`, `file "/path"`, `fd 7`, `anonymous region`.
    pub fn describe(&self) -> String {
        match &self.backing {
            Backing::Shm { name, .. } => name.describe(),
            Backing::File { path, .. } => object::describe_path(path),
            Backing::Fd { .. } | Backing::Anonymous { .. } => match &self.fd {
                Some(fd) => format!("{} ({} bytes)", object::describe_fd(fd), self.len()),
                None => format!("anonymous region of {} bytes", self.len()),
            },
        }
    }
}

/// The descriptor kept with the region, for `fstat`, `send_fd`, `fcntl` and any other API taking
/// `impl AsFd`.
///
/// Regions from [`SharedRegion::create_anonymous`], [`SharedRegion::copy_from_bytes`] and every
/// region mapped with [`MapOptions::keep_fd`]`(true)` (the default for [`MapOptions::map_fd`] and
/// received regions is to close it; ask to keep it) have one. [`SharedRegion::fd`] is the
/// non-panicking form.
///
/// # Panics
///
/// If the region kept no descriptor (mapped with `keep_fd(false)`, or after
/// [`take_fd`](SharedRegion::take_fd)).
impl AsFd for SharedRegion {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self.fd() {
            Some(fd) => fd,
            None => panic!(
                "{} kept no file descriptor; map it with keep_fd(true) or use SharedRegion::fd()",
                self.describe()
            ),
        }
    }
}

impl Deref for SharedRegion {
    type Target = Mapping;

    fn deref(&self) -> &Mapping {
        &self.map
    }
}

impl DerefMut for SharedRegion {
    fn deref_mut(&mut self) -> &mut Mapping {
        &mut self.map
    }
}

impl fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRegion")
            .field("backing", &self.backing)
            .field("fd", &self.fd)
            .field("map", &self.map)
            .finish()
    }
}

/// How to open or create and map a shared object: PyTorch's `MapAllocator` flags as a builder.
///
/// | PyTorch flag | here |
/// | --- | --- |
/// | `ALLOCATOR_MAPPED_SHAREDMEM` | [`map_shm`](Self::map_shm) (vs. [`map_path`](Self::map_path)) |
/// | `ALLOCATOR_MAPPED_SHARED` | always: mappings are `MAP_SHARED`; see [`access`](Self::access) |
/// | `ALLOCATOR_MAPPED_EXCLUSIVE` | [`CreateMode::CreateExclusive`] |
/// | `ALLOCATOR_MAPPED_NOCREATE` | [`CreateMode::OpenExisting`] (the default) |
/// | `ALLOCATOR_MAPPED_KEEPFD` | [`keep_fd`](Self::keep_fd) |
/// | `ALLOCATOR_MAPPED_FROMFD` | [`map_fd`](Self::map_fd) |
/// | `ALLOCATOR_MAPPED_UNLINK` | [`unlink_after_map`](Self::unlink_after_map) |
///
/// ```
/// use tensormem_shm::{CreateMode, MapOptions, NameGenerator};
///
/// let name = NameGenerator::default().next_name();
/// let mut producer = MapOptions::new()
///     .create(CreateMode::CreateExclusive)
///     .len(4096)
///     .map_shm(&name)?;
/// producer.write_at(0, b"hello")?;
///
/// let consumer = MapOptions::new().read_only().map_shm(&name)?; // length from fstat
/// let mut hello = [0u8; 5];
/// consumer.read_at(0, &mut hello)?;
/// assert_eq!(&hello, b"hello");
/// producer.unlink()?;
/// # Ok::<(), tensormem_shm::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct MapOptions {
    create: CreateMode,
    access: Access,
    len: Option<u64>,
    keep_fd: bool,
    unlink_after_map: bool,
    allow_foreign_owner: bool,
    populate: bool,
    huge_pages: bool,
}

impl MapOptions {
    /// Open an existing object read-write, its whole length, closing the fd after mapping.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether to create the object (default [`CreateMode::OpenExisting`]).
    pub fn create(mut self, create: CreateMode) -> Self {
        self.create = create;
        self
    }

    /// Read-write (default) or read-only.
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Shorthand for `access(Access::ReadOnly)`.
    pub fn read_only(self) -> Self {
        self.access(Access::ReadOnly)
    }

    /// Bytes to map. Required when creating; when opening, the object must hold at least this
    /// many bytes ([`Error::TooSmall`] otherwise) and the default is its whole current size.
    pub fn len(mut self, len: u64) -> Self {
        self.len = Some(len);
        self
    }

    /// Keep the object's descriptor open in the region (for sending it to another process).
    pub fn keep_fd(mut self, keep: bool) -> Self {
        self.keep_fd = keep;
        self
    }

    /// Unlink the name right after mapping: the memory stays reachable only through this mapping
    /// and the kept descriptor (PyTorch's fd sharing strategy).
    pub fn unlink_after_map(mut self, unlink: bool) -> Self {
        self.unlink_after_map = unlink;
        self
    }

    /// Accept objects owned by another user. Off by default: mapping memory another user controls
    /// lets that user change (or truncate) what this process reads.
    pub fn allow_foreign_owner(mut self, allow: bool) -> Self {
        self.allow_foreign_owner = allow;
        self
    }

    /// Fault every page in at map time (`MAP_POPULATE`). Off by default: attaching stays an
    /// `mmap` only and pages are faulted on first touch.
    pub fn populate(mut self, populate: bool) -> Self {
        self.populate = populate;
        self
    }

    /// Ask for transparent huge pages (`MADV_HUGEPAGE`); honoured for shared memory only where
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows it.
    pub fn huge_pages(mut self, huge: bool) -> Self {
        self.huge_pages = huge;
        self
    }

    /// Opens or creates the POSIX shared memory object `name` and maps it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSize`] for a zero, missing (when creating) or oversized length;
    /// [`Error::AlreadyExists`] / [`Error::NotFound`] per the create mode;
    /// [`Error::ForeignOwner`], [`Error::WrongKind`], [`Error::TooSmall`] from the attach checks;
    /// [`Error::PermissionDenied`] or [`Error::Os`] from the system calls.
    pub fn map_shm(&self, name: &ShmName) -> Result<SharedRegion> {
        self.map_named(name, 0)
    }

    /// Opens or creates the file at `path` and maps it `MAP_SHARED`.
    ///
    /// # Errors
    ///
    /// As [`map_shm`](Self::map_shm).
    pub fn map_path(&self, path: impl AsRef<Path>) -> Result<SharedRegion> {
        let path = path.as_ref();
        let object = object::describe_path(path);
        let len = self.requested_len(&object, 0)?;
        let fd = object::file_open(path, self.create, self.access)?;
        let created = self.create == CreateMode::CreateExclusive;
        let result = self.size_and_map(&fd, &object, len, 0, created);
        let cleanup = || {
            if created {
                let _ = rustix::fs::unlink(path);
            }
        };
        let map = result.inspect_err(|_| cleanup())?;
        let mut region = SharedRegion::from_parts(
            map,
            self.keep_fd.then_some(fd),
            Backing::File {
                path: path.to_owned(),
                unlinked: false,
            },
        );
        if self.unlink_after_map {
            region.unlink()?;
        }
        Ok(region)
    }

    /// Maps the object behind `fd` (PyTorch's `ALLOCATOR_MAPPED_FROMFD`); the object must exist,
    /// so the create mode is ignored. With [`keep_fd`](Self::keep_fd) the region keeps a
    /// duplicate of `fd` (`F_DUPFD_CLOEXEC`); `fd` itself stays the caller's.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidFd`] for a closed descriptor; [`Error::WrongKind`] unless it refers to a
    /// regular file, memfd or shm object; [`Error::TooSmall`], [`Error::ForeignOwner`],
    /// [`Error::InvalidSize`] as for [`map_shm`](Self::map_shm).
    pub fn map_fd(&self, fd: impl AsFd) -> Result<SharedRegion> {
        let fd = fd.as_fd();
        let object = object::describe_fd(fd);
        let map = self.attach(fd, &object, self.len, 0)?;
        let kept = if self.keep_fd {
            Some(
                rustix::io::fcntl_dupfd_cloexec(fd, 0)
                    .map_err(Error::os("fcntl(F_DUPFD_CLOEXEC)", &object))?,
            )
        } else {
            None
        };
        let sealed = object::is_sealed_against_shrink(fd);
        Ok(SharedRegion::from_parts(map, kept, Backing::Fd { sealed }))
    }

    /// Like [`map_fd`](Self::map_fd) for a descriptor this crate already owns (a received one):
    /// checks and maps it with a data offset of `header` bytes, keeping the fd if asked.
    pub(crate) fn map_owned_fd(
        &self,
        fd: OwnedFd,
        needed: u64,
        header: usize,
    ) -> Result<SharedRegion> {
        let object = object::describe_fd(&fd);
        let map = self.attach(&fd, &object, Some(needed), header)?;
        let sealed = object::is_sealed_against_shrink(&fd);
        Ok(SharedRegion::from_parts(
            map,
            self.keep_fd.then_some(fd),
            Backing::Fd { sealed },
        ))
    }

    /// `map_shm` with a header of `header` bytes before the data (refcounted regions); the length
    /// set with `len` counts data bytes only.
    pub(crate) fn map_named(&self, name: &ShmName, header: usize) -> Result<SharedRegion> {
        let object = name.describe();
        let len = self.requested_len(&object, header)?;
        let fd = object::shm_open(name, self.create, self.access)?;
        let created = self.create == CreateMode::CreateExclusive;
        let map = match self.size_and_map(&fd, &object, len, header, created) {
            Ok(map) => map,
            Err(err) => {
                if created {
                    let _ = object::unlink_shm(name);
                }
                return Err(err);
            }
        };
        if created {
            tracing::debug!(name = %name, len = map.map_len(), "created shared memory object");
        } else {
            tracing::debug!(name = %name, len = map.map_len(), "attached shared memory object");
        }
        let mut region = SharedRegion::from_parts(
            map,
            self.keep_fd.then_some(fd),
            Backing::Shm {
                name: name.clone(),
                unlinked: false,
            },
        );
        if self.unlink_after_map {
            region.unlink()?;
        }
        Ok(region)
    }

    /// The total length to map (header included): required and checked when creating,
    /// optional (`None` = whole object) when opening.
    fn requested_len(&self, object: &str, header: usize) -> Result<Option<u64>> {
        match self.len {
            Some(len) => {
                object::check_len(len, object)?;
                let total = len.saturating_add(header as u64);
                object::check_len(total, object)?;
                Ok(Some(total))
            }
            None if self.create != CreateMode::OpenExisting => Err(Error::InvalidSize {
                object: object.to_owned(),
                len: 0,
                problem: SizeProblem::Missing,
            }),
            None => Ok(None),
        }
    }

    /// Sizes a just-opened object as the create mode asks, then attaches it.
    fn size_and_map(
        &self,
        fd: &OwnedFd,
        object: &str,
        len: Option<u64>,
        header: usize,
        created: bool,
    ) -> Result<Mapping> {
        if let Some(len) = len {
            let grow = match self.create {
                CreateMode::CreateExclusive => true,
                CreateMode::OpenOrCreate => {
                    // Kind and owner first: never resize an object we would refuse to map.
                    let info = object::inspect(fd, object)?;
                    object::check_info(info, object, 0, self.allow_foreign_owner)?;
                    self.access.is_writable() && info.size < len
                }
                CreateMode::OpenExisting => false,
            };
            if grow {
                rustix::fs::ftruncate(fd, len).map_err(Error::os("ftruncate", object))?;
            }
        }
        // An exclusively created object is ours; skip the owner check for it only.
        let len = len.map(|total| total - header as u64);
        let saved = self.allow_foreign_owner;
        let options = Self {
            allow_foreign_owner: saved || created,
            ..self.clone()
        };
        options.attach(fd, object, len, header)
    }

    /// Checks `fd` (kind, owner, size) and maps `header + len` bytes of it (`len` = `None`: the
    /// whole object).
    fn attach(
        &self,
        fd: impl AsFd,
        object: &str,
        len: Option<u64>,
        header: usize,
    ) -> Result<Mapping> {
        let fd = fd.as_fd();
        let needed = match len {
            Some(len) => len.saturating_add(header as u64),
            None => header as u64 + 1,
        };
        let size = object::check_attachable(fd, object, needed, self.allow_foreign_owner)?;
        let total = object::check_len(len.map_or(size, |_| needed), object)?;
        let map = Mapping::map(fd, total, header, self.access, self.populate)
            .map_err(Error::os("mmap", object))?;
        if self.huge_pages {
            object::advise_huge_pages(&map);
        }
        Ok(map)
    }
}
