//! [`PoolSender`]: the producer's end of one connection to one consumer.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};

use super::link::{to_pool_error, Leases, Link, Mirror, ReadWait};
use super::wire::{self, Header, Kind, Record, POOL_SLOTS};
use super::{Inner, PoolBuffer, ShmPool};
use crate::channel::{Channel, ChannelOptions, MAX_MESSAGE};
use crate::error::{Error, Result};
use crate::transfer::RecvOptions;
use crate::wire::{WireFormat, POOL_MAGIC};

/// The producer's end of a connection to one consumer (a
/// [`PoolReceiver`](crate::pool::PoolReceiver)): sends [`PoolBuffer`]s, the region's fd
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
/// Messages travel on a shared-memory [`channel`](crate::channel) the consumer set up over the
/// socket (the socket itself carries only the regions' fds and tells when the consumer's process
/// is gone): a message to a consumer that is awake costs no system call, one to a consumer
/// asleep in [`recv`](crate::pool::PoolReceiver::recv) one `futex` wake.
///
/// Releases arrive as records on the channel; they are read at every `send`, by
/// [`poll_releases`](Self::poll_releases) (non-blocking), by
/// [`wait_release`](Self::wait_release), and by the pool itself when a request finds no cached
/// region of its size (without waiting: a connection whose sender is busy is skipped). If the consumer's end closes (it exited or was killed),
/// every lease still open on this connection is released.
pub struct PoolSender {
    pool: Arc<Inner>,
    /// The socket, the consumer's cache as this end accounts it and the open leases, shared
    /// with the pool.
    link: Arc<Link>,
    max_entries: u64,
    max_bytes: u64,
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
    /// Wraps the producer's end of a connected Unix socket (stream or seqpacket), accepting the
    /// shared-memory channel the consumer set up on it and reading the consumer's announcement
    /// of its cache limits (it blocks until the consumer has made its
    /// [`PoolReceiver`](crate::pool::PoolReceiver)).
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] if the consumer hung up first; [`Error::Protocol`] if what it sent
    /// is not a pool hello (or not a channel); the checks of the channel's memory
    /// ([`Channel::accept`]).
    pub fn new(pool: &ShmPool, socket: impl Into<OwnedFd>) -> Result<Self> {
        let mut channel = Channel::accept_as(socket.into(), ChannelOptions::default(), POOL_MAGIC)
            .map_err(to_pool_error)?;
        let mut hello = [0u8; MAX_MESSAGE];
        let n = channel.recv(&mut hello).map_err(to_pool_error)?;
        let Record::Hello { entries, bytes } = Record::decode(&hello[..n])? else {
            return Err(Error::Protocol {
                wire: WireFormat::Pool,
                problem: "the consumer's first record must be its hello".into(),
            });
        };
        let pool = Arc::clone(pool.inner());
        let link = Arc::new(Link::new(channel));
        pool.register_link(&link);
        Ok(Self {
            pool,
            link,
            max_entries: entries,
            max_bytes: bytes,
            tick: 0,
            stats: SenderStats::default(),
        })
    }

    /// Lends `buffer` to the consumer with `user` (at most
    /// [`MAX_POOL_USER_DATA`](super::MAX_POOL_USER_DATA) bytes) beside it: one more lease on its
    /// region, released when the consumer drops its [`Lease`](crate::pool::Lease) or
    /// dies. The same buffer may be sent several times (each send is a lease).
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] if the consumer is gone (seen at once if it dropped its
    /// receiver; a killed consumer is seen by the next read of releases, which then reclaims
    /// the lease); [`Error::TooManyLeases`] with [`MAX_LEASES`](super::MAX_LEASES) leases open;
    /// [`Error::Protocol`] for too much application data, a buffer of another pool, or a
    /// malformed record from the consumer; [`Error::ChannelCorrupt`]; [`Error::Os`] for other
    /// socket failures. Nothing is lent when it fails. Waits while the consumer has
    /// [`MAX_LEASES`](super::MAX_LEASES) messages unread.
    pub fn send(&mut self, buffer: &PoolBuffer, user: &[u8]) -> Result<()> {
        if !Arc::ptr_eq(buffer.pool(), &self.pool) {
            return Err(Error::Protocol {
                wire: WireFormat::Pool,
                problem: "this buffer belongs to another pool than the sender's".into(),
            });
        }
        let link = Arc::clone(&self.link);
        let mut mirror = link.mirror();
        let mut leases = link.leases();
        // With no lease open there is nothing to read: a consumer that dropped its end makes
        // the send itself fail (the channel's closed flag), a killed one is seen by the next
        // read of releases (which reclaims this lease too). Save the look (and the `poll` of
        // the socket it may make) on the round-trip path.
        if leases.outstanding > 0 || leases.deferred.is_some() {
            self.poll_locked(&mut leases)?;
        }
        if leases.gone {
            mirror.clear();
            return Err(Error::Disconnected);
        }
        if leases.outstanding >= POOL_SLOTS as usize {
            return Err(Error::TooManyLeases {
                outstanding: leases.outstanding,
            });
        }
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
            if self.make_room(&mut mirror, &leases, capacity)? {
                mirror.insert(id, capacity, self.tick);
                newly_known = true;
            } else {
                header.transient = true;
            }
        }
        let message = match wire::encode(&header, user) {
            Ok(message) => message,
            Err(err) => {
                // Nothing was sent: the consumer does not know the region.
                if newly_known {
                    mirror.remove(id);
                }
                return Err(err);
            }
        };
        let fd = match header.kind {
            Kind::New => Some(buffer.fd().ok_or_else(|| Error::NoFd {
                object: format!("pooled region {id}"),
            })?),
            _ => None,
        };
        // Count the lease before the consumer can possibly release it.
        self.pool.acquire(id);
        leases.add(id);
        let bytes = &message[..wire::ring_len(&message)];
        let sent = match fd {
            Some(fd) => mirror.tx.send_with_fd(bytes, fd),
            None => mirror.tx.send(bytes),
        };
        if let Err(err) = sent {
            if newly_known {
                mirror.remove(id);
            }
            leases.remove_one(id);
            drop((mirror, leases));
            self.pool.release(id, 1);
            return Err(to_pool_error(err));
        }
        drop((mirror, leases));
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
        let mut mirror = self.link.mirror();
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
        let link = Arc::clone(&self.link);
        let mut leases = link.leases();
        self.poll_locked(&mut leases)
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
        self.wait_releases(ReadWait::Block(recv.spin))
    }

    /// [`wait_release`](Self::wait_release) giving up after `timeout` (returns 0 then).
    ///
    /// # Errors
    ///
    /// As [`poll_releases`](Self::poll_releases).
    pub fn wait_release_timeout(&mut self, timeout: Duration) -> Result<usize> {
        self.wait_releases(ReadWait::Until(Instant::now() + timeout))
    }

    /// Reads releases, waiting as `wait` says, until at least one came back, none is open, or
    /// the consumer is gone; with [`ReadWait::Until`], also once its instant has passed.
    fn wait_releases(&mut self, wait: ReadWait) -> Result<usize> {
        let link = Arc::clone(&self.link);
        let mut leases = link.leases();
        if let Some(err) = leases.deferred.take() {
            return Err(err);
        }
        let mut count = 0;
        while count == 0 && leases.outstanding > 0 && !leases.gone {
            match link.read(&mut leases, &self.pool, wait)? {
                Some(got) => count += got,
                // Nothing read: a blocking wait goes on, a bounded one has timed out.
                None if matches!(wait, ReadWait::Block(_)) => {}
                None => break,
            }
        }
        Ok(count)
    }

    /// The pool this sender lends from (a clone sharing it).
    pub fn pool(&self) -> ShmPool {
        ShmPool::from_inner(Arc::clone(&self.pool))
    }

    /// Leases open on this connection.
    pub fn outstanding(&self) -> usize {
        self.link.leases().outstanding
    }

    /// `false` once the consumer's end has closed (every lease on it was then released).
    pub fn is_connected(&self) -> bool {
        !self.link.is_closed()
    }

    /// Regions the consumer caches, as this end accounts it (0 once the consumer is gone).
    pub fn known_regions(&self) -> usize {
        if self.link.is_closed() {
            return 0;
        }
        self.link.mirror().known.len()
    }

    /// What this sender has done.
    pub fn stats(&self) -> SenderStats {
        let leases = self.link.leases();
        SenderStats {
            forgotten: self.link.forgotten(),
            released: leases.released,
            reclaimed: leases.reclaimed,
            ..self.stats
        }
    }

    /// Reads every record that has arrived; the caller holds the leases.
    fn poll_locked(&self, leases: &mut Leases) -> Result<usize> {
        if let Some(err) = leases.deferred.take() {
            return Err(err);
        }
        let mut count = 0;
        while !leases.gone {
            match self.link.read(leases, &self.pool, ReadWait::Now)? {
                Some(n) => count += n,
                None => break,
            }
        }
        Ok(count)
    }

    /// Evicts least recently used known regions (not leased now) until one of `capacity` bytes
    /// fits the consumer's limits; `false` if it cannot fit.
    fn make_room(&self, mirror: &mut Mirror, leases: &Leases, capacity: u64) -> Result<bool> {
        if capacity > self.max_bytes || self.max_entries == 0 {
            return Ok(false);
        }
        while mirror.known.len() as u64 + 1 > self.max_entries
            || mirror.known_bytes + capacity > self.max_bytes
        {
            let victim = mirror
                .known
                .iter()
                .filter(|(id, _)| !leases.open.contains_key(id))
                .min_by_key(|(_, &(_, tick))| tick)
                .map(|(&id, _)| id);
            let Some(id) = victim else {
                return Ok(false);
            };
            mirror.remove(id);
            self.link.send_forget(mirror, id, false)?;
        }
        Ok(true)
    }
}

impl AsFd for PoolSender {
    /// The socket under the connection's channel. Releases travel in shared memory and do not
    /// make it readable: wait for them with [`wait_release`](PoolSender::wait_release) or
    /// [`wait_release_timeout`](PoolSender::wait_release_timeout). It reports a hang-up when
    /// the consumer's process is gone.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.link.socket()
    }
}

impl Drop for PoolSender {
    fn drop(&mut self) {
        let link = Arc::clone(&self.link);
        let mut leases = link.leases();
        if !leases.gone {
            let _ = self.poll_locked(&mut leases);
        }
        // Leases still open belong to a consumer that may still read: never reuse those regions.
        leases.gone = true;
        leases.outstanding = 0;
        for (id, n) in leases.open.drain() {
            self.pool.abandon(id, n);
        }
    }
}

impl fmt::Debug for PoolSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolSender")
            .field("known", &self.known_regions())
            .field("outstanding", &self.outstanding())
            .field("connected", &self.is_connected())
            .field("stats", &self.stats)
            .finish()
    }
}
