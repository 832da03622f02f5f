//! [`Link`]: what the pool and one [`PoolSender`](super::PoolSender) share about a connection, so
//! that the pool can tell the consumer at once to drop its mapping of a region the pool released
//! (trim, limits, idle release), even while the producer is not sending.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use rustix::fd::{AsFd, OwnedFd};

use super::wire::{self, Header, Kind};
use crate::error::Result;

/// One connection's write side and the consumer's mapping cache as the producer accounts it.
/// Every write to the socket happens under `mirror`'s lock, so messages never interleave.
pub(crate) struct Link {
    pub(crate) socket: OwnedFd,
    mirror: Mutex<Mirror>,
    /// Released regions the pool could not forget at once (the sender held the lock, or the
    /// socket was full); the sender forgets them before its next message.
    pending: Mutex<Vec<u64>>,
    forgotten: AtomicU64,
}

/// The consumer's cache as the producer accounts it.
#[derive(Debug, Default)]
pub(crate) struct Mirror {
    /// Cached region ids: (capacity, last use tick).
    pub(crate) known: HashMap<u64, (u64, u64)>,
    pub(crate) known_bytes: u64,
    /// The consumer's end closed: nothing more to tell it.
    pub(crate) closed: bool,
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
}

impl Link {
    pub(crate) fn new(socket: OwnedFd) -> Self {
        Self {
            socket,
            mirror: Mutex::new(Mirror::default()),
            pending: Mutex::new(Vec::new()),
            forgotten: AtomicU64::new(0),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Mirror> {
        self.mirror.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn forgotten(&self) -> u64 {
        self.forgotten.load(Ordering::Relaxed)
    }

    /// The pool released `ids` (called outside the pool's lock): tell the consumer to drop the
    /// ones it caches, without ever waiting for the sender's lock or a full socket (those go to
    /// `pending`).
    pub(crate) fn forget_released(&self, ids: &[u64]) {
        let mut mirror = match self.mirror.try_lock() {
            Ok(mirror) => mirror,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                self.pending_lock().extend_from_slice(ids);
                return;
            }
        };
        if mirror.closed {
            return;
        }
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
            if mirror.remove(id) && !mirror.closed {
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

    fn pending_lock(&self) -> MutexGuard<'_, Vec<u64>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
