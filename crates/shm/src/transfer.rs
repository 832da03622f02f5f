//! Passing regions between processes over a Unix domain socket: the fd travels as `SCM_RIGHTS`
//! ancillary data, next to a fixed-size message saying how many bytes the receiver may map
//! (PyTorch's fd strategy sends `(fd, size)` the same way, through Python's `multiprocessing`).
//!
//! # Wire format
//!
//! Every message is exactly [`MESSAGE_LEN`] bytes, integers little-endian, with one fd attached:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `b"TMSR"` |
//! | 4..6 | version (1) |
//! | 6..8 | flags: bit 0 = the sender grants read-only access |
//! | 8..16 | `len`: data bytes the receiver maps |
//! | 16..24 | `offset`: where the data starts in the object |
//! | 24..26 | `user_len`: bytes of application data that follow (at most [`MAX_USER_DATA`]) |
//! | 26..32 | zero |
//! | 32..32+user_len | application data; zero up to [`MESSAGE_LEN`] |
//!
//! A fixed size keeps framing trivial on `SOCK_STREAM` (read exactly one message) and on
//! `SOCK_SEQPACKET` (one message per packet).
//!
//! # What the receiver checks
//!
//! The claimed size is never trusted: before mapping, the receiver `fstat`s the fd and refuses
//! objects that are not regular files / memfds / shm objects ([`Error::WrongKind`]: sockets,
//! directories, pipes), that another user owns ([`Error::ForeignOwner`], unless allowed), or that
//! hold fewer than `offset + len` bytes ([`Error::TooSmall`]: a producer that truncated the object
//! after sending it gets an error at attach, not a SIGBUS later). Regions from
//! [`SharedRegion::create_anonymous`] are sealed so they cannot shrink after the check either; for
//! unsealed objects [`Backing::Fd`](crate::Backing::Fd)`{ sealed: false }` tells the receiver that
//! a peer could still truncate it under the mapping.
//!
//! Attaching is an `fstat`, an `fcntl(F_GET_SEALS)` and an `mmap`: no page is touched or faulted in
//! (unless [`MapOptions::populate`] asks for it).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::{Error, Result};
use crate::mapping::Access;
use crate::region::{MapOptions, SharedRegion};
use crate::wire::{WireFormat, REGION_MAGIC};

/// Size of every region message.
pub const MESSAGE_LEN: usize = 256;

/// Bytes of the fixed header before the application data.
pub const HEADER_LEN: usize = 32;

/// Most application bytes a message carries.
pub const MAX_USER_DATA: usize = MESSAGE_LEN - HEADER_LEN;

const VERSION: u16 = 1;
const FLAG_READ_ONLY: u16 = 1;

/// The fixed part of a region message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionHeader {
    /// Data bytes the receiver maps.
    pub len: u64,
    /// Where the data starts in the object.
    pub offset: u64,
    /// The sender grants read-only access: the receiver maps read-only whatever it asks for.
    pub read_only: bool,
    /// Length of the application data that follows.
    pub user_len: u16,
}

impl RegionHeader {
    /// The header's [`HEADER_LEN`] wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&REGION_MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if self.read_only { FLAG_READ_ONLY } else { 0 };
        out[6..8].copy_from_slice(&flags.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..26].copy_from_slice(&self.user_len.to_le_bytes());
        out
    }

    /// Parses and validates header bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] for a short buffer, wrong magic or version, unknown flags, non-zero
    /// reserved bytes, `user_len` over [`MAX_USER_DATA`], or `len` of zero.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let protocol = |problem: String| {
            Err(Error::Protocol {
                wire: WireFormat::Region,
                problem,
            })
        };
        let Some(b) = bytes.get(..HEADER_LEN) else {
            return protocol(format!(
                "{} header bytes, expected {HEADER_LEN}",
                bytes.len()
            ));
        };
        if b[0..4] != REGION_MAGIC {
            return Err(WireFormat::Region.bad_magic(b));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let version = u16_at(4);
        if version != VERSION {
            return protocol(format!("version {version}, this end speaks {VERSION}"));
        }
        let flags = u16_at(6);
        if flags & !FLAG_READ_ONLY != 0 {
            return protocol(format!("unknown flags {flags:#x}"));
        }
        if b[26..32].iter().any(|&x| x != 0) {
            return protocol("reserved bytes are not zero".to_owned());
        }
        let header = Self {
            len: u64_at(8),
            offset: u64_at(16),
            read_only: flags & FLAG_READ_ONLY != 0,
            user_len: u16_at(24),
        };
        if usize::from(header.user_len) > MAX_USER_DATA {
            return protocol(format!(
                "{} bytes of application data, at most {MAX_USER_DATA} fit",
                header.user_len
            ));
        }
        if header.len == 0 {
            return protocol("a region of 0 bytes".to_owned());
        }
        Ok(header)
    }
}

/// How to share a region: which part, with what access, and what to say with it.
#[derive(Debug, Clone, Copy, Default)]
pub struct SendOptions<'a> {
    /// Application data sent with the region (at most [`MAX_USER_DATA`] bytes).
    pub user: &'a [u8],
    /// Grant read-only access.
    pub read_only: bool,
}

/// Sends `region` (its kept fd and its length) over the Unix socket `socket`.
///
/// # Errors
///
/// [`Error::NoFd`] if the region kept no descriptor (map it with `keep_fd(true)` or create it
/// with [`SharedRegion::create_anonymous`]); [`Error::FdTaken`] if its descriptor was taken with
/// [`SharedRegion::take_fd`]; [`Error::Protocol`] for too much application data;
/// [`Error::Disconnected`] if the peer is gone; [`Error::Os`] for other `sendmsg` failures.
pub fn send_region(
    socket: impl AsFd,
    region: &SharedRegion,
    options: SendOptions<'_>,
) -> Result<()> {
    let fd = region.fd().ok_or_else(|| region.no_fd_error())?;
    send_fd(socket, fd, region.len() as u64, 0, options)
}

/// Sends any mappable `fd`, claiming `len` data bytes starting `offset` bytes into the object.
///
/// # Errors
///
/// As [`send_region`].
pub fn send_fd(
    socket: impl AsFd,
    fd: BorrowedFd<'_>,
    len: u64,
    offset: u64,
    options: SendOptions<'_>,
) -> Result<()> {
    let user_len = u16::try_from(options.user.len())
        .ok()
        .filter(|&n| usize::from(n) <= MAX_USER_DATA)
        .ok_or_else(|| Error::Protocol {
            wire: WireFormat::Region,
            problem: format!(
                "{} bytes of application data, at most {MAX_USER_DATA} fit",
                options.user.len()
            ),
        })?;
    let header = RegionHeader {
        len,
        offset,
        read_only: options.read_only,
        user_len,
    };
    let mut message = [0u8; MESSAGE_LEN];
    message[..HEADER_LEN].copy_from_slice(&header.encode());
    message[HEADER_LEN..HEADER_LEN + options.user.len()].copy_from_slice(options.user);

    let fds = [fd];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let pushed = control.push(SendAncillaryMessage::ScmRights(&fds));
    debug_assert!(pushed, "cmsg_space!(ScmRights(1)) holds one fd");

    let socket = socket.as_fd();
    let mut sent = loop {
        match rustix::net::sendmsg(
            socket,
            &[IoSlice::new(&message)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(socket_error(errno, "sendmsg")),
        }
    };
    // A stream socket may take part of the message; the fd went with the first byte.
    while sent < MESSAGE_LEN {
        match rustix::net::send(socket, &message[sent..], SendFlags::NOSIGNAL) {
            Ok(n) => sent += n,
            Err(Errno::INTR) => {}
            Err(errno) => return Err(socket_error(errno, "send")),
        }
    }
    tracing::trace!(len, offset, "sent region");
    Ok(())
}

/// A region received from a peer, attached, with the application data sent along.
#[derive(Debug)]
pub struct Received {
    /// The attached region (its fd kept if the options asked for it).
    pub region: SharedRegion,
    /// What the sender claimed and granted.
    pub header: RegionHeader,
    user: [u8; MAX_USER_DATA],
}

impl Received {
    /// The application data sent with the region.
    pub fn user_data(&self) -> &[u8] {
        &self.user[..usize::from(self.header.user_len)]
    }
}

/// How a receiving call waits for its peer.
///
/// By default (`spin` zero) a call blocks in the kernel until data arrives: the thread sleeps and
/// the sender's write wakes it. A wake-up is cheap on bare metal but costs several microseconds
/// where the CPU was idle (an inter-processor interrupt; in a virtual machine also a VM exit and
/// the host rescheduling the vCPU), and a round trip has two of them. With `spin` above zero the
/// call first polls for up to that long (non-blocking `recvmsg` / `recv` in a loop with
/// [`std::hint::spin_loop`] between attempts), so a message that comes within `spin` is taken
/// without any wake-up; after `spin` it blocks as usual, so a slow sender still gets through.
///
/// The trade-off: while it waits, a spinning call keeps a core 100% busy (and, on a machine with
/// fewer cores than busy threads, can delay the very peer it waits for). Use it on latency
/// critical paths where the peer answers within microseconds and a core can be spared; keep
/// `spin` short (tens to hundreds of microseconds) so an idle peer costs little.
///
/// ```
/// use std::time::Duration;
/// use tensormem_shm::transfer::RecvOptions;
///
/// let low_latency = RecvOptions::spinning(Duration::from_micros(100));
/// assert_eq!(RecvOptions::default().spin, Duration::ZERO); // blocking
/// # let _ = low_latency;
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecvOptions {
    /// How long to poll before blocking; zero (the default) blocks at once.
    pub spin: Duration,
}

impl RecvOptions {
    /// Blocks at once (the default).
    pub const BLOCKING: Self = Self {
        spin: Duration::ZERO,
    };

    /// Polls for up to `spin` before blocking.
    pub const fn spinning(spin: Duration) -> Self {
        Self { spin }
    }
}

/// Receives one region message from `socket`, checks the object and maps it, blocking until a
/// message comes ([`recv_region_with`] can spin first).
///
/// From `options`, `access` (downgraded to read-only if the sender granted only that),
/// `keep_fd`, `allow_foreign_owner`, `populate` and `huge_pages` apply; the length comes from the
/// message.
///
/// # Errors
///
/// [`Error::Disconnected`] if the peer closed the socket; [`Error::Protocol`] for a malformed
/// message, a message with no fd or several, or lost ancillary data; and the attach errors:
/// [`Error::WrongKind`], [`Error::TooSmall`], [`Error::ForeignOwner`], [`Error::InvalidSize`].
pub fn recv_region(socket: impl AsFd, options: &MapOptions) -> Result<Received> {
    recv_region_with(socket, options, RecvOptions::BLOCKING)
}

/// [`recv_region`], waiting as `recv` says (spinning first for the lowest latency).
///
/// # Errors
///
/// As [`recv_region`].
pub fn recv_region_with(
    socket: impl AsFd,
    options: &MapOptions,
    recv: RecvOptions,
) -> Result<Received> {
    let (fd, message) = recv_message(socket.as_fd(), recv)?;
    let header = RegionHeader::decode(&message)?;
    let mut user = [0u8; MAX_USER_DATA];
    user.copy_from_slice(&message[HEADER_LEN..]);
    let options = if header.read_only {
        options.clone().access(Access::ReadOnly)
    } else {
        options.clone()
    };
    let offset = usize::try_from(header.offset).map_err(|_| Error::Protocol {
        wire: WireFormat::Region,
        problem: format!("offset {} does not fit in memory", header.offset),
    })?;
    let region = options.map_owned_fd(fd, header.len, offset)?;
    tracing::debug!(len = header.len, "attached received region");
    Ok(Received {
        region,
        header,
        user,
    })
}

/// Reads exactly `buf.len()` bytes from a stream socket, waiting as `recv` says: for small
/// replies on the same socket (an acknowledgement after [`send_region`]) with the same
/// low-latency option as [`recv_region_with`].
///
/// # Errors
///
/// [`Error::Disconnected`] if the peer closed the socket first; [`Error::Os`] for other `recv`
/// failures.
pub fn recv_exact(socket: impl AsFd, buf: &mut [u8], recv: RecvOptions) -> Result<()> {
    let socket = socket.as_fd();
    let mut got = 0;
    while got < buf.len() {
        let n = wait_and(recv.spin, |flags| {
            rustix::net::recv(socket, &mut buf[got..], flags).map(|(n, _)| n)
        })
        .map_err(|errno| socket_error(errno, "recv"))?;
        if n == 0 {
            return Err(Error::Disconnected);
        }
        got += n;
    }
    Ok(())
}

/// Runs the receiving call `call` with the flags to use: first non-blocking
/// (`MSG_DONTWAIT`) in a loop for up to `spin`, then blocking. `EINTR` is retried.
pub(crate) fn wait_and<T>(
    spin: Duration,
    mut call: impl FnMut(RecvFlags) -> rustix::io::Result<T>,
) -> rustix::io::Result<T> {
    if !spin.is_zero() {
        let start = Instant::now();
        loop {
            match call(RecvFlags::DONTWAIT) {
                Err(Errno::AGAIN | Errno::INTR) => {}
                done => return done,
            }
            if start.elapsed() >= spin {
                break;
            }
            for _ in 0..SPIN_HINTS {
                std::hint::spin_loop();
            }
            // The peer may be waiting for this very CPU (the scheduler likes to put two
            // processes that wake each other on one CPU); let it run. With nothing else
            // runnable here, `sched_yield` returns at once.
            std::thread::yield_now();
        }
    }
    loop {
        match call(RecvFlags::empty()) {
            Err(Errno::INTR) => {}
            done => return done,
        }
    }
}

/// `spin_loop` hints between two polls: the poll and the `sched_yield` after it already take a
/// few hundred nanoseconds, so a short pause suffices to give the core's pipeline to a
/// hyperthread sibling.
const SPIN_HINTS: u32 = 16;

/// Reads exactly one message and its single fd.
fn recv_message(socket: BorrowedFd<'_>, recv: RecvOptions) -> Result<(OwnedFd, [u8; MESSAGE_LEN])> {
    let mut message = [0u8; MESSAGE_LEN];
    // Room for a few fds: a peer sending more gets a protocol error and the extras are closed.
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = wait_and(recv.spin, |flags| {
        rustix::net::recvmsg(
            socket,
            &mut [IoSliceMut::new(&mut message)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | flags,
        )
    })
    .map_err(|errno| socket_error(errno, "recvmsg"))?;
    if received.bytes == 0 {
        return Err(Error::Disconnected);
    }
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = msg {
            fds.extend(rights);
        }
    }
    if received.flags.contains(ReturnFlags::CTRUNC) {
        return Err(Error::Protocol {
            wire: WireFormat::Region,
            problem: "ancillary data was truncated (more fds than one message carries)".into(),
        });
    }
    if received.flags.contains(ReturnFlags::TRUNC) {
        return Err(Error::Protocol {
            wire: WireFormat::Region,
            problem: format!("a packet longer than {MESSAGE_LEN} bytes"),
        });
    }
    let mut got = received.bytes;
    if got < MESSAGE_LEN {
        // On a packet socket every message is one packet: a short one is malformed, and reading
        // on would splice the next message (and lose its fd) or block for one that never comes.
        if !is_stream(socket)? {
            return Err(Error::Protocol {
                wire: WireFormat::Region,
                problem: format!(
                    "a packet of {got} bytes; region messages are {MESSAGE_LEN} bytes"
                ),
            });
        }
        // A stream socket may deliver the message in parts; the fd came with the first.
        if got < REGION_MAGIC.len() {
            recv_exact(socket, &mut message[got..REGION_MAGIC.len()], recv)?;
            got = REGION_MAGIC.len();
        }
    }
    // A peer of another format (a pool producer's or a channel's first frame is 16 bytes) is
    // told apart by its first four bytes, before waiting for the rest of a region message that
    // would never come.
    if message[0..4] != REGION_MAGIC {
        return Err(WireFormat::Region.bad_magic(&message[..4]));
    }
    if got < MESSAGE_LEN {
        recv_exact(socket, &mut message[got..], recv)?;
    }
    let count = fds.len();
    match <[OwnedFd; 1]>::try_from(fds) {
        Ok([fd]) => Ok((fd, message)),
        Err(_) => Err(Error::Protocol {
            wire: WireFormat::Region,
            problem: format!("a region message carries exactly one fd, this one carried {count}"),
        }),
    }
}

/// `true` for a stream socket (its messages may arrive in parts), `false` for a packet socket.
fn is_stream(socket: BorrowedFd<'_>) -> Result<bool> {
    let kind = rustix::net::sockopt::socket_type(socket)
        .map_err(|errno| socket_error(errno, "getsockopt(SO_TYPE)"))?;
    Ok(kind == rustix::net::SocketType::STREAM)
}

pub(crate) fn socket_error(errno: Errno, op: &'static str) -> Error {
    match errno {
        Errno::PIPE | Errno::CONNRESET => Error::Disconnected,
        _ => Error::from_errno(errno, op, "region socket"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

    fn pair(kind: SocketType) -> (OwnedFd, OwnedFd) {
        socketpair(AddressFamily::UNIX, kind, SocketFlags::CLOEXEC, None).unwrap()
    }

    #[test]
    fn round_trip_in_process_on_stream_and_seqpacket() {
        for kind in [SocketType::STREAM, SocketType::SEQPACKET] {
            let (a, b) = pair(kind);
            let mut region = SharedRegion::create_anonymous(10_000).unwrap();
            region.write_at(9_999, &[5]).unwrap();
            let options = SendOptions {
                user: b"tensor 7",
                read_only: false,
            };
            send_region(&a, &region, options).unwrap();
            let got = recv_region(&b, &MapOptions::new()).unwrap();
            assert_eq!(got.region.len(), 10_000);
            assert_eq!(got.user_data(), b"tensor 7");
            assert_eq!(got.region.read_volatile(9_999).unwrap(), 5);
            assert!(matches!(
                got.region.backing(),
                crate::Backing::Fd { sealed: true }
            ));
        }
    }

    #[test]
    fn read_only_grant_is_enforced() {
        let (a, b) = pair(SocketType::STREAM);
        let region = SharedRegion::create_anonymous(4096).unwrap();
        let options = SendOptions {
            user: &[],
            read_only: true,
        };
        send_region(&a, &region, options).unwrap();
        let mut got = recv_region(&b, &MapOptions::new()).unwrap();
        assert_eq!(got.region.access(), Access::ReadOnly);
        assert!(matches!(got.region.write_at(0, &[1]), Err(Error::ReadOnly)));
    }

    #[test]
    fn message_without_fd_or_closed_peer() {
        let (a, b) = pair(SocketType::STREAM);
        let bytes = [0u8; MESSAGE_LEN];
        rustix::net::send(&a, &bytes, SendFlags::empty()).unwrap();
        assert!(matches!(
            recv_region(&b, &MapOptions::new()),
            Err(Error::Protocol { .. })
        ));
        drop(a);
        assert!(matches!(
            recv_region(&b, &MapOptions::new()),
            Err(Error::Disconnected)
        ));
    }

    #[test]
    fn too_much_user_data_is_refused() {
        let (a, _b) = pair(SocketType::STREAM);
        let region = SharedRegion::create_anonymous(4096).unwrap();
        let big = [0u8; MAX_USER_DATA + 1];
        let options = SendOptions {
            user: &big,
            read_only: false,
        };
        assert!(matches!(
            send_region(&a, &region, options),
            Err(Error::Protocol { .. })
        ));
    }

    #[test]
    fn spinning_receive_gets_a_waiting_message() {
        for kind in [SocketType::STREAM, SocketType::SEQPACKET] {
            let (a, b) = pair(kind);
            let mut region = SharedRegion::create_anonymous(1 << 20).unwrap();
            region.write_at((1 << 20) - 1, &[9]).unwrap();
            let options = SendOptions {
                user: b"spin",
                read_only: false,
            };
            send_region(&a, &region, options).unwrap();
            let recv = RecvOptions::spinning(Duration::from_secs(5));
            let got = recv_region_with(&b, &MapOptions::new(), recv).unwrap();
            assert_eq!(got.user_data(), b"spin");
            assert_eq!(got.region.len(), 1 << 20);
            assert_eq!(got.region.read_volatile((1 << 20) - 1).unwrap(), 9);
        }
    }

    #[test]
    fn spinning_receive_gets_a_message_sent_while_it_spins() {
        let (a, b) = pair(SocketType::STREAM);
        let sender = std::thread::spawn(move || {
            let region = SharedRegion::create_anonymous(4096).unwrap();
            for round in 0u8..20 {
                send_region(&a, &region, SendOptions::default()).unwrap();
                let mut answer = [0u8; 1];
                recv_exact(
                    &a,
                    &mut answer,
                    RecvOptions::spinning(Duration::from_secs(5)),
                )
                .unwrap();
                assert_eq!(answer[0], round);
            }
        });
        let recv = RecvOptions::spinning(Duration::from_secs(5));
        for round in 0u8..20 {
            let got = recv_region_with(&b, &MapOptions::new(), recv).unwrap();
            assert_eq!(got.region.len(), 4096);
            rustix::net::send(&b, &[round], SendFlags::empty()).unwrap();
        }
        sender.join().unwrap();
    }

    #[test]
    fn slow_sender_falls_back_to_blocking() {
        let (a, b) = pair(SocketType::STREAM);
        let sender = std::thread::spawn(move || {
            // Far longer than the receiver spins: it must be blocked in recvmsg by now.
            std::thread::sleep(Duration::from_millis(100));
            let mut region = SharedRegion::create_anonymous(8192).unwrap();
            region.write_at(0, &[7]).unwrap();
            send_region(&a, &region, SendOptions::default()).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            rustix::net::send(&a, b"late", SendFlags::empty()).unwrap();
        });
        let recv = RecvOptions::spinning(Duration::from_micros(200));
        let got = recv_region_with(&b, &MapOptions::new(), recv).unwrap();
        assert_eq!(got.region.read_volatile(0).unwrap(), 7);
        let mut reply = [0u8; 4];
        recv_exact(&b, &mut reply, recv).unwrap();
        assert_eq!(&reply, b"late");
        sender.join().unwrap();
    }

    #[test]
    fn spinning_receive_sees_a_closed_peer() {
        let (a, b) = pair(SocketType::STREAM);
        drop(a);
        let recv = RecvOptions::spinning(Duration::from_millis(1));
        assert!(matches!(
            recv_region_with(&b, &MapOptions::new(), recv),
            Err(Error::Disconnected)
        ));
        let mut buf = [0u8; 1];
        assert!(matches!(
            recv_exact(&b, &mut buf, recv),
            Err(Error::Disconnected)
        ));
        assert!(matches!(
            recv_exact(&b, &mut buf, RecvOptions::BLOCKING),
            Err(Error::Disconnected)
        ));
    }
}
