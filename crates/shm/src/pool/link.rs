//! [`Link`]: what the pool and one [`PoolSender`](super::PoolSender) share about a connection:
//! the consumer's mapping cache as the producer accounts it (so the pool can tell the consumer at
//! once to drop its mapping of a region the pool released) and the consumer's open leases (so the
//! pool, missing a region of some size, can take the releases that have arrived itself).
//!
//! The connection is a shared-memory [`channel`](crate::channel) the consumer created: its
//! sending half lives in the mirror (every message to the consumer is written under the
//! mirror's lock), its receiving half in the leases (every release is read under theirs).
//!
//! Locks: `mirror` before `leases` where both are held (the sender's `send`); the pool only ever
//! `try_lock`s either, so it never waits on a sender and no order can deadlock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use rustix::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use super::wire::{self, Header, Kind, Record};
use super::Inner;
use crate::channel::{Channel, ChannelReceiver, ChannelSender, MAX_MESSAGE};
use crate::error::{Error, Result};
use crate::wire::WireFormat;

/// One connection, shared by its sender and the pool. Every message to the consumer is sent
/// under `mirror`'s lock, every release read under `leases'`.
pub(crate) struct Link {
    /// The channel's socket (owned by the halves below).
    socket: RawFd,
    mirror: Mutex<Mirror>,
    leases: Mutex<Leases>,
    /// Released regions the pool could not forget at once (the sender held the lock, or the
    /// socket was full); the sender forgets them before its next message.
    pending: Mutex<Vec<u64>>,
    forgotten: AtomicU64,
    /// The consumer's end has closed.
    closed: AtomicBool,
}

/// The consumer's cache as the producer accounts it, and the channel's sending half.
#[derive(Debug)]
pub(crate) struct Mirror {
    /// Cached region ids: (capacity, last use tick).
    pub(crate) known: HashMap<u64, (u64, u64)>,
    pub(crate) known_bytes: u64,
    pub(crate) tx: ChannelSender,
}

impl Mirror {
    pub(crate) fn insert(&mut self, id: u64, capacity: u64, tick: u64) {
        self.known.insert(id, (capacity, tick));
        self.known_bytes += capacity;
    }

    pub(crate) fn remove(&mut self, id: u64) -> bool {
        match self.known.remove(&id) {
            Some((capacity, _)) => {
                self.known_bytes -= capacity;
                true
            }
            None => false,
        }
    }

    pub(crate) fn clear(&mut self) {
        self.known.clear();
        self.known_bytes = 0;
    }
}

/// The consumer's open leases, what reading its records found, and the channel's receiving half.
#[derive(Debug)]
pub(crate) struct Leases {
    /// Open leases per region id.
    pub(crate) open: HashMap<u64, usize>,
    pub(crate) outstanding: usize,
    pub(crate) rx: ChannelReceiver,
    /// The consumer's end closed (every lease was then released).
    pub(crate) gone: bool,
    pub(crate) released: u64,
    pub(crate) reclaimed: u64,
    /// A protocol error the pool met while reading, for the sender to report.
    pub(crate) deferred: Option<Error>,
}

impl Leases {
    pub(crate) fn add(&mut self, id: u64) {
        *self.open.entry(id).or_default() += 1;
        self.outstanding += 1;
    }

    pub(crate) fn remove_one(&mut self, id: u64) -> bool {
        match self.open.get_mut(&id) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    self.open.remove(&id);
                }
                self.outstanding -= 1;
                true
            }
            None => false,
        }
    }
}

/// How a read of releases waits for the first one.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ReadWait {
    /// Not at all.
    Now,
    /// Until one comes, spinning up to this long first.
    Block(Duration),
    /// Until this instant at most.
    Until(Instant),
}

impl Link {
    pub(crate) fn new(channel: Channel) -> Self {
        let socket = channel.as_fd().as_raw_fd();
        let (tx, rx) = channel.split();
        Self {
            socket,
            mirror: Mutex::new(Mirror {
                known: HashMap::new(),
                known_bytes: 0,
                tx,
            }),
            leases: Mutex::new(Leases {
                open: HashMap::new(),
                outstanding: 0,
                rx,
                gone: false,
                released: 0,
                reclaimed: 0,
                deferred: None,
            }),
            pending: Mutex::new(Vec::new()),
            forgotten: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        }
    }

    pub(crate) fn mirror(&self) -> MutexGuard<'_, Mirror> {
        self.mirror.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn leases(&self) -> MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn forgotten(&self) -> u64 {
        self.forgotten.load(Ordering::Relaxed)
    }

    /// The pool released `ids` (called outside the pool's lock): tell the consumer to drop the
    /// ones it caches, without ever waiting for the sender's lock or a full socket (those go to
    /// `pending`).
    pub(crate) fn forget_released(&self, ids: &[u64]) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let mut mirror = match self.mirror.try_lock() {
            Ok(mirror) => mirror,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                self.pending_lock().extend_from_slice(ids);
                return;
            }
        };
        for &id in ids {
            if !mirror.known.contains_key(&id) {
                continue;
            }
            match self.send_forget(&mut mirror, id, true) {
                Ok(true) => {
                    mirror.remove(id);
                }
                Ok(false) => self.pending_lock().push(id),
                Err(err) => {
                    // The sender meets the same failure at its next call and reports it.
                    tracing::debug!(id, error = %err, "could not tell a consumer to forget a region");
                    self.pending_lock().push(id);
                }
            }
        }
    }

    /// Forgets what is pending, blocking; the caller holds `mirror` (the sender).
    pub(crate) fn flush_pending(&self, mirror: &mut Mirror) -> Result<()> {
        let pending = std::mem::take(&mut *self.pending_lock());
        for id in pending {
            if mirror.remove(id) && !self.closed.load(Ordering::Acquire) {
                self.send_forget(mirror, id, false)?;
            }
        }
        Ok(())
    }

    /// Sends one `FORGET`; `Ok(false)` if `nowait` and the ring was full. The caller holds
    /// `mirror` (all writes happen under it) and updates it.
    pub(crate) fn send_forget(&self, mirror: &mut Mirror, id: u64, nowait: bool) -> Result<bool> {
        let header = Header {
            kind: Kind::Forget,
            transient: false,
            id,
            len: 0,
            map_len: 0,
            user_len: 0,
        };
        let message = wire::encode(&header, &[])?;
        let bytes = &message[..wire::ring_len(&message)];
        let sent = if nowait {
            mirror.tx.try_send(bytes)
        } else {
            mirror.tx.send(bytes).map(|()| true)
        }
        .map_err(to_pool_error)?;
        if sent {
            self.forgotten.fetch_add(1, Ordering::Relaxed);
        }
        Ok(sent)
    }

    /// Called by the pool on a cache miss: applies the releases that have arrived, never
    /// waiting (not for the sender, not for the consumer). Returns how many leases came back.
    pub(crate) fn drain_for_pool(&self, pool: &Inner) -> usize {
        let mut leases = match self.leases.try_lock() {
            Ok(leases) => leases,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return 0,
        };
        let mut count = 0;
        while !leases.gone && leases.outstanding > 0 && leases.deferred.is_none() {
            match self.read(&mut leases, pool, ReadWait::Now) {
                Ok(Some(n)) => count += n,
                Ok(None) => break,
                Err(err) => leases.deferred = Some(err),
            }
        }
        count
    }

    /// Reads releases: the first one waiting as `wait` says, then every one that has arrived
    /// (up to 64 in all), applying them; `None` if nothing came. A consumer found gone (its end
    /// dropped, its process dead) releases every lease open on the connection.
    pub(crate) fn read(
        &self,
        leases: &mut Leases,
        pool: &Inner,
        wait: ReadWait,
    ) -> Result<Option<usize>> {
        // Room for any message, so that a wrong one is read (and refused), never stuck.
        let mut buf = [0u8; MAX_MESSAGE];
        let mut count = 0;
        let mut read = 0;
        // Every well-formed release is applied even if a bad record comes first: a misbehaving
        // consumer must not make the producer lose track of the leases it did give back.
        let mut first_error = None;
        while read < 64 {
            let got = match (read, wait) {
                (0, ReadWait::Block(spin)) => {
                    if leases.rx.spin() != spin {
                        leases.rx.set_spin(spin);
                    }
                    leases.rx.recv(&mut buf).map(Some)
                }
                (0, ReadWait::Until(deadline)) => leases
                    .rx
                    .recv_timeout(&mut buf, deadline.saturating_duration_since(Instant::now())),
                _ => leases.rx.try_recv(&mut buf),
            };
            let n = match got {
                Ok(Some(n)) => n,
                Ok(None) => {
                    // Nothing there: for a non-blocking look, check that the consumer still
                    // lives (its socket), since a killed one says nothing.
                    if read == 0 && matches!(wait, ReadWait::Now) && !leases.rx.is_peer_alive() {
                        return Ok(Some(self.consumer_gone(leases, pool)));
                    }
                    break;
                }
                Err(Error::PeerGone) => return Ok(Some(count + self.consumer_gone(leases, pool))),
                Err(err) => return Err(err),
            };
            read += 1;
            let problem = match Record::decode(&buf[..n]) {
                Ok(Record::Release { id }) if leases.remove_one(id) => {
                    pool.release(id, 1);
                    leases.released += 1;
                    count += 1;
                    continue;
                }
                Ok(Record::Release { id }) => Error::Protocol {
                    wire: WireFormat::Pool,
                    problem: format!("the consumer released region {id}, which it did not hold"),
                },
                Ok(Record::Hello { .. }) => Error::Protocol {
                    wire: WireFormat::Pool,
                    problem: "a second hello from the consumer".into(),
                },
                Err(err) => err,
            };
            first_error.get_or_insert(problem);
        }
        match first_error {
            Some(err) => Err(err),
            None if read == 0 => Ok(None),
            None => Ok(Some(count)),
        }
    }

    /// The consumer's end closed: every lease on this connection comes back.
    fn consumer_gone(&self, leases: &mut Leases, pool: &Inner) -> usize {
        self.closed.store(true, Ordering::Release);
        leases.gone = true;
        let count = leases.outstanding;
        for (id, n) in leases.open.drain() {
            pool.release(id, n);
        }
        leases.outstanding = 0;
        leases.reclaimed += count as u64;
        if count > 0 {
            tracing::info!(
                leases = count,
                "consumer gone; its open leases were released"
            );
        }
        count
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The connection's socket (it carries the regions' fds).
    pub(crate) fn socket(&self) -> BorrowedFd<'_> {
        // SAFETY: `socket` is the channel's socket, owned by the channel's halves inside
        // `mirror` and `leases`, which keep it open as long as `self` (so `&self`) lives.
        unsafe { BorrowedFd::borrow_raw(self.socket) }
    }

    fn pending_lock(&self) -> MutexGuard<'_, Vec<u64>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The channel's errors as the pool reports them: a consumer gone is [`Error::Disconnected`].
pub(crate) fn to_pool_error(err: Error) -> Error {
    match err {
        Error::PeerGone => Error::Disconnected,
        // A pool connection is a channel: a peer that speaks another format was expected to speak
        // the pool's.
        Error::WrongProtocol {
            expected: WireFormat::Channel,
            got,
        } => Error::WrongProtocol {
            expected: WireFormat::Pool,
            got,
        },
        other => other,
    }
}
