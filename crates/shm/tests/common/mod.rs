//! Helpers shared by the shm integration tests.

use rustix::fd::OwnedFd;
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use tensormem_shm::{NameGenerator, ShmName};

/// Unlinks a test's name when the test ends (ignoring "already gone").
pub(crate) struct UnlinkOnDrop(pub(crate) ShmName);

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        let _ = tensormem_shm::unlink_shm(&self.0);
    }
}

/// A new name with the tests' prefix, and the guard that unlinks it.
#[allow(dead_code)] // not every test binary that includes this module makes names this way
pub(crate) fn fresh_name() -> (ShmName, UnlinkOnDrop) {
    let name = NameGenerator::with_prefix("tmtest").unwrap().next_name();
    (name.clone(), UnlinkOnDrop(name))
}

/// A connected pair of Unix stream sockets (close-on-exec), for sending descriptors.
#[allow(dead_code)] // not every test binary that includes this module sends descriptors
pub(crate) fn stream_pair() -> (OwnedFd, OwnedFd) {
    socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap()
}
