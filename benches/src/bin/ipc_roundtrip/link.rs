//! The message transports between the producer and the consumer: [`ChanLink`]
//! (`tensormem_shm::channel`, the default) and [`PipeLink`] (two pipes).

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};
use tensormem_shm::channel::{Channel, ChannelOptions, MAX_MESSAGE};

use crate::BoxError;

/// One end of the message transport between the two processes: whole messages, each sent with one
/// system call (a second write could wake the reader once for each part).
pub(crate) trait Link {
    /// Sends one message.
    fn send(&mut self, message: &[u8]) -> std::io::Result<()>;
    /// Receives the next message into `message`; `Ok(false)` when the peer closed its end.
    fn recv(&mut self, message: &mut Vec<u8>) -> std::io::Result<bool>;
}

/// A pair of pipes, messages framed by a 4-byte little-endian length. With a non-zero `spin` the
/// read end is non-blocking and polled for up to `spin` before blocking in `poll`.
pub(crate) struct PipeLink<R, W> {
    input: R,
    output: W,
    spin: Duration,
    /// Bytes read and not yet handed out: `pending[..filled]`.
    pending: Vec<u8>,
    filled: usize,
    frame: Vec<u8>,
}

impl<R: Read + AsFd, W: Write> PipeLink<R, W> {
    pub(crate) fn new(input: R, output: W, spin: Duration) -> std::io::Result<Self> {
        if !spin.is_zero() {
            let flags = fcntl_getfl(input.as_fd())?;
            fcntl_setfl(input.as_fd(), flags | OFlags::NONBLOCK)?;
        }
        Ok(Self {
            input,
            output,
            spin,
            pending: vec![0; 64 << 10],
            filled: 0,
            frame: Vec::new(),
        })
    }

    /// The length of the complete message at the front of `pending`, if there is one.
    fn complete(&self) -> Option<usize> {
        let len = u32::from_le_bytes(self.pending.get(..4)?.try_into().ok()?) as usize;
        (self.filled >= 4 + len).then_some(len)
    }

    /// Reads what is there (at least one byte) into `pending`; `Ok(false)` at end of input.
    fn fill(&mut self) -> std::io::Result<bool> {
        if self.filled == self.pending.len() {
            self.pending.resize(self.pending.len() * 2, 0);
        }
        let started = Instant::now();
        loop {
            match self.input.read(&mut self.pending[self.filled..]) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.filled += n;
                    return Ok(true);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if started.elapsed() < self.spin {
                        std::hint::spin_loop();
                    } else {
                        let mut fds = [PollFd::new(&self.input, PollFlags::IN)];
                        poll(&mut fds, None)?;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl<R: Read + AsFd, W: Write> Link for PipeLink<R, W> {
    fn send(&mut self, message: &[u8]) -> std::io::Result<()> {
        self.frame.clear();
        self.frame
            .extend_from_slice(&(message.len() as u32).to_le_bytes());
        self.frame.extend_from_slice(message);
        // Up to PIPE_BUF (4096) bytes, one write(2) puts the whole frame in the pipe at once.
        self.output.write_all(&self.frame)?;
        self.output.flush()
    }

    fn recv(&mut self, message: &mut Vec<u8>) -> std::io::Result<bool> {
        loop {
            if let Some(len) = self.complete() {
                message.clear();
                message.extend_from_slice(&self.pending[4..4 + len]);
                self.pending.copy_within(4 + len..self.filled, 0);
                self.filled -= 4 + len;
                return Ok(true);
            }
            if !self.fill()? {
                return Ok(false);
            }
        }
    }
}

/// The shared-memory channel of `tensormem_shm::channel`: futex doorbells, no system call while
/// the receiver spins or is awake, one `futex` wake when it sleeps.
pub(crate) struct ChanLink {
    channel: Channel,
    buf: Vec<u8>,
}

impl ChanLink {
    /// The creating end, over `socket` (the other end's process accepts).
    pub(crate) fn create(socket: UnixStream, spin: Duration) -> std::io::Result<Self> {
        Ok(Self::new(Channel::create(socket, Self::options(spin))?))
    }

    /// The accepting end, over `socket`.
    pub(crate) fn accept(socket: OwnedFd, spin: Duration) -> std::io::Result<Self> {
        Ok(Self::new(Channel::accept(socket, Self::options(spin))?))
    }

    fn options(spin: Duration) -> ChannelOptions {
        ChannelOptions {
            spin,
            ..ChannelOptions::default()
        }
    }

    fn new(channel: Channel) -> Self {
        Self {
            channel,
            buf: vec![0; MAX_MESSAGE],
        }
    }
}

impl Link for ChanLink {
    fn send(&mut self, message: &[u8]) -> std::io::Result<()> {
        Ok(self.channel.send(message)?)
    }

    fn recv(&mut self, message: &mut Vec<u8>) -> std::io::Result<bool> {
        match self.channel.recv(&mut self.buf) {
            Ok(n) => {
                message.clear();
                message.extend_from_slice(&self.buf[..n]);
                Ok(true)
            }
            Err(tensormem_shm::Error::PeerGone) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

/// Which transport carries the messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transport {
    /// `tensormem_shm::channel` (the default).
    Chan,
    /// Two pipes.
    Pipe,
}

impl Transport {
    pub(crate) fn parse(text: &str) -> Result<Self, BoxError> {
        match text {
            "chan" => Ok(Self::Chan),
            "pipe" => Ok(Self::Pipe),
            other => Err(format!("--transport {other}: expected `chan` or `pipe`").into()),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Chan => "chan",
            Self::Pipe => "pipe",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    /// Both ends of a pipe, as files.
    fn pipe() -> (File, File) {
        let (read, write) = rustix::pipe::pipe().unwrap();
        (File::from(read), File::from(write))
    }

    fn framing(spin: Duration) {
        let (a_in, b_out) = pipe();
        let (b_in, a_out) = pipe();
        let mut a = PipeLink::new(a_in, a_out, spin).unwrap();
        let mut b = PipeLink::new(b_in, b_out, spin).unwrap();
        let big = vec![7u8; 100_000];
        let writer = std::thread::spawn(move || {
            a.send(b"first").unwrap();
            a.send(b"").unwrap();
            a.send(&big).unwrap();
            let mut back = Vec::new();
            assert!(a.recv(&mut back).unwrap());
            assert_eq!(back, b"done");
        });
        let mut message = Vec::new();
        assert!(b.recv(&mut message).unwrap());
        assert_eq!(message, b"first");
        assert!(b.recv(&mut message).unwrap());
        assert!(message.is_empty());
        assert!(b.recv(&mut message).unwrap());
        assert_eq!(message.len(), 100_000);
        assert!(message.iter().all(|&x| x == 7));
        b.send(b"done").unwrap();
        writer.join().unwrap();
        assert!(!b.recv(&mut message).unwrap(), "the peer's end is closed");
    }

    #[test]
    fn pipe_messages_arrive_whole_and_in_order_blocking() {
        framing(Duration::ZERO);
    }

    #[test]
    fn pipe_messages_arrive_whole_and_in_order_spinning() {
        framing(Duration::from_micros(50));
    }

    fn chan_framing(spin: Duration) {
        let (a, b) = UnixStream::pair().unwrap();
        let mut a = ChanLink::create(a, spin).unwrap();
        let mut b = ChanLink::accept(OwnedFd::from(b), spin).unwrap();
        let writer = std::thread::spawn(move || {
            for i in 0..500u32 {
                a.send(&i.to_le_bytes().repeat(i as usize % 100)).unwrap();
            }
            let mut back = Vec::new();
            assert!(a.recv(&mut back).unwrap());
            assert_eq!(back, b"done");
        });
        let mut message = Vec::new();
        for i in 0..500u32 {
            assert!(b.recv(&mut message).unwrap());
            assert_eq!(message, i.to_le_bytes().repeat(i as usize % 100));
        }
        b.send(b"done").unwrap();
        writer.join().unwrap();
        assert!(!b.recv(&mut message).unwrap(), "the peer's end is closed");
    }

    #[test]
    fn chan_messages_arrive_whole_and_in_order_blocking() {
        chan_framing(Duration::ZERO);
    }

    #[test]
    fn chan_messages_arrive_whole_and_in_order_spinning() {
        chan_framing(Duration::from_micros(50));
    }
}
