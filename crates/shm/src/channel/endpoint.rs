//! [`Channel`] and its halves: setting the channel up over a socket, sending, receiving,
//! waiting, and noticing a peer that is gone.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};

use super::frame::{self, FrameRead, FrameWait, FRAME_LEN};
use super::layout::{self, Memory, VERSION};
use super::ring::{self, Consumer, Corrupt, Producer, Stop, WaitPlan, SLOT_FD};
use super::{ChannelOptions, MAX_MESSAGE, MAX_SLOTS};
use crate::error::{Error, Result, SizeProblem};
use crate::region::{MapOptions, SharedRegion};
use crate::wire::{WireFormat, ACCEPT_MAGIC, CHANNEL_MAGIC, FD_MAGIC, POOL_MAGIC};

/// What both halves of one end share: the mapping, the socket, which side this is.
struct Shared {
    memory: Memory,
    socket: OwnedFd,
    /// 0: the creator (sends on ring 0), 1: the acceptor.
    side: usize,
    liveness: Duration,
    /// Set when the peer broke the protocol in a way that leaves the channel out of step (an
    /// fd frame missing or short): every later call on either half fails with it.
    broken: OnceLock<String>,
}

impl Shared {
    fn send_ring(&self) -> ring::Ring<'_> {
        self.memory.ring(self.side)
    }

    fn recv_ring(&self) -> ring::Ring<'_> {
        self.memory.ring(1 - self.side)
    }

    /// The peer dropped its end (a load; no system call).
    fn peer_closed(&self) -> bool {
        self.memory.closed(1 - self.side).load(Ordering::Acquire) != 0
    }

    /// The peer dropped its end, or its process closed the socket (one `poll`).
    fn peer_gone(&self) -> bool {
        self.peer_closed() || frame::hung_up(self.socket.as_fd())
    }

    /// Fails if an earlier protocol error closed this end.
    fn check_broken(&self) -> Result<()> {
        match self.broken.get() {
            Some(problem) => Err(Error::Protocol {
                wire: WireFormat::Channel,
                problem: format!(
                    "this channel end was closed after the peer broke the protocol ({problem})"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Closes this end for good after the peer broke the protocol: the peer sees it closed
    /// (its sends fail, its receives end), and every later call here fails with `problem`.
    fn break_off(&self, problem: String) -> Error {
        tracing::warn!(
            problem = %problem,
            "shared-memory channel peer broke the protocol; closing this end"
        );
        let _ = self.broken.set(problem.clone());
        self.memory.closed(self.side).store(1, Ordering::SeqCst);
        ring::wake_unconditionally(&self.send_ring().control.rx_sleep.0);
        ring::wake_unconditionally(&self.recv_ring().control.tx_sleep.0);
        Error::Protocol {
            wire: WireFormat::Channel,
            problem,
        }
    }

    /// What the peer queued on the socket, if it is no frame of this channel: a peer that
    /// speaks another of the crate's formats (a `send_region` peer, paired wrongly) writes its
    /// messages on the socket and never on the ring, so a receive would otherwise wait for the
    /// ring forever. One `MSG_PEEK`; the error closes this end as [`break_off`](Self::break_off)
    /// does.
    fn foreign_on_socket(&self) -> Option<Error> {
        let (head, n) = frame::peek_head(self.socket.as_fd());
        if n == 0 || is_frame_head(&head[..n]) {
            return None;
        }
        let err = WireFormat::Channel.bad_magic(&head[..n]);
        let _ = self.break_off(err.to_string());
        Some(err)
    }

    fn plan(&self, spin: Duration, deadline: Option<Instant>) -> WaitPlan {
        WaitPlan {
            spin,
            check_every: Some(self.liveness),
            deadline,
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Closed first, then the wake-ups: a peer that announced its sleep before reading the
        // flag is woken, one that reads the flag later sees it (ring module docs).
        self.memory.closed(self.side).store(1, Ordering::SeqCst);
        ring::wake_unconditionally(&self.send_ring().control.rx_sleep.0);
        ring::wake_unconditionally(&self.recv_ring().control.tx_sleep.0);
    }
}

/// `true` if `head` (the first bytes queued on the socket) can start a frame this channel reads:
/// an fd frame, or the acceptor's accept frame (a plain channel's or a pool's).
fn is_frame_head(head: &[u8]) -> bool {
    [FD_MAGIC, ACCEPT_MAGIC, POOL_MAGIC]
        .iter()
        .any(|magic| magic.starts_with(head))
}

/// `true` if `frame` is an acceptor's accept frame (it carries no fd).
fn is_accept_frame(frame: &[u8; FRAME_LEN]) -> bool {
    frame[0..4] == ACCEPT_MAGIC || frame[0..4] == POOL_MAGIC
}

fn corrupt(c: Corrupt) -> Error {
    Error::ChannelCorrupt { problem: c.0 }
}

fn stopped(stop: Stop<Error>) -> Option<Error> {
    match stop {
        Stop::TimedOut => None,
        Stop::Peer(err) => Some(err),
        Stop::Corrupt(c) => Some(corrupt(c)),
    }
}

/// How long an operation may wait.
#[derive(Clone, Copy)]
enum Wait {
    Never,
    Forever,
    Until(Instant),
}

/// A message received with [`ChannelReceiver::recv_with_fd`]: its length in the buffer given,
/// and the fd the sender attached, if any.
#[derive(Debug)]
pub struct Received {
    /// Bytes of the message (at the start of the buffer given).
    pub len: usize,
    /// The fd sent with it ([`ChannelSender::send_with_fd`]).
    pub fd: Option<OwnedFd>,
}

/// The sending half of a [`Channel`] end (single producer: `&mut self`).
pub struct ChannelSender {
    shared: Arc<Shared>,
    producer: Producer,
    spin: Duration,
}

/// The receiving half of a [`Channel`] end (single consumer: `&mut self`).
pub struct ChannelReceiver {
    shared: Arc<Shared>,
    consumer: Consumer,
    spin: Duration,
    /// The creator's end: the acceptor's accept frame may still be queued on the socket, ahead
    /// of the first fd frame, and is read and dropped there.
    accept_frame_pending: bool,
}

/// One end of a shared-memory channel: sends to and receives from the other end (see the
/// [module docs](super)). [`split`](Self::split) gives the halves to two threads.
pub struct Channel {
    tx: ChannelSender,
    rx: ChannelReceiver,
}

impl ChannelSender {
    /// Sends `message` (at most [`MAX_MESSAGE`] bytes), waiting while the ring is full.
    ///
    /// # Errors
    ///
    /// [`Error::MessageTooLarge`]; [`Error::PeerGone`] if the other end is gone (nothing sent);
    /// [`Error::ChannelCorrupt`] if the receiver's index is not one a correct peer writes.
    pub fn send(&mut self, message: &[u8]) -> Result<()> {
        self.send_as(message, 0, Wait::Forever).map(|_| ())
    }

    /// Sends `message` if a slot is free, without waiting: `Ok(false)` (nothing sent) if the
    /// ring is full.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    pub fn try_send(&mut self, message: &[u8]) -> Result<bool> {
        self.send_as(message, 0, Wait::Never)
    }

    /// Sends `fd` on the socket and then `message` on the ring, flagged so that the receiver's
    /// [`recv_with_fd`](ChannelReceiver::recv_with_fd) takes the fd with it (waiting for a free
    /// slot first, so the two always pair up).
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send); socket failures as [`Error::Os`].
    pub fn send_with_fd(&mut self, message: &[u8], fd: BorrowedFd<'_>) -> Result<()> {
        check_len(message)?;
        self.reserve(Wait::Forever)?;
        let mut out = [0u8; FRAME_LEN];
        out[0..4].copy_from_slice(&FD_MAGIC);
        out[8..12].copy_from_slice(&self.producer.position().to_le_bytes());
        frame::send(self.shared.socket.as_fd(), &out, Some(fd))?;
        let ring = self.shared.send_ring();
        match self.producer.push(ring, message, SLOT_FD) {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::ChannelCorrupt {
                problem: "a reserved slot was taken: the receiver's index moved back".into(),
            }),
            Err(c) => Err(corrupt(c)),
        }
    }

    /// Changes how long a send facing a full ring spins before sleeping.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Messages sent that the receiver has not taken yet, as this side last saw (it reads the
    /// receiver's index only when the ring looks full).
    pub fn in_flight(&self) -> u32 {
        self.producer.in_flight()
    }

    /// Messages sent that the receiver has not taken yet, reading the receiver's index now
    /// (exact at the moment of the read; [`in_flight`](Self::in_flight) may be stale).
    ///
    /// # Errors
    ///
    /// [`Error::ChannelCorrupt`] if the receiver's index is not one a correct peer writes.
    pub fn unread(&mut self) -> Result<u32> {
        let ring = self.shared.send_ring();
        self.producer.unread(ring).map_err(corrupt)
    }

    /// `false` once the other end is known to be gone: it dropped its end, or its socket
    /// reports a hang-up (one `poll`).
    pub fn is_peer_alive(&self) -> bool {
        !self.shared.peer_gone()
    }

    /// The socket the channel was set up over (it carries the fds).
    pub fn socket(&self) -> BorrowedFd<'_> {
        self.shared.socket.as_fd()
    }

    /// Publishes `message` flagged "an fd follows on the socket" without sending the frame:
    /// what a broken or hostile peer does.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn push_claiming_fd(&mut self, message: &[u8]) -> Result<bool> {
        self.send_as(message, SLOT_FD, Wait::Never)
    }

    fn send_as(&mut self, message: &[u8], flags: u64, wait: Wait) -> Result<bool> {
        check_len(message)?;
        if !self.reserve(wait)? {
            return Ok(false);
        }
        let ring = self.shared.send_ring();
        self.producer.push(ring, message, flags).map_err(corrupt)
    }

    /// Makes sure a slot is free, waiting as `wait` says; `false` if it did not wait and none is.
    fn reserve(&mut self, wait: Wait) -> Result<bool> {
        let shared = &*self.shared;
        shared.check_broken()?;
        if shared.peer_closed() {
            return Err(Error::PeerGone);
        }
        let ring = shared.send_ring();
        if self.producer.free(ring).map_err(corrupt)? > 0 {
            return Ok(true);
        }
        let deadline = match wait {
            Wait::Never => return Ok(false),
            Wait::Forever => None,
            Wait::Until(at) => Some(at),
        };
        let producer = &mut self.producer;
        let result = ring::wait_for(
            &ring.control.tx_sleep.0,
            shared.plan(self.spin, deadline),
            || Ok(producer.free(ring)?.checked_sub(1).map(|_| ())),
            || shared.peer_closed().then_some(Error::PeerGone),
            || shared.peer_gone().then_some(Error::PeerGone),
        );
        match result {
            Ok(()) => Ok(true),
            Err(stop) => stopped(stop).map_or(Ok(false), Err),
        }
    }
}

impl ChannelReceiver {
    /// Receives the next message into `buf`, waiting for one; returns its length. An fd sent
    /// with it is closed (use [`recv_with_fd`](Self::recv_with_fd) to keep it).
    ///
    /// # Errors
    ///
    /// [`Error::PeerGone`] once the other end is gone and every message it sent was received;
    /// [`Error::BufferTooSmall`] (the message stays queued); [`Error::ChannelCorrupt`];
    /// [`Error::Protocol`] if the message says an fd follows on the socket and no whole fd
    /// frame is there (waited for as long as the receive waits, here while the peer lives):
    /// this end is then closed, and every later call on it fails the same way.
    pub fn recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.recv_as(buf, Wait::Forever)
            .map(|got| got.map_or(0, |r| r.len))
    }

    /// Receives the next message if one is there, without waiting.
    ///
    /// # Errors
    ///
    /// As [`recv`](Self::recv) ([`Error::PeerGone`] only once the other end dropped its end:
    /// telling a killed peer takes a system call, [`ChannelSender::is_peer_alive`]). An fd
    /// frame that is not whole on the socket at once is [`Error::Protocol`]: a correct sender
    /// queues it before it publishes the message.
    pub fn try_recv(&mut self, buf: &mut [u8]) -> Result<Option<usize>> {
        Ok(self.recv_as(buf, Wait::Never)?.map(|r| r.len))
    }

    /// Receives the next message, waiting at most `timeout` in all (an fd frame included);
    /// `Ok(None)` if none came.
    ///
    /// # Errors
    ///
    /// As [`recv`](Self::recv); an fd frame not whole by the end of `timeout` is
    /// [`Error::Protocol`].
    pub fn recv_timeout(&mut self, buf: &mut [u8], timeout: Duration) -> Result<Option<usize>> {
        let wait = Instant::now()
            .checked_add(timeout)
            .map_or(Wait::Forever, Wait::Until);
        Ok(self.recv_as(buf, wait)?.map(|r| r.len))
    }

    /// [`recv`](Self::recv), keeping the fd sent with the message.
    ///
    /// # Errors
    ///
    /// As [`recv`](Self::recv); [`Error::Protocol`] if the ring says an fd follows and the
    /// socket carries a frame without one or for another message.
    pub fn recv_with_fd(&mut self, buf: &mut [u8]) -> Result<Received> {
        self.recv_as(buf, Wait::Forever)?.ok_or(Error::PeerGone)
    }

    /// [`try_recv`](Self::try_recv), keeping the fd sent with the message.
    ///
    /// # Errors
    ///
    /// As [`recv_with_fd`](Self::recv_with_fd), with [`try_recv`](Self::try_recv)'s rule for
    /// the fd frame (it must be on the socket at once).
    pub fn try_recv_with_fd(&mut self, buf: &mut [u8]) -> Result<Option<Received>> {
        self.recv_as(buf, Wait::Never)
    }

    /// [`recv_timeout`](Self::recv_timeout), keeping the fd sent with the message.
    ///
    /// # Errors
    ///
    /// As [`recv_with_fd`](Self::recv_with_fd), with [`recv_timeout`](Self::recv_timeout)'s
    /// rule for the fd frame (it must be whole by the end of `timeout`).
    pub fn recv_timeout_with_fd(
        &mut self,
        buf: &mut [u8],
        timeout: Duration,
    ) -> Result<Option<Received>> {
        let wait = Instant::now()
            .checked_add(timeout)
            .map_or(Wait::Forever, Wait::Until);
        self.recv_as(buf, wait)
    }

    /// Changes how long a receive with nothing to read spins before sleeping.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// How long a receive spins before sleeping.
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// `false` once the other end is known to be gone (see [`ChannelSender::is_peer_alive`]).
    pub fn is_peer_alive(&self) -> bool {
        !self.shared.peer_gone()
    }

    /// The socket the channel was set up over (it carries the fds).
    pub fn socket(&self) -> BorrowedFd<'_> {
        self.shared.socket.as_fd()
    }

    fn recv_as(&mut self, buf: &mut [u8], wait: Wait) -> Result<Option<Received>> {
        let shared = &*self.shared;
        shared.check_broken()?;
        let ring = shared.recv_ring();
        let consumer = &mut self.consumer;
        let peeked = match consumer.peek(ring).map_err(corrupt)? {
            Some(peeked) => peeked,
            None => {
                let deadline = match wait {
                    // The peer published everything before closing: look once more.
                    Wait::Never if shared.peer_closed() => match consumer.peek(ring) {
                        Ok(Some(peeked)) => return self.take(peeked, buf, wait),
                        Ok(None) => return Err(Error::PeerGone),
                        Err(c) => return Err(corrupt(c)),
                    },
                    Wait::Never => return Ok(None),
                    Wait::Forever => None,
                    Wait::Until(at) => Some(at),
                };
                let waited = ring::wait_for(
                    &ring.control.rx_sleep.0,
                    shared.plan(self.spin, deadline),
                    || consumer.peek(ring),
                    || shared.peer_closed().then_some(Error::PeerGone),
                    || {
                        shared
                            .foreign_on_socket()
                            .or_else(|| shared.peer_gone().then_some(Error::PeerGone))
                    },
                );
                match waited {
                    Ok(peeked) => peeked,
                    Err(stop) => return stopped(stop).map_or(Ok(None), Err),
                }
            }
        };
        self.take(peeked, buf, wait)
    }

    /// Takes the message `peeked` describes into `buf`, with its fd if flagged. The fd frame is
    /// read within the caller's `wait`: a correct sender queues it on the socket before it
    /// publishes the message, so it is there at once; one that is missing or short by the end
    /// of the wait is a protocol error, which closes this end (the socket's byte stream is out
    /// of step with the ring from then on).
    fn take(
        &mut self,
        peeked: ring::Peeked,
        buf: &mut [u8],
        wait: Wait,
    ) -> Result<Option<Received>> {
        let shared = &*self.shared;
        let ring = shared.recv_ring();
        let consumer = &mut self.consumer;
        if peeked.len > buf.len() {
            return Err(Error::BufferTooSmall {
                needed: peeked.len,
                len: buf.len(),
            });
        }
        let position = consumer.position();
        consumer.take(ring, peeked, buf);
        if peeked.flags & SLOT_FD == 0 {
            return Ok(Some(Received {
                len: peeked.len,
                fd: None,
            }));
        }
        let frame_wait = match wait {
            Wait::Never => FrameWait::Now,
            Wait::Until(at) => FrameWait::Until(at),
            Wait::Forever => FrameWait::Forever(shared.liveness),
        };
        let read = loop {
            let read = match frame::recv_within(shared.socket.as_fd(), frame_wait, || {
                shared.peer_gone()
            }) {
                Ok(read) => read,
                Err(Error::Protocol { problem, .. }) => return Err(shared.break_off(problem)),
                Err(err) => return Err(err),
            };
            // The acceptor queued its accept frame before anything else it sends.
            if std::mem::take(&mut self.accept_frame_pending) {
                if let FrameRead::Whole(got, None) = &read {
                    if is_accept_frame(got) {
                        continue;
                    }
                }
            }
            break read;
        };
        let problem = match read {
            FrameRead::Whole(got, fd) => {
                let mut expected = [0u8; FRAME_LEN];
                expected[0..4].copy_from_slice(&FD_MAGIC);
                expected[8..12].copy_from_slice(&position.to_le_bytes());
                match fd {
                    Some(fd) if got == expected => {
                        return Ok(Some(Received {
                            len: peeked.len,
                            fd: Some(fd),
                        }))
                    }
                    None => format!(
                        "message {position} says an fd follows on the socket; the frame there carries no fd"
                    ),
                    Some(_) => format!(
                        "message {position} says an fd follows on the socket; the frame there is for another message"
                    ),
                }
            }
            FrameRead::Short { got, closed } => {
                let when = match (closed, wait) {
                    (true, _) => "before the peer closed its socket",
                    (false, Wait::Never) => "when it was received without waiting",
                    (false, _) => "within the receive's timeout",
                };
                format!(
                    "message {position} says an fd follows on the socket, but {got} of the fd \
                     frame's {FRAME_LEN} bytes were there {when} (a sender queues the whole \
                     frame before it publishes the message)"
                )
            }
        };
        Err(shared.break_off(problem))
    }
}

fn check_len(message: &[u8]) -> Result<()> {
    if message.len() > MAX_MESSAGE {
        return Err(Error::MessageTooLarge {
            len: message.len(),
            max: MAX_MESSAGE,
        });
    }
    Ok(())
}

fn check_slots(slots: u32) -> Result<()> {
    if slots == 0 || slots > MAX_SLOTS || !slots.is_power_of_two() {
        return Err(Error::InvalidSize {
            object: "shared-memory channel".into(),
            len: slots.into(),
            problem: SizeProblem::SlotCount,
        });
    }
    Ok(())
}

impl Channel {
    /// Makes the channel's memory (a sealed memfd of `options.slots` slots per direction) and
    /// sends it over `socket`, a connected Unix socket (stream or seqpacket) whose other end
    /// calls [`accept`](Self::accept). Does not wait for the peer. The channel keeps the socket:
    /// it carries fds ([`ChannelSender::send_with_fd`]) and tells when the peer's process is
    /// gone.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSize`] for a slot count that is not a power of two from 1 to
    /// [`MAX_SLOTS`]; [`Error::Protocol`] where no sealed memfd can be made; [`Error::PeerGone`]
    /// or [`Error::Os`] if the socket fails.
    pub fn create(socket: impl Into<OwnedFd>, options: ChannelOptions) -> Result<Self> {
        let socket = socket.into();
        check_slots(options.slots)?;
        let region = SharedRegion::create_anonymous(layout::total_len(options.slots) as u64)?;
        let memory = Memory::new(region, options.slots)?;
        let header = header_words(options.slots);
        for (i, word) in header.iter().enumerate() {
            memory.header_word(i).store(*word, Ordering::Relaxed);
        }
        let fd = memory.region().fd().ok_or_else(|| Error::NoFd {
            object: "shared-memory channel".into(),
        })?;
        frame::send(socket.as_fd(), &frame_of(&header), Some(fd))?;
        tracing::debug!(slots = options.slots, "created a shared-memory channel");
        let mut channel = Self::from_shared(memory, socket, 0, options);
        channel.rx.accept_frame_pending = true;
        Ok(channel)
    }

    /// Receives the channel's memory from the peer's [`create`](Self::create) on `socket`
    /// (waiting for it) and maps it. The slot count is the creator's; `spin` and
    /// `liveness_interval` of `options` apply to this end.
    ///
    /// # Errors
    ///
    /// [`Error::PeerGone`] if the peer hung up first; [`Error::Protocol`] if what came is not a
    /// channel's setup (no fd, another magic or version, a bad slot count, an fd that is not
    /// sealed against shrinking); the checks of a received fd ([`Error::WrongKind`],
    /// [`Error::TooSmall`], [`Error::ForeignOwner`]); [`Error::ChannelCorrupt`] if the memory's
    /// header disagrees with the setup message.
    pub fn accept(socket: impl Into<OwnedFd>, options: ChannelOptions) -> Result<Self> {
        Self::accept_as(socket.into(), options, ACCEPT_MAGIC)
    }

    /// [`accept`](Self::accept), announcing itself with an accept frame of magic `magic` first
    /// (a pool's producer sends the pool's, so that a `recv_region` peer names the pool).
    pub(crate) fn accept_as(
        socket: OwnedFd,
        options: ChannelOptions,
        magic: [u8; 4],
    ) -> Result<Self> {
        // First write, then read: a peer that only reads (`recv_region`, another format's
        // receiver) gets these bytes and reports the wrong pairing instead of both ends waiting
        // for each other. A creator that already closed its end is no error here: what it sent
        // before closing is still to be read.
        let mut hello = [0u8; FRAME_LEN];
        hello[0..4].copy_from_slice(&magic);
        hello[4..8].copy_from_slice(&VERSION.to_le_bytes());
        match frame::send(socket.as_fd(), &hello, None) {
            Ok(()) | Err(Error::PeerGone) => {}
            Err(err) => return Err(err),
        }
        let (got, fd) = frame::recv(socket.as_fd())?;
        let word = |i: usize| {
            u32::from_le_bytes([got[4 * i], got[4 * i + 1], got[4 * i + 2], got[4 * i + 3]])
        };
        if got[0..4] != CHANNEL_MAGIC {
            return Err(WireFormat::Channel.bad_magic(&got));
        }
        if word(1) != VERSION || word(3) != 0 {
            return Err(Error::Protocol {
                wire: WireFormat::Channel,
                problem: format!(
                    "a channel setup of version {} (reserved word {}), this end speaks version {VERSION}",
                    word(1),
                    word(3)
                ),
            });
        }
        let slots = word(2);
        check_slots(slots).map_err(|_| Error::Protocol {
            wire: WireFormat::Channel,
            problem: format!(
                "the creator announced {slots} slots, not a power of two from 1 to {MAX_SLOTS}"
            ),
        })?;
        let fd = fd.ok_or_else(|| Error::Protocol {
            wire: WireFormat::Channel,
            problem: "the channel setup carried no fd".into(),
        })?;
        let region = MapOptions::new().map_owned_fd(fd, layout::total_len(slots) as u64, 0)?;
        let memory = Memory::new(region, slots)?;
        let header = header_words(slots);
        for (i, word) in header.iter().enumerate() {
            if memory.header_word(i).load(Ordering::Relaxed) != *word {
                return Err(Error::ChannelCorrupt {
                    problem: "the memory's header does not match the setup message".into(),
                });
            }
        }
        tracing::debug!(slots, "accepted a shared-memory channel");
        Ok(Self::from_shared(memory, socket, 1, options))
    }

    /// Both ends in this process, over a new socket pair: make it before a `fork` and keep one
    /// end in each process (drop the other one there, or its socket keeps the peer from seeing
    /// a hang-up).
    ///
    /// # Errors
    ///
    /// As [`create`](Self::create).
    pub fn pair(options: ChannelOptions) -> Result<(Self, Self)> {
        let (a, b) = std::os::unix::net::UnixStream::pair().map_err(|source| Error::Os {
            object: "shared-memory channel".into(),
            op: "socketpair",
            source,
        })?;
        let first = Self::create(a, options)?;
        let second = Self::accept(b, options)?;
        Ok((first, second))
    }

    fn from_shared(memory: Memory, socket: OwnedFd, side: usize, options: ChannelOptions) -> Self {
        let shared = Arc::new(Shared {
            memory,
            socket,
            side,
            liveness: options.liveness_interval.max(Duration::from_millis(1)),
            broken: OnceLock::new(),
        });
        Self {
            tx: ChannelSender {
                shared: Arc::clone(&shared),
                producer: Producer::default(),
                spin: options.spin,
            },
            rx: ChannelReceiver {
                shared,
                consumer: Consumer::default(),
                spin: options.spin,
                accept_frame_pending: false,
            },
        }
    }

    /// See [`ChannelSender::send`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn send(&mut self, message: &[u8]) -> Result<()> {
        self.tx.send(message)
    }

    /// See [`ChannelSender::try_send`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn try_send(&mut self, message: &[u8]) -> Result<bool> {
        self.tx.try_send(message)
    }

    /// See [`ChannelSender::send_with_fd`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn send_with_fd(&mut self, message: &[u8], fd: BorrowedFd<'_>) -> Result<()> {
        self.tx.send_with_fd(message, fd)
    }

    /// See [`ChannelReceiver::recv`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.rx.recv(buf)
    }

    /// See [`ChannelReceiver::try_recv`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn try_recv(&mut self, buf: &mut [u8]) -> Result<Option<usize>> {
        self.rx.try_recv(buf)
    }

    /// See [`ChannelReceiver::recv_timeout`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn recv_timeout(&mut self, buf: &mut [u8], timeout: Duration) -> Result<Option<usize>> {
        self.rx.recv_timeout(buf, timeout)
    }

    /// See [`ChannelReceiver::recv_with_fd`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn recv_with_fd(&mut self, buf: &mut [u8]) -> Result<Received> {
        self.rx.recv_with_fd(buf)
    }

    /// See [`ChannelReceiver::try_recv_with_fd`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn try_recv_with_fd(&mut self, buf: &mut [u8]) -> Result<Option<Received>> {
        self.rx.try_recv_with_fd(buf)
    }

    /// See [`ChannelReceiver::recv_timeout_with_fd`].
    ///
    /// # Errors
    ///
    /// As there.
    pub fn recv_timeout_with_fd(
        &mut self,
        buf: &mut [u8],
        timeout: Duration,
    ) -> Result<Option<Received>> {
        self.rx.recv_timeout_with_fd(buf, timeout)
    }

    /// Sets how long both halves spin before sleeping.
    pub fn set_spin(&mut self, spin: Duration) {
        self.tx.set_spin(spin);
        self.rx.set_spin(spin);
    }

    /// See [`ChannelSender::is_peer_alive`].
    pub fn is_peer_alive(&self) -> bool {
        self.tx.is_peer_alive()
    }

    /// Slots per direction.
    pub fn slots(&self) -> u32 {
        self.tx.shared.memory.slots()
    }

    /// The sending and the receiving half, for two threads (the end is closed for the peer
    /// when both are dropped).
    pub fn split(self) -> (ChannelSender, ChannelReceiver) {
        (self.tx, self.rx)
    }
}

fn header_words(slots: u32) -> [u32; 4] {
    [u32::from_le_bytes(CHANNEL_MAGIC), VERSION, slots, 0]
}

fn frame_of(words: &[u32; 4]) -> [u8; FRAME_LEN] {
    let mut out = [0u8; FRAME_LEN];
    for (i, word) in words.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&word.to_le_bytes());
    }
    out
}

impl AsFd for Channel {
    /// The socket the channel was set up over.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.tx.shared.socket.as_fd()
    }
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("tx", &self.tx)
            .field("rx", &self.rx)
            .finish()
    }
}

impl fmt::Debug for ChannelSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelSender")
            .field("side", &self.shared.side)
            .field("slots", &self.shared.memory.slots())
            .field("in_flight", &self.producer.in_flight())
            .field("spin", &self.spin)
            .finish()
    }
}

impl fmt::Debug for ChannelReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelReceiver")
            .field("side", &self.shared.side)
            .field("slots", &self.shared.memory.slots())
            .field("spin", &self.spin)
            .finish()
    }
}
