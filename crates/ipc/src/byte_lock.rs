//! One-byte open-file-description locks (`fcntl(F_OFD_SETLK)`): how a process shows it is alive to
//! processes that share a file with it, whatever their pid namespace. The kernel drops a process's
//! locks when the last descriptor of the open file description is closed, also when the process is
//! killed, so a lock that is there means its holder is alive. Locks may lie past the end of the
//! file: they need no bytes behind them.

use std::os::fd::{AsRawFd, BorrowedFd};

/// What taking (or letting go of) a byte lock came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Locked {
    /// Done.
    Taken,
    /// Another open file description holds it: a live process.
    Held,
    /// The file system refuses such locks.
    Unsupported,
}

/// `fcntl(F_OFD_SETLK)` of a write lock (`take`) or of its release on byte `offset` of `fd`.
pub(crate) fn byte_lock(fd: BorrowedFd<'_>, offset: usize, take: bool) -> Locked {
    let mut lock = one_byte(offset, if take { libc::F_WRLCK } else { libc::F_UNLCK });
    // SAFETY: `fd` is open for the call (borrowed); `lock` is a valid `flock` that lives for it.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &mut lock) } == 0 {
        return Locked::Taken;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Locked::Held,
        _ => Locked::Unsupported,
    }
}

/// Whether another open file description holds a lock on byte `offset` of `fd`
/// (`fcntl(F_OFD_GETLK)`); `None` where the call fails.
pub(crate) fn byte_locked(fd: BorrowedFd<'_>, offset: usize) -> Option<bool> {
    let mut lock = one_byte(offset, libc::F_WRLCK);
    // SAFETY: as in `byte_lock`; the kernel writes the conflicting lock (or F_UNLCK) into `lock`.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut lock) } != 0 {
        return None;
    }
    Some(i32::from(lock.l_type) != libc::F_UNLCK)
}

fn one_byte(offset: usize, kind: i32) -> libc::flock {
    // SAFETY: a plain C struct; all-zero bytes is a valid value (and `l_pid` must be 0 for OFD
    // locks); the fields used are set below.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = offset as libc::off_t;
    lock.l_len = 1;
    lock
}
