//! [`Link`]: what the pool and one [`PoolSender`](super::PoolSender) share about a connection:
//! the consumer's mapping cache as the producer accounts it (so the pool can tell the consumer at
//! once to drop its mapping of a region the pool released) and the consumer's open leases (so the
//! pool, missing a region of some size, can take the releases that have arrived itself).
//!
//! Locks: `mirror` before `leases` where both are held (the sender's `send`); the pool only ever
//! `try_lock`s either, so it never waits on a sender and no order can deadlock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::Duration;

use rustix::fd::{AsFd, OwnedFd};
use rustix::io::Errno;
use rustix::net::RecvFlags;

use super::wire::{self, Header, Kind, Record, RECORD_LEN};
use super::Inner;
use crate::error::{Error, Result};
use crate::transfer;

/// One connection, shared by its sender and the pool. Every write to the socket happens under
/// `mirror`'s lock, every read under `leases`'.
pub(crate) struct Link {
    pub(crate) socket: OwnedFd,
    mirror: Mutex<Mirror>,
    leases: Mutex<Leases>,
    /// Released regions the pool could not forget at once (the sender held the lock, or the
    /// socket was full); the sender forgets them before its next message.
    pending: Mutex<Vec<u64>>,
    forgotten: AtomicU64,
    /// The consumer's end has closed.
    closed: AtomicBool,
}

/// The consumer's cache as the producer accounts it.
#[derive(Debug, Default)]
pub(crate) struct Mirror {
    /// Cached region ids: (capacity, last use tick).
    pub(crate) known: HashMap<u64, (u64, u64)>,
    pub(crate) known_bytes: u64,
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

/// The consumer's open leases and what reading its records found.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    /// Open leases per region id.
    pub(crate) open: HashMap<u64, usize>,
    pub(crate) outstanding: usize,
    /// Bytes of a record not complete yet.
    partial: Vec<u8>,
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

impl Link {
    pub(crate) fn new(socket: OwnedFd) -> Self {
        Self {
            socket,
            mirror: Mutex::new(Mirror::default()),
            leases: Mutex::new(Leases::default()),
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
            match self.send_forget(id, true) {
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
                self.send_forget(id, false)?;
            }
        }
        Ok(())
    }

    /// Sends one `FORGET`; `Ok(false)` if `nowait` and the socket was full. The caller holds
    /// `mirror` (all writes happen under it) and updates it.
    pub(crate) fn send_forget(&self, id: u64, nowait: bool) -> Result<bool> {
        let header = Header {
            kind: Kind::Forget,
            transient: false,
            id,
            len: 0,
            map_len: 0,
            user_len: 0,
        };
        let message = wire::encode(&header, &[])?;
        let sent = wire::send_message_with(self.socket.as_fd(), &message, None, nowait)?;
        if sent {
            self.forgotten.fetch_add(1, Ordering::Relaxed);
        }
        Ok(sent)
    }

    /// Called by the pool on a cache miss: applies the releases that have arrived, never
    /// waiting (not for the sender, not for the socket). Returns how many leases came back.
    pub(crate) fn drain_for_pool(&self, pool: &Inner) -> usize {
        let mut leases = match self.leases.try_lock() {
            Ok(leases) => leases,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return 0,
        };
        let mut count = 0;
        while !leases.gone && leases.outstanding > 0 && leases.deferred.is_none() {
            match self.read(&mut leases, pool, RecvFlags::DONTWAIT, Duration::ZERO) {
                Ok(Some(n)) => count += n,
                Ok(None) => break,
                Err(err) => leases.deferred = Some(err),
            }
        }
        count
    }

    /// One `recv` (spinning up to `spin` first, if `flags` may block), applying the records that
    /// came; `None` if nothing was there (`EAGAIN`).
    pub(crate) fn read(
        &self,
        leases: &mut Leases,
        pool: &Inner,
        flags: RecvFlags,
        spin: Duration,
    ) -> Result<Option<usize>> {
        let mut buf = [0u8; RECORD_LEN * 64];
        let socket = self.socket.as_fd();
        let got = transfer::wait_and(spin, |extra| {
            rustix::net::recv(socket, &mut buf, flags | extra).map(|(n, _)| n)
        });
        let n = match got {
            Ok(0) | Err(Errno::CONNRESET | Errno::PIPE) => {
                return Ok(Some(self.consumer_gone(leases, pool)))
            }
            Ok(n) => n,
            Err(Errno::AGAIN) => return Ok(None),
            Err(errno) => return Err(transfer::socket_error(errno, "recv")),
        };
        leases.partial.extend_from_slice(&buf[..n]);
        let whole = leases.partial.len() / RECORD_LEN * RECORD_LEN;
        let records: Vec<u8> = leases.partial.drain(..whole).collect();
        let mut count = 0;
        // Every well-formed release is applied even if a bad record comes first: a misbehaving
        // consumer must not make the producer lose track of the leases it did give back.
        let mut first_error = None;
        for chunk in records.chunks_exact(RECORD_LEN) {
            let problem = match Record::decode(chunk) {
                Ok(Record::Release { id }) if leases.remove_one(id) => {
                    pool.release(id, 1);
                    leases.released += 1;
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

    fn pending_lock(&self) -> MutexGuard<'_, Vec<u64>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
