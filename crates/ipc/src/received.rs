//! The consumer side: [`IpcConsumer`] opens memory another process shared (PyTorch's
//! `_new_shared_cuda`, `getIpcDevPtr` and the deleter that calls `_release_ipc_counter`).
//!
//! Opening checks everything PyTorch takes on trust before anything is mapped or written: the device
//! index, the slot against the file's real size, that the slot still holds a reference, and, once the
//! base allocation is open, that `offset + size` lies inside its real size. Memory handles are opened
//! once per base allocation and device in the process (threads opening the same handle at once share
//! one `cuIpcOpenMemHandle`) and closed when the last [`ReceivedMemory`] of that allocation goes (or
//! kept open for the next share, see [`ConsumerConfig::idle_mem_handles`]).
//!
//! Dropping a [`ReceivedMemory`] synchronizes the streams it was used on, then decrements its slot:
//! from then on the producer may hand the memory out again.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tensormem_cuda_alloc::{DeviceAddress, StreamId};
use tensormem_shm::ShmName;

use crate::batch::{BatchHandle, ReceivedBatch};
use crate::cache::{Lease, LeaseCache};
use crate::chunks::{ChunkFdRoutes, FdRoute, DEFAULT_CHUNK_FD_TIMEOUT};
use crate::driver::{EventHandle, IpcDriver};
use crate::error::{Error, Result};
use crate::handle::{IpcHandle, SegmentMemory};
use crate::opened::{release_held, OpenedBase, SegmentKey};
use crate::refcounter::{claim_refused, MappedCounterFile};
pub use crate::view::{DeviceElement, DeviceView};

/// How long a consumer keeps what it opened; see [`IpcConsumer::with_config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// Opened memory handles kept open after their last user let go, so that the next share of the
    /// same base allocation opens nothing (default 0: closed at once, as PyTorch does). Each one keeps
    /// the producer's allocation mapped here, and so alive on the device, until it is evicted.
    pub idle_mem_handles: usize,
    /// Mapped ref-counter files kept after their last use (default 8; a file is 400 KB of address
    /// space and at most a few pages of memory).
    pub idle_counter_files: usize,
    /// Opened events of tensormem producers kept open between shares (default 1024, the producer's
    /// event budget): such a producer reuses an event only for a later share and never destroys one
    /// while it lives, so waiting on the kept event waits on the new record. Events of producers
    /// that do not say who they are (PyTorch's tuples) are opened and closed per share.
    pub idle_events: usize,
    /// Segments opened for batches ([`IpcConsumer::open_batch`]) kept open after the batch is
    /// dropped, most recently used first (default 4096): the next handoff of the same model opens
    /// nothing. Like [`idle_mem_handles`](Self::idle_mem_handles), each keeps the producer's
    /// allocation mapped here until it is evicted or [`IpcConsumer::trim`] is called; the producer's
    /// ref counting is not affected (its memory is released with the batch's slot). Ranges of
    /// expandable-segment chunks are never kept: they are unmapped with the last batch holding
    /// them (see [`chunk_fds`](Self::chunk_fds)).
    pub batch_segments: usize,
    /// How the descriptors of expandable-segment chunks are taken from the producer (default
    /// [`ChunkFdRoutes::Auto`]: `pidfd_getfd`, then the producer's socket; see [`crate::chunks`]).
    /// Opened chunks are never kept idle: they are unmapped when their last user lets go, as
    /// PyTorch does, because the producer may reuse a descriptor number for other memory after
    /// that.
    pub chunk_fds: ChunkFdRoutes,
    /// How long taking chunk descriptors over the producer's socket may wait for the socket to take
    /// the connection, and then for each answer (default [`DEFAULT_CHUNK_FD_TIMEOUT`], 30 s): a
    /// process squatting the socket's name costs an open this long and
    /// [`Error::ChunkSocketTimedOut`], never a hang (see [`crate::chunks`]).
    pub chunk_fd_timeout: Duration,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            idle_mem_handles: 0,
            idle_counter_files: 8,
            idle_events: 1024,
            batch_segments: 4096,
            chunk_fds: ChunkFdRoutes::Auto,
            chunk_fd_timeout: DEFAULT_CHUNK_FD_TIMEOUT,
        }
    }
}

/// Whether an opened segment may stay open with no user: device allocations may, chunks may not
/// (see [`ConsumerConfig::chunk_fds`]).
fn keep_idle(key: &SegmentKey) -> bool {
    matches!(key.1, SegmentMemory::Allocation(_))
}

/// Key of an opened event: producer id, device, handle.
type EventKey = (u64, u32, EventHandle);

/// A lease on an opened base allocation.
type MemLease<B> = Lease<SegmentKey, OpenedBase<B>>;

/// Segments of batches kept open between messages: a lease each, with the tick of its last use.
struct KeptSegments<B: IpcDriver> {
    leases: HashMap<SegmentKey, (MemLease<B>, u64)>,
    tick: u64,
    max: usize,
}

struct ConsumerInner<B: IpcDriver> {
    driver: Arc<B>,
    mems: Arc<LeaseCache<SegmentKey, OpenedBase<B>>>,
    chunk_fds: ChunkFdRoutes,
    chunk_fd_timeout: Duration,
    files: Arc<LeaseCache<ShmName, MappedCounterFile>>,
    events: Arc<LeaseCache<EventKey, B::ImportedEvent>>,
    kept: Mutex<KeptSegments<B>>,
}

impl<B: IpcDriver> ConsumerInner<B> {
    /// Makes `stream` wait for `producer`'s event, through the cache for known producers.
    fn wait(
        &self,
        producer: u64,
        device: u32,
        event: &EventHandle,
        stream: StreamId,
    ) -> Result<()> {
        if producer == 0 {
            let opened = self.driver.open_event_handle(device, event)?;
            return Ok(self.driver.wait_event(device, &opened, stream)?);
        }
        let opened = self.events.acquire(&(producer, device, *event), || {
            Ok(self.driver.open_event_handle(device, event)?)
        })?;
        Ok(self.driver.wait_event(device, opened.get(), stream)?)
    }

    /// Keeps a lease on each of `segments` (already open) for the next batches, evicting the least
    /// recently used past the limit.
    fn keep(&self, keys: impl Iterator<Item = SegmentKey>) {
        let mut evicted = Vec::new();
        {
            let mut kept = self.kept.lock();
            if kept.max == 0 {
                return;
            }
            for key in keys {
                kept.tick += 1;
                let tick = kept.tick;
                if let Some(entry) = kept.leases.get_mut(&key) {
                    entry.1 = tick;
                    continue;
                }
                // Open already (the batch holds it): this only adds a user.
                if let Some(again) = self.mems.acquire_open(&key) {
                    kept.leases.insert(key, (again, tick));
                }
            }
            while kept.leases.len() > kept.max {
                let oldest = kept
                    .leases
                    .iter()
                    .min_by_key(|(_, (_, tick))| *tick)
                    .map(|(k, _)| k.clone());
                let Some(oldest) = oldest else { break };
                evicted.extend(kept.leases.remove(&oldest));
            }
        }
        // Closed (if nobody else uses them) outside the lock.
        drop(evicted);
    }
}

/// Opens memory other processes shared (see the [module docs](self)). Cheap to clone.
pub struct IpcConsumer<B: IpcDriver> {
    inner: Arc<ConsumerInner<B>>,
}

impl<B: IpcDriver> Clone for IpcConsumer<B> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<B: IpcDriver> std::fmt::Debug for IpcConsumer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcConsumer")
            .field("open_mem_handles", &self.inner.mems.len())
            .field("mapped_files", &self.inner.files.len())
            .finish_non_exhaustive()
    }
}

impl<B: IpcDriver> IpcConsumer<B> {
    /// A consumer with the default [`ConsumerConfig`].
    pub fn new(driver: Arc<B>) -> Self {
        Self::with_config(driver, ConsumerConfig::default())
    }

    /// A consumer keeping idle handles and files as `config` says.
    pub fn with_config(driver: Arc<B>, config: ConsumerConfig) -> Self {
        Self {
            inner: Arc::new(ConsumerInner {
                driver,
                mems: LeaseCache::with_keep_idle(config.idle_mem_handles, keep_idle),
                chunk_fds: config.chunk_fds,
                chunk_fd_timeout: config.chunk_fd_timeout,
                files: LeaseCache::new(config.idle_counter_files),
                events: LeaseCache::new(config.idle_events),
                kept: Mutex::new(KeptSegments {
                    leases: HashMap::new(),
                    tick: 0,
                    max: config.batch_segments,
                }),
            }),
        }
    }

    /// The driver calls in use.
    pub fn driver(&self) -> &Arc<B> {
        &self.inner.driver
    }

    /// Memory handles open now (used or idle).
    #[must_use]
    pub fn open_mem_handles(&self) -> usize {
        self.inner.mems.len()
    }

    /// Closes the idle memory handles and events (batch segments kept for the next batch too,
    /// unless a batch still holds them), and unmaps the idle ref-counter files.
    pub fn trim(&self) {
        let kept = std::mem::take(&mut self.inner.kept.lock().leases);
        drop(kept);
        self.inner.mems.clear_idle();
        self.inner.files.clear_idle();
        self.inner.events.clear_idle();
    }

    /// Opens shared memory: checks the handle, makes `stream` wait for the producer's event, opens the
    /// base allocation (through the process's cache) and records this process as the slot's holder.
    ///
    /// `stream` must be the default stream (0) or a live stream of the handle's device; it is
    /// synchronized when the returned memory is dropped.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDevice`], [`Error::RefCounterFile`] (the file is gone: the producer ended),
    /// [`Error::SlotOutOfRange`], [`Error::SlotNotHeld`] (released already, or opened twice),
    /// [`Error::SlotClaimed`], [`Error::OutOfBounds`], [`Error::Driver`]. Nothing is left open or
    /// changed then.
    pub fn open(&self, handle: &IpcHandle, stream: StreamId) -> Result<ReceivedMemory<B>> {
        let inner = &self.inner;
        let Some(name) = &handle.ref_counter else {
            return Err(Error::EmptyHandle {
                device: handle.device,
            });
        };
        let count = inner.driver.device_count()?;
        if handle.device >= count {
            return Err(Error::InvalidDevice {
                device: i64::from(handle.device),
                count,
            });
        }
        let (file, slot) = self.held_slot(name, handle.slot)?;
        let device = handle.device;
        let key = (device, handle.memory.clone());
        let mem = inner.mems.acquire(&key, || {
            OpenedBase::open(
                &inner.driver,
                device,
                &handle.memory,
                inner.chunk_fds,
                inner.chunk_fd_timeout,
            )
        })?;
        let base = mem.get();
        let end = handle.offset.checked_add(handle.size);
        if end.is_none_or(|end| end > base.size as u64) {
            return Err(Error::OutOfBounds {
                offset: handle.offset,
                size: handle.size,
                base_size: base.size as u64,
            });
        }
        if let Err(pid) = file.get().claim(slot)? {
            return Err(claim_refused(handle.slot, name.to_string(), pid));
        }
        if let Some(event) = &handle.event {
            if let Err(err) = inner.wait(handle.producer, device, event, stream) {
                let _ = file.get().unclaim(slot);
                return Err(err);
            }
        }
        Ok(ReceivedMemory {
            driver: Arc::clone(&inner.driver),
            device,
            ptr: base.ptr.offset(handle.offset as usize),
            size: handle.size,
            stream,
            more_streams: Vec::new(),
            slot,
            file,
            _mem: mem,
        })
    }

    /// Gives back the reference a handle carries without opening its memory (PyTorch's
    /// `_release_ipc_counter_cuda`, which a receiver calls when it already holds the storage): the
    /// handle's ref-counter slot is decremented, and nothing else is touched: no memory handle is
    /// opened, no event waited on, no stream synchronized (nothing of this process used the
    /// memory through this handle). An empty storage's handle holds no reference: nothing to do.
    ///
    /// # Errors
    ///
    /// [`Error::RefCounterFile`] (the file is gone: the producer ended; PyTorch ignores this),
    /// [`Error::NotRefCounterFile`], [`Error::SlotOutOfRange`], [`Error::SlotNotHeld`] (released
    /// already), [`Error::SlotClaimed`] (a consumer opened this handle: its memory is in use, and
    /// that consumer releases it when done). Nothing is changed then.
    pub fn release(&self, handle: &IpcHandle) -> Result<()> {
        let Some(name) = &handle.ref_counter else {
            return Ok(());
        };
        self.release_slot(name, handle.slot)
    }

    /// Gives back the reference a batch carries without opening it, as [`release`](Self::release)
    /// does for one handle: the batch's one slot is decremented, nothing is opened or waited on.
    ///
    /// # Errors
    ///
    /// As [`release`](Self::release).
    pub fn release_batch(&self, batch: &BatchHandle) -> Result<()> {
        self.release_slot(batch.ref_counter(), batch.slot())
    }

    fn release_slot(&self, name: &ShmName, handle_slot: u64) -> Result<()> {
        let (file, slot) = self.held_slot(name, handle_slot)?;
        let (table, map) = (file.get().table(), file.get().mapping());
        // Claimed for the time of the decrement, so that an open of the same handle racing this
        // release fails instead of holding a reference that is gone.
        if let Err(pid) = file.get().claim(slot)? {
            return Err(claim_refused(handle_slot, name.to_string(), pid));
        }
        let counter = table.counter(map, slot)?;
        let released = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
            (value > 0).then(|| value - 1)
        });
        let _ = file.get().unclaim(slot);
        match released {
            Ok(_) => Ok(()),
            Err(value) => Err(Error::SlotNotHeld {
                slot: handle_slot,
                name: name.to_string(),
                value,
            }),
        }
    }

    /// Opens every view of a batch (see [`crate::batch`]): checks the device and the message's
    /// slot, opens each segment once (through the process's cache: a segment open already, or
    /// kept from an earlier batch, is not opened again) and checks the segment's declared size
    /// against the real mapping, records this process as the slot's holder, makes `stream` wait for
    /// the producer's event if there is one, and rebuilds the views.
    ///
    /// A segment that is a range of an expandable segment is opened as a single share of chunks is
    /// ([`open`](Self::open)): the descriptors taken from the producer
    /// ([`ConsumerConfig::chunk_fds`]), the chunks imported and mapped in order into one range of
    /// this process, so its views keep the distances they have in the producer; the range is
    /// unmapped when the last batch holding it is dropped (never kept for the next batch).
    ///
    /// `stream` must be the default stream (0) or a live stream of the batch's device; it is
    /// synchronized when the batch is dropped.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open): [`Error::InvalidDevice`], [`Error::RefCounterFile`],
    /// [`Error::NotRefCounterFile`], [`Error::SlotOutOfRange`], [`Error::SlotNotHeld`],
    /// [`Error::SlotClaimed`], [`Error::OutOfBounds`] (a segment larger than what its handle
    /// opened), [`Error::Driver`]; for ranges of chunks, what taking the descriptors answers
    /// ([`Error::ChunkDescriptors`], [`Error::ImpostorPeer`], [`Error::ChunkSocketTimedOut`]).
    /// Nothing is left claimed or changed then.
    pub fn open_batch(&self, batch: &BatchHandle, stream: StreamId) -> Result<ReceivedBatch<B>> {
        let inner = &self.inner;
        let device = batch.device();
        let count = inner.driver.device_count()?;
        if device >= count {
            return Err(Error::InvalidDevice {
                device: i64::from(device),
                count,
            });
        }
        let (file, slot) = self.held_slot(batch.ref_counter(), batch.slot())?;
        let mut segments = Vec::with_capacity(batch.segments().len());
        for segment in batch.segments() {
            let memory = &segment.memory;
            let mem = inner.mems.acquire(&(device, memory.clone()), || {
                OpenedBase::open(
                    &inner.driver,
                    device,
                    memory,
                    inner.chunk_fds,
                    inner.chunk_fd_timeout,
                )
            })?;
            let real = mem.get().size as u64;
            if segment.size > real {
                return Err(Error::OutOfBounds {
                    offset: 0,
                    size: segment.size,
                    base_size: real,
                });
            }
            segments.push(mem);
        }
        if let Err(pid) = file.get().claim(slot)? {
            return Err(claim_refused(
                batch.slot(),
                batch.ref_counter().to_string(),
                pid,
            ));
        }
        if let Some(event) = batch.event() {
            if let Err(err) = inner.wait(batch.producer(), device, event, stream) {
                let _ = file.get().unclaim(slot);
                return Err(err);
            }
        }
        let views = batch
            .views()
            .iter()
            .map(|view| {
                let ptr = match view.segment {
                    Some(s) => segments[s as usize].get().ptr.offset(view.offset as usize),
                    None => DeviceAddress(0),
                };
                ReceivedBatch::<B>::make_view(view.name.clone(), ptr, view.len, view.segment)
            })
            .collect();
        // Device allocations stay open for the next batch; chunks never stay idle (`keep_idle`).
        inner.keep(
            batch
                .segments()
                .iter()
                .filter(|s| matches!(s.memory, SegmentMemory::Allocation(_)))
                .map(|s| (device, s.memory.clone())),
        );
        tracing::debug!(
            target: "tensormem_ipc",
            device,
            views = batch.views().len(),
            segments = segments.len(),
            chunk_segments = batch
                .segments()
                .iter()
                .filter(|s| matches!(s.memory, SegmentMemory::Chunks(_)))
                .count(),
            slot,
            "batch opened"
        );
        Ok(ReceivedBatch {
            driver: Arc::clone(&inner.driver),
            device,
            stream,
            more_streams: Vec::new(),
            views,
            by_name: batch.by_name().to_vec(),
            slot,
            file,
            segments,
        })
    }

    /// The mapped ref-counter file `name` (probed) and `slot` in it, checked to be in range and to
    /// hold a reference.
    fn held_slot(
        &self,
        name: &ShmName,
        slot: u64,
    ) -> Result<(Lease<ShmName, MappedCounterFile>, usize)> {
        let file = self
            .inner
            .files
            .acquire(name, || MappedCounterFile::open(name))?;
        file.get().probe()?;
        let table = file.get().table();
        let index = usize::try_from(slot)
            .ok()
            .filter(|&s| s < table.slots())
            .ok_or_else(|| Error::SlotOutOfRange {
                slot,
                name: name.to_string(),
                slots: table.slots(),
            })?;
        let value = table
            .counter(file.get().mapping(), index)?
            .load(Ordering::Acquire);
        if value <= 0 {
            if table.is_expired(file.get().mapping(), index) {
                return Err(Error::ShareExpired {
                    slot,
                    name: name.to_string(),
                });
            }
            return Err(Error::SlotNotHeld {
                slot,
                name: name.to_string(),
                value,
            });
        }
        Ok((file, index))
    }
}

/// Memory another process shared, open in this one. Dropping it synchronizes its streams and releases
/// the producer's reference (see the [module docs](self)).
pub struct ReceivedMemory<B: IpcDriver> {
    driver: Arc<B>,
    device: u32,
    ptr: DeviceAddress,
    size: u64,
    /// The stream it was opened on, and others it was used on ([`use_on`](Self::use_on)).
    stream: StreamId,
    more_streams: Vec<StreamId>,
    slot: usize,
    file: Lease<ShmName, MappedCounterFile>,
    _mem: Lease<SegmentKey, OpenedBase<B>>,
}

impl<B: IpcDriver> std::fmt::Debug for ReceivedMemory<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceivedMemory")
            .field("device", &self.device)
            .field("ptr", &self.ptr)
            .field("size", &self.size)
            .field("file", self.file.get().name())
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl<B: IpcDriver> ReceivedMemory<B> {
    /// How the producer's chunk descriptors were obtained, for memory of an expandable segment
    /// (see [`crate::chunks`]); `None` for a device allocation's handle.
    #[must_use]
    pub fn fd_route(&self) -> Option<FdRoute> {
        self._mem.get().route
    }

    /// The device address in this process.
    #[must_use]
    pub fn ptr(&self) -> DeviceAddress {
        self.ptr
    }

    /// The size in bytes.
    #[must_use]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The device ordinal.
    #[must_use]
    pub fn device(&self) -> u32 {
        self.device
    }

    /// Records that work on `stream` uses the memory: it is synchronized too before the reference is
    /// released.
    pub fn use_on(&mut self, stream: StreamId) {
        if stream != self.stream && !self.more_streams.contains(&stream) {
            self.more_streams.push(stream);
        }
    }

    /// The memory as `len` elements of `T`.
    ///
    /// # Errors
    ///
    /// [`Error::BadView`] if the size is not a multiple of `T`'s or the address not aligned to it.
    pub fn view<T: DeviceElement>(&self) -> Result<DeviceView<'_, T>> {
        DeviceView::new(self.ptr, self.size)
    }
}

impl<B: IpcDriver> Drop for ReceivedMemory<B> {
    fn drop(&mut self) {
        release_held(
            &*self.driver,
            self.device,
            std::iter::once(&self.stream).chain(&self.more_streams),
            self.file.get(),
            self.slot,
        );
        // The leases (file mapping, opened memory handle) are released after this, in field order.
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tensormem_cuda_alloc::backend::sim::SimDevice;
    use tensormem_cuda_alloc::{CachingAllocator, StreamId};

    use super::*;
    use crate::driver::fake::FakeDriver;
    use crate::opened::check_shareable;
    use crate::IpcProducer;

    #[test]
    fn received_memory_cannot_be_shared_again() {
        const S: StreamId = StreamId(0);
        let driver = Arc::new(FakeDriver::default());
        let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
        let producer = IpcProducer::new(Arc::clone(&driver));
        let consumer = IpcConsumer::new(Arc::clone(&driver));
        let (_shared, handle) = producer
            .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
            .unwrap();
        let received = consumer.open(&handle, S).unwrap();
        let err = check_shareable(0, received.ptr()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Attempted to send CUDA tensor received from another process; this is not currently \
             supported. Consider cloning before sending."
        );
        let ptr = received.ptr();
        drop(received);
        assert!(
            check_shareable(0, ptr).is_ok(),
            "closed: no longer received memory"
        );
    }
}
