//! The chunk handle's PyTorch bytes, both ways of taking descriptors, and the descriptor socket's
//! refusals: descriptors not exported, impostors on its name, squatters that never answer.

use std::os::fd::AsRawFd;

use super::*;

fn handle() -> ChunkHandle {
    ChunkHandle {
        pid: 551,
        chunk_size: 20 << 20,
        fds: vec![51, 52],
    }
}

#[test]
fn torch_bytes_round_trip_and_match_pytorchs_layout() {
    let bytes = handle().to_torch();
    // What PyTorch 2.11 wrote for a 25 MiB block over two 20 MiB chunks (pid 551, fds 51, 52).
    let pytorch = "02652702000000000000000040010000000002000000000000003300000034000000";
    assert_eq!(
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        pytorch
    );
    assert_eq!(ChunkHandle::from_torch(&bytes).unwrap(), handle());
    assert_eq!(handle().extent(), 40 << 20);
}

#[test]
fn padding_is_ignored_and_hostile_handles_are_refused() {
    let mut bytes = handle().to_torch();
    bytes[2 + 4] = 0xAB; // PyTorch's uninitialised padding
    assert_eq!(ChunkHandle::from_torch(&bytes).unwrap(), handle());
    let refused = |b: &[u8]| matches!(ChunkHandle::from_torch(b), Err(Error::InvalidTuple { .. }));
    assert!(refused(&bytes[..bytes.len() - 1]), "truncated");
    let mut fabric = bytes[..2 + HEADER_LEN].to_vec();
    fabric.extend_from_slice(&[0u8; 2 * FABRIC_HANDLE_LEN]);
    assert!(refused(&fabric), "fabric handles");
    let mut zero = handle();
    zero.fds.clear();
    assert!(refused(&zero.to_torch()), "no chunks");
    let mut odd = handle();
    odd.chunk_size = 3 << 20;
    assert!(refused(&odd.to_torch()), "chunk size");
    let mut negative = handle().to_torch();
    negative[2 + HEADER_LEN..2 + HEADER_LEN + 4].copy_from_slice(&(-1i32).to_ne_bytes());
    assert!(refused(&negative), "negative fd");
    let mut huge = handle().to_torch();
    huge[2 + 16..2 + 24].copy_from_slice(&u64::MAX.to_ne_bytes());
    assert!(refused(&huge), "count overflow");
    let mut other = handle().to_torch();
    other[1] = b'c';
    assert!(refused(&other), "type byte");
}

#[test]
fn both_routes_copy_descriptors_of_this_process() {
    let memfd =
        |name: &str| rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let (a, b) = (memfd("chunk-a"), memfd("chunk-b"));
    let wanted = ChunkHandle {
        pid: std::process::id(),
        chunk_size: 2 << 20,
        fds: vec![a.as_raw_fd(), b.as_raw_fd()],
    };
    offer(&wanted.fds);
    for routes in [ChunkFdRoutes::SocketOnly, ChunkFdRoutes::Auto] {
        let (fds, route) = wanted.take_descriptors(routes).unwrap();
        if routes == ChunkFdRoutes::SocketOnly {
            assert_eq!(route, FdRoute::Socket);
        }
        assert_eq!(fds.len(), 2);
        for (got, want) in fds.iter().zip([&a, &b]) {
            assert_ne!(
                got.as_raw_fd(),
                want.as_raw_fd(),
                "a copy, not the same number"
            );
            assert_eq!(identity(got.as_fd()), identity(want.as_fd()));
        }
    }
}

#[test]
fn the_socket_refuses_descriptors_not_exported() {
    let secret = rustix::fs::memfd_create("not-shared", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let shared = rustix::fs::memfd_create("shared", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    offer(&[shared.as_raw_fd()]);
    let asked = ChunkHandle {
        pid: std::process::id(),
        chunk_size: 2 << 20,
        fds: vec![shared.as_raw_fd(), secret.as_raw_fd()],
    };
    let err = asked
        .take_descriptors(ChunkFdRoutes::SocketOnly)
        .unwrap_err();
    assert!(
        matches!(&err, Error::ChunkDescriptors { problem, .. } if problem.contains("not exported")),
        "{err}"
    );
    // A number exported once, closed, and reused for another file is refused too.
    let number = shared.as_raw_fd();
    drop(shared);
    let reused = rustix::fs::memfd_create("reused", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let again = ChunkHandle {
        fds: vec![number],
        ..asked
    };
    if reused.as_raw_fd() == number {
        assert!(again.take_descriptors(ChunkFdRoutes::SocketOnly).is_err());
    }
    assert!(is_open(reused.as_raw_fd()));
}

/// A harmless process standing for a producer: its pid names the socket. Killed at the end.
struct StandIn(std::process::Child);

impl StandIn {
    fn spawn() -> Self {
        Self(
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("sleep(1)"),
        )
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn only_the_producer_itself_of_this_user_or_root_may_answer() {
    assert!(is_producer(10, Some(10), 1000, 1000));
    assert!(
        is_producer(10, Some(10), 0, 1000),
        "a producer running as root"
    );
    assert!(!is_producer(10, Some(11), 1000, 1000), "another process");
    assert!(
        !is_producer(10, Some(10), 1001, 1000),
        "the pid, but another user"
    );
    assert!(!is_producer(10, None, 1000, 1000), "a pid not visible here");
}

#[test]
fn a_squatter_that_never_accepts_costs_a_timeout_not_a_hang() {
    let producer = StandIn::spawn();
    let addr = SocketAddrUnix::new_abstract_name(socket_name(producer.pid()).as_bytes()).unwrap();
    let unix = |flags| {
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None).unwrap()
    };
    // Bound first, backlog 0, never accepting, its backlog filled.
    let squatter = unix(SocketFlags::CLOEXEC);
    rustix::net::bind(&squatter, &addr).unwrap();
    rustix::net::listen(&squatter, 0).unwrap();
    let mut queued = Vec::new();
    loop {
        let client = unix(SocketFlags::NONBLOCK | SocketFlags::CLOEXEC);
        match rustix::net::connect(&client, &addr) {
            Ok(()) => queued.push(client),
            Err(Errno::AGAIN) => break,
            Err(e) => panic!("filling the backlog: {e}"),
        }
        assert!(queued.len() < 1024, "the backlog never filled");
    }
    let handle = ChunkHandle {
        pid: producer.pid(),
        chunk_size: 2 << 20,
        fds: vec![3],
    };
    let err = handle
        .take_descriptors_within(ChunkFdRoutes::SocketOnly, Duration::from_millis(200))
        .unwrap_err();
    assert!(
        matches!(&err, Error::ChunkSocketTimedOut { pid, timeout, pidfd: None, .. }
            if *pid == producer.pid() && *timeout == Duration::from_millis(200)),
        "{err}"
    );
    assert!(err.to_string().contains("backlog"), "{err}");
}

#[test]
fn an_impostor_on_the_producers_socket_is_refused_and_hands_nothing_over() {
    let producer = StandIn::spawn();
    let name = socket_name(producer.pid());
    let listener =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    listener.set_nonblocking(true).unwrap();
    let forged = rustix::fs::memfd_create("forged", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    // The squatter answers whatever it is asked with memory of its own; it reports whether it
    // was asked anything.
    let impostor = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut stream = loop {
            match listener.accept() {
                Ok((stream, _)) => break stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no consumer connected");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut head = [0u8; 8];
        if stream.read_exact(&mut head).is_err() {
            return false;
        }
        let count = u32::from_le_bytes(head[4..].try_into().unwrap()) as usize;
        let mut body = vec![0u8; 4 * count];
        let _ = stream.read_exact(&mut body);
        let forged = vec![forged.as_raw_fd(); count];
        let _ = send_reply(&stream, 0, &forged);
        true
    });
    let handle = ChunkHandle {
        pid: producer.pid(),
        chunk_size: 2 << 20,
        fds: vec![7],
    };
    let err = handle
        .take_descriptors_within(ChunkFdRoutes::SocketOnly, Duration::from_secs(20))
        .unwrap_err();
    let me = std::process::id();
    let my_uid = rustix::process::geteuid().as_raw();
    assert!(
        matches!(&err, Error::ImpostorPeer { pid, peer_pid: Some(peer), peer_uid, socket, .. }
            if *pid == producer.pid() && *peer == me && *peer_uid == my_uid && *socket == name),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!(
            "answered by process {me}, uid {my_uid}, not by the producer"
        )),
        "{err}"
    );
    assert!(
        !impostor.join().unwrap(),
        "the consumer asked the impostor for descriptors"
    );
}

#[test]
fn a_missing_producer_is_named() {
    let gone = ChunkHandle {
        pid: i32::MAX as u32 - 7,
        chunk_size: 2 << 20,
        fds: vec![3],
    };
    let err = gone
        .take_descriptors(ChunkFdRoutes::Auto)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("gone") || err.contains("no descriptor socket"),
        "{err}"
    );
}
