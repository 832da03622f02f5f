//! Regression tests for what hostile peers and hostile names once broke: truncation under a
//! mapping, FIFOs planted in `/dev/shm`, 255-byte names, short packets, kills during anonymous
//! creation.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::{fresh_name, stream_pair};
use rustix::fs::{FileType, Mode};
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use tensormem_shm::transfer::{recv_region, send_fd, send_region, SendOptions};
use tensormem_shm::{
    AnonymousKind, CreateMode, Error, MapOptions, RefcountedRegion, SharedRegion, ShmName,
};
use tensormem_test_support::child;

/// Runs `f` on a thread and fails the test if it does not finish within `limit` (a hang is the
/// bug some of these tests catch).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .expect("the call blocked (it must fail at once)")
}

fn truncate_by_name(name: &ShmName, len: u64) {
    let peer = MapOptions::new().keep_fd(true).map_shm(name).unwrap();
    rustix::fs::ftruncate(peer.fd().unwrap(), len).unwrap();
}

fn assert_truncated<T: std::fmt::Debug>(result: tensormem_shm::Result<T>) {
    assert!(
        matches!(result, Err(Error::Truncated { .. })),
        "expected Error::Truncated, got {result:?}"
    );
}

/// Regression: a peer's `ftruncate(0)` after attach made safe `read_at`/`write_at` raise
/// SIGBUS (killing this test process) on named, refcounted and file-backed regions.
#[test]
fn truncation_by_a_peer_is_an_error_not_a_sigbus() {
    let (name, _cleanup) = fresh_name();
    let mut region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(3 * 4096)
        .map_shm(&name)
        .unwrap();
    assert!(region.is_truncatable());
    region.write_at(0, b"before").unwrap();
    truncate_by_name(&name, 4096);
    let mut buf = [0u8; 16];
    region.read_at(0, &mut buf[..6]).unwrap();
    assert_eq!(&buf[..6], b"before", "the first page is still there");
    assert_truncated(region.read_at(4096, &mut buf));
    assert_truncated(region.write_at(8000, b"after"));
    assert_truncated(region.read_volatile(3 * 4096 - 1));
    assert_truncated(region.write_volatile(5000, 1));
    assert_truncated(region.to_vec());
    assert_truncated(region.fill(7));
    // A read straddling the end copies what exists, then reports the rest.
    let err = region.read_at(4090, &mut buf).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Truncated {
                offset: 4096,
                len: 10
            }
        ),
        "{err}"
    );

    // Refcounted (data after a 64-byte header).
    let (rc_name, _rc_cleanup) = fresh_name();
    let mut refcounted = RefcountedRegion::create(&rc_name, 3 * 4096).unwrap();
    truncate_by_name(&rc_name, 4096);
    assert_truncated(refcounted.write_at(2 * 4096, b"x"));
    assert_truncated(refcounted.read_at(4096, &mut buf));
    // Its refcount word is in the first page: closing still works.
    assert!(refcounted.close().unwrap(), "the last close unlinks");
    // Truncated below the header: opening and closing report it instead of faulting.
    let (rc2, _rc2_cleanup) = fresh_name();
    let holder = RefcountedRegion::create(&rc2, 4096).unwrap();
    truncate_by_name(&rc2, 0);
    assert_eq!(holder.refcount(), 0);
    assert_truncated(holder.close());
    let reopened = RefcountedRegion::open(&rc2).map(drop);
    assert!(
        matches!(reopened, Err(Error::TooSmall { actual: 0, .. })),
        "{reopened:?}"
    );

    // File-backed.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    let file_region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(2 * 4096)
        .map_path(&path)
        .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    assert_truncated(file_region.read_at(0, &mut buf));
}

/// Sealed anonymous regions cannot shrink, so their copies take the plain path.
#[test]
fn sealed_regions_are_not_truncatable_and_unsealed_received_ones_are() {
    let sealed = SharedRegion::create_anonymous(4096).unwrap();
    assert!(!sealed.is_truncatable());
    let unsealed = SharedRegion::create_anonymous_as(8192, AnonymousKind::UnlinkedShm).unwrap();
    assert!(unsealed.is_truncatable());

    let (a, b) = stream_pair();
    send_region(&a, &unsealed, SendOptions::default()).unwrap();
    let received = recv_region(&b, &MapOptions::new()).unwrap();
    assert!(received.region.is_truncatable());
    rustix::fs::ftruncate(unsealed.fd().unwrap(), 0).unwrap();
    let mut buf = [0u8; 1];
    assert_truncated(received.region.read_at(0, &mut buf));
}

/// Regression: opening a name that is a FIFO read-only blocked forever.
#[test]
fn a_fifo_in_dev_shm_is_refused_at_once() {
    let (name, _cleanup) = fresh_name();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        name.path(),
        FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    for read_only in [true, false] {
        let name = name.clone();
        let result = within(Duration::from_secs(5), move || {
            let options = if read_only {
                MapOptions::new().read_only()
            } else {
                MapOptions::new()
            };
            options.map_shm(&name).map(drop)
        });
        assert!(matches!(result, Err(Error::WrongKind { .. })), "{result:?}");
    }
}

/// Regression: a 255-byte name was created but could not be unlinked (`ENAMETOOLONG`).
#[test]
fn the_longest_names_can_be_created_and_unlinked() {
    let head = format!("tmtest_{}_", std::process::id());
    let long = ShmName::new(format!("/{head}{}", "n".repeat(255 - head.len()))).unwrap();
    let _cleanup = common::UnlinkOnDrop(long.clone());
    assert_eq!(long.as_str().len(), 256, "255 bytes after the slash");
    let mut region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(4096)
        .map_shm(&long)
        .unwrap();
    assert!(long.path().exists());
    region.unlink().unwrap();
    assert!(!long.path().exists(), "the object must not leak");

    let refcounted = RefcountedRegion::create(&long, 64).unwrap();
    assert!(refcounted.close().unwrap());
    assert!(!long.path().exists());
}

/// Regression: on a packet socket a short packet was spliced with the next message (losing
/// its region) or, alone, blocked the receiver forever.
#[test]
fn a_short_packet_is_refused_and_the_next_message_survives() {
    let (a, b) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let region = SharedRegion::create_anonymous(4096).unwrap();
    // A 40-byte packet carrying an fd, then a valid message.
    let fd = region.fd().unwrap();
    let fds = [fd];
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds));
    rustix::net::sendmsg(
        &a,
        &[std::io::IoSlice::new(&[0u8; 40])],
        &mut control,
        rustix::net::SendFlags::empty(),
    )
    .unwrap();
    send_region(
        &a,
        &region,
        SendOptions {
            user: b"second",
            ..Default::default()
        },
    )
    .unwrap();

    let first = recv_region(&b, &MapOptions::new());
    assert!(
        matches!(&first, Err(Error::Protocol { problem, .. }) if problem.contains("40 bytes")),
        "{first:?}"
    );
    let second = recv_region(&b, &MapOptions::new()).unwrap();
    assert_eq!(second.user_data(), b"second");

    // A short packet alone: an error at once, not a wait for more bytes.
    send_fd(&a, fd, 4096, 0, SendOptions::default()).unwrap();
    recv_region(&b, &MapOptions::new()).unwrap();
    rustix::net::send(&a, &[1u8; 8], rustix::net::SendFlags::empty()).unwrap();
    let b_owned = b.try_clone().unwrap();
    let lone = within(Duration::from_secs(5), move || {
        recv_region(&b_owned, &MapOptions::new()).map(drop)
    });
    assert!(matches!(lone, Err(Error::Protocol { .. })), "{lone:?}");
}

const CREATOR_ROLE: &str = "TMTEST_HOSTILE_ROLE";

/// Whether this system gives a nameless shared object, `O_TMPFILE` in `/dev/shm` or a memfd.
fn nameless_objects_available() -> bool {
    let tmpfile = rustix::fs::open(
        "/dev/shm",
        rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::from_raw_mode(0o600),
    );
    let memfd = rustix::fs::memfd_create("tensormem-probe", rustix::fs::MemfdFlags::CLOEXEC);
    tmpfile.is_ok() || memfd.is_ok()
}

/// Regression: unlinked-shm regions leaked when the creator was killed between `shm_open`
/// and `shm_unlink` (8 of 200 kill trials), and again where `/dev/shm` refused `O_TMPFILE`. An
/// unlinked-shm region is a nameless object whenever the system has one (`O_TMPFILE` or a
/// memfd), so there is no name to leak.
#[test]
fn killing_a_creator_of_unlinked_shm_regions_leaks_nothing() {
    if std::env::var_os(CREATOR_ROLE).is_some() {
        // The child: create and drop unlinked-shm regions until killed.
        println!("creating");
        loop {
            drop(SharedRegion::create_anonymous_as(4096, AnonymousKind::UnlinkedShm).unwrap());
        }
    }
    if !nameless_objects_available() {
        eprintln!(
            "SKIPPED: neither O_TMPFILE in /dev/shm nor memfd_create here; the named fallback \
             leaves a name when killed between create and unlink (gc removes it)"
        );
        return;
    }
    // Names an earlier process left (pids are reused) are not this child's.
    let shm_names = || -> std::collections::HashSet<String> {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect()
    };
    let mut leaked = Vec::new();
    for trial in 0..40u64 {
        let before = shm_names();
        let (mut child, mut out) = child::spawn(
            child::this_test("killing_a_creator_of_unlinked_shm_regions_leaks_nothing")
                .env(CREATOR_ROLE, "1")
                .stderr(Stdio::null()),
        );
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        thread::sleep(Duration::from_micros(500 + (trial * 7919) % 5000));
        child.kill9();
        let prefix = format!("{}_{}_", tensormem_shm::DEFAULT_PREFIX, child.id());
        for file in shm_names() {
            if file.starts_with(&prefix) && !before.contains(&file) {
                let _ = std::fs::remove_file(Path::new("/dev/shm").join(&file));
                leaked.push(file);
            }
        }
    }
    assert!(leaked.is_empty(), "leaked: {leaked:?}");
}
