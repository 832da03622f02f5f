//! Bad input: every refusal is a typed error, nothing is left behind, nothing raises SIGBUS.

mod common;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;

use tensormem_shm::{Error as ShmError, ObjectKind};
use tensormem_storage::{Error, FilenameHandle, Storage, StorageKind};

/// A descriptor number that is not open in this process (far above anything the tests open).
const NOT_OPEN: i32 = i32::MAX - 11;

fn shm(err: Error) -> ShmError {
    match err {
        Error::Shm(e) => e,
        other => panic!("expected a shm error, got {other:?}"),
    }
}

#[test]
fn a_closed_descriptor_is_an_invalid_fd_error() {
    // SAFETY: the number is only passed to fstat (EBADF); nothing closes or uses it otherwise.
    let closed = unsafe { BorrowedFd::borrow_raw(NOT_OPEN) };
    let err = Storage::new_shared_fd(closed, 10).unwrap_err();
    assert!(matches!(shm(err), ShmError::InvalidFd { .. }));
}

#[test]
fn descriptors_of_the_wrong_kind_are_refused() {
    let (socket, _peer) = UnixStream::pair().unwrap();
    let err = Storage::new_shared_fd(&socket, 10).unwrap_err();
    assert!(matches!(
        shm(err),
        ShmError::WrongKind {
            kind: ObjectKind::Socket,
            ..
        }
    ));
    let dir: OwnedFd = std::fs::File::open("/tmp").unwrap().into();
    let err = Storage::new_shared_fd(&dir, 10).unwrap_err();
    assert!(matches!(
        shm(err),
        ShmError::WrongKind {
            kind: ObjectKind::Directory,
            ..
        }
    ));
}

#[test]
fn a_size_larger_than_the_object_is_refused_before_mapping() {
    let s = Storage::new_shared_fd_storage(4096).unwrap();
    let h = s.share_fd().unwrap();
    let err = Storage::new_shared_fd(h.fd(), 4097).unwrap_err();
    assert!(matches!(
        shm(err),
        ShmError::TooSmall {
            actual: 4096,
            needed: 4097,
            ..
        }
    ));
    assert!(matches!(
        Storage::new_shared_fd(h.fd(), u64::MAX),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        Storage::new_shared_fd(h.fd(), 0),
        Err(Error::Empty { .. })
    ));
}

#[test]
fn a_file_truncated_after_sharing_is_refused_not_a_sigbus() {
    let file = tempfile::tempfile().unwrap();
    file.set_len(8192).unwrap();
    let fd: OwnedFd = file.try_clone().unwrap().into();
    let s = Storage::new_shared_fd(&fd, 8192).unwrap();
    assert_eq!(s.nbytes(), 8192);
    file.set_len(100).unwrap(); // a peer shrinks it
    let err = Storage::new_shared_fd(fd.as_fd(), 8192).unwrap_err();
    assert!(matches!(shm(err), ShmError::TooSmall { actual: 100, .. }));
}

#[test]
fn missing_and_malformed_names_are_refused() {
    common::manager();
    let missing =
        FilenameHandle::from_torch(b"", b"/tensormem_storage_test_missing_0", 10).unwrap();
    let err = Storage::new_shared_filename(&missing).unwrap_err();
    assert!(matches!(shm(err), ShmError::NotFound { .. }));
    for bad in [&b"no_slash"[..], b"/a/b", b"/", b"/with\0nul"] {
        assert!(
            matches!(
                FilenameHandle::from_torch(b"", bad, 10),
                Err(Error::Shm(ShmError::InvalidName { .. }))
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn a_named_size_larger_than_the_object_is_refused_and_the_count_is_untouched() {
    common::manager();
    let s = Storage::new_shared_filename_storage(100).unwrap();
    let mut handle = s.share_filename().unwrap();
    handle.size = 101;
    let err = Storage::new_shared_filename(&handle).unwrap_err();
    assert!(matches!(shm(err), ShmError::TooSmall { .. }));
    assert_eq!(s.shared_refcount(), Some(1));
    handle.size = 0;
    assert!(matches!(
        Storage::new_shared_filename(&handle),
        Err(Error::Empty { .. })
    ));
    let path = handle.name.path();
    drop(s);
    assert!(!path.exists(), "the failed opens left no reference behind");
}

#[test]
fn a_plain_shm_object_is_not_a_named_storage() {
    common::manager();
    // An fd-backed object has no refcount header: opening it by name finds count 0.
    let name = tensormem_shm::NameGenerator::default().next_name();
    let mut plain = tensormem_shm::MapOptions::new()
        .create(tensormem_shm::CreateMode::CreateExclusive)
        .len(4096)
        .map_shm(&name)
        .unwrap();
    let handle = FilenameHandle {
        manager_handle: Vec::new(),
        name: name.clone(),
        size: 16,
    };
    let err = Storage::new_shared_filename(&handle).unwrap_err();
    assert!(matches!(
        shm(err),
        ShmError::RefcountGone { refcount: 0, .. }
    ));
    plain.unlink().unwrap();
}

#[test]
fn from_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    for shared in [false, true] {
        let err = Storage::from_file(&missing, shared, None).unwrap_err();
        assert!(
            matches!(shm(err), ShmError::NotFound { .. }),
            "shared={shared}"
        );
        let err = Storage::from_file(dir.path(), shared, Some(10)).unwrap_err();
        assert!(
            matches!(
                shm(err),
                ShmError::WrongKind { .. }
                    | ShmError::Os { .. }
                    | ShmError::PermissionDenied { .. }
            ),
            "a directory, shared={shared}"
        );
    }
    let small = dir.path().join("small");
    std::fs::write(&small, [1u8; 10]).unwrap();
    let err = Storage::from_file(&small, false, Some(11)).unwrap_err();
    assert!(matches!(
        shm(err),
        ShmError::TooSmall {
            actual: 10,
            needed: 11,
            ..
        }
    ));
    let empty = dir.path().join("empty");
    std::fs::write(&empty, []).unwrap();
    assert!(matches!(
        Storage::from_file(&empty, false, None),
        Err(Error::Empty { .. })
    ));
    assert!(matches!(
        Storage::from_file(&empty, true, None),
        Err(Error::Empty { .. })
    ));
    assert!(matches!(
        Storage::from_file(&small, true, Some(0)),
        Err(Error::Empty { .. })
    ));
}

#[test]
fn from_file_shared_writes_reach_the_file_and_private_ones_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    std::fs::write(&path, b"0123456789").unwrap();

    let private = Storage::from_file(&path, false, None).unwrap();
    assert_eq!(private.kind(), StorageKind::CpuPrivate);
    private.write_at(0, b"X").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"0123456789");

    let shared = Storage::from_file(&path, true, None).unwrap();
    assert_eq!(shared.kind(), StorageKind::CpuFile);
    assert!(shared.is_shared());
    assert_eq!(shared.to_vec().unwrap(), b"0123456789");
    shared.write_at(0, b"Y").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"Y123456789");

    // A size beyond the file grows it (shared) ...
    let grown = Storage::from_file(&path, true, Some(20)).unwrap();
    assert_eq!(grown.nbytes(), 20);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 20);
    // ... and a new file is created.
    let fresh = dir.path().join("fresh");
    let created = Storage::from_file(&fresh, true, Some(5)).unwrap();
    created.write_at(0, b"hello").unwrap();
    assert_eq!(std::fs::read(&fresh).unwrap(), b"hello");
    // The kept descriptor can be shared on.
    let h = created.share_fd().unwrap();
    assert_eq!(created.kind(), StorageKind::CpuFile);
    assert_eq!(
        Storage::new_shared_fd(h.fd(), 5).unwrap().to_vec().unwrap(),
        b"hello"
    );
}

#[test]
fn errors_convert_to_io_errors_with_a_kind() {
    let err: std::io::Error = Error::Expired.into();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    let err: std::io::Error = Storage::new(1).get_shared_fd().unwrap_err().into();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("share_fd()"), "{err}");
}

#[test]
fn objects_of_another_user_are_refused() {
    common::manager();
    let name = tensormem_shm::NameGenerator::default().next_name();
    let region = tensormem_shm::RefcountedRegion::create(&name, 64).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(name.path())
        .unwrap();
    // Only root can give an object away; elsewhere there is nothing foreign to test with.
    if std::os::unix::fs::fchown(&file, Some(12345), Some(12345)).is_err() {
        eprintln!("skipped: not allowed to chown (run as root to test foreign owners)");
        return;
    }
    let handle = FilenameHandle {
        manager_handle: Vec::new(),
        name: name.clone(),
        size: 64,
    };
    let err = Storage::new_shared_filename(&handle).unwrap_err();
    assert!(matches!(
        shm(err),
        ShmError::ForeignOwner { owner: 12345, .. }
    ));
    let err = Storage::new_shared_fd(&file, 64).unwrap_err();
    assert!(matches!(
        shm(err),
        ShmError::ForeignOwner { owner: 12345, .. }
    ));
    assert_eq!(region.refcount(), 1, "the refused opens counted nothing");
    assert!(region.close().unwrap());
}

#[test]
fn from_file_of_a_fifo_is_refused_without_waiting_for_a_writer() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    for shared in [false, true] {
        // A watchdog, not a timing: a call that blocks would otherwise hang the test run.
        let (tx, rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || {
            let _ = tx.send(Storage::from_file(&path, shared, None).map(|_| ()));
        });
        let result = rx.recv_timeout(std::time::Duration::from_secs(60));
        if result.is_err() {
            // Release the blocked open (a writer appears), then fail.
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                .open(&fifo);
            panic!("from_file(fifo, shared={shared}) waited for a writer");
        }
        let err = result.unwrap().unwrap_err();
        match shm(err) {
            ShmError::WrongKind { kind, .. } => {
                assert!(shared || kind == ObjectKind::Fifo, "{kind}")
            }
            other => panic!("shared={shared}: {other}"),
        }
    }
}
