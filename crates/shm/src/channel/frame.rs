//! The channel's frames on its Unix socket: the accept frame (the acceptor's first bytes, so that
//! a peer that only reads, such as `recv_region`, is told it was paired wrongly instead of waiting
//! forever), the setup frame (the creator's memfd and the ring geometry) and the fd frames that go
//! before a ring message flagged "an fd follows". Each frame
//! is [`FRAME_LEN`] bytes with at most one fd attached (`SCM_RIGHTS`); on a stream socket the
//! kernel may split the bytes, and the rest is read after the first part (the fd comes with the
//! first byte).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use rustix::fd::{AsRawFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::{Error, Result};
use crate::transfer::{self, RecvOptions};
use crate::wire::WireFormat;

/// Bytes of every frame.
pub(crate) const FRAME_LEN: usize = 16;

/// The first (up to four) bytes queued on the socket, without consuming them or waiting: empty
/// when nothing is queued (or the socket fails; the next real read reports that).
pub(crate) fn peek_head(socket: BorrowedFd<'_>) -> ([u8; 4], usize) {
    let mut head = [0u8; 4];
    loop {
        match rustix::net::recv(socket, &mut head, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((n, _)) => return (head, n.min(head.len())),
            Err(Errno::INTR) => {}
            Err(_) => return (head, 0),
        }
    }
}

/// Sends one frame with `fd` attached if given (blocking).
pub(crate) fn send(
    socket: BorrowedFd<'_>,
    frame: &[u8; FRAME_LEN],
    fd: Option<BorrowedFd<'_>>,
) -> Result<()> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(Error::Protocol {
                wire: WireFormat::Channel,
                problem: "no room for one fd in a control buffer sized for one".into(),
            });
        }
    }
    let sent = loop {
        match rustix::net::sendmsg(
            socket,
            &[IoSlice::new(frame)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(Errno::INTR) => {}
            Err(errno) => return Err(peer_error(errno, "sendmsg")),
        }
    };
    let mut sent = sent;
    while sent < FRAME_LEN {
        match rustix::net::send(socket, &frame[sent..], SendFlags::NOSIGNAL) {
            Ok(n) => sent += n,
            Err(Errno::INTR) => {}
            Err(errno) => return Err(peer_error(errno, "send")),
        }
    }
    Ok(())
}

/// Receives one frame and the fd it carries, if any (blocking).
pub(crate) fn recv(socket: BorrowedFd<'_>) -> Result<([u8; FRAME_LEN], Option<OwnedFd>)> {
    let mut frame = [0u8; FRAME_LEN];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = loop {
        match rustix::net::recvmsg(
            socket,
            &mut [IoSliceMut::new(&mut frame)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(received) => break received,
            Err(Errno::INTR) => {}
            Err(errno) => return Err(peer_error(errno, "recvmsg")),
        }
    };
    // Take ownership of every fd first, so that none leaks whatever is wrong below.
    let mut fds: Vec<OwnedFd> = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if received.bytes == 0 {
        return Err(Error::PeerGone);
    }
    if received
        .flags
        .intersects(ReturnFlags::CTRUNC | ReturnFlags::TRUNC)
    {
        return Err(Error::Protocol {
            wire: WireFormat::Channel,
            problem: "a channel frame or its ancillary data was truncated".into(),
        });
    }
    if received.bytes < FRAME_LEN {
        transfer::recv_exact(socket, &mut frame[received.bytes..], RecvOptions::BLOCKING).map_err(
            |err| match err {
                Error::Disconnected => Error::PeerGone,
                other => other,
            },
        )?;
    }
    if fds.len() > 1 {
        return Err(Error::Protocol {
            wire: WireFormat::Channel,
            problem: format!(
                "a channel frame carries at most one fd, this one {}",
                fds.len()
            ),
        });
    }
    Ok((frame, fds.pop()))
}

/// How long [`recv_within`] may wait for the bytes of a frame that are not there yet.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FrameWait {
    /// Not at all: only what is queued on the socket now.
    Now,
    /// Until this instant.
    Until(Instant),
    /// As long as the peer lives, asking `peer_gone` this often.
    Forever(Duration),
}

/// What [`recv_within`] read.
#[derive(Debug)]
pub(crate) enum FrameRead {
    /// A whole frame and the fd it carried, if any.
    Whole([u8; FRAME_LEN], Option<OwnedFd>),
    /// Only `got` bytes came within the wait (`closed`: the peer then closed its socket).
    Short {
        /// Bytes of the frame that arrived (consumed from the socket).
        got: usize,
        /// The socket reported end of file.
        closed: bool,
    },
}

/// Receives one frame and the fd it carries, waiting for its bytes no longer than `wait` says
/// (`MSG_DONTWAIT` reads, `poll` in between). With [`FrameWait::Forever`], `peer_gone` is asked
/// whenever a wait of the interval passes with nothing new, and ends the wait with
/// [`Error::PeerGone`].
pub(crate) fn recv_within(
    socket: BorrowedFd<'_>,
    wait: FrameWait,
    mut peer_gone: impl FnMut() -> bool,
) -> Result<FrameRead> {
    let mut frame = [0u8; FRAME_LEN];
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while got < FRAME_LEN {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let result = rustix::net::recvmsg(
            socket,
            &mut [IoSliceMut::new(&mut frame[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
        );
        // Take ownership of every fd first, so that none leaks whatever is wrong below.
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = message {
                fds.extend(rights);
            }
        }
        match result {
            Ok(received) if received.bytes == 0 => {
                return Ok(FrameRead::Short { got, closed: true })
            }
            Ok(received) => {
                if received
                    .flags
                    .intersects(ReturnFlags::CTRUNC | ReturnFlags::TRUNC)
                {
                    return Err(Error::Protocol {
                        wire: WireFormat::Channel,
                        problem: "a channel frame or its ancillary data was truncated".into(),
                    });
                }
                got += received.bytes;
            }
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => {
                if !wait_readable(socket, wait, &mut peer_gone)? {
                    return Ok(FrameRead::Short { got, closed: false });
                }
            }
            Err(errno) => return Err(peer_error(errno, "recvmsg")),
        }
    }
    if fds.len() > 1 {
        return Err(Error::Protocol {
            wire: WireFormat::Channel,
            problem: format!(
                "a channel frame carries at most one fd, this one {}",
                fds.len()
            ),
        });
    }
    Ok(FrameRead::Whole(frame, fds.pop()))
}

/// Waits until the socket is readable (or reports a hang-up) within `wait`; `false` once the
/// wait is over with nothing to read.
fn wait_readable(
    socket: BorrowedFd<'_>,
    wait: FrameWait,
    peer_gone: &mut impl FnMut() -> bool,
) -> Result<bool> {
    loop {
        let timeout = match wait {
            FrameWait::Now => return Ok(false),
            FrameWait::Until(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                left
            }
            FrameWait::Forever(every) => every,
        };
        let mut pfd = libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = i32::try_from(timeout.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd, the count says one; the timeout is bounded.
        let rc = unsafe { libc::poll(&mut pfd, 1, millis) };
        if rc > 0 {
            return Ok(true);
        }
        if rc < 0 {
            let errno = Errno::from_raw_os_error(io_errno());
            if errno != Errno::INTR {
                return Err(Error::from_errno(errno, "poll", "channel socket"));
            }
            continue;
        }
        if matches!(wait, FrameWait::Forever(_)) && peer_gone() {
            return Err(Error::PeerGone);
        }
    }
}

fn io_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// `true` if the socket's peer has closed its end (`POLLHUP`/`POLLERR`), without waiting.
pub(crate) fn hung_up(socket: BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, the count says one; a zero timeout never blocks.
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    rc > 0 && pfd.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLRDHUP | libc::POLLNVAL) != 0
}

fn peer_error(errno: Errno, op: &'static str) -> Error {
    match errno {
        Errno::PIPE | Errno::CONNRESET => Error::PeerGone,
        _ => Error::from_errno(errno, op, "channel socket"),
    }
}
