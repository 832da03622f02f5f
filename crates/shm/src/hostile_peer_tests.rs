//! A peer that breaks the channel and pool protocols on purpose and stays alive: every call
//! that promises not to wait (or to wait a bounded time) must come back, with a typed error,
//! and no destructor may block. Each case runs on a thread with a generous limit, so a
//! regression fails the test instead of hanging it.

use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use rustix::fd::AsFd;

use crate::channel::{Channel, ChannelOptions, ChannelSender, MAX_MESSAGE};
use crate::error::Error;
use crate::mapping_cache::{PoolReceiver, ReceiverOptions};
use crate::pool::wire::{self, Header, Kind, Record, POOL_SLOTS};
use crate::pool::{PoolConfig, PoolSender, ShmPool, MAX_LEASES};
use crate::region::SharedRegion;

/// Far longer than any of these calls takes when it does not hang.
const LIMIT: Duration = Duration::from_secs(20);

/// Runs `f` on a thread; panics if it has not returned within [`LIMIT`].
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(LIMIT) {
        Ok(value) => value,
        Err(_) => panic!("{what} did not return within {LIMIT:?}: it waits on a hostile peer"),
    }
}

fn assert_protocol<T: std::fmt::Debug>(what: &str, got: crate::Result<T>) {
    assert!(
        matches!(got, Err(Error::Protocol { .. })),
        "{what}: expected a protocol error, got {got:?}"
    );
}

/// The error names the protocol that was broken, not another one.
fn assert_worded_as<T: std::fmt::Debug>(wire: &str, got: &crate::Result<T>) {
    let Err(err) = got else {
        panic!("expected an error, got {got:?}");
    };
    let text = err.to_string();
    assert!(text.starts_with(&format!("bad {wire} message: ")), "{text}");
    assert!(!text.contains("region protocol"), "{text}");
}

/// How the hostile peer breaks the fd frame.
#[derive(Debug, Clone, Copy)]
enum Breakage {
    /// The ring slot says an fd follows; nothing is sent on the socket.
    FlagOnly,
    /// The slot says so and one byte of the 16-byte frame is sent.
    OneByte,
}

impl Breakage {
    fn apply(self, peer: &mut ChannelSender, message: &[u8]) {
        if let Breakage::OneByte = self {
            rustix::net::send(peer.socket(), b"T", rustix::net::SendFlags::NOSIGNAL).unwrap();
        }
        assert!(peer.push_claiming_fd(message).unwrap());
    }
}

#[derive(Debug, Clone, Copy)]
enum Receive {
    Try,
    Timeout,
    TryWithFd,
    TimeoutWithFd,
}

#[test]
fn a_peer_that_claims_an_fd_and_stays_alive_cannot_stall_bounded_receives() {
    for breakage in [Breakage::FlagOnly, Breakage::OneByte] {
        for receive in [
            Receive::Try,
            Receive::Timeout,
            Receive::TryWithFd,
            Receive::TimeoutWithFd,
        ] {
            let (mut victim, peer) = Channel::pair(ChannelOptions::default()).unwrap();
            let (mut peer_tx, _peer_rx) = peer.split();
            breakage.apply(&mut peer_tx, b"hostile");
            let what = format!("{receive:?} after {breakage:?}");
            let victim = within(&what, move || {
                let mut buf = [0u8; MAX_MESSAGE];
                let timeout = Duration::from_millis(100);
                let got = match receive {
                    Receive::Try => victim.try_recv(&mut buf).map(|_| ()),
                    Receive::Timeout => victim.recv_timeout(&mut buf, timeout).map(|_| ()),
                    Receive::TryWithFd => victim.try_recv_with_fd(&mut buf).map(|_| ()),
                    Receive::TimeoutWithFd => {
                        victim.recv_timeout_with_fd(&mut buf, timeout).map(|_| ())
                    }
                };
                assert_worded_as("channel", &got);
                assert_protocol(&format!("{receive:?} after {breakage:?}"), got);
                // The end stays closed: the socket is out of step with the ring.
                assert_protocol("a later receive", victim.try_recv(&mut buf));
                assert_protocol("a later send", victim.send(b"x"));
                victim
            });
            // The peer sees this end closed.
            assert!(matches!(peer_tx.send(b"more"), Err(Error::PeerGone)));
            drop(victim);
        }
    }
}

#[test]
fn an_fd_sent_correctly_is_received_by_a_non_blocking_receive() {
    let (mut a, mut b) = Channel::pair(ChannelOptions::default()).unwrap();
    let region = SharedRegion::create_anonymous(4096).unwrap();
    for _ in 0..50 {
        a.send_with_fd(b"with fd", region.fd().unwrap()).unwrap();
        let mut buf = [0u8; MAX_MESSAGE];
        let got = b
            .try_recv_with_fd(&mut buf)
            .unwrap()
            .expect("a message is there");
        assert_eq!(&buf[..got.len], b"with fd");
        assert!(got.fd.is_some());
    }
}

/// A pool connection whose consumer end is in the test's hands.
fn hostile_consumer() -> (ShmPool, PoolSender, ChannelSender) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let options = ChannelOptions {
        slots: POOL_SLOTS,
        ..ChannelOptions::default()
    };
    let consumer = Channel::create(theirs, options).unwrap();
    let (mut tx, rx) = consumer.split();
    tx.send(
        &Record::Hello {
            entries: 16,
            bytes: 1 << 30,
        }
        .encode(),
    )
    .unwrap();
    std::mem::forget(rx); // the consumer's receiving half stays open, unread
    let pool = ShmPool::new(PoolConfig {
        prefault: false,
        ..PoolConfig::default()
    });
    let mut sender = PoolSender::new(&pool, ours).unwrap();
    // One lease open, so that every path reads releases.
    let buffer = pool.alloc(4096).unwrap();
    sender.send(&buffer, b"").unwrap();
    drop(buffer);
    (pool, sender, tx)
}

#[test]
fn a_consumer_that_claims_an_fd_cannot_stall_the_producer_or_its_pool() {
    for path in ["poll_releases", "wait_release_timeout", "send", "alloc"] {
        for breakage in [Breakage::FlagOnly, Breakage::OneByte] {
            let (pool, mut sender, mut consumer) = hostile_consumer();
            breakage.apply(&mut consumer, &Record::Release { id: 1 }.encode());
            let what = format!("{path} after {breakage:?}");
            let (pool, sender) = within(&what, move || {
                match path {
                    "poll_releases" => assert_protocol(path, sender.poll_releases()),
                    "wait_release_timeout" => assert_protocol(
                        path,
                        sender.wait_release_timeout(Duration::from_millis(100)),
                    ),
                    "send" => {
                        let buffer = pool.alloc(4096).unwrap();
                        assert_protocol(path, sender.send(&buffer, b""));
                    }
                    _ => {
                        // A cache miss drains releases without waiting; the error is the
                        // sender's to report.
                        let buffer = pool.alloc(4096).unwrap();
                        drop(buffer);
                        assert_protocol("the sender after the pool met it", sender.poll_releases());
                    }
                }
                (pool, sender)
            });
            within(&format!("dropping the sender after {what}"), move || {
                drop(sender);
                drop(pool);
            });
            drop(consumer);
        }
    }
}

/// A pool connection whose producer end is in the test's hands.
fn hostile_producer() -> (PoolReceiver, ChannelSender, SharedRegion) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let receiver = PoolReceiver::new(ours, ReceiverOptions::default()).unwrap();
    let producer = Channel::accept(theirs, ChannelOptions::default()).unwrap();
    let (tx, mut rx) = producer.split();
    let mut hello = [0u8; MAX_MESSAGE];
    rx.recv(&mut hello).unwrap();
    std::mem::forget(rx); // releases are never read
    let region = SharedRegion::create_anonymous(4096).unwrap();
    (receiver, tx, region)
}

fn message(kind: Kind, id: u64) -> Vec<u8> {
    let header = Header {
        kind,
        transient: false,
        id,
        len: 4096,
        map_len: 4096,
        user_len: 0,
    };
    let message = wire::encode(&header, &[]).unwrap();
    message[..wire::ring_len(&message)].to_vec()
}

#[test]
fn a_producer_that_claims_an_fd_cannot_stall_the_consumers_poll() {
    for breakage in [Breakage::FlagOnly, Breakage::OneByte] {
        let (receiver, mut producer, _region) = hostile_producer();
        breakage.apply(&mut producer, &message(Kind::New, 1));
        let receiver = within(&format!("poll after {breakage:?}"), move || {
            let mut receiver = receiver;
            assert_protocol("poll", receiver.poll());
            receiver
        });
        drop(receiver);
    }
}

#[test]
fn a_producer_over_the_lease_limit_is_refused_and_no_lease_drop_waits() {
    let (receiver, mut producer, region) = hostile_producer();
    let (receiver, leases, refused) = within("receiving 300 leases", move || {
        let mut receiver = receiver;
        let mut leases = Vec::new();
        let mut refused = 0;
        for n in 0..300u64 {
            if n == 0 {
                producer
                    .send_with_fd(&message(Kind::New, 1), region.fd().unwrap().as_fd())
                    .unwrap();
            } else {
                producer.send(&message(Kind::Known, 1)).unwrap();
            }
            match receiver.recv() {
                Ok(lease) => leases.push(lease),
                Err(err @ Error::Protocol { .. }) => {
                    assert_worded_as::<()>("pool", &Err(err));
                    refused += 1;
                }
                Err(other) => panic!("lease {n}: {other:?}"),
            }
        }
        // The producer never reads what comes back.
        std::mem::forget(producer);
        (receiver, leases, refused)
    });
    if leases.len() != MAX_LEASES || refused != 300 - MAX_LEASES {
        let accepted = leases.len();
        // Dropping them here could block this very thread: the bug this test catches.
        std::mem::forget((leases, receiver));
        panic!(
            "{accepted} leases accepted and {refused} refused; at most {MAX_LEASES} may be open"
        );
    }
    within("dropping every lease", move || {
        drop(leases);
        drop(receiver);
    });
}
