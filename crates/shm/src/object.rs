//! The objects behind mappings: opening POSIX shared memory objects and files, unlinking them,
//! and checking (with `fstat`) that a descriptor is safe to map.

use std::path::Path;

use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{FileType, Mode, OFlags};

use crate::error::{Error, ObjectKind, Result};
use crate::mapping::Access;
use crate::name::ShmName;

/// How to treat an object that does or does not exist yet (PyTorch's `ALLOCATOR_MAPPED_EXCLUSIVE`
/// and `ALLOCATOR_MAPPED_NOCREATE` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CreateMode {
    /// Open an existing object; fail with [`Error::NotFound`] if there is none
    /// (`ALLOCATOR_MAPPED_NOCREATE`).
    #[default]
    OpenExisting,
    /// Create a new object, mode 0600; fail with [`Error::AlreadyExists`] if the name is taken
    /// (`O_CREAT | O_EXCL`, `ALLOCATOR_MAPPED_EXCLUSIVE`).
    CreateExclusive,
    /// Open the object, creating it (mode 0600) if absent, and grow it to the requested length
    /// if it is shorter (PyTorch's behaviour with neither flag).
    OpenOrCreate,
}

impl CreateMode {
    fn oflags(self) -> OFlags {
        match self {
            Self::OpenExisting => OFlags::empty(),
            Self::CreateExclusive => OFlags::CREATE | OFlags::EXCL,
            Self::OpenOrCreate => OFlags::CREATE,
        }
    }
}

/// Permission bits of every object this crate creates: owner read/write only.
pub(crate) const CREATE_MODE: u32 = 0o600;

fn access_oflags(access: Access) -> OFlags {
    match access {
        Access::ReadWrite => OFlags::RDWR,
        Access::ReadOnly => OFlags::RDONLY,
    }
}

/// `shm_open(name, flags, 0600)`, done as glibc does: `open("/dev/shm/<name>")` with `O_NOFOLLOW`
/// and `O_CLOEXEC`, plus `O_NONBLOCK`: anyone can `mkfifo` in `/dev/shm`, and a read-only open of
/// a FIFO would otherwise block until a writer comes (the attach checks then refuse it as
/// [`Error::WrongKind`]). On regular files and shm objects `O_NONBLOCK` changes nothing.
pub(crate) fn shm_open(name: &ShmName, create: CreateMode, access: Access) -> Result<OwnedFd> {
    let flags = access_oflags(access)
        | create.oflags()
        | OFlags::NOFOLLOW
        | OFlags::NONBLOCK
        | OFlags::CLOEXEC;
    rustix::fs::open(name.path(), flags, Mode::from_raw_mode(CREATE_MODE))
        .map_err(Error::os("shm_open", &name.describe()))
}

/// `open(path, flags, 0600)` for file-backed mappings (PyTorch's `ALLOCATOR_MAPPED_SHARED`),
/// with `O_NONBLOCK` so a FIFO at the path cannot block the open (see [`shm_open`]).
pub(crate) fn file_open(path: &Path, create: CreateMode, access: Access) -> Result<OwnedFd> {
    let flags = access_oflags(access) | create.oflags() | OFlags::NONBLOCK | OFlags::CLOEXEC;
    rustix::fs::open(path, flags, Mode::from_raw_mode(CREATE_MODE))
        .map_err(Error::os("open", &describe_path(path)))
}

/// `shm_unlink(name)`: removes the name; mappings and descriptors already open stay valid and the
/// memory is freed when the last of them goes.
///
/// # Errors
///
/// [`Error::NotFound`] if no object has that name, [`Error::PermissionDenied`] if another user
/// owns it (in a sticky `/dev/shm`).
#[doc(alias = "shm_unlink")]
pub fn unlink_shm(name: &ShmName) -> Result<()> {
    // `unlink("/dev/shm/<name>")`, as glibc's shm_unlink does and as `shm_open` here opens: the
    // same path both ways, so every name `ShmName` accepts (up to 255 bytes) can be removed.
    rustix::fs::unlink(name.path()).map_err(Error::os("shm_unlink", &name.describe()))?;
    tracing::debug!(name = %name, "unlinked shared memory object");
    Ok(())
}

/// What `fstat` says about an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ObjectInfo {
    pub(crate) kind: ObjectKind,
    pub(crate) size: u64,
    pub(crate) uid: u32,
}

/// `fstat(fd)`, reduced to what attach checks need.
pub(crate) fn inspect(fd: impl AsFd, object: &str) -> Result<ObjectInfo> {
    let stat = rustix::fs::fstat(fd).map_err(Error::os("fstat", object))?;
    let kind = match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => ObjectKind::Regular,
        FileType::Directory => ObjectKind::Directory,
        FileType::Socket => ObjectKind::Socket,
        FileType::Fifo => ObjectKind::Fifo,
        FileType::CharacterDevice => ObjectKind::CharDevice,
        FileType::BlockDevice => ObjectKind::BlockDevice,
        FileType::Symlink => ObjectKind::Symlink,
        _ => ObjectKind::Unknown,
    };
    Ok(ObjectInfo {
        kind,
        size: u64::try_from(stat.st_size).unwrap_or(0),
        uid: stat.st_uid,
    })
}

/// The checks every attach goes through before `mmap`: the object is a regular file or shared
/// memory object, owned by this user (unless `allow_foreign_owner`), and at least `needed` bytes
/// long. Returns the object's size.
pub(crate) fn check_attachable(
    fd: impl AsFd,
    object: &str,
    needed: u64,
    allow_foreign_owner: bool,
) -> Result<u64> {
    let info = inspect(fd, object)?;
    check_info(info, object, needed, allow_foreign_owner)?;
    Ok(info.size)
}

/// The pure part of [`check_attachable`], separate so it can be tested without a foreign uid.
pub(crate) fn check_info(
    info: ObjectInfo,
    object: &str,
    needed: u64,
    allow_foreign_owner: bool,
) -> Result<()> {
    if info.kind != ObjectKind::Regular {
        return Err(Error::WrongKind {
            object: object.to_owned(),
            kind: info.kind,
        });
    }
    let ours = rustix::process::geteuid().as_raw();
    if info.uid != ours && !allow_foreign_owner {
        return Err(Error::ForeignOwner {
            object: object.to_owned(),
            owner: info.uid,
            ours,
        });
    }
    if info.size < needed {
        return Err(Error::TooSmall {
            object: object.to_owned(),
            actual: info.size,
            needed,
        });
    }
    Ok(())
}

/// Rejects sizes that cannot be mapped; `object` names the target in the error.
pub(crate) fn check_len(len: u64, object: &str) -> Result<usize> {
    use crate::error::SizeProblem;
    let problem = if len == 0 {
        SizeProblem::Zero
    } else if len > isize::MAX as u64 {
        SizeProblem::TooLarge
    } else {
        return Ok(len as usize);
    };
    Err(Error::InvalidSize {
        object: object.to_owned(),
        len,
        problem,
    })
}

/// Whether `fd` carries `F_SEAL_SHRINK` (`fcntl(F_GET_SEALS)`); `false` for objects that cannot
/// be sealed.
pub(crate) fn is_sealed_against_shrink(fd: impl AsFd) -> bool {
    rustix::fs::fcntl_get_seals(fd).is_ok_and(|seals| seals.contains(rustix::fs::SealFlags::SHRINK))
}

/// `madvise(MADV_HUGEPAGE)` on the whole mapping; failures (no THP support) are only traced,
/// since huge pages are an optimisation.
pub(crate) fn advise_huge_pages(map: &crate::mapping::Mapping) {
    // SAFETY: the range is exactly the mapping `map` owns; MADV_HUGEPAGE only changes how the
    // kernel backs it, never its contents.
    let advised = unsafe {
        rustix::mm::madvise(
            map.base_ptr().cast(),
            map.map_len(),
            rustix::mm::Advice::LinuxHugepage,
        )
    };
    if let Err(errno) = advised {
        tracing::trace!(%errno, "MADV_HUGEPAGE refused; using normal pages");
    }
}

pub(crate) fn describe_path(path: &Path) -> String {
    format!("file {:?}", path.display().to_string())
}

pub(crate) fn describe_fd(fd: impl AsFd) -> String {
    use rustix::fd::AsRawFd;
    format!("fd {}", fd.as_fd().as_raw_fd())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(kind: ObjectKind, size: u64, uid: u32) -> ObjectInfo {
        ObjectInfo { kind, size, uid }
    }

    #[test]
    fn foreign_owner_is_refused_unless_allowed() {
        let ours = rustix::process::geteuid().as_raw();
        let other = ours.wrapping_add(1);
        let err = check_info(info(ObjectKind::Regular, 10, other), "x", 10, false).unwrap_err();
        assert!(
            matches!(err, Error::ForeignOwner { owner, ours: o, .. } if owner == other && o == ours)
        );
        check_info(info(ObjectKind::Regular, 10, other), "x", 10, true).unwrap();
        check_info(info(ObjectKind::Regular, 10, ours), "x", 10, false).unwrap();
    }

    #[test]
    fn wrong_kind_and_short_objects_are_refused() {
        let ours = rustix::process::geteuid().as_raw();
        for kind in [ObjectKind::Socket, ObjectKind::Directory, ObjectKind::Fifo] {
            let err = check_info(info(kind, 100, ours), "x", 1, false).unwrap_err();
            assert!(matches!(err, Error::WrongKind { kind: k, .. } if k == kind));
        }
        let err = check_info(info(ObjectKind::Regular, 99, ours), "x", 100, false).unwrap_err();
        assert!(matches!(
            err,
            Error::TooSmall {
                actual: 99,
                needed: 100,
                ..
            }
        ));
    }

    #[test]
    fn lengths_are_checked() {
        assert!(matches!(check_len(0, "x"), Err(Error::InvalidSize { .. })));
        assert!(matches!(
            check_len(isize::MAX as u64 + 1, "x"),
            Err(Error::InvalidSize { .. })
        ));
        assert_eq!(check_len(4096, "x").unwrap(), 4096);
    }
}
