//! Bad input gives the right typed error: names, sizes, descriptors, foreign owners, access.

mod common;

use std::sync::atomic::{AtomicU32, AtomicU64};

use common::{fresh_name, stream_pair};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{Mode, OFlags};
use tensormem_shm::transfer::{recv_region, send_fd, SendOptions};
use tensormem_shm::{
    CreateMode, Error, MapOptions, NameGenerator, NameProblem, ObjectKind, RefcountedRegion,
    SharedRegion, ShmName, SizeProblem,
};

fn create(name: &ShmName, len: u64) -> tensormem_shm::Result<SharedRegion> {
    MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(len)
        .map_shm(name)
}

#[test]
fn bad_names_name_the_rule_they_break() {
    let long = format!("/{}", "a".repeat(256));
    let cases: &[(&str, NameProblem)] = &[
        ("", NameProblem::NoLeadingSlash),
        ("tensormem_1", NameProblem::NoLeadingSlash),
        ("/", NameProblem::Empty),
        ("//x", NameProblem::InnerSlash),
        ("/a/b", NameProblem::InnerSlash),
        ("/a\0b", NameProblem::Nul),
        (&long, NameProblem::TooLong),
        ("/.", NameProblem::DotName),
        ("/..", NameProblem::DotName),
    ];
    for (name, expected) in cases {
        match ShmName::new(*name) {
            Err(Error::InvalidName { name: n, problem }) => {
                assert_eq!(problem, *expected, "{name:?}");
                assert_eq!(n, *name);
            }
            other => panic!("{name:?} gave {other:?}"),
        }
    }
    assert!(ShmName::new(format!("/{}", "a".repeat(255))).is_ok());
    assert!(matches!(
        ShmName::from_bytes(b"/\xff\xfe"),
        Err(Error::InvalidName {
            problem: NameProblem::NotUtf8,
            ..
        })
    ));
    assert!(matches!(
        NameGenerator::with_prefix("a/b"),
        Err(Error::InvalidPrefix { .. })
    ));
    assert!(matches!(
        NameGenerator::with_prefix(""),
        Err(Error::InvalidPrefix { .. })
    ));
}

#[test]
fn bad_sizes_are_refused_before_anything_is_created() {
    let (name, _cleanup) = fresh_name();
    for (len, problem) in [
        (0, SizeProblem::Zero),
        (isize::MAX as u64 + 1, SizeProblem::TooLarge),
        (u64::MAX, SizeProblem::TooLarge),
    ] {
        match create(&name, len) {
            Err(Error::InvalidSize {
                len: l, problem: p, ..
            }) => {
                assert_eq!((l, p), (len, problem));
            }
            other => panic!("len {len} gave {other:?}"),
        }
        assert!(matches!(
            SharedRegion::create_anonymous(len),
            Err(Error::InvalidSize { .. })
        ));
        assert!(matches!(
            RefcountedRegion::create(&name, len),
            Err(Error::InvalidSize { .. })
        ));
        // Data + 64-byte header must fit as well.
        assert!(!name.path().exists(), "a failed create left {name} behind");
    }
    assert!(matches!(
        RefcountedRegion::create(&name, isize::MAX as u64 - 10),
        Err(Error::InvalidSize {
            problem: SizeProblem::TooLarge,
            ..
        })
    ));
    assert!(matches!(
        MapOptions::new()
            .create(CreateMode::CreateExclusive)
            .map_shm(&name),
        Err(Error::InvalidSize {
            problem: SizeProblem::Missing,
            ..
        })
    ));
    assert!(!name.path().exists());
}

#[test]
fn huge_but_representable_size_fails_cleanly() {
    // 2^62 bytes: a valid isize, but no machine maps that much: an Os/ENOMEM-style error, the
    // half-created object unlinked again.
    let (name, _cleanup) = fresh_name();
    let err = create(&name, 1 << 62).unwrap_err();
    assert!(
        matches!(err, Error::Os { .. } | Error::InvalidSize { .. }),
        "{err:?}"
    );
    assert!(!name.path().exists(), "{err}");
}

#[test]
fn existence_is_checked_per_create_mode() {
    let (name, _cleanup) = fresh_name();
    assert!(matches!(
        MapOptions::new().map_shm(&name),
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        RefcountedRegion::open(&name),
        Err(Error::NotFound { .. })
    ));
    let _region = create(&name, 4096).unwrap();
    assert!(matches!(
        create(&name, 4096),
        Err(Error::AlreadyExists { .. })
    ));
    assert!(matches!(
        RefcountedRegion::create(&name, 4096),
        Err(Error::AlreadyExists { .. })
    ));
    // Opening with more bytes than the object holds.
    assert!(matches!(
        MapOptions::new().len(8192).map_shm(&name),
        Err(Error::TooSmall {
            actual: 4096,
            needed: 8192,
            ..
        })
    ));
}

/// A descriptor number that is not open in this process (tests run in parallel, so a number
/// just closed could be reused by another thread; this one is far above anything they open).
const NOT_OPEN: i32 = i32::MAX - 7;

#[test]
fn closed_fd_is_an_invalid_fd_error() {
    // SAFETY: the borrowed number is only passed to fstat, which reports EBADF for it; nothing
    // closes or otherwise uses it.
    let closed = unsafe { BorrowedFd::borrow_raw(NOT_OPEN) };
    assert!(matches!(
        MapOptions::new().map_fd(closed),
        Err(Error::InvalidFd { .. })
    ));
}

fn open_dir() -> OwnedFd {
    rustix::fs::open(
        "/tmp",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .unwrap()
}

fn wrong_kinds() -> Vec<(OwnedFd, ObjectKind)> {
    let (sock, _other) = stream_pair();
    let (pipe_read, _pipe_write) = rustix::pipe::pipe().unwrap();
    vec![
        (sock, ObjectKind::Socket),
        (open_dir(), ObjectKind::Directory),
        (pipe_read, ObjectKind::Fifo),
    ]
}

#[test]
fn sockets_directories_and_pipes_are_refused_when_mapped() {
    for (fd, kind) in wrong_kinds() {
        match MapOptions::new().len(16).map_fd(&fd) {
            Err(Error::WrongKind { kind: k, .. }) => assert_eq!(k, kind),
            other => panic!("{kind} gave {other:?}"),
        }
    }
}

#[test]
fn sockets_directories_and_pipes_are_refused_when_received() {
    let (a, b) = stream_pair();
    for (fd, kind) in wrong_kinds() {
        send_fd(&a, fd.as_fd(), 4096, 0, SendOptions::default()).unwrap();
        match recv_region(&b, &MapOptions::new()) {
            Err(Error::WrongKind { kind: k, .. }) => assert_eq!(k, kind),
            other => panic!("{kind} gave {other:?}"),
        }
    }
    // A claimed size beyond the object is refused too.
    let region = SharedRegion::create_anonymous(4096).unwrap();
    send_fd(&a, region.fd().unwrap(), 4097, 0, SendOptions::default()).unwrap();
    assert!(matches!(
        recv_region(&b, &MapOptions::new()),
        Err(Error::TooSmall {
            actual: 4096,
            needed: 4097,
            ..
        })
    ));
    send_fd(&a, region.fd().unwrap(), 100, 4000, SendOptions::default()).unwrap();
    assert!(matches!(
        recv_region(&b, &MapOptions::new()),
        Err(Error::TooSmall { needed: 4100, .. })
    ));
}

#[test]
fn objects_of_another_user_need_an_explicit_opt_in() {
    let (name, _cleanup) = fresh_name();
    let region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(4096)
        .keep_fd(true)
        .map_shm(&name)
        .unwrap();
    let ours = rustix::process::geteuid().as_raw();
    let other = if ours == 0 { 4242 } else { ours };
    // Only root can hand the object to another uid; unprivileged runs rely on the unit test of
    // the owner check (object::tests) instead.
    if rustix::fs::fchown(
        region.fd().unwrap(),
        Some(rustix::fs::Uid::from_raw(other)),
        None,
    )
    .is_err()
    {
        eprintln!("not root: foreign-owner path covered by unit tests only");
        return;
    }
    match MapOptions::new().map_shm(&name) {
        Err(Error::ForeignOwner { owner, ours: o, .. }) => {
            assert_eq!((owner, o), (other, ours));
        }
        other => panic!("foreign object gave {other:?}"),
    }
    assert!(matches!(
        RefcountedRegion::open(&name),
        Err(Error::ForeignOwner { .. })
    ));
    // OpenOrCreate must refuse before growing the foreign object.
    assert!(matches!(
        MapOptions::new()
            .create(CreateMode::OpenOrCreate)
            .len(8192)
            .map_shm(&name),
        Err(Error::ForeignOwner { .. })
    ));
    assert_eq!(std::fs::metadata(name.path()).unwrap().len(), 4096);
    let opened = MapOptions::new()
        .allow_foreign_owner(true)
        .map_shm(&name)
        .unwrap();
    assert_eq!(opened.len(), 4096);
    // The same check guards received descriptors.
    let (a, b) = stream_pair();
    send_fd(&a, region.fd().unwrap(), 4096, 0, SendOptions::default()).unwrap();
    assert!(matches!(
        recv_region(&b, &MapOptions::new()),
        Err(Error::ForeignOwner { .. })
    ));
}

#[test]
fn access_errors() {
    let (name, _cleanup) = fresh_name();
    let mut rw = create(&name, 4096).unwrap();
    let mut ro = MapOptions::new().read_only().map_shm(&name).unwrap();
    assert!(matches!(ro.write_at(0, &[1]), Err(Error::ReadOnly)));
    // SAFETY: the call fails before any slice exists.
    let refused = unsafe { ro.try_as_mut_slice() };
    assert!(matches!(refused, Err(Error::ReadOnly)));
    assert!(matches!(ro.fill(1), Err(Error::ReadOnly)));
    assert!(matches!(ro.atomic::<AtomicU32>(0), Err(Error::ReadOnly)));
    assert!(matches!(ro.write_volatile(0, 1), Err(Error::ReadOnly)));
    assert!(matches!(
        rw.write_at(4090, &[0; 7]),
        Err(Error::OutOfBounds {
            offset: 4090,
            len: 7,
            region_len: 4096
        })
    ));
    assert!(matches!(
        rw.write_at(usize::MAX, &[0; 2]),
        Err(Error::OutOfBounds { .. })
    ));
    let mut buf = [0u8; 2];
    assert!(matches!(
        rw.read_at(4095, &mut buf),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        rw.read_volatile(4096),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        rw.atomic::<AtomicU64>(4),
        Err(Error::Misaligned {
            offset: 4,
            align: 8
        })
    ));
    assert!(matches!(
        rw.atomic::<AtomicU64>(4096 - 4),
        Err(Error::OutOfBounds { .. })
    ));
    rw.write_volatile(5, 9).unwrap();
    assert_eq!(ro.read_volatile(5).unwrap(), 9);
}

#[test]
#[should_panic(expected = "read-only")]
fn as_mut_slice_on_a_read_only_mapping_panics() {
    let (name, _cleanup) = fresh_name();
    let _rw = create(&name, 4096).unwrap();
    let mut ro = MapOptions::new().read_only().map_shm(&name).unwrap();
    // SAFETY: it panics before creating a slice; nobody else uses the object.
    unsafe { ro.as_mut_slice()[0] = 1 };
}

#[test]
fn sending_a_region_without_fd_is_refused() {
    let (name, _cleanup) = fresh_name();
    let region = create(&name, 4096).unwrap();
    let (a, _b) = stream_pair();
    assert!(matches!(
        tensormem_shm::transfer::send_region(&a, &region, SendOptions::default()),
        Err(Error::NoFd { .. })
    ));
}

#[test]
fn error_messages_name_the_object_and_the_remedy() {
    let (name, _cleanup) = fresh_name();
    let msg = MapOptions::new().map_shm(&name).unwrap_err().to_string();
    assert!(msg.contains(name.as_str()), "{msg}");
    assert!(msg.contains("does not exist"), "{msg}");
    let msg = ShmName::new("bad").unwrap_err().to_string();
    assert!(msg.contains("NameGenerator"), "{msg}");
}

#[test]
fn regions_are_as_fd_and_errors_convert_to_io_errors() {
    let region = tensormem_shm::SharedRegion::create_anonymous(4096).unwrap();
    let stat = rustix::fs::fstat(&region).unwrap();
    assert_eq!(stat.st_size, 4096);
    assert_eq!(
        rustix::fs::fstat(region.as_fd()).unwrap().st_ino,
        rustix::fs::fstat(region.fd().unwrap()).unwrap().st_ino
    );

    let (name, _cleanup) = fresh_name();
    let err = MapOptions::new().map_shm(&name).unwrap_err();
    let io: std::io::Error = err.into();
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    let inner = io.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(matches!(inner, Some(Error::NotFound { .. })), "{io:?}");
    let io: std::io::Error = Error::ReadOnly.into();
    assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
}

#[test]
fn a_region_whose_fd_was_taken_says_so_when_sent() {
    let mut region = SharedRegion::create_anonymous(4096).unwrap();
    let fd = region.take_fd().unwrap();
    let (a, b) = stream_pair();
    let err =
        tensormem_shm::transfer::send_region(&a, &region, SendOptions::default()).unwrap_err();
    assert!(matches!(err, Error::FdTaken { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("take_fd") && msg.contains("send_fd"), "{msg}");
    assert!(!msg.contains("keep_fd(true)"), "{msg}");
    // The remedy works: the descriptor taken travels by itself.
    send_fd(&a, fd.as_fd(), 4096, 0, SendOptions::default()).unwrap();
    assert_eq!(
        recv_region(&b, &MapOptions::new()).unwrap().region.len(),
        4096
    );
}

#[test]
fn a_peer_that_hung_up_is_named_the_same_way_on_both_sides() {
    let region = SharedRegion::create_anonymous(4096).unwrap();
    let (a, b) = stream_pair();
    drop(b);
    let err =
        tensormem_shm::transfer::send_region(&a, &region, SendOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Disconnected), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("closed the connection"), "{msg}");
    assert!(
        !msg.contains("arrived"),
        "a send side waits for no message: {msg}"
    );
}

#[test]
fn a_pool_sender_paired_with_send_region_names_both_formats_once() {
    use tensormem_shm::{PoolSender, ShmPool, WireFormat};
    let region = SharedRegion::create_anonymous(4096).unwrap();
    let (a, b) = stream_pair();
    tensormem_shm::transfer::send_region(&a, &region, SendOptions::default()).unwrap();
    let pool = ShmPool::new(Default::default());
    let err = PoolSender::new(&pool, b).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongProtocol {
                expected: WireFormat::Pool,
                got: WireFormat::Region
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("PoolReceiver with PoolSender"), "{msg}");
    assert!(!msg.contains("[84"), "no magic as decimal bytes: {msg}");
}

#[test]
fn a_pool_receiver_paired_with_send_region_says_so_instead_of_waiting() {
    use tensormem_shm::{PoolReceiver, ReceiverOptions, WireFormat};
    let region = SharedRegion::create_anonymous(4096).unwrap();
    let (a, b) = stream_pair();
    tensormem_shm::transfer::send_region(&a, &region, SendOptions::default()).unwrap();
    let mut receiver = PoolReceiver::new(b, ReceiverOptions::default()).unwrap();
    let started = std::time::Instant::now();
    let err = receiver.recv().map(|_| ()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongProtocol {
                expected: WireFormat::Pool,
                got: WireFormat::Region
            }
        ),
        "{err:?}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "found within the liveness interval, not after a long wait"
    );
    assert!(
        err.to_string().contains("PoolReceiver with PoolSender"),
        "{err}"
    );
    // The end stays closed: the next receive says the same, without waiting.
    assert!(receiver.recv().is_err());
    // The plain end, reading, is told what its peer is.
    let err = recv_region(&a, &MapOptions::new()).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongProtocol {
                expected: WireFormat::Region,
                got: WireFormat::Channel
            }
        ),
        "{err:?}"
    );
}

#[test]
fn recv_region_paired_with_a_pool_sender_says_so_instead_of_waiting() {
    use tensormem_shm::{PoolSender, ShmPool, WireFormat};
    let (a, b) = stream_pair();
    // The producer blocks until its consumer set the connection up; a plain receiver never does.
    let producer = std::thread::spawn(move || {
        let pool = ShmPool::new(Default::default());
        PoolSender::new(&pool, a).map(|_| ())
    });
    let err = recv_region(&b, &MapOptions::new()).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongProtocol {
                expected: WireFormat::Region,
                got: WireFormat::Pool
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("PoolReceiver with PoolSender"),
        "{err}"
    );
    // The consumer gives up and closes; the producer's wait ends too.
    drop(b);
    let err = producer.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Disconnected), "{err:?}");
}

#[test]
fn recv_region_paired_with_a_channel_acceptor_says_so_instead_of_waiting() {
    use tensormem_shm::channel::{Channel, ChannelOptions};
    use tensormem_shm::WireFormat;
    let (a, b) = stream_pair();
    let acceptor =
        std::thread::spawn(move || Channel::accept(a, ChannelOptions::default()).map(|_| ()));
    let err = recv_region(&b, &MapOptions::new()).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WrongProtocol {
                expected: WireFormat::Region,
                got: WireFormat::Channel
            }
        ),
        "{err:?}"
    );
    drop(b);
    let err = acceptor.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::PeerGone), "{err:?}");
}

#[test]
fn an_unknown_magic_is_printed_as_text() {
    let msg = tensormem_shm::transfer::RegionHeader::decode(&[b'X'; 256])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("\"XXXX\"") && msg.contains("\"TMSR\""),
        "{msg}"
    );
}
