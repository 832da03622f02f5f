//! A caching pool of shared-memory regions: the CPU analogue of the CUDA caching allocator.
//!
//! # Why
//!
//! A fresh shared object costs a kernel page allocation, zeroing and a page-cache insertion per
//! 4 KiB page on first touch, plus `mmap`, faults and `munmap` in every process that maps it:
//! PyTorch's `share_memory_` and its `file_descriptor` strategy pay all of it again for every
//! tensor they share, and a data loader shares a new batch every step. The pool keeps regions
//! after use instead, already faulted in (and huge-page advised), and lends them again; a
//! consumer connected with a [`PoolReceiver`] keeps its
//! mapping of every region it has seen, so a region sent again travels as an id: no fd, no
//! `mmap`, no faults, no `munmap` on either side. The ids and the releases travel on a
//! shared-memory [`channel`](crate::channel): no system call while the other side is awake.
//!
//! # The pieces
//!
//! | piece | side | what it does |
//! | --- | --- | --- |
//! | [`ShmPool`] | producer | size classes, cached regions, limits, statistics |
//! | [`PoolBuffer`] | producer | one region lent by the pool; dropping it gives the producer's share back |
//! | [`PoolSender`] | producer | one connection to one consumer: sends buffers (fd the first time, id after), tracks the consumer's leases and its mapping cache |
//! | [`PoolReceiver`] | consumer | receives, keeps a bounded cache of mappings, hands out [`Lease`]s |
//! | [`Lease`] | consumer | read (and write) access to a received region; dropping it tells the producer |
//!
//! Both ends are in this module (and at the crate root); the consumer's side is implemented in
//! [`mapping_cache`](crate::mapping_cache).
//!
//! # The socket belongs to the connection
//!
//! [`PoolReceiver::new`] and [`PoolSender::new`] take the socket over: the channel's doorbells and
//! the descriptors of regions sent for the first time travel on it, so the application must not
//! write or read bytes of its own there (nor on a duplicate of it): the other end would read them as
//! a broken pool message ([`Error::Protocol`]) and close the connection. A few bytes that belong to
//! one buffer ride with it as its user data ([`PoolSender::send`]'s `user`, up to
//! [`MAX_POOL_USER_DATA`] bytes, read with [`Lease::user_data`]); for anything else, connect a
//! second socket, or open a [`channel`](crate::channel) of your own on it.
//!
//! Both ends must be the pool's: a [`PoolReceiver`] whose producer uses
//! [`transfer::send_region`](crate::transfer::send_region), or a
//! [`transfer::recv_region`](crate::transfer::recv_region) whose producer is a [`PoolSender`],
//! fails with [`Error::WrongProtocol`] naming both formats (within the channel's liveness
//! interval, 50 ms by default) instead of waiting.
//!
//! # When a region comes back: leases bound to a connection
//!
//! A region returns to the cache only when nobody can still read it: the producer's
//! [`PoolBuffer`] is gone and every lease a consumer took is released. A consumer releases a
//! lease by sending a 24-byte record on its connection (done when the [`Lease`] drops). A consumer
//! killed with `kill -9` cannot send anything, so the pool does not rely on it: every lease is
//! bound to the connection it was sent over, and when the connection's consumer end is gone, all
//! leases still open on it are released at once. "Gone" is the consumer's end of the
//! connection's [`channel`](crate::channel) dropped (a flag in its shared memory), or its socket
//! closed (the kernel closes every descriptor of a dying process; the [`PoolSender`] sees the
//! hang-up when a read of releases finds none, and a sleeping wait within 50 ms). Each [`Lease`]
//! keeps the consumer's end open, so dropping the receiver while leases live does not count as
//! done; a socket a forked child still holds closes only when both have let go (the pool then
//! waits longer, never shorter).
//!
//! A region lent over a [`PoolSender`] that is dropped while the consumer still holds it is never
//! reused ("abandoned"): the pool forgets it, and its memory goes when the consumer's mapping
//! does.
//!
//! # Trust
//!
//! Regions are memfds sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`), so no
//! peer can truncate one under anybody's mapping. A reused region still holds the bytes of its
//! previous use, and a consumer maps a region's whole capacity: all consumers of one pool see
//! what the pool's earlier buffers held. Use one pool per trust domain.
//!
//! # Example
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use tensormem_shm::pool::{PoolConfig, PoolReceiver, PoolSender, ReceiverOptions, ShmPool};
//!
//! let (producer_end, consumer_end) = UnixStream::pair()?;
//! // Consumer first: it announces how many mappings it caches.
//! let mut receiver = PoolReceiver::new(consumer_end, ReceiverOptions::default())?;
//! let pool = ShmPool::new(PoolConfig::default());
//! let mut sender = PoolSender::new(&pool, producer_end)?;
//!
//! for step in 0..3u8 {
//!     let mut batch = pool.alloc(1 << 20)?; // step 0 makes a region, later steps reuse it
//!     batch.fill(step)?;
//!     sender.send(&batch, b"batch")?; // step 0 sends the fd, later steps an id
//!     drop(batch); // the producer's share
//!
//!     let lease = receiver.recv()?; // step 0 maps, later steps find the mapping cached
//!     assert_eq!(lease.read_volatile(0)?, step);
//!     assert_eq!(lease.user_data(), b"batch");
//!     drop(lease); // tells the producer
//!     sender.wait_release(None)?; // the region is back in the pool
//! }
//! assert_eq!(pool.stats().regions.allocated, 1);
//! assert_eq!(pool.stats().cache_hits, 2);
//! assert_eq!(receiver.stats().mapped, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// Why releasing every lease of a closed connection is sound, and why the connection:
//
// - the consumer's channel end, and with it its socket, stays open while any lease lives (each
//   `Lease` holds a reference to it);
// - a process's memory mappings are torn down before its descriptors are closed (`exit_mm`
//   precedes `exit_files` in the kernel's `do_exit`), so once the hang-up is seen the dead
//   consumer maps nothing;
// - alternatives: the refcounted header count (PyTorch's layout) is decremented by the consumer
//   itself, so a `kill -9` leaves it stuck forever; per-consumer slots in a header with pid and
//   start time need polling `/proc` to notice a death and trust what a peer wrote into shared
//   memory; a memfd has no mapping count a peer could read. The connection is something the
//   kernel closes for a dead process, atomically and with no polling.

mod buffer;
mod link;
mod sender;
pub mod size_class;
mod stats;
pub(crate) mod wire;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

pub use crate::mapping_cache::{CacheLimits, Lease, PoolReceiver, ReceiverOptions, ReceiverStats};
pub use buffer::PoolBuffer;
use link::Link;
pub use sender::{PoolSender, SenderStats};
pub use stats::{PoolStats, Stat};
pub use wire::MAX_POOL_USER_DATA;

/// Most leases open on one connection ([`PoolSender`]) at a time: a send beyond it is
/// [`Error::TooManyLeases`]. (The consumer's releases then always fit its channel's ring.)
pub const MAX_LEASES: usize = wire::POOL_SLOTS as usize;

use crate::copy::{self, CopyPlan};
use crate::error::{Error, Result, SizeProblem};
use crate::object;
use crate::region::SharedRegion;

/// What a [`ShmPool`] keeps and how it makes regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// At most this many bytes of regions kept for reuse (not counting regions in use); when a
    /// region comes back and would exceed it, the least recently used cached regions are released
    /// first (default 4 GiB).
    pub max_cached_bytes: u64,
    /// Release cached regions unused for longer than this (checked whenever the pool is used, and
    /// by [`ShmPool::trim_idle`]); `None` keeps them until trimmed (default 60 s).
    pub idle_release: Option<Duration>,
    /// Advise transparent huge pages on new regions (effective where
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows it for shared memory).
    pub huge_pages: bool,
    /// Fault every page of a new region in (`MADV_POPULATE_WRITE`) when [`ShmPool::alloc`] makes
    /// it, so the producer's fill runs at memory speed even the first time.
    pub prefault: bool,
    /// Threads for copies, fills and pre-faulting of large buffers (each takes at least 4 MiB).
    pub threads: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_cached_bytes: 4 << 30,
            idle_release: Some(Duration::from_secs(60)),
            huge_pages: true,
            prefault: true,
            threads: copy::parallelism(),
        }
    }
}

/// A caching pool of shared-memory regions (see the [module docs](self)). Cheap to clone: clones
/// share one pool. `Send + Sync`.
#[derive(Clone)]
pub struct ShmPool {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    config: PoolConfig,
    state: Mutex<State>,
}

/// What a pool operation released, dealt with once the pool's lock is dropped: the producer's
/// mappings are unmapped (a large `munmap` takes a while) and every connection tells its
/// consumer to drop its mappings of the released regions.
#[derive(Default)]
struct Released {
    regions: Vec<SharedRegion>,
    ids: Vec<u64>,
    links: Vec<Arc<Link>>,
}

impl Drop for Released {
    fn drop(&mut self) {
        self.regions.clear();
        if !self.ids.is_empty() {
            for link in &self.links {
                link.forget_released(&self.ids);
            }
        }
    }
}

struct State {
    entries: HashMap<u64, Entry>,
    /// Cached region ids by capacity; the most recently returned last (reused first: warmest).
    free: BTreeMap<u64, Vec<u64>>,
    next_id: u64,
    stats: PoolStats,
    links: Vec<Weak<Link>>,
    last_idle_scan: Instant,
}

struct Entry {
    capacity: u64,
    /// The producer's buffer (while one is out) plus every consumer lease.
    holders: usize,
    /// The producer's mapping and fd: `Some` unless a [`PoolBuffer`] holds it.
    region: Option<SharedRegion>,
    /// In the cache (`holders == 0`) since this instant.
    idle_since: Instant,
    cached: bool,
    /// Never reuse: release when the last holder goes.
    doomed: bool,
}

impl ShmPool {
    /// An empty pool.
    pub fn new(config: PoolConfig) -> Self {
        let config = PoolConfig {
            threads: config.threads.max(1),
            ..config
        };
        Self {
            inner: Arc::new(Inner {
                config,
                state: Mutex::new(State {
                    entries: HashMap::new(),
                    free: BTreeMap::new(),
                    next_id: 1,
                    stats: PoolStats::default(),
                    links: Vec::new(),
                    last_idle_scan: Instant::now(),
                }),
            }),
        }
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// A buffer of `len` bytes in shared memory. Its bytes are unspecified: a reused region
    /// holds what its previous use wrote (a new one is zeroed); see
    /// [`alloc_zeroed`](Self::alloc_zeroed).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSize`] for 0 or an oversized `len`; [`Error::Os`] if a new region cannot
    /// be made (`ENOMEM`, `EMFILE`, ...).
    pub fn alloc(&self, len: u64) -> Result<PoolBuffer> {
        let (capacity, len) = self.class(len)?;
        if let Some(buffer) = self.inner.take_cached_or_drain(capacity, len) {
            return Ok(buffer);
        }
        let mut region = self.inner.new_region(capacity)?;
        if self.inner.config.prefault {
            buffer::prefault(&mut region, self.inner.config.threads)?;
        }
        Ok(self.inner.register(region, capacity, len))
    }

    /// [`alloc`](Self::alloc), with the `len` bytes set to zero.
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc).
    pub fn alloc_zeroed(&self, len: u64) -> Result<PoolBuffer> {
        let (capacity, len) = self.class(len)?;
        if let Some(mut buffer) = self.inner.take_cached_or_drain(capacity, len) {
            buffer.fill(0)?;
            return Ok(buffer);
        }
        // A new memfd reads as zeros.
        let mut region = self.inner.new_region(capacity)?;
        if self.inner.config.prefault {
            buffer::prefault(&mut region, self.inner.config.threads)?;
        }
        Ok(self.inner.register(region, capacity, len))
    }

    /// Copies `src` into a buffer (PyTorch's `share_memory_`): into a cached region at memory
    /// speed (threads copying into pages already faulted in), or, for the first region of its
    /// size, into a new one exactly as [`SharedRegion::copy_from_bytes`] does (cold path).
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc).
    #[doc(alias = "share_memory_")]
    pub fn copy_from_bytes(&self, src: &[u8]) -> Result<PoolBuffer> {
        let (capacity, len) = self.class(src.len() as u64)?;
        if let Some(mut buffer) = self.inner.take_cached_or_drain(capacity, len) {
            buffer.copy_from(src)?;
            return Ok(buffer);
        }
        let mut region = self.inner.new_region(capacity)?;
        let plan = CopyPlan {
            huge_pages: false, // advised by new_region already
            ..CopyPlan::with_threads(self.inner.config.threads)
        };
        copy::fill_fresh_region(&mut region, src, &plan)?;
        Ok(self.inner.register(region, capacity, len))
    }

    /// What the pool holds and has done.
    pub fn stats(&self) -> PoolStats {
        self.inner.lock().stats
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let mut state = self.inner.lock();
        let stats = &mut state.stats;
        for stat in [
            &mut stats.reserved_bytes,
            &mut stats.in_use_bytes,
            &mut stats.cached_bytes,
            &mut stats.regions,
        ] {
            stat.peak = stat.current;
        }
    }

    /// Releases every cached region (PyTorch's `empty_cache`); regions in use are untouched.
    /// Every connected consumer that caches one is told at once to drop its mapping (see
    /// [`PoolSender`]); the memory is freed once the last mapping is gone.
    /// Returns the bytes released.
    pub fn trim(&self) -> u64 {
        self.trim_to(0)
    }

    /// Releases least recently used cached regions until at most `max_cached` bytes stay cached.
    /// Returns the bytes released.
    pub fn trim_to(&self, max_cached: u64) -> u64 {
        self.inner.trim_where(|state| {
            (state.stats.cached_bytes.current > max_cached)
                .then(|| state.least_recently_used())
                .flatten()
        })
    }

    /// Releases cached regions that have been idle for at least `older_than`. Returns the bytes
    /// released.
    pub fn trim_idle(&self, older_than: Duration) -> u64 {
        let now = Instant::now();
        self.inner.trim_where(|state| {
            state
                .least_recently_used()
                .filter(|id| now.duration_since(state.entries[id].idle_since) >= older_than)
        })
    }

    /// Starts a thread that releases cached regions idle longer than
    /// [`PoolConfig::idle_release`], checking every quarter of it, so a producer that stops
    /// sharing gives its memory back without calling the pool again. The thread holds no
    /// reference to the pool and ends once the pool and all its buffers and senders are gone.
    /// Without it, idle regions are released only when the pool is next used, or by
    /// [`trim_idle`](Self::trim_idle).
    ///
    /// Returns `None` if the configuration has no `idle_release`.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] if the thread cannot be started.
    pub fn start_idle_trimmer(&self) -> Result<Option<std::thread::JoinHandle<()>>> {
        let Some(idle) = self.inner.config.idle_release else {
            return Ok(None);
        };
        let period = (idle / 4).max(Duration::from_millis(1));
        let pool = Arc::downgrade(&self.inner);
        std::thread::Builder::new()
            .name("tensormem-shm-pool-trim".into())
            .spawn(move || loop {
                std::thread::sleep(period);
                let Some(inner) = pool.upgrade() else { return };
                let released = ShmPool { inner }.trim_idle(idle);
                if released > 0 {
                    tracing::debug!(bytes = released, "released idle pooled regions");
                }
            })
            .map(Some)
            .map_err(|source| Error::Os {
                object: "shared-memory pool".into(),
                op: "spawn idle trimmer",
                source,
            })
    }

    fn class(&self, len: u64) -> Result<(u64, usize)> {
        let object = "pooled region";
        let len_usize = object::check_len(len, object)?;
        let capacity = size_class::class_for(len)
            .filter(|&c| c <= isize::MAX as u64)
            .ok_or(Error::InvalidSize {
                object: object.to_owned(),
                len,
                problem: SizeProblem::TooLarge,
            })?;
        Ok((capacity, len_usize))
    }

    pub(crate) fn from_inner(inner: Arc<Inner>) -> Self {
        Self { inner }
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }
}

impl Default for ShmPool {
    fn default() -> Self {
        Self::new(PoolConfig::default())
    }
}

impl std::fmt::Debug for ShmPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmPool")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl State {
    /// The cached region idle the longest.
    fn least_recently_used(&self) -> Option<u64> {
        self.free
            .values()
            .filter_map(|ids| ids.first())
            .min_by_key(|id| self.entries[id].idle_since)
            .copied()
    }

    /// Removes `id` from the pool into `out` (its region, and its id for every connection to
    /// forget), to be dealt with outside the lock.
    fn destroy(&mut self, id: u64, out: &mut Released) {
        let Some(entry) = self.entries.remove(&id) else {
            return;
        };
        if entry.cached {
            if let Some(ids) = self.free.get_mut(&entry.capacity) {
                ids.retain(|&other| other != id);
                if ids.is_empty() {
                    self.free.remove(&entry.capacity);
                }
            }
            self.stats.cached_bytes.sub(entry.capacity);
        }
        self.stats.reserved_bytes.sub(entry.capacity);
        self.stats.regions.sub(1);
        if out.ids.is_empty() {
            self.links.retain(|link| link.strong_count() > 0);
            out.links = self.links.iter().filter_map(Weak::upgrade).collect();
        }
        out.ids.push(id);
        out.regions.extend(entry.region);
        tracing::trace!(id, capacity = entry.capacity, "released pooled region");
    }

    /// Releases cached regions idle longer than `idle`, at most every `idle / 4`.
    fn release_idle(&mut self, idle: Option<Duration>, now: Instant, out: &mut Released) {
        let Some(idle) = idle else { return };
        if now.duration_since(self.last_idle_scan) < idle / 4 {
            return;
        }
        self.last_idle_scan = now;
        while let Some(id) = self
            .least_recently_used()
            .filter(|id| now.duration_since(self.entries[id].idle_since) >= idle)
        {
            self.stats.trimmed += 1;
            self.destroy(id, out);
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A cached region of `capacity` bytes lent as a buffer of `len`; if none is cached, the
    /// releases that consumers have sent but no sender has read yet are applied first (never
    /// waiting: a connection whose sender is busy is skipped).
    fn take_cached_or_drain(self: &Arc<Self>, capacity: u64, len: usize) -> Option<PoolBuffer> {
        if let Some(buffer) = self.take_cached(capacity, len, true) {
            return Some(buffer);
        }
        let links: Vec<Arc<Link>> = self.lock().links.iter().filter_map(Weak::upgrade).collect();
        let returned: usize = links.iter().map(|link| link.drain_for_pool(self)).sum();
        if returned == 0 {
            return None;
        }
        self.take_cached(capacity, len, false)
    }

    /// A cached region of exactly `capacity` bytes, if there is one, lent as a buffer of `len`.
    fn take_cached(self: &Arc<Self>, capacity: u64, len: usize, count: bool) -> Option<PoolBuffer> {
        let mut released = Released::default();
        let taken = {
            let mut state = self.lock();
            if count {
                state.stats.requests += 1;
            }
            state.release_idle(self.config.idle_release, Instant::now(), &mut released);
            let ids = state.free.get_mut(&capacity)?;
            let id = ids.pop()?;
            if ids.is_empty() {
                state.free.remove(&capacity);
            }
            let entry = state
                .entries
                .get_mut(&id)
                .expect("a cached id has an entry");
            entry.cached = false;
            entry.holders = 1;
            let region = entry.region.take().expect("a cached region is in the pool");
            state.stats.cache_hits += 1;
            state.stats.cached_bytes.sub(capacity);
            state.stats.in_use_bytes.add(capacity);
            (id, region)
        };
        drop(released);
        let (id, region) = taken;
        Some(PoolBuffer::new(Arc::clone(self), id, region, len, false))
    }

    fn new_region(&self, capacity: u64) -> Result<SharedRegion> {
        let region = SharedRegion::create_anonymous(capacity)?;
        if self.config.huge_pages {
            object::advise_huge_pages(region.mapping());
        }
        Ok(region)
    }

    /// Enters a region made for a request (already counted by `take_cached`) and lends it.
    fn register(self: &Arc<Self>, region: SharedRegion, capacity: u64, len: usize) -> PoolBuffer {
        let id = {
            let mut state = self.lock();
            let id = state.next_id;
            state.next_id += 1;
            state.entries.insert(
                id,
                Entry {
                    capacity,
                    holders: 1,
                    region: None,
                    idle_since: Instant::now(),
                    cached: false,
                    doomed: false,
                },
            );
            state.stats.reserved_bytes.add(capacity);
            state.stats.in_use_bytes.add(capacity);
            state.stats.regions.add(1);
            id
        };
        tracing::debug!(id, capacity, "made a pooled region");
        PoolBuffer::new(Arc::clone(self), id, region, len, true)
    }

    /// The producer's buffer is dropped: its region goes back into the entry.
    pub(crate) fn put_back(&self, id: u64, region: SharedRegion) {
        let mut released = Released::default();
        {
            let mut state = self.lock();
            if let Some(entry) = state.entries.get_mut(&id) {
                entry.region = Some(region);
            }
            self.release_in(&mut state, id, 1, false, &mut released);
        }
        drop(released);
    }

    /// One more holder (a lease sent to a consumer) of a region that has at least one.
    pub(crate) fn acquire(&self, id: u64) {
        if let Some(entry) = self.lock().entries.get_mut(&id) {
            debug_assert!(entry.holders > 0, "acquire of a region nobody holds");
            entry.holders += 1;
        }
    }

    /// `count` holders let go (consumer leases released, or their consumer died).
    pub(crate) fn release(&self, id: u64, count: usize) {
        let mut released = Released::default();
        {
            let mut state = self.lock();
            self.release_in(&mut state, id, count, false, &mut released);
        }
        drop(released);
    }

    /// The producer's buffer left the pool for good ([`PoolBuffer::detach`]): the region is
    /// never reused, and the entry goes once the consumers' leases are released.
    pub(crate) fn detach(&self, id: u64) {
        let mut released = Released::default();
        {
            let mut state = self.lock();
            if let Some(entry) = state.entries.get_mut(&id) {
                entry.doomed = true;
                state.stats.detached += 1;
            }
            self.release_in(&mut state, id, 1, false, &mut released);
        }
        drop(released);
    }

    /// `count` holders are lost track of (their connection was dropped while the consumer still
    /// held them): the region is never reused.
    pub(crate) fn abandon(&self, id: u64, count: usize) {
        let mut released = Released::default();
        {
            let mut state = self.lock();
            if let Some(entry) = state.entries.get_mut(&id) {
                if !entry.doomed {
                    entry.doomed = true;
                    state.stats.abandoned += 1;
                }
            }
            self.release_in(&mut state, id, count, true, &mut released);
        }
        drop(released);
    }

    fn release_in(
        &self,
        state: &mut State,
        id: u64,
        count: usize,
        abandoned: bool,
        released: &mut Released,
    ) {
        let Some(entry) = state.entries.get_mut(&id) else {
            return;
        };
        debug_assert!(entry.holders >= count, "more releases than holders");
        entry.holders = entry.holders.saturating_sub(count);
        if entry.holders > 0 {
            return;
        }
        let capacity = entry.capacity;
        let doomed = entry.doomed;
        state.stats.in_use_bytes.sub(capacity);
        if doomed {
            if abandoned {
                tracing::debug!(id, "abandoned pooled region released");
            }
            state.destroy(id, released);
            return;
        }
        if capacity > self.config.max_cached_bytes {
            state.stats.evictions += 1;
            state.destroy(id, released);
            return;
        }
        while state.stats.cached_bytes.current + capacity > self.config.max_cached_bytes {
            let Some(victim) = state.least_recently_used() else {
                break;
            };
            state.stats.evictions += 1;
            state.destroy(victim, released);
        }
        let now = Instant::now();
        let entry = state.entries.get_mut(&id).expect("entry checked above");
        entry.cached = true;
        entry.idle_since = now;
        state.free.entry(capacity).or_default().push(id);
        state.stats.cached_bytes.add(capacity);
        state.release_idle(self.config.idle_release, now, released);
    }

    fn trim_where(&self, mut next: impl FnMut(&State) -> Option<u64>) -> u64 {
        let mut released = Released::default();
        let mut bytes = 0;
        {
            let mut state = self.lock();
            while let Some(id) = next(&state) {
                bytes += state.entries[&id].capacity;
                state.stats.trimmed += 1;
                state.destroy(id, &mut released);
            }
        }
        drop(released);
        bytes
    }

    /// Registers a connection, to be told about every region the pool releases from now on.
    pub(crate) fn register_link(&self, link: &Arc<Link>) {
        let mut state = self.lock();
        state.links.retain(|link| link.strong_count() > 0);
        state.links.push(Arc::downgrade(link));
    }
}
