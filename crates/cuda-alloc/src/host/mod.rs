//! The pinned host caching allocator (PyTorch's `CachingHostAllocator`, `torch.cuda.host_memory_stats`).
//!
//! Copies between the host and a device run asynchronously, and at full bandwidth, only from
//! page-locked ("pinned") host memory; but pinning is slow (`cudaHostAlloc` of 64 MiB takes tens of
//! milliseconds) and makes the memory unswappable. So, like device memory, pinned memory is cached:
//!
//! - requests are rounded up to a power of two (at least a page) and served from a free list per
//!   size class; a miss allocates from a [`PinnedSource`] (`cuMemHostAlloc`, or `malloc` +
//!   `cuMemHostRegister` when `pinned_use_cuda_host_register` is set, its pages touched in parallel
//!   by `pinned_num_register_threads` threads first);
//! - with `pinned_max_round_threshold_mb` or `pinned_max_cached_size_mb` set
//!   ([`with_config`](HostCachingAllocator::with_config)), a request above either is not rounded to
//!   a power of two but to a whole page, and a freed block above `pinned_max_cached_size_mb` goes
//!   back to the system (once its streams are done with it) instead of into the cache;
//! - a block used by copies on streams is marked with [`record_stream`](HostCachingAllocator::record_stream)
//!   (PyTorch's `record_event`); when it is freed an event is recorded on each of those streams, and
//!   the block is reused only once they have all completed (checked at the next allocation), so a
//!   copy still reading it is never overwritten;
//! - [`empty_cache`](HostCachingAllocator::empty_cache) returns the cached blocks to the system;
//! - [`stats`](HostCachingAllocator::stats) reports PyTorch's host statistics;
//! - [`record_history`](HostCachingAllocator::record_history) records its events
//!   (`_record_memory_history(record_pinned_host_memory=True)`), which
//!   [`add_to_snapshot`](HostCachingAllocator::add_to_snapshot) writes as a snapshot's
//!   `host_segments` and `host_traces`.
//!
//! Events come from a [`Device`] (the CUDA backend's, or the simulated device in tests).
//!
//! ```
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator};
//! use tensormem_cuda_alloc::StreamId;
//!
//! let host = HostCachingAllocator::new(SimDevice::new(1 << 30), HeapSource);
//! let mut buffer = host.allocate(3000)?; // a 4 KiB block
//! buffer.as_mut_slice().fill(7);
//! host.record_stream(&buffer, StreamId(5))?; // a copy on stream 5 reads it
//! let addr = buffer.as_ptr();
//! host.free(buffer)?; // not reusable until stream 5's work is done
//! host.device().complete_stream_work(StreamId(5));
//! let again = host.allocate(4096)?;
//! assert_eq!(again.as_ptr(), addr); // reused once the copy finished
//! assert_eq!(host.stats().to_flat()["allocations.current"], 1);
//! host.free(again)?;
//! host.empty_cache()?;
//! assert_eq!(host.stats().allocated_bytes.current, 0);
//! # Ok::<(), tensormem_cuda_alloc::Error>(())
//! ```

pub(crate) mod pages;
mod source;
mod stats;

use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::Mutex;

pub use source::{HeapSource, PinnedSource, HOST_ALIGNMENT};
pub use stats::{DurationStat, HostStats};

use crate::config::AllocatorConfig;
use crate::device::{Device, StreamId};
use crate::error::{Error, Result};
use crate::snapshot::{Block, BlockState, HostSegment, Snapshot, TraceAction, TraceEntry};
use crate::stack::RecordContext;
use crate::trace::TraceRecorder;
use stats::adjust;

/// Pinned host memory handed out by a [`HostCachingAllocator`]; give it back with
/// [`HostCachingAllocator::free`]. It owns its bytes until then: reading and writing them from the
/// host is safe through the handle.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    /// The block's size.
    size: usize,
    /// The size asked for.
    requested: usize,
    /// The allocator that handed it out.
    allocator: u32,
}

// SAFETY: the buffer is the only owner of its bytes (the allocator hands a block to one buffer at a
// time and does not touch its contents), so moving it to another thread moves that ownership.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references only give shared (read) access to the bytes.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// The host address (a device may read it in copies: `cuMemcpyHtoDAsync`).
    #[must_use]
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The size asked for.
    #[must_use]
    pub fn len(&self) -> usize {
        self.requested
    }

    /// Whether the size asked for was 0.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// The block's size: the request rounded up to a power of two, at least a page (or to a whole
    /// page above `pinned_max_round_threshold_mb` / `pinned_max_cached_size_mb`); a cached block
    /// reused for a request may be larger than that.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.size
    }

    /// The bytes asked for. Device copies queued on a stream may still be writing them: synchronize
    /// with that stream before reading data a copy produces.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        if self.requested == 0 {
            return &[];
        }
        // SAFETY: the block is valid for `size >= requested` bytes (`PinnedSource` obligation) and
        // owned by this handle until it is freed, which consumes the handle.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.requested) }
    }

    /// The bytes asked for, writable.
    #[must_use]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.requested == 0 {
            return &mut [];
        }
        // SAFETY: as in `as_slice`; `&mut self` makes the access unique on the host.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.requested) }
    }
}

/// One block held from the system.
#[derive(Debug)]
struct HostBlock {
    size: usize,
    /// What its last user asked for.
    requested: usize,
    allocated: bool,
    /// Streams that used the block (`record_stream`), besides none: PyTorch's `streams_`.
    streams: Vec<StreamId>,
    /// Events still to complete before the freed block is reusable.
    event_count: usize,
}

/// What the allocator's lock guards.
struct State<E> {
    /// Every block by address.
    blocks: HashMap<usize, HostBlock>,
    /// Free blocks by size class (`ceil(log2(size))`), most recently freed last.
    free: Vec<Vec<usize>>,
    /// Events recorded for freed blocks, oldest first: (event, block address).
    events: VecDeque<(E, usize)>,
    /// Completed events kept for reuse.
    spare_events: Vec<E>,
    stats: HostStats,
}

/// Blocks taken out of the table, to go back to the system once the lock is released:
/// (address, size).
type Releases = Vec<(usize, usize)>;

/// PyTorch's pinned host caching allocator over a [`PinnedSource`], with events from a [`Device`].
/// See the [module docs](self).
pub struct HostCachingAllocator<D: Device> {
    device: D,
    source: Box<dyn PinnedSource>,
    id: u32,
    /// The size rules (`pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb`).
    config: AllocatorConfig,
    state: Mutex<State<D::Event>>,
    trace: TraceRecorder,
}

impl<D: Device> std::fmt::Debug for HostCachingAllocator<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCachingAllocator")
            .field("device", &self.device.index())
            .field("source", &self.source)
            .field("id", &self.id)
            .field(
                "pinned_max_round_threshold",
                &self.config.pinned_max_round_threshold,
            )
            .field(
                "pinned_max_cached_size",
                &self.config.pinned_max_cached_size,
            )
            .finish_non_exhaustive()
    }
}

/// Size classes: `ceil(log2(size))` for every `usize`.
const CLASSES: usize = usize::BITS as usize + 1;

/// The size class of a block of `size` bytes (PyTorch's `size_index`: `ceil(log2(size))`).
fn class_of(size: usize) -> usize {
    if size <= 1 {
        0
    } else {
        (usize::BITS - (size - 1).leading_zeros()) as usize
    }
}

fn next_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Relaxed)
}

impl<D: Device> HostCachingAllocator<D> {
    /// An allocator of memory from `source`, recording events on `device`'s streams, with PyTorch's
    /// default size rules (every request rounded to a power of two, every block cached).
    pub fn new(device: D, source: impl PinnedSource) -> Self {
        Self::with_config(device, source, &AllocatorConfig::default())
    }

    /// [`new`](Self::new) following `config`'s host keys: `pinned_max_round_threshold_mb` and
    /// `pinned_max_cached_size_mb` (see [`AllocatorConfig::pinned_block_size`] and
    /// [`AllocatorConfig::pinned_caches`]). The other keys are the source's business
    /// (`pinned_use_cuda_host_register`) or kept without effect.
    pub fn with_config(device: D, source: impl PinnedSource, config: &AllocatorConfig) -> Self {
        Self {
            device,
            source: Box::new(source),
            id: next_id(),
            config: AllocatorConfig {
                pinned_max_round_threshold: config.pinned_max_round_threshold,
                pinned_max_cached_size: config.pinned_max_cached_size,
                ..AllocatorConfig::default()
            },
            state: Mutex::new(State {
                blocks: HashMap::new(),
                free: (0..CLASSES).map(|_| Vec::new()).collect(),
                events: VecDeque::new(),
                spare_events: Vec::new(),
                stats: HostStats::default(),
            }),
            trace: TraceRecorder::default(),
        }
    }

    /// The device whose streams and events gate reuse.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The size of the block a request of `size` bytes gets when no cached block serves it
    /// (PyTorch's host `roundSize`), or `None` when there is no such size.
    #[must_use]
    pub fn block_size(&self, size: usize) -> Option<usize> {
        self.config.pinned_block_size(size, HOST_ALIGNMENT)
    }

    /// Allocates at least `size` bytes of pinned host memory (PyTorch's `allocate`): a cached block
    /// of the request's size class, at least [`block_size`](Self::block_size) bytes, whose streams
    /// have finished with it (the most recently freed such block), else a new block of
    /// `block_size` bytes from the source. A zero-sized request returns an empty buffer without a
    /// block.
    ///
    /// # Errors
    /// [`Error::TooLarge`] for a size with no block size ([`block_size`](Self::block_size));
    /// [`Error::Device`] when the source fails (out of memory included) or an event cannot be
    /// queried. A block too large to cache that cannot be returned to the system on the way is
    /// logged and stays cached.
    pub fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        if size == 0 {
            return Ok(PinnedBuffer {
                ptr: NonNull::dangling(),
                size: 0,
                requested: 0,
                allocator: self.id,
            });
        }
        let wanted = self
            .block_size(size)
            .ok_or(Error::TooLarge { bytes: size })?;
        if let Some(buffer) = self.reuse(size, wanted)? {
            return Ok(buffer);
        }
        // A new block, made without the lock (pinning is slow).
        let started = Instant::now();
        let ptr = self.source.alloc(wanted)?;
        let took = started.elapsed();
        tracing::debug!(
            bytes = wanted,
            source = self.source.name(),
            ?took,
            "pinned host block"
        );
        let addr = ptr.as_ptr() as usize;
        {
            let mut state = self.state.lock();
            state.blocks.insert(
                addr,
                HostBlock {
                    size: wanted,
                    requested: size,
                    allocated: true,
                    streams: Vec::new(),
                    event_count: 0,
                },
            );
            let stats = &mut state.stats;
            stats.num_host_alloc += 1;
            stats.host_alloc_time.add(took);
            adjust(&mut stats.allocations, 1);
            adjust(&mut stats.allocated_bytes, wanted as i64);
            adjust(&mut stats.active_requests, 1);
            adjust(&mut stats.active_bytes, wanted as i64);
        }
        self.trace.record(
            TraceAction::SegmentAlloc,
            addr as u64,
            wanted as u64,
            StreamId(0),
        );
        self.trace
            .record(TraceAction::Alloc, addr as u64, size as u64, StreamId(0));
        Ok(self.buffer(addr, wanted, size))
    }

    /// [`allocate`](Self::allocate) from the cache alone: a cached block that serves `size` bytes,
    /// or `None` where serving it would pin new memory. What a sleeping pool's backup takes first
    /// (memory reserved ahead, or left from an earlier sleep), staging the rest.
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate), without the source's.
    pub fn allocate_cached(&self, size: usize) -> Result<Option<PinnedBuffer>> {
        if size == 0 {
            return self.allocate(0).map(Some);
        }
        let wanted = self
            .block_size(size)
            .ok_or(Error::TooLarge { bytes: size })?;
        self.reuse(size, wanted)
    }

    /// A cached block of at least `wanted` bytes whose streams are done with it, handed out for a
    /// request of `size` bytes, if there is one.
    fn reuse(&self, size: usize, wanted: usize) -> Result<Option<PinnedBuffer>> {
        let mut releases = Releases::new();
        let reused = {
            let mut state = self.state.lock();
            self.process_events(&mut state, &mut releases)
                .map(|()| self.take_cached(&mut state, class_of(wanted), wanted, size))
        };
        if let Err(error) = self.release(releases) {
            // The blocks that could not be returned stay cached; this request goes on.
            tracing::warn!(%error, "returning an uncached pinned host block failed");
        }
        Ok(reused?.map(|(addr, block_size)| {
            self.trace
                .record(TraceAction::Alloc, addr as u64, size as u64, StreamId(0));
            self.buffer(addr, block_size, size)
        }))
    }

    /// The most recently freed block of size class `class` with at least `wanted` bytes, handed out
    /// for a request of `size` bytes: (address, block size).
    fn take_cached(
        &self,
        state: &mut State<D::Event>,
        class: usize,
        wanted: usize,
        size: usize,
    ) -> Option<(usize, usize)> {
        let at = state.free[class]
            .iter()
            .rposition(|addr| state.blocks[addr].size >= wanted)?;
        let addr = state.free[class].remove(at);
        let block = state.blocks.get_mut(&addr).expect("free blocks are known");
        block.allocated = true;
        block.requested = size;
        let block_size = block.size;
        adjust(&mut state.stats.active_requests, 1);
        adjust(&mut state.stats.active_bytes, block_size as i64);
        Some((addr, block_size))
    }

    fn buffer(&self, addr: usize, size: usize, requested: usize) -> PinnedBuffer {
        PinnedBuffer {
            ptr: NonNull::new(addr as *mut u8).expect("blocks are non-null"),
            size,
            requested,
            allocator: self.id,
        }
    }

    /// Marks `buffer` as used by work queued on `stream` (PyTorch's `record_event` of the host
    /// allocator, called for every copy from or to pinned memory): once freed, it is not reused
    /// before that stream's work queued until the free has completed.
    ///
    /// # Errors
    /// [`Error::InvalidPointer`] for another allocator's buffer; the device's errors for a stream it
    /// does not know.
    pub fn record_stream(&self, buffer: &PinnedBuffer, stream: StreamId) -> Result<()> {
        if buffer.size == 0 {
            return Ok(());
        }
        self.check_owner(buffer)?;
        self.device.check_stream(stream)?;
        let mut state = self.state.lock();
        let block = state
            .blocks
            .get_mut(&(buffer.ptr.as_ptr() as usize))
            .ok_or_else(|| invalid(buffer))?;
        if !block.streams.contains(&stream) {
            block.streams.push(stream);
        }
        Ok(())
    }

    /// Gives `buffer` back (PyTorch's host `free`): done at once if no stream used it, else once
    /// events recorded now on each of those streams have completed. Done, the block is cached, or
    /// returned to the system when it is larger than `pinned_max_cached_size_mb`.
    ///
    /// # Errors
    /// [`Error::InvalidPointer`] for another allocator's buffer; [`Error::Device`] when an event
    /// cannot be created or recorded (the device is then synchronized instead, and the block done
    /// with), or when returning a block to the system fails (it stays cached).
    pub fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        if buffer.size == 0 {
            return Ok(());
        }
        self.check_owner(&buffer)?;
        let addr = buffer.ptr.as_ptr() as usize;
        let mut releases = Releases::new();
        {
            let mut state = self.state.lock();
            let block = state
                .blocks
                .get_mut(&addr)
                .ok_or_else(|| invalid(&buffer))?;
            block.allocated = false;
            let streams = std::mem::take(&mut block.streams);
            let requested = block.requested;
            self.trace.record(
                TraceAction::FreeRequested,
                addr as u64,
                requested as u64,
                StreamId(0),
            );
            let mut recorded = 0;
            let mut failure = None;
            for stream in streams {
                let event = match state.spare_events.pop() {
                    Some(event) => Ok(event),
                    None => self.device.create_event(),
                };
                match event.and_then(|e| self.device.record_event(&e, stream).map(|()| e)) {
                    Ok(event) => {
                        state.events.push_back((event, addr));
                        recorded += 1;
                    }
                    Err(error) => {
                        failure = Some(error);
                        break;
                    }
                }
            }
            if let Some(error) = failure {
                // Without all the events the block could be reused too early: wait for the device.
                tracing::warn!(%error, "recording a pinned block's event failed; synchronizing the device");
                self.device.synchronize()?;
                recorded = 0;
                state.events.retain(|&(_, a)| a != addr);
            }
            let block = state.blocks.get_mut(&addr).expect("looked up above");
            block.event_count = recorded;
            if recorded == 0 {
                self.done(&mut state, addr, &mut releases);
            }
        }
        self.release(releases)
    }

    /// Pins host memory ahead of its use and keeps it cached: enough blocks of `block` bytes
    /// (rounded as [`allocate`](Self::allocate) rounds) that `bytes` of them are cached, made by up to
    /// `threads` threads at once (pinning is slow, and runs in parallel). Later requests of that
    /// size are served from the cache without pinning: a sleeping pool's first backup, which takes
    /// pieces of 256 MiB ([`BACKUP_PIECE_BYTES`](crate::BACKUP_PIECE_BYTES)), then copies at once
    /// instead of pinning as it goes. Blocks above `pinned_max_cached_size` are not cached, so a
    /// reserve of them keeps nothing. Returns the bytes of such blocks cached now.
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate); the blocks pinned before the failure stay cached.
    pub fn reserve(&self, bytes: usize, block: usize, threads: usize) -> Result<usize> {
        let wanted = self
            .block_size(block.max(1))
            .ok_or(Error::TooLarge { bytes: block })?;
        let cached = |state: &State<D::Event>| -> usize {
            state.free.get(class_of(wanted)).map_or(0, |addrs| {
                addrs
                    .iter()
                    .filter(|addr| state.blocks[addr].size >= wanted)
                    .count()
            }) * wanted
        };
        let have = cached(&self.state.lock());
        if have >= bytes {
            return Ok(have);
        }
        // Every block is held until all are made: the cached ones first (an allocation takes
        // them), then new ones, so that each new one is pinned.
        let missing = bytes.div_ceil(wanted);
        let threads = threads.clamp(1, missing);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let made: Mutex<Vec<PinnedBuffer>> = Mutex::new(Vec::with_capacity(missing));
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < missing {
                        match self.allocate(wanted) {
                            Ok(buffer) => made.lock().push(buffer),
                            Err(error) => {
                                failure.lock().get_or_insert(error);
                                break;
                            }
                        }
                    }
                });
            }
        });
        for buffer in made.into_inner() {
            self.free(buffer)?;
        }
        if let Some(error) = failure.into_inner() {
            return Err(error);
        }
        let now = cached(&self.state.lock());
        tracing::debug!(block = wanted, bytes = now, "pinned host memory reserved");
        Ok(now)
    }

    /// Returns every cached block to the system (PyTorch's host `empty_cache`); blocks handed out or
    /// waiting for their streams stay.
    ///
    /// # Errors
    /// [`Error::Device`] when the source fails to free (the blocks not yet freed stay cached) or an
    /// event cannot be queried.
    pub fn empty_cache(&self) -> Result<()> {
        let mut releases = Releases::new();
        let processed = {
            let mut state = self.state.lock();
            let processed = self.process_events(&mut state, &mut releases);
            let addrs: Vec<usize> = state.free.iter_mut().flat_map(std::mem::take).collect();
            for addr in addrs {
                let block = state.blocks.remove(&addr).expect("free blocks are known");
                releases.push((addr, block.size));
            }
            processed
        };
        let released = self.release(releases);
        processed.and(released)
    }

    /// Returns `releases` (blocks already out of the table, free and unused) to the system, then
    /// counts them; on a failure the blocks not yet returned go back into the cache, and the error
    /// is returned.
    fn release(&self, releases: Releases) -> Result<()> {
        if releases.is_empty() {
            return Ok(());
        }
        let mut result = Ok(());
        let mut returned = Vec::new();
        let mut kept: &[(usize, usize)] = &[];
        for (at, &(addr, size)) in releases.iter().enumerate() {
            let started = Instant::now();
            let ptr = NonNull::new(addr as *mut u8).expect("blocks are non-null");
            // SAFETY: the block came from `source.alloc` with this size, is free (not handed out, no
            // events pending) and was removed from the table before it was listed here, so it is
            // freed once and nothing uses it.
            match unsafe { self.source.free(ptr, size) } {
                Ok(()) => returned.push((addr, size, started.elapsed())),
                Err(error) => {
                    kept = &releases[at..];
                    result = Err(error.into());
                    break;
                }
            }
        }
        {
            let mut state = self.state.lock();
            // Keep the rest cached: nothing is lost.
            for &(addr, size) in kept {
                state.blocks.insert(
                    addr,
                    HostBlock {
                        size,
                        requested: 0,
                        allocated: false,
                        streams: Vec::new(),
                        event_count: 0,
                    },
                );
                state.free[class_of(size)].push(addr);
            }
            let stats = &mut state.stats;
            for &(_, size, took) in &returned {
                stats.num_host_free += 1;
                stats.host_free_time.add(took);
                adjust(&mut stats.allocations, -1);
                adjust(&mut stats.allocated_bytes, -(size as i64));
            }
        }
        for (addr, size, _) in returned {
            self.trace.record(
                TraceAction::SegmentFree,
                addr as u64,
                size as u64,
                StreamId(0),
            );
        }
        result
    }

    /// The statistics (`torch.cuda.host_memory_stats()`; [`HostStats::to_flat`] gives its keys).
    #[must_use]
    pub fn stats(&self) -> HostStats {
        self.state.lock().stats
    }

    /// Resets every peak to its current value (`torch.cuda.reset_peak_host_memory_stats`).
    pub fn reset_peak_stats(&self) {
        let stats = &mut self.state.lock().stats;
        for stat in [
            &mut stats.allocations,
            &mut stats.allocated_bytes,
            &mut stats.active_requests,
            &mut stats.active_bytes,
        ] {
            stat.peak = stat.current;
        }
    }

    /// Resets the accumulated counts (`allocated`, `freed`, `num_host_*`, durations) to zero
    /// (`torch.cuda.reset_accumulated_host_memory_stats`).
    pub fn reset_accumulated_stats(&self) {
        let stats = &mut self.state.lock().stats;
        for stat in [
            &mut stats.allocations,
            &mut stats.allocated_bytes,
            &mut stats.active_requests,
            &mut stats.active_bytes,
        ] {
            stat.allocated = 0;
            stat.freed = 0;
        }
        stats.num_host_alloc = 0;
        stats.num_host_free = 0;
        stats.host_alloc_time = DurationStat::default();
        stats.host_free_time = DurationStat::default();
    }

    /// Starts or stops recording this allocator's events into a ring buffer of `max_entries`
    /// (`torch.cuda.memory._record_memory_history(record_pinned_host_memory=True)`): `segment_alloc` /
    /// `segment_free` when a block is taken from or returned to the system, `alloc`,
    /// `free_requested` and `free_completed` as on a device, at the block's address, with stream 0.
    /// `context` says which entries keep call stacks ([`RecordContext::Alloc`] and above: all).
    /// Stopping clears the recorded events.
    pub fn record_history(&self, enabled: bool, max_entries: usize, context: RecordContext) {
        self.trace.configure(enabled, max_entries, context);
    }

    /// Whether [`record_history`](Self::record_history) is on.
    #[must_use]
    pub fn history_enabled(&self) -> bool {
        self.trace.enabled()
    }

    /// The recorded events, oldest first (a snapshot's `host_traces`).
    #[must_use]
    pub fn trace(&self) -> Vec<TraceEntry> {
        self.trace.entries()
    }

    /// Every block held from the system, in address order, each as a segment of one block (the
    /// host allocator does not split blocks): a snapshot's `host_segments`.
    #[must_use]
    pub fn segments(&self) -> Vec<HostSegment> {
        let state = self.state.lock();
        let mut segments: Vec<HostSegment> = state
            .blocks
            .iter()
            .map(|(&addr, b)| {
                let state = if b.allocated {
                    BlockState::ActiveAllocated
                } else if b.event_count > 0 {
                    BlockState::ActivePendingFree
                } else {
                    BlockState::Inactive
                };
                let size = b.size as u64;
                let active = state != BlockState::Inactive;
                HostSegment {
                    address: addr as u64,
                    total_size: size,
                    allocated_size: if b.allocated { size } else { 0 },
                    active_size: if active { size } else { 0 },
                    requested_size: if active { b.requested as u64 } else { 0 },
                    blocks: vec![Block {
                        address: addr as u64,
                        size,
                        requested_size: b.requested as u64,
                        state,
                        ..Block::default()
                    }],
                    ..HostSegment::default()
                }
            })
            .collect();
        drop(state);
        segments.sort_by_key(|s| s.address);
        segments
    }

    /// Adds this allocator to `snapshot` as PyTorch does when host recording is on: its blocks as
    /// `host_segments`, and its recorded events as `host_traces` when `include_traces` is set.
    pub fn add_to_snapshot(&self, snapshot: &mut Snapshot, include_traces: bool) {
        snapshot.host_segments = Some(self.segments());
        snapshot.host_traces = include_traces.then(|| self.trace());
    }

    /// Completes the frees whose events completed, oldest first, up to the first event still
    /// pending (PyTorch's `process_events`). Blocks to return to the system go to `releases`.
    fn process_events(&self, state: &mut State<D::Event>, releases: &mut Releases) -> Result<()> {
        while let Some((event, _)) = state.events.front() {
            if !self.device.query_event(event)? {
                break;
            }
            let (event, addr) = state.events.pop_front().expect("peeked");
            state.spare_events.push(event);
            let block = state
                .blocks
                .get_mut(&addr)
                .expect("pending blocks are known");
            block.event_count -= 1;
            if block.event_count == 0 {
                self.done(state, addr, releases);
            }
        }
        Ok(())
    }

    /// A block no stream uses any more: into its free list, or out of the table into `releases`
    /// when it is too large to cache.
    fn done(&self, state: &mut State<D::Event>, addr: usize, releases: &mut Releases) {
        let block = &state.blocks[&addr];
        let (size, requested) = (block.size, block.requested);
        adjust(&mut state.stats.active_requests, -1);
        adjust(&mut state.stats.active_bytes, -(size as i64));
        self.trace.record(
            TraceAction::FreeCompleted,
            addr as u64,
            requested as u64,
            StreamId(0),
        );
        if self.config.pinned_caches(size) {
            state.free[class_of(size)].push(addr);
        } else {
            state.blocks.remove(&addr);
            releases.push((addr, size));
        }
    }

    fn check_owner(&self, buffer: &PinnedBuffer) -> Result<()> {
        if buffer.allocator == self.id {
            Ok(())
        } else {
            Err(invalid(buffer))
        }
    }
}

fn invalid(buffer: &PinnedBuffer) -> Error {
    Error::InvalidPointer {
        ptr: crate::DeviceAddress(buffer.ptr.as_ptr() as u64),
    }
}

impl<D: Device> Drop for HostCachingAllocator<D> {
    /// Returns the cached blocks; blocks still handed out are left to their holders' process (their
    /// memory stays valid: freeing it under a live buffer would be unsound).
    fn drop(&mut self) {
        if let Err(error) = self.empty_cache() {
            tracing::warn!(%error, "returning cached pinned host memory failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::class_of;

    #[test]
    fn size_classes_are_the_ceiling_of_log2() {
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(4096), 12);
        assert_eq!(class_of(4097), 13);
        assert_eq!(class_of(3 << 20), 22);
        assert_eq!(class_of(usize::MAX), 64);
    }
}
