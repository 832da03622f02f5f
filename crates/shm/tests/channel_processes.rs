//! The shared-memory channel between real processes: this test binary re-executes itself as the
//! peer (role in an environment variable; hence its own `main`, no libtest). A watchdog ends the
//! run if a wait that must end does not.
//!
//! Run with `cargo test -p tensormem-shm --test channel_processes [-- FILTER]`.

use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Stdio;
use std::time::Duration;

use tensormem_shm::channel::{Channel, ChannelOptions, MAX_MESSAGE};
use tensormem_shm::Error;
use tensormem_test_support::child;
use tensormem_test_support::harness::{self, RoleResult, Test, Watchdog};

const ROLE: &str = "TENSORMEM_CHANNEL_TEST_ROLE";
const SOCKET: &str = "TENSORMEM_CHANNEL_TEST_SOCKET";
/// A wait that should end within the liveness interval (50 ms) but has not after this long is
/// a hang.
const WATCHDOG: Duration = Duration::from_secs(60);

const TESTS: &[Test] = &[
    (
        "messages_cross_processes_in_order_both_ways",
        messages_cross_processes_in_order_both_ways,
    ),
    (
        "a_receiver_asleep_sees_a_killed_peer_gone",
        a_receiver_asleep_sees_a_killed_peer_gone,
    ),
    (
        "a_sender_asleep_on_a_full_ring_sees_a_killed_peer_gone",
        a_sender_asleep_on_a_full_ring_sees_a_killed_peer_gone,
    ),
    (
        "a_peer_that_exits_normally_is_gone_after_its_messages",
        a_peer_that_exits_normally_is_gone_after_its_messages,
    ),
];

const MESSAGES: u32 = 20_000;

fn message(i: u32) -> Vec<u8> {
    let len = (i as usize * 37) % (MAX_MESSAGE + 1);
    (0..len).map(|k| (i as usize ^ k) as u8).collect()
}

fn main() {
    let watchdog = Watchdog {
        binary: "channel_processes",
        after: WATCHDOG,
    };
    harness::main(ROLE, run_role, TESTS, Some(watchdog));
}

/// The peer process, connected over a Unix socket; killed if the test fails before it exits.
struct Peer {
    child: child::Peer,
    dir: tempfile::TempDir,
}

impl Peer {
    /// Spawns the peer in `role`; returns it and this end of the connection.
    fn spawn(role: &str) -> (Self, UnixStream) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let child = child::Peer(
            child::this_binary()
                .env(ROLE, role)
                .env(SOCKET, &path)
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let (socket, _) = listener.accept().unwrap();
        (Self { child, dir }, socket)
    }

    fn kill(&mut self) {
        self.child.kill9();
    }

    fn wait_success(mut self) {
        let status = self.child.wait().unwrap();
        assert!(status.success(), "peer exited with {status}");
        let _ = &self.dir;
    }
}

fn run_role(role: &str) -> RoleResult {
    let path = std::env::var(SOCKET)?;
    let socket = UnixStream::connect(path)?;
    let mut channel = Channel::accept(socket, ChannelOptions::default())?;
    let mut buf = [0u8; MAX_MESSAGE];
    match role {
        // Checks every message and sends it back.
        "echo" => loop {
            let n = match channel.recv(&mut buf) {
                Ok(n) => n,
                Err(Error::PeerGone) => return Ok(()),
                Err(err) => return Err(err.into()),
            };
            channel.send(&buf[..n])?;
        },
        // Says it is ready, then never reads or writes again (until killed).
        "idle" => {
            channel.send(b"ready")?;
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        // Sends three messages and exits (its end is dropped first).
        "three" => {
            for i in 0..3u32 {
                channel.send(&message(i))?;
            }
            Ok(())
        }
        other => Err(format!("unknown role {other}").into()),
    }
}

fn messages_cross_processes_in_order_both_ways() {
    let (peer, socket) = Peer::spawn("echo");
    let options = ChannelOptions {
        slots: 8, // small: both rings fill and both sides wait for room
        ..ChannelOptions::default()
    };
    let (mut tx, mut rx) = Channel::create(socket, options).unwrap().split();
    let sender = std::thread::spawn(move || {
        for i in 0..MESSAGES {
            tx.send(&message(i)).unwrap();
        }
        tx
    });
    let mut buf = [0u8; MAX_MESSAGE];
    for i in 0..MESSAGES {
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &message(i)[..], "echo of message {i}");
    }
    drop(sender.join().unwrap());
    drop(rx);
    peer.wait_success();
}

fn a_receiver_asleep_sees_a_killed_peer_gone() {
    let (mut peer, socket) = Peer::spawn("idle");
    let mut channel = Channel::create(socket, ChannelOptions::default()).unwrap();
    let mut buf = [0u8; MAX_MESSAGE];
    assert_eq!(channel.recv(&mut buf).unwrap(), 5);
    let (_tx, mut rx) = channel.split();
    let sleeper = std::thread::spawn(move || rx.recv(&mut buf));
    std::thread::sleep(Duration::from_millis(100)); // asleep in the futex by now
    peer.kill();
    assert!(matches!(sleeper.join().unwrap(), Err(Error::PeerGone)));
}

fn a_sender_asleep_on_a_full_ring_sees_a_killed_peer_gone() {
    let (mut peer, socket) = Peer::spawn("idle");
    let options = ChannelOptions {
        slots: 2,
        ..ChannelOptions::default()
    };
    let mut channel = Channel::create(socket, options).unwrap();
    let mut buf = [0u8; MAX_MESSAGE];
    assert_eq!(channel.recv(&mut buf).unwrap(), 5);
    let (mut tx, _rx) = channel.split();
    tx.send(b"1").unwrap();
    tx.send(b"2").unwrap();
    let sender = std::thread::spawn(move || tx.send(b"3"));
    std::thread::sleep(Duration::from_millis(100));
    peer.kill();
    assert!(matches!(sender.join().unwrap(), Err(Error::PeerGone)));
}

fn a_peer_that_exits_normally_is_gone_after_its_messages() {
    let (peer, socket) = Peer::spawn("three");
    let mut channel = Channel::create(socket, ChannelOptions::default()).unwrap();
    let mut buf = [0u8; MAX_MESSAGE];
    for i in 0..3u32 {
        let n = channel.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &message(i)[..]);
    }
    assert!(matches!(channel.recv(&mut buf), Err(Error::PeerGone)));
    peer.wait_success();
}
