//! The producer side: [`IpcProducer`] shares allocations of a [`CachingAllocator`] with other
//! processes (PyTorch's `_share_cuda_`, `GetNewRefCountedSentData` and `CudaIPCGlobalEntities`).
//!
//! Sharing an allocation hands it to a [`SharedAllocation`], which owns it from then on. Each
//! [`share`](SharedAllocation::share) takes the next slot of the current ref-counter file (set to 1),
//! records an interprocess event on the producer's stream (or, past
//! [`MAXIMUM_EVENTS_TO_USE`] events in use, synchronizes the stream instead), and returns the
//! [`IpcHandle`] to send. Dropping the `SharedAllocation` frees the allocation back to the allocator
//! once every consumer released its slot; until then it waits in the *limbo*, which
//! [`IpcProducer::collect`] (also registered as the allocator's free-memory callback) empties.

mod batch;
mod events;
mod sent;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tensormem_cuda_alloc::{
    Allocation, CachingAllocator, Device, DeviceAddress, ShareableSegment, StreamId,
};
use tensormem_shm::NameGenerator;

use crate::chunks::ChunkHandle;
use crate::driver::{IpcDriver, MemHandle};
use crate::error::{Error, Result};
use crate::handle::{IpcHandle, SegmentMemory};
use crate::opened::check_shareable;
use crate::refcounter::{RefCounterFile, REF_COUNTER_FILE_SIZE};
use events::EventPool;
use sent::{Sent, SentSlot};

/// At most this many interprocess events are in use at once; past it, sharing synchronizes the stream
/// instead of recording one (PyTorch's `CUDA_IPC_MAXIMUM_EVENTS_TO_USE`).
pub const MAXIMUM_EVENTS_TO_USE: usize = 1000;

/// The limbo warns (once) when it holds more blocks than this (PyTorch's
/// `CUDA_IPC_WARN_AFTER_X_BLOCKS_IN_LIMBO`).
pub const WARN_AFTER_X_BLOCKS_IN_LIMBO: usize = 1000;

/// The warning PyTorch prints when a producer ends while consumers still hold its memory.
pub const PRODUCER_TERMINATED_WARNING: &str =
    "Producer process has been terminated before all shared \
CUDA tensors released. See Note [Sharing CUDA tensors]";

/// Limits of an [`IpcProducer`]; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerConfig {
    /// Slots per ref-counter file ([`REF_COUNTER_FILE_SIZE`]).
    pub slots_per_file: usize,
    /// Interprocess events in use at once ([`MAXIMUM_EVENTS_TO_USE`]).
    pub max_events: usize,
    /// Limbo size past which it warns ([`WARN_AFTER_X_BLOCKS_IN_LIMBO`]).
    pub warn_after_blocks_in_limbo: usize,
    /// Share without an event when the stream has no pending work (default `true`; PyTorch always
    /// records one). Waiting on an interprocess event costs the consumer's next stream operation
    /// about 0.27 ms on an H100, a wait for nothing when every write has completed.
    pub skip_event_when_idle: bool,
    /// How long a batch ([`crate::batch`]) may stay unopened once its memory was freed here:
    /// after that, [`IpcProducer::collect`] gives up the batch's slot if no consumer
    /// claimed it (a message sent and never opened, a consumer killed before it opened it), and a
    /// consumer opening it later is refused with [`Error::ShareExpired`].
    /// Batches are opened only by tensormem consumers, which claim their slot as they open it.
    /// Default: 60 s. `None`: never (the memory stays held until a consumer opens and releases it).
    pub expire_unopened_batches: Option<Duration>,
    /// The same for single shares ([`SharedAllocation::share`]). Default `None`, as in PyTorch:
    /// a PyTorch consumer never claims the slot it holds, so a share it may open must not expire.
    /// Set it when every consumer is tensormem.
    pub expire_unopened_shares: Option<Duration>,
}

/// [`ProducerConfig::expire_unopened_batches`] by default.
pub const DEFAULT_BATCH_EXPIRY: Duration = Duration::from_secs(60);

impl Default for ProducerConfig {
    fn default() -> Self {
        Self {
            slots_per_file: REF_COUNTER_FILE_SIZE,
            max_events: MAXIMUM_EVENTS_TO_USE,
            warn_after_blocks_in_limbo: WARN_AFTER_X_BLOCKS_IN_LIMBO,
            skip_event_when_idle: true,
            expire_unopened_batches: Some(DEFAULT_BATCH_EXPIRY),
            expire_unopened_shares: None,
        }
    }
}

/// Figures of an [`IpcProducer`], for tests and monitoring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProducerStats {
    /// Shares made.
    pub shares: usize,
    /// Allocations waiting in the limbo for consumers to release them.
    pub limbo: usize,
    /// Whether the limbo warning was given.
    pub limbo_warned: bool,
    /// Interprocess events in use.
    pub events_in_use: usize,
    /// Shares that synchronized the stream because the event budget was spent.
    pub synchronized_shares: usize,
    /// Shares made while the stream had no pending work: no event needed.
    pub idle_stream_shares: usize,
    /// Ref-counter files created.
    pub files_created: usize,
    /// Slots reclaimed from consumers that died holding them.
    pub slots_reclaimed: usize,
    /// Whether the shutdown warning was given.
    pub shutdown_warned: bool,
}

/// Shares allocations with other processes (see the [module docs](self)).
///
/// Cheap to clone; every clone is the same producer. One per process is the usual setup (PyTorch's
/// state is process-global), but several work side by side.
#[derive(Debug)]
pub struct IpcProducer<D: Device, B: IpcDriver> {
    inner: Arc<ProducerInner<D, B>>,
}

impl<D: Device, B: IpcDriver> Clone for IpcProducer<D, B> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    shares: AtomicUsize,
    synchronized: AtomicUsize,
    idle_stream: AtomicUsize,
    files: AtomicUsize,
    reclaimed: AtomicUsize,
}

/// A memory handle, valid while the allocation at its base has this buffer id and size.
#[derive(Debug, Clone, Copy)]
struct CachedHandle {
    buffer_id: u64,
    size: usize,
    handle: MemHandle,
}

pub(crate) struct ProducerInner<D: Device, B: IpcDriver> {
    driver: Arc<B>,
    config: ProducerConfig,
    names: NameGenerator,
    /// The file slots are handed out from (PyTorch's `next_available_ref_counters_file_`).
    current: Mutex<Option<Arc<RefCounterFile>>>,
    /// Every file made, while something holds it (PyTorch's `ref_counters_files_`): what
    /// [`IpcProducer::close_at_exit`] releases.
    files: Mutex<Vec<Weak<RefCounterFile>>>,
    limbo: Mutex<Vec<Sent<D, B>>>,
    limbo_warned: AtomicBool,
    shutdown_warned: AtomicBool,
    events: Arc<EventPool<B>>,
    /// Sent in every handle: lets consumers keep this producer's events open.
    id: u64,
    /// Memory handles by (device, base address).
    handles: Mutex<HashMap<(u32, u64), CachedHandle>>,
    /// Allocators whose free-memory callback is registered (by address).
    registered: Mutex<Vec<usize>>,
    counters: Counters,
}

impl<D: Device, B: IpcDriver> std::fmt::Debug for ProducerInner<D, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcProducer")
            .field("config", &self.config)
            .field("limbo", &self.limbo.lock().len())
            .finish_non_exhaustive()
    }
}

impl<D: Device, B: IpcDriver> IpcProducer<D, B> {
    /// A producer with PyTorch's limits.
    pub fn new(driver: Arc<B>) -> Self {
        Self::with_config(driver, ProducerConfig::default())
    }

    /// A producer with other limits (small files, to see rotation in tests).
    pub fn with_config(driver: Arc<B>, config: ProducerConfig) -> Self {
        Self {
            inner: Arc::new(ProducerInner {
                driver,
                config: ProducerConfig {
                    slots_per_file: config.slots_per_file.max(1),
                    ..config
                },
                names: NameGenerator::default(),
                current: Mutex::new(None),
                files: Mutex::new(Vec::new()),
                limbo: Mutex::new(Vec::new()),
                limbo_warned: AtomicBool::new(false),
                shutdown_warned: AtomicBool::new(false),
                events: Arc::new(EventPool::new()),
                id: random_id(),
                handles: Mutex::new(HashMap::new()),
                registered: Mutex::new(Vec::new()),
                counters: Counters::default(),
            }),
        }
    }

    /// The driver calls in use.
    pub fn driver(&self) -> &Arc<B> {
        &self.inner.driver
    }

    /// Takes ownership of `allocation` (of `allocator`) for sharing, and registers [`collect`](Self::collect)
    /// as the allocator's free-memory callback (once per allocator).
    pub fn adopt(
        &self,
        allocator: &Arc<CachingAllocator<D>>,
        allocation: Allocation,
    ) -> SharedAllocation<D, B> {
        self.inner.register(allocator);
        SharedAllocation {
            sent: Some(Sent {
                allocation,
                allocator: Arc::clone(allocator),
                slots: Vec::new(),
            }),
            base: None,
            producer: Arc::clone(&self.inner),
        }
    }

    /// [`adopt`](Self::adopt) and [`share`](SharedAllocation::share) in one call.
    ///
    /// # Errors
    ///
    /// As [`SharedAllocation::share`]; the allocation is then freed back to the allocator.
    pub fn share(
        &self,
        allocator: &Arc<CachingAllocator<D>>,
        allocation: Allocation,
        stream: StreamId,
    ) -> Result<(SharedAllocation<D, B>, IpcHandle)> {
        let mut shared = self.adopt(allocator, allocation);
        let handle = shared.share(stream)?;
        Ok((shared, handle))
    }

    /// The driver, the name generator of its files, its id and the memory handle of the
    /// allocation at `base` (cached per allocation): what a publication of memory outside the
    /// allocator needs ([`crate::weights`]).
    pub(crate) fn driver_arc(&self) -> &Arc<B> {
        &self.inner.driver
    }

    pub(crate) fn file_names(&self) -> &NameGenerator {
        &self.inner.names
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    pub(crate) fn handle_of(
        &self,
        device: u32,
        base: DeviceAddress,
        size: usize,
    ) -> Result<MemHandle> {
        self.inner.mem_handle(device, base, size)
    }

    /// A ref-counter slot (set to 1) for one message that holds no allocation of the allocator.
    pub(crate) fn message_slot(&self) -> Result<(Arc<RefCounterFile>, usize)> {
        let slot = self.inner.take_slot()?;
        self.inner.counters.shares.fetch_add(1, Ordering::Relaxed);
        Ok(slot)
    }

    /// Frees what consumers released (PyTorch's `CudaIPCCollect`): limbo entries whose slots are all
    /// back to 0, after reclaiming slots of consumers that died holding them; when the limbo is empty,
    /// also lets go of the current ref-counter file if none of its slots is out. Returns whether any
    /// memory was freed.
    pub fn collect(&self) -> bool {
        self.inner.collect()
    }

    /// Collects, and warns once (PyTorch's message) if consumers still hold memory. Returns the number
    /// of allocations still held by consumers.
    pub fn shutdown(&self) -> usize {
        self.inner.shutdown()
    }

    /// What PyTorch does with its process-wide IPC state at static destruction
    /// (`~CudaIPCGlobalEntities`), for a producer about to end with the process: reclaims the
    /// slots of dead consumers, warns once ([`PRODUCER_TERMINATED_WARNING`], a `warn` event of
    /// target `tensormem_ipc`) if consumers still hold memory freed here, and releases this
    /// process's hold on every ref-counter file it made, including those of shares still alive:
    /// the last holder unlinks each name, so nothing of this process stays in `/dev/shm` unless a
    /// PyTorch consumer still has a file open (it unlinks it when it closes it). Returns the number
    /// of freed allocations consumers still hold.
    ///
    /// It makes no driver call and frees nothing (the memory goes with the process; the driver
    /// may already be torn down at exit), and waits at most a moment for a lock another thread
    /// holds, skipping that part. The exit hook ([`register_exit_hook`](Self::register_exit_hook))
    /// calls it; call it directly only when the process is about to end: consumers can no longer
    /// open shares made before it whose file was unlinked. Shares made after it start a new file.
    pub fn close_at_exit(&self) -> usize {
        self.inner.close_at_exit()
    }

    /// Makes this producer [`close_at_exit`](Self::close_at_exit) when the process exits normally
    /// (a return from `main`, `std::process::exit`), as PyTorch's static IPC state does: for a
    /// producer that lives as long as the process, which Rust never drops. The first registration
    /// installs one `atexit(3)` hook for the process; registering twice does nothing more, and a
    /// producer dropped before the exit is skipped. The process runtime (`tensormem-runtime`)
    /// registers the process's producer.
    pub fn register_exit_hook(&self) {
        let weak: Weak<ProducerInner<D, B>> = Arc::downgrade(&self.inner);
        crate::at_exit::register(weak);
    }

    /// The producer's figures.
    #[must_use]
    pub fn stats(&self) -> ProducerStats {
        let c = &self.inner.counters;
        ProducerStats {
            shares: c.shares.load(Ordering::Relaxed),
            limbo: self.inner.limbo.lock().len(),
            limbo_warned: self.inner.limbo_warned.load(Ordering::Relaxed),
            events_in_use: self.inner.events.lent(),
            synchronized_shares: c.synchronized.load(Ordering::Relaxed),
            idle_stream_shares: c.idle_stream.load(Ordering::Relaxed),
            files_created: c.files.load(Ordering::Relaxed),
            slots_reclaimed: c.reclaimed.load(Ordering::Relaxed),
            shutdown_warned: self.inner.shutdown_warned.load(Ordering::Relaxed),
        }
    }
}

impl<D: Device, B: IpcDriver> ProducerInner<D, B> {
    fn register(self: &Arc<Self>, allocator: &Arc<CachingAllocator<D>>) {
        let key = Arc::as_ptr(allocator) as usize;
        let mut registered = self.registered.lock();
        if registered.contains(&key) {
            return;
        }
        registered.push(key);
        let weak: Weak<Self> = Arc::downgrade(self);
        allocator.add_free_memory_callback(Arc::new(move || {
            weak.upgrade().is_some_and(|producer| producer.collect())
        }));
    }

    /// The handle of the base allocation, from the cache while the allocation there is the same one.
    fn mem_handle(&self, device: u32, base: DeviceAddress, size: usize) -> Result<MemHandle> {
        let id = self.driver.buffer_id(device, base)?;
        if let Some(cached) = self.handles.lock().get(&(device, base.0)) {
            if cached.buffer_id == id && cached.size == size {
                return Ok(cached.handle);
            }
        }
        let handle = self.driver.mem_handle(device, base, size)?;
        let mut handles = self.handles.lock();
        if handles.len() >= 4096 {
            handles.clear();
        }
        handles.insert(
            (device, base.0),
            CachedHandle {
                buffer_id: id,
                size,
                handle,
            },
        );
        Ok(handle)
    }

    /// The next slot: the current file's, or a new file's when it has none left.
    fn take_slot(&self) -> Result<(Arc<RefCounterFile>, usize)> {
        let mut current = self.current.lock();
        let file = match current.as_ref() {
            Some(file) => Arc::clone(file),
            None => {
                let file = Arc::new(RefCounterFile::create(
                    &self.names.next_name(),
                    self.config.slots_per_file,
                )?);
                self.counters.files.fetch_add(1, Ordering::Relaxed);
                let mut files = self.files.lock();
                files.retain(|f| f.strong_count() > 0);
                files.push(Arc::downgrade(&file));
                drop(files);
                *current = Some(Arc::clone(&file));
                file
            }
        };
        let slot = file.take_slot()?.ok_or_else(|| Error::SlotOutOfRange {
            slot: self.config.slots_per_file as u64,
            name: file.name().to_string(),
            slots: self.config.slots_per_file,
        })?;
        if !file.has_slots() {
            // Rotate: the file lives on in the shares holding its slots and goes when they do.
            *current = None;
        }
        Ok((file, slot))
    }

    fn add_to_limbo(&self, sent: Sent<D, B>) {
        let mut limbo = self.limbo.lock();
        limbo.push(sent);
        if limbo.len() > self.config.warn_after_blocks_in_limbo
            && !self.limbo_warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                target: "tensormem_ipc",
                blocks = limbo.len(),
                limit = self.config.warn_after_blocks_in_limbo,
                "more than {} freed allocations are still held by consumer processes and wait in the \
                 limbo; every free now scans them. Make consumers release shared memory sooner \
                 (drop their ReceivedMemory), or check that they are alive",
                self.config.warn_after_blocks_in_limbo
            );
        }
    }

    /// Frees limbo entries whose slots are all released; with `reclaim`, slots of dead consumers are
    /// reclaimed first. Returns whether anything was freed.
    fn collect_limbo(&self, reclaim: bool) -> bool {
        let done: Vec<Sent<D, B>> = {
            let mut limbo = self.limbo.lock();
            let mut done = Vec::new();
            let mut i = 0;
            while i < limbo.len() {
                let reclaimed = limbo[i].prune(reclaim);
                self.counters
                    .reclaimed
                    .fetch_add(reclaimed, Ordering::Relaxed);
                if limbo[i].slots.is_empty() {
                    done.push(limbo.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            done
        };
        let freed = !done.is_empty();
        for sent in done {
            sent.free();
        }
        freed
    }

    fn collect(&self) -> bool {
        let freed = self.collect_limbo(true);
        if self.limbo.lock().is_empty() {
            let mut current = self.current.lock();
            // Only `current` holds the file: none of its slots is out.
            if current.as_ref().is_some_and(|f| Arc::strong_count(f) == 1) {
                *current = None;
            }
        }
        freed
    }

    fn shutdown(&self) -> usize {
        self.collect();
        let held = self.limbo.lock().len();
        if held > 0 && !self.shutdown_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(target: "tensormem_ipc", held, "{PRODUCER_TERMINATED_WARNING}");
        }
        held
    }
}

impl<D: Device, B: IpcDriver> ProducerInner<D, B> {
    fn close_at_exit(&self) -> usize {
        let wait = crate::at_exit::EXIT_LOCK_WAIT;
        // Pruned, not collected: freeing calls into the driver.
        let held = match self.limbo.try_lock_for(wait) {
            Some(mut limbo) => {
                let reclaimed: usize = limbo.iter_mut().map(|sent| sent.prune(true)).sum();
                self.counters
                    .reclaimed
                    .fetch_add(reclaimed, Ordering::Relaxed);
                limbo.iter().filter(|sent| !sent.slots.is_empty()).count()
            }
            None => 0,
        };
        if held > 0 && !self.shutdown_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(target: "tensormem_ipc", held, "{PRODUCER_TERMINATED_WARNING}");
        }
        if let Some(mut current) = self.current.try_lock_for(wait) {
            current.take();
        }
        let files: Vec<Arc<RefCounterFile>> = self
            .files
            .try_lock_for(wait)
            .map(|files| files.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default();
        let unlinked = files.iter().filter(|file| file.release_hold()).count();
        tracing::debug!(target: "tensormem_ipc", files = files.len(), unlinked, held,
            "released the ref-counter files at exit");
        held
    }
}

impl<D: Device, B: IpcDriver> crate::at_exit::CloseAtExit for ProducerInner<D, B> {
    fn close_at_exit(&self) -> usize {
        ProducerInner::close_at_exit(self)
    }
}

impl<D: Device, B: IpcDriver> Drop for ProducerInner<D, B> {
    fn drop(&mut self) {
        let held = self.shutdown();
        if held > 0 {
            // Consumers may still use this memory: it is never handed out again (leaked until the
            // allocator goes), and the slots' files are closed.
            for sent in self.limbo.lock().drain(..) {
                let Sent { allocation, .. } = sent;
                drop(allocation);
            }
        }
    }
}

/// A random producer id (never 0), from the standard library's randomly seeded hasher.
fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish().max(1)
}

/// Where an allocation lies in its segment (see [`SharedAllocation::locate`]).
struct Located {
    base: u64,
    base_size: u64,
    memory: SegmentMemory,
    offset: u64,
}

/// An allocation owned by the IPC layer so that it can be shared; dropping it frees the allocation once
/// every consumer released it (see the [module docs](self)).
pub struct SharedAllocation<D: Device, B: IpcDriver> {
    /// `None` only while dropping.
    sent: Option<Sent<D, B>>,
    base: Option<(DeviceAddress, usize)>,
    producer: Arc<ProducerInner<D, B>>,
}

impl<D: Device, B: IpcDriver> std::fmt::Debug for SharedAllocation<D, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = f.debug_struct("SharedAllocation");
        if let Some(sent) = &self.sent {
            s.field("ptr", &sent.allocation.ptr())
                .field("size", &sent.allocation.size())
                .field("outstanding", &sent.slots.len());
        }
        s.finish_non_exhaustive()
    }
}

impl<D: Device, B: IpcDriver> SharedAllocation<D, B> {
    fn sent(&self) -> &Sent<D, B> {
        // Invariant: `sent` is `Some` until `drop`.
        self.sent
            .as_ref()
            .expect("a SharedAllocation holds its allocation until dropped")
    }

    /// The device address.
    #[must_use]
    pub fn ptr(&self) -> DeviceAddress {
        self.sent().allocation.ptr()
    }

    /// The size in bytes of the block handed out (the request rounded up by the allocator).
    #[must_use]
    pub fn size(&self) -> usize {
        self.sent().allocation.size()
    }

    /// The bytes shared: the size the allocation was asked for, which every handle carries (a
    /// 1000-byte allocation arrives as 1000 bytes, not as its 1024-byte block).
    #[must_use]
    pub fn nbytes(&self) -> usize {
        self.sent().allocation.requested_size()
    }

    /// The stream the allocation belongs to.
    #[must_use]
    pub fn stream(&self) -> StreamId {
        self.sent().allocation.stream()
    }

    /// Whether `producer` adopted this allocation.
    pub(crate) fn is_of(&self, producer: &IpcProducer<D, B>) -> bool {
        Arc::ptr_eq(&self.producer, &producer.inner)
    }

    /// Where the allocation lies for sharing: its device, the memory handle and size of its base
    /// allocation (segment), and its offset in it; `None` for a zero-byte allocation (no memory).
    fn locate(&mut self) -> Result<Option<Located>> {
        let sent = self
            .sent
            .as_ref()
            .expect("a SharedAllocation holds its allocation until dropped");
        let device = sent.allocator.device().index();
        let ptr = sent.allocation.ptr();
        if sent.allocation.size() == 0 {
            return Ok(None);
        }
        check_shareable(device, ptr)?;
        let (base, base_size) = match self.base {
            Some(base) => base,
            None => match sent.allocator.shareable_segment(ptr)? {
                ShareableSegment::Allocation { base, size } => {
                    self.base = Some((base, size));
                    (base, size)
                }
                ShareableSegment::Chunks(export) => {
                    // The descriptors stay open while the block is allocated, which this share
                    // keeps it until the consumer lets go.
                    crate::chunks::offer(&export.fds);
                    let chunks = ChunkHandle {
                        pid: std::process::id(),
                        chunk_size: export.chunk_size,
                        fds: export.fds,
                    };
                    return Ok(Some(Located {
                        base: export.base.0,
                        base_size: chunks.extent(),
                        memory: SegmentMemory::Chunks(chunks),
                        offset: ptr.0 - export.base.0,
                    }));
                }
            },
        };
        let mem_handle = self.producer.mem_handle(device, base, base_size)?;
        Ok(Some(Located {
            base: base.0,
            base_size: base_size as u64,
            memory: SegmentMemory::Allocation(mem_handle),
            offset: ptr.0 - base.0,
        }))
    }

    /// Shares made whose consumers have not released them yet.
    #[must_use]
    pub fn outstanding(&mut self) -> usize {
        if let Some(sent) = self.sent.as_mut() {
            sent.prune(false);
        }
        self.sent().slots.len()
    }

    /// Shares the allocation once more (one handle per consumer): a new slot set to 1, an event
    /// recorded on `stream` (the stream whose work the consumer must wait for). The handle's size is
    /// [`nbytes`](Self::nbytes), its offset where the allocation starts in its segment.
    ///
    /// A zero-byte allocation has no memory: its handle is [`IpcHandle::empty`] (no slot, no
    /// event), as PyTorch shares an empty storage.
    ///
    /// # Errors
    ///
    /// [`Error::Allocator`] if the allocator cannot say where the allocation lies or cannot
    /// export the chunks of its expandable segment;
    /// [`Error::RefCounterFile`] if a ref-counter file cannot be created; [`Error::Driver`] if a driver
    /// call fails. Nothing is handed out then, and the allocation stays owned here.
    pub fn share(&mut self, stream: StreamId) -> Result<IpcHandle> {
        let Some(located) = self.locate()? else {
            return Ok(IpcHandle::empty(self.sent().allocator.device().index()));
        };
        let producer = Arc::clone(&self.producer);
        let sent = self
            .sent
            .as_mut()
            .expect("a SharedAllocation holds its allocation until dropped");
        let device = sent.allocator.device().index();
        sent.prune(false);
        let (file, slot, event, event_handle) = producer.slot_and_event(device, stream)?;
        let handle = IpcHandle {
            device,
            memory: located.memory,
            size: sent.allocation.requested_size() as u64,
            offset: located.offset,
            ref_counter: Some(file.name().clone()),
            slot: slot as u64,
            event: event_handle,
            producer: producer.id,
        };
        sent.slots.push(SentSlot {
            file,
            slot,
            _event: event.map(Arc::new),
            shared_at: Instant::now(),
            expires: producer.config.expire_unopened_shares,
        });
        producer.counters.shares.fetch_add(1, Ordering::Relaxed);
        Ok(handle)
    }
}

impl<D: Device, B: IpcDriver> Drop for SharedAllocation<D, B> {
    fn drop(&mut self) {
        let Some(mut sent) = self.sent.take() else {
            return;
        };
        sent.prune(false);
        if sent.slots.is_empty() {
            sent.free();
        } else {
            self.producer.add_to_limbo(sent);
        }
        self.producer.collect_limbo(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::fake::FakeDriver;
    use crate::received::IpcConsumer;
    use tensormem_cuda_alloc::backend::sim::SimDevice;

    #[test]
    fn closing_at_exit_releases_every_file_and_warns_of_memory_still_held() {
        let s = StreamId(0);
        let driver = Arc::new(FakeDriver::default());
        let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
        let config = ProducerConfig {
            slots_per_file: 2,
            ..ProducerConfig::default()
        };
        let producer = IpcProducer::with_config(Arc::clone(&driver), config);
        let consumer = IpcConsumer::new(Arc::clone(&driver));
        let share = |size| {
            producer
                .share(&allocator, allocator.allocate(size, s).unwrap(), s)
                .unwrap()
        };
        // The first file: a share its consumer holds after the producer freed it (the limbo),
        // and a share alive at exit (a model's weights). The second: only `current` holds it.
        let (freed, held) = share(4096);
        let (alive, _) = share(8192);
        let (done, released) = share(4096);
        let received = consumer.open(&held, s).unwrap();
        drop(consumer.open(&released, s).unwrap());
        drop((freed, done));
        assert_eq!(producer.stats().limbo, 1);
        let names = [&held, &released].map(|h| h.ref_counter.clone().unwrap());
        assert_ne!(names[0], names[1]);
        assert!(names.iter().all(|name| name.path().exists()));

        assert_eq!(producer.close_at_exit(), 1, "one allocation still held");
        assert!(producer.stats().shutdown_warned);
        for name in &names {
            assert!(!name.path().exists(), "{name} left in /dev/shm");
        }
        assert_eq!(
            producer.close_at_exit(),
            1,
            "a second close changes nothing"
        );

        // Nothing was freed; the consumer still releases its slot, which the producer sees.
        assert_eq!(producer.stats().limbo, 1);
        drop(received);
        assert!(producer.collect());
        assert_eq!(producer.stats().limbo, 0);
        drop(alive);
        assert_eq!(producer.stats().limbo, 1, "its slot was never released");
    }
}
