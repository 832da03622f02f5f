//! A shared-memory message channel between two processes: two single-producer /
//! single-consumer rings of small fixed-size messages in one memfd that both map, with `futex`
//! doorbells, so that a message costs no system call while the receiver is awake (or spinning),
//! and one `futex` wake when it announced that it sleeps.
//!
//! # Why
//!
//! A message on a Unix socket is a `sendmsg` and a `recvmsg` (with ancillary parsing), plus the
//! socket's own wake-up of a sleeping reader: measured on a 2-core VM with both processes on one
//! CPU, a socket ping-pong round trip costs 4.2 µs (seqpacket) to 5.1 µs (stream), a `futex` on
//! shared memory 2.7 µs. The channel keeps the socket for what only it can do: passing fds (a
//! ring message can say "an fd follows on the socket", [`Channel::send_with_fd`]) and telling
//! that the peer's process is gone (the kernel closes its end).
//!
//! # How it works
//!
//! One memfd (sealed against shrinking and growing, so the peer cannot truncate it under this
//! side's mapping) holds a header, each side's "closed" flag and two rings of `slots` slots of
//! 512 bytes (a message of at most [`MAX_MESSAGE`] bytes each). The side that
//! [creates](Channel::create) the channel passes the memfd over an existing Unix socket; the other
//! [accepts](Channel::accept) it; [`Channel::pair`] makes both ends in one process (before a
//! `fork`).
//!
//! Sending copies the message into the next slot and publishes it (a release store of the ring's
//! head); then, after a fence, it reads the receiver's doorbell word and makes a `futex` wake call
//! only if the receiver announced that it sleeps. A receiver with nothing to read spins for
//! [`ChannelOptions::spin`] (default 0: it sleeps at once), then announces that it sleeps, looks
//! once more, and `futex`-waits (the protocol, and why no wake-up is lost, is in the `ring`
//! module; a loom model checks it). A full ring makes the sender wait the same way for a free
//! slot.
//!
//! # A peer that dies or misbehaves
//!
//! - Dropping an end marks it closed in shared memory and wakes the peer: the peer's receives
//!   return what was sent before, then [`Error::PeerGone`](crate::Error::PeerGone); its sends fail with it at once.
//! - A process killed with `kill -9` marks nothing, but the kernel closes its socket: a sleeping
//!   side wakes every [`ChannelOptions::liveness_interval`] (default 50 ms) and looks for the
//!   socket's hang-up, so it returns [`Error::PeerGone`](crate::Error::PeerGone) within that interval. (If the peer's
//!   socket end was inherited by another live process, e.g. over a `fork`, there is no hang-up
//!   to see until that process closes it too.)
//! - A peer that speaks another of this crate's formats (a `send_region` or `recv_region` peer,
//!   the ends paired wrongly) is [`Error::WrongProtocol`](crate::Error::WrongProtocol), never a
//!   wait for each other: the acceptor writes a small accept frame before it reads the setup (so
//!   a reading peer gets bytes it can name), and a receive that waits on an empty ring looks at
//!   the socket every liveness interval for bytes no channel peer sends there.
//! - Each side keeps its own index privately and checks every index and length the peer wrote
//!   before using it: a peer scribbling on the shared memory makes this side return
//!   [`Error::ChannelCorrupt`](crate::Error::ChannelCorrupt), never panic or read out of bounds. Message bytes are copied with
//!   atomic word loads and stores, so a peer writing a slot while it is read yields garbage bytes
//!   (the peer's own fault), not undefined behaviour. A live peer that simply stops reading or
//!   writing can still keep this side waiting: use [`Channel::recv_timeout`] where that matters.
//! - A message flagged "an fd follows" is matched with its frame on the socket within the
//!   receive's own wait: at once for [`Channel::try_recv`], within the timeout for
//!   [`Channel::recv_timeout`]. A correct sender queues the frame before it publishes the
//!   message, so a frame that is missing or short (a peer that set the flag, or sent part of a
//!   frame, and stays alive) is [`Error::Protocol`](crate::Error::Protocol), never a wait
//!   beyond the caller's: the socket is then out of step with the ring, so this end closes (the
//!   peer sees it gone) and every later call on it returns the same error.
//!
//! # Example
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use tensormem_shm::channel::{Channel, ChannelOptions, MAX_MESSAGE};
//!
//! // Normally the two ends live in two processes, connected by a UnixListener.
//! let (a, b) = UnixStream::pair()?;
//! let mut producer = Channel::create(a, ChannelOptions::default())?; // makes and sends the memfd
//! let mut consumer = Channel::accept(b, ChannelOptions::default())?; // maps it
//!
//! producer.send(b"hello")?;
//! producer.send(&[7u8; MAX_MESSAGE])?;
//! let mut buf = [0u8; MAX_MESSAGE];
//! let n = consumer.recv(&mut buf)?;
//! assert_eq!(&buf[..n], b"hello");
//! assert_eq!(consumer.recv(&mut buf)?, MAX_MESSAGE);
//! consumer.send(b"and back")?; // both directions
//! assert_eq!(producer.recv(&mut buf)?, 8);
//!
//! drop(producer);
//! assert!(matches!(consumer.recv(&mut buf), Err(tensormem_shm::Error::PeerGone)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod endpoint;
pub(crate) mod frame;
mod futex;
pub(crate) mod layout;
#[cfg(all(test, loom))]
mod loom_models;
mod ring;

use std::time::Duration;

pub use endpoint::{Channel, ChannelReceiver, ChannelSender, Received};

/// Longest message a channel carries, in bytes.
pub const MAX_MESSAGE: usize = ring::MAX_MESSAGE;

/// Most slots per direction.
pub const MAX_SLOTS: u32 = 1 << 16;

/// How a channel is shaped and how its ends wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelOptions {
    /// Slots per direction: how many messages can wait unread before a sender waits (a power
    /// of two, 1 to [`MAX_SLOTS`]; default 64). Set by the creating side; the accepting side
    /// takes the creator's.
    pub slots: u32,
    /// How long a receiver with nothing to read (or a sender facing a full ring) spins before
    /// sleeping in the kernel (default 0: it sleeps at once). Spinning trades a CPU for the
    /// wake-up's latency.
    pub spin: Duration,
    /// How often a sleeping end checks that its peer's process still holds the socket (default
    /// 50 ms): the bound on noticing a peer killed with `kill -9`.
    pub liveness_interval: Duration,
}

impl Default for ChannelOptions {
    fn default() -> Self {
        Self {
            slots: 64,
            spin: Duration::ZERO,
            liveness_interval: Duration::from_millis(50),
        }
    }
}
