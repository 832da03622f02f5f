//! [`PoolSender`]: the producer's end of one connection to one consumer.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use rustix::net::RecvFlags;

use super::link::{Link, Mirror};
use super::wire::{self, Header, Kind, Record, RECORD_LEN};
use super::{Inner, PoolBuffer, ShmPool};
use crate::error::{Error, Result};
use crate::transfer::{self, RecvOptions};

/// The producer's end of a connection to one consumer (a
/// [`PoolReceiver`](crate::mapping_cache::PoolReceiver)): sends [`PoolBuffer`]s, the region's fd
/// the first time and only its id once the consumer caches the mapping, and keeps account of the
/// consumer's leases (see the [pool docs](super) for why a lease is bound to the connection).
///
/// The sender mirrors the consumer's mapping cache: the consumer announced its limits when it
/// connected, and the sender decides what it evicts (a `FORGET` message), so both ends always
/// agree on which ids are known without a round trip. When the pool releases a region (trim,
/// limits, idle release), the consumer is told at once to drop its mapping (or, if this sender
/// is writing at that moment or the socket is full, before the next [`send`](Self::send) or
/// [`flush`](Self::flush)).
///
/// Releases arrive as records on the socket; they are read at every `send`, by
/// [`poll_releases`](Self::poll_releases) (non-blocking) and by
/// [`wait_release`](Self::wait_release). If the consumer's end closes (it exited or was killed),
/// every lease still open on this connection is released.
pub struct PoolSender {
    pool: Arc<Inner>,
    /// The socket and the consumer's cache as this end accounts it, shared with the pool.
    link: Arc<Link>,
    max_entries: u64,
    max_bytes: u64,
    /// Open leases per region id.
    leases: HashMap<u64, usize>,
    outstanding: usize,
    partial: Vec<u8>,
    gone: bool,
    tick: u64,
    stats: SenderStats,
}

/// What a [`PoolSender`] has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SenderStats {
    /// Messages that carried a region's fd (first sight, or after eviction).
    pub sent_fd: u64,
    /// Messages that carried only the id of a region the consumer caches.
    pub sent_id: u64,
    /// Of `sent_fd`: regions sent not to be cached (the consumer's cache was full of leased
    /// regions).
    pub sent_transient: u64,
    /// Mappings the consumer was told to drop (evicted, or released by the pool).
    pub forgotten: u64,
    /// Leases released by the consumer.
    pub released: u64,
    /// Leases released because the consumer's end closed with them open.
    pub reclaimed: u64,
}

impl PoolSender {
    /// Wraps the producer's end of a connected Unix socket (stream or seqpacket), reading the
    /// consumer's announcement of its cache limits (it blocks until the consumer has made its
    /// [`PoolReceiver`](crate::mapping_cache::PoolReceiver)).
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] if the consumer hung up first; [`Error::Protocol`] if what it sent
    /// is not a pool hello.
    pub fn new(pool: &ShmPool, socket: impl Into<OwnedFd>) -> Result<Self> {
        let socket = socket.into();
        let mut hello = [0u8; RECORD_LEN];
        transfer::recv_exact(&socket, &mut hello, RecvOptions::BLOCKING)?;
        let Record::Hello { entries, bytes } = Record::decode(&hello)? else {
            return Err(Error::Protocol {
                problem: "the consumer's first record must be its hello".into(),
            });
        };
        let pool = Arc::clone(pool.inner());
        let link = Arc::new(Link::new(socket));
        pool.register_link(&link);
        Ok(Self {
            pool,
            link,
            max_entries: entries,
            max_bytes: bytes,
            leases: HashMap::new(),
            outstanding: 0,
            partial: Vec::new(),
            gone: false,
            tick: 0,
            stats: SenderStats::default(),
        })
    }

    /// Lends `buffer` to the consumer with `user` (at most
    /// [`MAX_POOL_USER_DATA`](super::MAX_POOL_USER_DATA) bytes) beside it: one more lease on its
    /// region, released when the consumer drops its [`Lease`](crate::mapping_cache::Lease) or
    /// dies. The same buffer may be sent several times (each send is a lease).
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] if the consumer is gone; [`Error::Protocol`] for too much
    /// application data, a buffer of another pool, or a malformed record from the consumer;
    /// [`Error::Os`] for other socket failures. Nothing is lent when it fails.
    pub fn send(&mut self, buffer: &PoolBuffer, user: &[u8]) -> Result<()> {
        if !Arc::ptr_eq(buffer.pool(), &self.pool) {
            return Err(Error::Protocol {
                problem: "this buffer belongs to another pool than the sender's".into(),
            });
        }
        // With no lease open there is nothing to read but an end of file, which the send
        // itself reports (EPIPE): save the system call on the round-trip path.
        if self.outstanding > 0 {
            self.poll_releases()?;
        }
        if self.gone {
            return Err(Error::Disconnected);
        }
        let link = Arc::clone(&self.link);
        let mut mirror = link.lock();
        link.flush_pending(&mut mirror)?;
        let id = buffer.id();
        let capacity = buffer.capacity() as u64;
        self.tick += 1;
        let mut header = Header {
            kind: Kind::Known,
            transient: false,
            id,
            len: buffer.len() as u64,
            map_len: capacity,
            user_len: 0,
        };
        let mut newly_known = false;
        if let Some(known) = mirror.known.get_mut(&id) {
            known.1 = self.tick;
        } else {
            header.kind = Kind::New;
            if self.make_room(&mut mirror, capacity)? {
                mirror.insert(id, capacity, self.tick);
                newly_known = true;
            } else {
                header.transient = true;
            }
        }
        let message = wire::encode(&header, user)?;
        // Count the lease before the consumer can possibly release it.
        self.pool.acquire(id);
        *self.leases.entry(id).or_default() += 1;
        self.outstanding += 1;
        let fd = match header.kind {
            Kind::New => Some(buffer.fd().ok_or_else(|| Error::NoFd {
                object: format!("pooled region {id}"),
            })?),
            _ => None,
        };
        if let Err(err) = wire::send_message(link.socket.as_fd(), &message, fd) {
            if newly_known {
                mirror.remove(id);
            }
            drop(mirror);
            self.drop_lease(id);
            self.pool.release(id, 1);
            return Err(err);
        }
        drop(mirror);
        match (header.kind, header.transient) {
            (Kind::Known, _) => self.stats.sent_id += 1,
            (_, true) => {
                self.stats.sent_fd += 1;
                self.stats.sent_transient += 1;
            }
            _ => self.stats.sent_fd += 1,
        }
        Ok(())
    }

    /// Tells the consumer to drop its mappings of regions the pool has released since the last
    /// send (a send does this first anyway).
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    pub fn flush(&mut self) -> Result<()> {
        let mut mirror = self.link.lock();
        self.link.flush_pending(&mut mirror)
    }

    /// Reads every release the consumer has sent so far, without waiting. Returns how many
    /// leases came back (all open ones if the consumer's end closed).
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] if the consumer released a lease it did not hold or sent garbage;
    /// [`Error::Os`] for socket failures. A closed consumer end is not an error here:
    /// [`is_connected`](Self::is_connected) turns `false`.
    pub fn poll_releases(&mut self) -> Result<usize> {
        let mut count = 0;
        while !self.gone {
            match self.read_records(RecvFlags::DONTWAIT)? {
                Some(n) => count += n,
                None => break,
            }
        }
        Ok(count)
    }

    /// Waits, as `recv` says (blocking, or spinning first), until at least one release arrives
    /// or the consumer's end closes, reading what has arrived by then (up to 64 records; later
    /// ones are read by the next call). Returns how many leases came back; 0 at once if none is
    /// open.
    ///
    /// # Errors
    ///
    /// As [`poll_releases`](Self::poll_releases).
    pub fn wait_release(&mut self, recv: Option<RecvOptions>) -> Result<usize> {
        let recv = recv.unwrap_or(RecvOptions::BLOCKING);
        let mut count = 0;
        while count == 0 && self.outstanding > 0 && !self.gone {
            let flags = RecvFlags::empty();
            count += self.read_records_waiting(flags, recv)?;
        }
        Ok(count)
    }

    /// [`wait_release`](Self::wait_release) giving up after `timeout` (returns 0 then).
    ///
    /// # Errors
    ///
    /// As [`poll_releases`](Self::poll_releases).
    pub fn wait_release_timeout(&mut self, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let count = self.poll_releases()?;
            if count > 0 || self.outstanding == 0 || self.gone {
                return Ok(count);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            wait_readable(self.link.socket.as_fd(), left)?;
        }
    }

    /// Leases open on this connection.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// `false` once the consumer's end has closed (every lease on it was then released).
    pub fn is_connected(&self) -> bool {
        !self.gone
    }

    /// Regions the consumer caches, as this end accounts them.
    pub fn known_regions(&self) -> usize {
        self.link.lock().known.len()
    }

    /// What this sender has done.
    pub fn stats(&self) -> SenderStats {
        SenderStats {
            forgotten: self.link.forgotten(),
            ..self.stats
        }
    }

    /// Evicts least recently used known regions (not leased now) until one of `capacity` bytes
    /// fits the consumer's limits; `false` if it cannot fit.
    fn make_room(&self, mirror: &mut Mirror, capacity: u64) -> Result<bool> {
        if capacity > self.max_bytes || self.max_entries == 0 {
            return Ok(false);
        }
        while mirror.known.len() as u64 + 1 > self.max_entries
            || mirror.known_bytes + capacity > self.max_bytes
        {
            let victim = mirror
                .known
                .iter()
                .filter(|(id, _)| !self.leases.contains_key(id))
                .min_by_key(|(_, &(_, tick))| tick)
                .map(|(&id, _)| id);
            let Some(id) = victim else {
                return Ok(false);
            };
            mirror.remove(id);
            self.link.send_forget(id, false)?;
        }
        Ok(true)
    }

    fn drop_lease(&mut self, id: u64) -> bool {
        match self.leases.get_mut(&id) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    self.leases.remove(&id);
                }
                self.outstanding -= 1;
                true
            }
            None => false,
        }
    }

    fn read_records_waiting(&mut self, flags: RecvFlags, recv: RecvOptions) -> Result<usize> {
        let mut buf = [0u8; RECORD_LEN * 64];
        let socket = self.link.socket.as_fd();
        let got = transfer::wait_and(recv.spin, |extra| {
            rustix::net::recv(socket, &mut buf, flags | extra).map(|(n, _)| n)
        });
        self.take_bytes(got, &buf)
    }

    /// One `recv` with `flags`; `None` if nothing was there (`EAGAIN`).
    fn read_records(&mut self, flags: RecvFlags) -> Result<Option<usize>> {
        let mut buf = [0u8; RECORD_LEN * 64];
        let got = loop {
            match rustix::net::recv(&self.link.socket, &mut buf, flags) {
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => return Ok(None),
                other => break other.map(|(n, _)| n),
            }
        };
        self.take_bytes(got, &buf).map(Some)
    }

    fn take_bytes(&mut self, got: rustix::io::Result<usize>, buf: &[u8]) -> Result<usize> {
        let n = match got {
            Ok(0) | Err(Errno::CONNRESET | Errno::PIPE) => return Ok(self.consumer_gone()),
            Ok(n) => n,
            Err(errno) => return Err(transfer::socket_error(errno, "recv")),
        };
        self.partial.extend_from_slice(&buf[..n]);
        let whole = self.partial.len() / RECORD_LEN * RECORD_LEN;
        let records: Vec<u8> = self.partial.drain(..whole).collect();
        let mut count = 0;
        // Every well-formed release is applied even if a bad record comes first: a misbehaving
        // consumer must not make the producer lose track of the leases it did give back.
        let mut first_error = None;
        for chunk in records.chunks_exact(RECORD_LEN) {
            let problem = match Record::decode(chunk) {
                Ok(Record::Release { id }) if self.drop_lease(id) => {
                    self.pool.release(id, 1);
                    self.stats.released += 1;
                    count += 1;
                    continue;
                }
                Ok(Record::Release { id }) => Error::Protocol {
                    problem: format!("the consumer released region {id}, which it did not hold"),
                },
                Ok(Record::Hello { .. }) => Error::Protocol {
                    problem: "a second hello from the consumer".into(),
                },
                Err(err) => err,
            };
            first_error.get_or_insert(problem);
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(count),
        }
    }

    /// The consumer's end closed: every lease on this connection comes back.
    fn consumer_gone(&mut self) -> usize {
        self.gone = true;
        {
            let mut mirror = self.link.lock();
            mirror.closed = true;
            mirror.known.clear();
            mirror.known_bytes = 0;
        }
        let count = self.outstanding;
        for (id, n) in self.leases.drain() {
            self.pool.release(id, n);
        }
        self.outstanding = 0;
        self.stats.reclaimed += count as u64;
        if count > 0 {
            tracing::info!(
                leases = count,
                "consumer gone; its open leases were released"
            );
        }
        count
    }
}

/// `poll(fd, POLLIN, timeout)`.
fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> Result<()> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd, the count says one.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(Error::Os {
                object: "pool connection".into(),
                op: "poll",
                source: err,
            });
        }
    }
    Ok(())
}

impl AsFd for PoolSender {
    /// The socket, for `poll`/`epoll` over several connections (readable = releases arrived).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.link.socket.as_fd()
    }
}

impl Drop for PoolSender {
    fn drop(&mut self) {
        if !self.gone {
            let _ = self.poll_releases();
        }
        // Leases still open belong to a consumer that may still read: never reuse those regions.
        for (id, n) in self.leases.drain() {
            self.pool.abandon(id, n);
        }
    }
}

impl fmt::Debug for PoolSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolSender")
            .field("known", &self.known_regions())
            .field("outstanding", &self.outstanding)
            .field("connected", &!self.gone)
            .field("stats", &self.stats)
            .finish()
    }
}
