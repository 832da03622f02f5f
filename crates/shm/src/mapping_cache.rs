//! The consumer's side of a [pool](crate::pool) connection (its types are re-exported in
//! [`pool`](crate::pool) and at the crate root, beside the producer's): a bounded cache of mappings of the
//! producer's regions, so a region received again is reached through the mapping made the first
//! time (no fd, no `mmap`, no page faults, no `munmap`), and [`Lease`]s, the handles through which
//! received regions are read.
//!
//! The cache is bounded by [`CacheLimits`] (regions and bytes), announced to the producer when
//! the receiver is made; the producer's [`PoolSender`](crate::pool::PoolSender) mirrors the cache
//! and says what to evict, and tells the receiver to drop mappings of regions its pool released.
//! When the producer goes away (it dropped its sender, or its process is gone), every cached
//! mapping is dropped; leases still held keep their mapping until they go.
//!
//! The receiver creates the connection's shared-memory [`channel`](crate::channel) over the
//! socket it is given: region messages and releases are ring messages (no system call while the
//! other side is awake), the socket carries the fds of regions seen for the first time.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::channel::{Channel, ChannelOptions, ChannelReceiver, ChannelSender, MAX_MESSAGE};
use crate::error::{Error, Result};
use crate::mapping::{Access, Mapping};
use crate::pool::wire::{self, Kind, Record, MAX_POOL_USER_DATA, POOL_SLOTS};
use crate::pool::MAX_LEASES;
use crate::region::{MapOptions, SharedRegion};
use crate::transfer::RecvOptions;
use crate::wire::WireFormat;

/// How many mappings a [`PoolReceiver`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLimits {
    /// At most this many regions (default 1024).
    pub max_regions: u64,
    /// At most this many bytes of regions (address space; pages are shared with the producer)
    /// (default 64 GiB).
    pub max_bytes: u64,
}

impl Default for CacheLimits {
    fn default() -> Self {
        Self {
            max_regions: 1024,
            max_bytes: 64 << 30,
        }
    }
}

/// How a [`PoolReceiver`] maps and waits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverOptions {
    /// The cache's bounds.
    pub limits: CacheLimits,
    /// Map regions read-write (default) or read-only.
    pub access: Access,
    /// Accept regions owned by another user (see [`MapOptions::allow_foreign_owner`]).
    pub allow_foreign_owner: bool,
    /// How [`PoolReceiver::recv`] waits (blocking by default).
    pub recv: RecvOptions,
}

/// What a [`PoolReceiver`] has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceiverStats {
    /// Regions mapped (messages that carried an fd).
    pub mapped: u64,
    /// Regions reached through a cached mapping (messages that carried an id).
    pub reused: u64,
    /// Cached mappings dropped because the producer said so (evicted or released by its pool).
    pub forgotten: u64,
}

/// The consumer's end of a pool connection: receives [`Lease`]s, keeping the mappings of the
/// regions it has seen (see the [module docs](self)).
pub struct PoolReceiver {
    /// Region messages from the producer.
    rx: ChannelReceiver,
    /// Releases to the producer (shared with every lease).
    releases: Arc<Releases>,
    /// A region message read by [`poll`](PoolReceiver::poll), for the next `recv`.
    stashed: Option<wire::Message>,
    cache: HashMap<u64, Arc<SharedRegion>>,
    cached_bytes: u64,
    options: ReceiverOptions,
    stats: ReceiverStats,
}

impl PoolReceiver {
    /// Wraps the consumer's end of a connected Unix socket, sets the connection's
    /// shared-memory channel up on it and announces its cache limits to the producer (whose
    /// [`PoolSender::new`](crate::pool::PoolSender::new) reads them). Does not wait for the
    /// producer.
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] if the producer hung up; the errors of [`Channel::create`];
    /// [`Error::Os`] for other socket failures.
    pub fn new(socket: impl Into<OwnedFd>, options: ReceiverOptions) -> Result<Self> {
        let channel_options = ChannelOptions {
            slots: POOL_SLOTS,
            spin: options.recv.spin,
            ..ChannelOptions::default()
        };
        let channel = Channel::create(socket.into(), channel_options).map_err(gone)?;
        let (mut tx, rx) = channel.split();
        let hello = Record::Hello {
            entries: options.limits.max_regions,
            bytes: options.limits.max_bytes,
        };
        tx.send(&hello.encode()).map_err(gone)?;
        Ok(Self {
            rx,
            releases: Arc::new(Releases {
                state: Mutex::new(ReleaseState {
                    tx,
                    backlog: VecDeque::new(),
                    live: 0,
                }),
                producer_gone: AtomicBool::new(false),
            }),
            stashed: None,
            cache: HashMap::new(),
            cached_bytes: 0,
            options,
            stats: ReceiverStats::default(),
        })
    }

    /// Waits for the next region and returns a lease on it. `FORGET` messages met on the way are
    /// applied (their mappings dropped) without returning.
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] once the producer is gone (every cached mapping is dropped then);
    /// [`Error::Protocol`] for a malformed message, an id this end does not know, a producer
    /// that overfills the cache, or one that lends more than [`MAX_LEASES`] leases at once (a
    /// correct producer never does: its [`send`](crate::pool::PoolSender::send) refuses; the
    /// lease is not taken and not given back); the attach errors of a received fd
    /// ([`Error::WrongKind`], [`Error::TooSmall`], [`Error::ForeignOwner`]).
    pub fn recv(&mut self) -> Result<Lease> {
        self.releases.flush_backlog();
        loop {
            let got = match self.stashed.take() {
                Some(message) => Ok(message),
                None => self.next_message(),
            };
            let (fd, message) = match got {
                Ok(got) => got,
                Err(Error::Disconnected) => {
                    self.clear();
                    return Err(Error::Disconnected);
                }
                Err(err) => return Err(err),
            };
            let header = wire::decode(&message)?;
            if header.kind != Kind::Forget {
                self.check_lease_limit(header.id)?;
            }
            let region = match (header.kind, fd) {
                (Kind::Forget, None) => {
                    self.forget(header.id);
                    continue;
                }
                (Kind::Known, None) => {
                    match self.cache.get(&header.id) {
                        Some(region) => {
                            self.stats.reused += 1;
                            Arc::clone(region)
                        }
                        None => {
                            self.refuse(header.id);
                            return Err(Error::Protocol {
                            wire: WireFormat::Pool,
                            problem: format!("the producer sent region {} by id, which this end has not cached", header.id),
                        });
                        }
                    }
                }
                (Kind::New, Some(fd)) => {
                    let region = match self.attach(fd, header.map_len) {
                        Ok(region) => Arc::new(region),
                        Err(err) => {
                            self.refuse(header.id);
                            return Err(err);
                        }
                    };
                    self.stats.mapped += 1;
                    if !header.transient {
                        let len = region.len() as u64;
                        if self.cache.len() as u64 >= self.options.limits.max_regions
                            || self.cached_bytes + len > self.options.limits.max_bytes
                            || self.cache.contains_key(&header.id)
                        {
                            self.refuse(header.id);
                            return Err(Error::Protocol {
                                wire: WireFormat::Pool,
                                problem: format!(
                                    "the producer overfilled this end's mapping cache (region {})",
                                    header.id
                                ),
                            });
                        }
                        self.cache.insert(header.id, Arc::clone(&region));
                        self.cached_bytes += len;
                    }
                    region
                }
                (kind, fd) => {
                    if kind != Kind::Forget {
                        self.refuse(header.id);
                    }
                    return Err(Error::Protocol {
                        wire: WireFormat::Pool,
                        problem: format!(
                            "a {kind:?} message {} an fd",
                            if fd.is_some() { "with" } else { "without" }
                        ),
                    });
                }
            };
            let len = usize::try_from(header.len).unwrap_or(usize::MAX);
            if len > region.len() {
                self.refuse(header.id);
                return Err(Error::Protocol {
                    wire: WireFormat::Pool,
                    problem: format!(
                        "a lease of {len} bytes on a region of {} bytes",
                        region.len()
                    ),
                });
            }
            let mut user = [0u8; MAX_POOL_USER_DATA];
            let user_len = usize::from(header.user_len);
            user[..user_len].copy_from_slice(&message[MESSAGE_HEADER..MESSAGE_HEADER + user_len]);
            self.releases.lease_taken();
            return Ok(Lease {
                id: header.id,
                len,
                region,
                releases: Arc::clone(&self.releases),
                user,
                user_len,
                released: false,
            });
        }
    }

    /// Applies the producer's `FORGET` messages that have arrived, without waiting, and returns
    /// how many mappings it dropped. A consumer blocked in [`recv`](Self::recv) applies them as
    /// they come; one that is busy elsewhere calls this now and then so that regions the
    /// producer's pool released (trim, limits, idle release) are unmapped here too. A region
    /// message met on the way is kept for the next `recv`.
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] for a malformed message; [`Error::Os`] for socket failures. The
    /// producer's end closing is not an error here: every cached mapping is dropped, and the next
    /// `recv` reports [`Error::Disconnected`].
    pub fn poll(&mut self) -> Result<usize> {
        self.releases.flush_backlog();
        let before = self.stats.forgotten;
        while self.stashed.is_none() {
            let (fd, message) = match self.try_next_message() {
                Ok(Some(got)) => got,
                Ok(None) => {
                    // A producer killed says nothing: look at the socket.
                    if !self.rx.is_peer_alive() {
                        self.clear();
                    }
                    break;
                }
                Err(Error::Disconnected) => {
                    self.clear();
                    break;
                }
                Err(err) => return Err(err),
            };
            let header = wire::decode(&message)?;
            if header.kind == Kind::Forget && fd.is_none() {
                self.forget(header.id);
            } else {
                self.stashed = Some((fd, message));
            }
        }
        Ok((self.stats.forgotten - before) as usize)
    }

    /// Changes how [`recv`](Self::recv) waits from now on.
    pub fn set_recv(&mut self, recv: RecvOptions) {
        self.options.recv = recv;
        self.rx.set_spin(recv.spin);
    }

    /// The next message and its fd, waiting for it.
    fn next_message(&mut self) -> Result<wire::Message> {
        let mut buf = [0u8; MAX_MESSAGE];
        let got = self.rx.recv_with_fd(&mut buf).map_err(gone)?;
        Ok((got.fd, wire::padded(&buf[..got.len])?))
    }

    /// The next message and its fd if one has arrived.
    fn try_next_message(&mut self) -> Result<Option<wire::Message>> {
        let mut buf = [0u8; MAX_MESSAGE];
        match self.rx.try_recv_with_fd(&mut buf).map_err(gone)? {
            Some(got) => Ok(Some((got.fd, wire::padded(&buf[..got.len])?))),
            None => Ok(None),
        }
    }

    /// Regions whose mappings are cached now.
    pub fn cached_regions(&self) -> usize {
        self.cache.len()
    }

    /// Bytes of the cached mappings.
    pub fn cached_bytes(&self) -> u64 {
        self.cached_bytes
    }

    /// What this receiver has done.
    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }

    fn attach(&self, fd: OwnedFd, map_len: u64) -> Result<SharedRegion> {
        MapOptions::new()
            .access(self.options.access)
            .allow_foreign_owner(self.options.allow_foreign_owner)
            .map_owned_fd(fd, map_len, 0)
    }

    /// A lease this end cannot honour: give it back at once so the producer's count stays true
    /// (never waiting: queued if the ring is full).
    fn refuse(&self, id: u64) {
        let _ = self.releases.send(id, false);
    }

    /// Fails if the producer already has [`MAX_LEASES`] leases open on this connection, as it
    /// counts them: leases this end holds, and releases the producer has not read yet. A
    /// correct producer stays below (its count is never lower than this end's), so the
    /// releases of every lease accepted always fit the ring and a drop never waits.
    fn check_lease_limit(&self, id: u64) -> Result<()> {
        let open = self.releases.open_leases()?;
        if open >= MAX_LEASES {
            tracing::warn!(
                id,
                open,
                "pool producer lent more leases than a connection carries; message refused"
            );
            return Err(Error::Protocol {
                wire: WireFormat::Pool,
                problem: format!(
                    "the producer lent region {id} with {open} leases already open on this \
                     connection, the most it carries is {MAX_LEASES}; the producer is broken \
                     or hostile (drop this receiver)"
                ),
            });
        }
        Ok(())
    }

    fn forget(&mut self, id: u64) {
        if let Some(region) = self.cache.remove(&id) {
            self.cached_bytes -= region.len() as u64;
            self.stats.forgotten += 1;
        }
    }

    /// The producer is gone: drop every cached mapping.
    fn clear(&mut self) {
        self.releases.producer_gone.store(true, Ordering::Relaxed);
        self.cache.clear();
        self.cached_bytes = 0;
    }
}

const MESSAGE_HEADER: usize = wire::MESSAGE_LEN - MAX_POOL_USER_DATA;

impl AsFd for PoolReceiver {
    /// The socket under the connection's channel. Region messages travel in shared memory and
    /// make it readable only when they carry an fd; it reports a hang-up when the producer's
    /// process is gone.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.rx.socket()
    }
}

/// The channel's sending half, shared by the receiver and its leases (any thread may drop a
/// lease; the ring has one producer, so sends are serialised here), and whether the receiver
/// has seen the producer gone.
struct Releases {
    state: Mutex<ReleaseState>,
    producer_gone: AtomicBool,
}

/// What [`Releases`] guards.
struct ReleaseState {
    tx: ChannelSender,
    /// Releases the ring had no room for, oldest first; sent before any other (never happens
    /// with a correct producer: the lease limit keeps the ring from filling).
    backlog: VecDeque<u64>,
    /// Leases handed out and not given back yet.
    live: usize,
}

impl ReleaseState {
    /// Sends what the backlog holds while the ring has room, never waiting.
    fn flush(&mut self) -> Result<()> {
        while let Some(&id) = self.backlog.front() {
            if !self
                .tx
                .try_send(&Record::Release { id }.encode())
                .map_err(gone)?
            {
                break;
            }
            self.backlog.pop_front();
        }
        Ok(())
    }
}

impl Releases {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReleaseState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the producer that one lease on `id` is released (`lease`: one this end handed
    /// out, `false`: a message refused). Never waits: with the ring full (a producer that
    /// does not read), the release is queued and sent by a later call.
    fn send(&self, id: u64, lease: bool) -> Result<()> {
        let mut state = self.lock();
        if lease {
            state.live = state.live.saturating_sub(1);
        }
        if self.producer_gone.load(Ordering::Relaxed) {
            state.backlog.clear();
            return Err(Error::Disconnected);
        }
        state.flush()?;
        if state.backlog.is_empty()
            && state
                .tx
                .try_send(&Record::Release { id }.encode())
                .map_err(gone)?
        {
            return Ok(());
        }
        state.backlog.push_back(id);
        tracing::warn!(
            id,
            queued = state.backlog.len(),
            "pool producer does not read releases; one queued to send later"
        );
        Ok(())
    }

    /// Sends queued releases while the ring has room (errors are the next send's to report).
    fn flush_backlog(&self) {
        let mut state = self.lock();
        if !state.backlog.is_empty() && !self.producer_gone.load(Ordering::Relaxed) {
            if let Err(err) = state.flush() {
                tracing::debug!(error = %err, "could not send queued pool releases");
            }
        }
    }

    /// A lease was handed out.
    fn lease_taken(&self) {
        self.lock().live += 1;
    }

    /// Leases the producer counts open: held here, queued, or released and not yet read.
    fn open_leases(&self) -> Result<usize> {
        let mut state = self.lock();
        let unread = state.tx.unread()? as usize;
        Ok(state.live + state.backlog.len() + unread)
    }
}

/// A producer gone is [`Error::Disconnected`] here, as it was on a bare socket.
fn gone(err: Error) -> Error {
    match err {
        Error::PeerGone => Error::Disconnected,
        // A pool connection is a channel: a peer that speaks another format (a `send_region`
        // producer) was expected to speak the pool's.
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

impl fmt::Debug for PoolReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolReceiver")
            .field("cached_regions", &self.cache.len())
            .field("cached_bytes", &self.cached_bytes)
            .field("options", &self.options)
            .field("stats", &self.stats)
            .finish()
    }
}

/// A received region, lent by the producer until this handle is dropped (or
/// [`release`](Self::release)d), which tells the producer; its region is then free to be reused
/// for other data, so read it only through the lease.
///
/// Access is by copies (safe) or the `unsafe` slice, with [`Mapping::as_slice`]'s contract; the
/// lease exposes `len` bytes of a region that may be larger.
pub struct Lease {
    id: u64,
    len: usize,
    region: Arc<SharedRegion>,
    releases: Arc<Releases>,
    user: [u8; MAX_POOL_USER_DATA],
    user_len: usize,
    released: bool,
}

impl Lease {
    /// The region's id in the producer's pool.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes lent.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: leases hold at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The application data sent with the region.
    pub fn user_data(&self) -> &[u8] {
        &self.user[..self.user_len]
    }

    /// The whole region's mapping (it may extend past `len`).
    pub fn mapping(&self) -> &Mapping {
        self.region.mapping()
    }

    /// Copies `buf.len()` bytes from `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] outside the lease's `len` bytes.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        self.region.read_at(offset, buf)
    }

    /// Copies `data` in at `offset` (the producer sees it).
    ///
    /// # Errors
    ///
    /// [`Error::ReadOnly`] if the receiver maps read-only; [`Error::OutOfBounds`] outside the
    /// lease.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        self.region.mapping().write_at_shared(offset, data)
    }

    /// One byte, read with a volatile load.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if `offset >= len()`.
    pub fn read_volatile(&self, offset: usize) -> Result<u8> {
        self.check(offset, 1)?;
        self.region.read_volatile(offset)
    }

    /// A copy of the lease's bytes.
    ///
    /// # Errors
    ///
    /// As [`Mapping::read_at`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        self.region.read_at(0, &mut out)?;
        Ok(out)
    }

    /// Pointer to the first byte, valid for `len` bytes while the lease lives.
    pub fn as_ptr(&self) -> *const u8 {
        self.region.as_ptr()
    }

    /// The lease's bytes as a slice.
    ///
    /// # Safety
    ///
    /// As [`Mapping::as_slice`]: nobody (the producer included) writes the bytes while the slice
    /// lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `len <= region.len()` (checked at receive); mapped while `self` lives; the rest
        // is the caller's obligation.
        unsafe { std::slice::from_raw_parts(self.region.as_ptr(), self.len) }
    }

    /// Gives the lease back now, reporting a failure to tell the producer (dropping does the
    /// same and only logs it). Never waits: if the producer has left the connection's release
    /// ring full (it does not read), the release is queued and sent by the next release,
    /// [`PoolReceiver::recv`] or [`PoolReceiver::poll`].
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] if the producer is gone (nothing to give back to): it dropped
    /// its sender, or its receiver has seen its process gone.
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        self.releases.send(self.id, true)
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.released {
            if let Err(err) = self.releases.send(self.id, true) {
                tracing::debug!(id = self.id, error = %err, "could not release a pool lease (producer gone?)");
            }
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("region_len", &self.region.len())
            .finish()
    }
}
