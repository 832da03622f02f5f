//! The channel's frames on its Unix socket: the setup frame (the creator's memfd and the ring
//! geometry) and the fd frames that go before a ring message flagged "an fd follows". Each frame
//! is [`FRAME_LEN`] bytes with at most one fd attached (`SCM_RIGHTS`); on a stream socket the
//! kernel may split the bytes, and the rest is read after the first part (the fd comes with the
//! first byte).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;

use rustix::fd::{AsRawFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::{Error, Result};
use crate::transfer::{self, RecvOptions};

/// Bytes of every frame.
pub(crate) const FRAME_LEN: usize = 16;

/// Magic of an fd frame.
pub(crate) const FD_MAGIC: [u8; 4] = *b"TMFD";

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
            problem: format!(
                "a channel frame carries at most one fd, this one {}",
                fds.len()
            ),
        });
    }
    Ok((frame, fds.pop()))
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
