//! Anonymous fd-backed regions (PyTorch's fd sharing strategy, `new_shm_fd_storage`): memory
//! with no name, reachable only through its descriptor, which is what gets sent to peers.
//!
//! PyTorch creates a named shm object and unlinks it right after mapping. Here the object is a
//! `memfd_create(2)` file, which never has a name at all, created with `MFD_ALLOW_SEALING` and
//! then sealed with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`:
//! - `F_SEAL_SHRINK`: no process holding the fd can truncate it, so a mapping of it can never
//!   SIGBUS because a peer shrank the object;
//! - `F_SEAL_GROW`: its size is fixed, like a non-resizable storage; receivers can trust the size
//!   they `fstat`;
//! - `F_SEAL_SEAL`: the seal set is final, so no peer can add a write seal
//!   (`F_SEAL_FUTURE_WRITE`) that would stop others from mapping it writable.
//!
//! Where `memfd_create` is unavailable (old kernels, some sandboxes) the region falls back to a
//! nameless object in `/dev/shm` (`O_TMPFILE`), and only where that is refused too to
//! `shm_open(O_CREAT | O_EXCL, 0600)` of a generated name followed at once by `shm_unlink`: equally
//! anonymous after the unlink, but unsealed (a peer holding the fd could truncate it), and a
//! process killed between the two calls leaves the name behind (`tensormem shm gc` removes it:
//! the name carries the dead creator's pid).

use rustix::fd::OwnedFd;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};
use crate::mapping::{Access, Mapping};
use crate::name::NameGenerator;
use crate::object::{self, CreateMode};
use crate::region::{Backing, SharedRegion};

/// The seals anonymous regions carry.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

impl SharedRegion {
    /// A new anonymous region of `len` zeroed bytes, mapped read-write, keeping its fd (see the
    /// [module docs](crate::anon) for memfd, seals and the fallback).
    ///
    /// Pages are not faulted in: creating even a large region is a few system calls.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSize`] for a zero or oversized `len`; [`Error::Os`] if neither memfd nor
    /// shm objects can be created (`ENOSPC`, `EMFILE`, ...) or the mapping fails.
    #[doc(alias = "memfd_create")]
    #[doc(alias = "new_shm_fd_storage")]
    pub fn create_anonymous(len: u64) -> Result<Self> {
        Self::create_anonymous_as(len, AnonymousKind::Memfd)
    }

    /// [`create_anonymous`](Self::create_anonymous) with a choice of object: a memfd (falling
    /// back to an unlinked shm object where memfd is unavailable) or directly an unlinked shm
    /// object in `/dev/shm` (whose mount options, not `shmem_enabled`, decide about huge pages).
    ///
    /// # Errors
    ///
    /// As [`create_anonymous`](Self::create_anonymous).
    pub fn create_anonymous_as(len: u64, kind: AnonymousKind) -> Result<Self> {
        let object = "anonymous region";
        let len_usize = object::check_len(len, object)?;
        let (fd, sealed) = anonymous_object(len, kind)?;
        let map = Mapping::map(&fd, len_usize, 0, Access::ReadWrite, false)
            .map_err(Error::os("mmap", object))?;
        tracing::debug!(len, sealed, "created anonymous shared region");
        Ok(Self::from_parts(
            map,
            Some(fd),
            Backing::Anonymous { sealed },
        ))
    }

    /// Whether the object is sealed against shrinking (`F_SEAL_SHRINK`), i.e. no process can
    /// truncate it under this mapping. `false` when the fd was not kept.
    pub fn is_sealed_against_shrink(&self) -> bool {
        self.fd().is_some_and(object::is_sealed_against_shrink)
    }
}

/// The object behind an anonymous region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AnonymousKind {
    /// `memfd_create`, sealed; an unlinked shm object where memfd is unavailable (the default).
    #[default]
    Memfd,
    /// A nameless object in `/dev/shm` (`O_TMPFILE`), not sealed: PyTorch's unlinked shm object
    /// without the name it has for a moment. Where `/dev/shm` refuses `O_TMPFILE` (it is not a
    /// tmpfs there, or a sandbox forbids it), a sealed memfd; where that is refused too, a
    /// generated name created and unlinked at once.
    UnlinkedShm,
}

/// Where a way of creating an object is not available here (not an error of this request).
fn unavailable(errno: Errno) -> bool {
    matches!(
        errno,
        Errno::NOSYS | Errno::OPNOTSUPP | Errno::ISDIR | Errno::INVAL | Errno::NOENT | Errno::PERM
    )
}

/// A way of creating a nameless object: the call's name (for errors), the call, whether the
/// object comes sealed.
type NamelessWay = (&'static str, fn(u64) -> rustix::io::Result<OwnedFd>, bool);

/// The object for an anonymous region of `len` bytes and whether it is sealed: the nameless ways
/// in `kind`'s order of preference, then the named-and-unlinked one.
fn anonymous_object(len: u64, kind: AnonymousKind) -> Result<(OwnedFd, bool)> {
    let object = "anonymous region";
    let memfd_way: NamelessWay = ("memfd_create", memfd, true);
    let tmpfile_way: NamelessWay = ("open(O_TMPFILE)", tmpfile, false);
    let nameless = match kind {
        AnonymousKind::Memfd => [memfd_way, tmpfile_way],
        AnonymousKind::UnlinkedShm => [tmpfile_way, memfd_way],
    };
    for (call, create, sealed) in nameless {
        match create(len) {
            Ok(fd) => return Ok((fd, sealed)),
            Err(errno) if unavailable(errno) => {
                tracing::debug!(call, %errno, "nameless shared object unavailable, trying the next way");
            }
            Err(errno) => return Err(Error::from_errno(errno, call, object)),
        }
    }
    Ok((unlinked_shm(len)?, false))
}

/// `memfd_create` + `ftruncate` + seals.
fn memfd(len: u64) -> rustix::io::Result<OwnedFd> {
    let fd =
        rustix::fs::memfd_create("tensormem", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len)?;
    rustix::fs::fcntl_add_seals(&fd, SEALS)?;
    Ok(fd)
}

/// A shm object that never has a name: `open("/dev/shm", O_TMPFILE | O_RDWR, 0600)` (tmpfs
/// supports `O_TMPFILE` since Linux 3.11), sized.
fn tmpfile(len: u64) -> rustix::io::Result<OwnedFd> {
    let fd = rustix::fs::open(
        crate::name::SHM_DIR,
        rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::from_raw_mode(object::CREATE_MODE),
    )?;
    rustix::fs::ftruncate(&fd, len)?;
    Ok(fd)
}

/// The last resort: an exclusively created name unlinked at once (PyTorch's way), which a process
/// killed between the two calls leaks (`tensormem shm gc` removes such objects: the name carries
/// the dead creator's pid).
fn unlinked_shm(len: u64) -> Result<OwnedFd> {
    let object = "anonymous shm object";
    let name = NameGenerator::default().next_name();
    let fd = object::shm_open(&name, CreateMode::CreateExclusive, Access::ReadWrite)?;
    object::unlink_shm(&name)?;
    rustix::fs::ftruncate(&fd, len).map_err(Error::os("ftruncate", object))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_regions_are_sealed_and_cannot_be_truncated() {
        let region = SharedRegion::create_anonymous(8192).unwrap();
        assert!(region.is_sealed_against_shrink());
        assert_eq!(region.backing(), &Backing::Anonymous { sealed: true });
        let fd = region.fd().unwrap();
        assert_eq!(rustix::fs::ftruncate(fd, 100), Err(Errno::PERM));
        assert_eq!(rustix::fs::ftruncate(fd, 1 << 20), Err(Errno::PERM));
        assert!(region.to_vec().unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn every_fallback_object_is_nameless_and_sized() {
        let mut objects = vec![unlinked_shm(4096).unwrap()];
        match tmpfile(4096) {
            Ok(fd) => objects.push(fd),
            Err(errno) => assert!(unavailable(errno), "O_TMPFILE: {errno}"),
        }
        for fd in objects {
            let info = object::inspect(&fd, "fallback").unwrap();
            assert_eq!(info.size, 4096);
            let stat = rustix::fs::fstat(&fd).unwrap();
            assert_eq!(
                stat.st_nlink, 0,
                "the fallback object must have no name left"
            );
            assert_eq!(stat.st_mode & 0o777, 0o600);
        }
    }

    #[test]
    fn unlinked_shm_regions_are_nameless_whatever_the_system_gives() {
        let region = SharedRegion::create_anonymous_as(4096, AnonymousKind::UnlinkedShm).unwrap();
        let stat = rustix::fs::fstat(region.fd().unwrap()).unwrap();
        assert_eq!(stat.st_nlink, 0);
        assert_eq!(region.to_vec().unwrap(), vec![0; 4096]);
    }
}
