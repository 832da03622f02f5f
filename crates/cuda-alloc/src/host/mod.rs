//! The pinned host caching allocator (PyTorch's `CachingHostAllocator`, `torch.cuda.host_memory_stats`).
//!
//! Copies between the host and a device run asynchronously, and at full bandwidth, only from
//! page-locked ("pinned") host memory; but pinning is slow (`cudaHostAlloc` of 64 MiB takes tens of
//! milliseconds) and makes the memory unswappable. So, like device memory, pinned memory is cached:
//!
//! - requests are rounded up to a power of two (at least a page) and served from a free list per
//!   size; a miss allocates from a [`PinnedSource`] (`cuMemHostAlloc`, or `malloc` +
//!   `cuMemHostRegister` when `pinned_use_cuda_host_register` is set, its pages touched in parallel
//!   by `pinned_num_register_threads` threads first);
//! - a block used by copies on streams is marked with [`record_stream`](HostCachingAllocator::record_stream)
//!   (PyTorch's `record_event`); when it is freed an event is recorded on each of those streams, and
//!   the block is reused only once they have all completed (checked at the next allocation), so a
//!   copy still reading it is never overwritten;
//! - [`empty_cache`](HostCachingAllocator::empty_cache) returns the cached blocks to the system;
//! - [`stats`](HostCachingAllocator::stats) reports PyTorch's host statistics.
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

mod source;
mod stats;

use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::Mutex;

#[cfg(feature = "cuda")]
pub(crate) use source::layout as heap_layout;
pub use source::{HeapSource, PinnedSource, HOST_ALIGNMENT};
pub use stats::{DurationStat, HostStats};

use crate::device::{Device, StreamId};
use crate::error::{Error, Result};
use stats::adjust;

/// Pinned host memory handed out by a [`HostCachingAllocator`]; give it back with
/// [`HostCachingAllocator::free`]. It owns its bytes until then: reading and writing them from the
/// host is safe through the handle.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    /// The block's (rounded) size.
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

    /// The block's size (the request rounded up to a power of two, at least a page).
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
    /// Free blocks by size class (`log2(size)`), most recently freed last.
    free: Vec<Vec<usize>>,
    /// Events recorded for freed blocks, oldest first: (event, block address).
    events: VecDeque<(E, usize)>,
    /// Completed events kept for reuse.
    spare_events: Vec<E>,
    stats: HostStats,
}

/// PyTorch's pinned host caching allocator over a [`PinnedSource`], with events from a [`Device`].
/// See the [module docs](self).
pub struct HostCachingAllocator<D: Device> {
    device: D,
    source: Box<dyn PinnedSource>,
    id: u32,
    state: Mutex<State<D::Event>>,
}

impl<D: Device> std::fmt::Debug for HostCachingAllocator<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCachingAllocator")
            .field("device", &self.device.index())
            .field("source", &self.source)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Size classes: powers of two up to 2^63.
const CLASSES: usize = 64;

/// The size class of a request: the log2 of its rounded size.
fn rounded(size: usize) -> Option<usize> {
    size.max(HOST_ALIGNMENT).checked_next_power_of_two()
}

fn next_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Relaxed)
}

impl<D: Device> HostCachingAllocator<D> {
    /// An allocator of memory from `source`, recording events on `device`'s streams.
    pub fn new(device: D, source: impl PinnedSource) -> Self {
        Self {
            device,
            source: Box::new(source),
            id: next_id(),
            state: Mutex::new(State {
                blocks: HashMap::new(),
                free: (0..CLASSES).map(|_| Vec::new()).collect(),
                events: VecDeque::new(),
                spare_events: Vec::new(),
                stats: HostStats::default(),
            }),
        }
    }

    /// The device whose streams and events gate reuse.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Allocates at least `size` bytes of pinned host memory (PyTorch's `allocate`): a cached block of
    /// the rounded size whose streams have finished with it, else a new one from the source. A
    /// zero-sized request returns an empty buffer without a block.
    ///
    /// # Errors
    /// [`Error::TooLarge`] for a size with no power of two above it; [`Error::Device`] when the source
    /// fails (out of memory included) or an event cannot be queried.
    pub fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        if size == 0 {
            return Ok(PinnedBuffer {
                ptr: NonNull::dangling(),
                size: 0,
                requested: 0,
                allocator: self.id,
            });
        }
        let rounded = rounded(size).ok_or(Error::TooLarge { bytes: size })?;
        let class = rounded.trailing_zeros() as usize;
        {
            let mut state = self.state.lock();
            self.process_events(&mut state)?;
            if let Some(addr) = state.free[class].pop() {
                let block = state.blocks.get_mut(&addr).expect("free blocks are known");
                block.allocated = true;
                adjust(&mut state.stats.active_requests, 1);
                adjust(&mut state.stats.active_bytes, rounded as i64);
                return Ok(self.buffer(addr, rounded, size));
            }
        }
        // A new block, made without the lock (pinning is slow).
        let started = Instant::now();
        let ptr = self.source.alloc(rounded)?;
        let took = started.elapsed();
        tracing::debug!(
            bytes = rounded,
            source = self.source.name(),
            ?took,
            "pinned host block"
        );
        let addr = ptr.as_ptr() as usize;
        let mut state = self.state.lock();
        state.blocks.insert(
            addr,
            HostBlock {
                size: rounded,
                allocated: true,
                streams: Vec::new(),
                event_count: 0,
            },
        );
        let stats = &mut state.stats;
        stats.num_host_alloc += 1;
        stats.host_alloc_time.add(took);
        adjust(&mut stats.allocations, 1);
        adjust(&mut stats.allocated_bytes, rounded as i64);
        adjust(&mut stats.active_requests, 1);
        adjust(&mut stats.active_bytes, rounded as i64);
        Ok(self.buffer(addr, rounded, size))
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

    /// Gives `buffer` back (PyTorch's host `free`): cached at once if no stream used it, else once
    /// events recorded now on each of those streams have completed.
    ///
    /// # Errors
    /// [`Error::InvalidPointer`] for another allocator's buffer; [`Error::Device`] when an event
    /// cannot be created or recorded (the device is then synchronized instead, and the block cached).
    pub fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        if buffer.size == 0 {
            return Ok(());
        }
        self.check_owner(&buffer)?;
        let addr = buffer.ptr.as_ptr() as usize;
        let mut state = self.state.lock();
        let block = state
            .blocks
            .get_mut(&addr)
            .ok_or_else(|| invalid(&buffer))?;
        block.allocated = false;
        let streams = std::mem::take(&mut block.streams);
        let size = block.size;
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
            Self::make_free(&mut state, addr, size);
        }
        Ok(())
    }

    /// Returns every cached block to the system (PyTorch's host `empty_cache`); blocks handed out or
    /// waiting for their streams stay.
    ///
    /// # Errors
    /// [`Error::Device`] when the source fails to free (the blocks not yet freed stay cached) or an
    /// event cannot be queried.
    pub fn empty_cache(&self) -> Result<()> {
        let freed: Vec<(usize, usize)> = {
            let mut state = self.state.lock();
            self.process_events(&mut state)?;
            let addrs: Vec<usize> = state.free.iter_mut().flat_map(std::mem::take).collect();
            addrs
                .into_iter()
                .map(|addr| {
                    let block = state.blocks.remove(&addr).expect("free blocks are known");
                    (addr, block.size)
                })
                .collect()
        };
        let mut result = Ok(());
        let mut returned = Vec::new();
        for (at, &(addr, size)) in freed.iter().enumerate() {
            let started = Instant::now();
            let ptr = NonNull::new(addr as *mut u8).expect("blocks are non-null");
            // SAFETY: the block came from `source.alloc` with this size, is free (not handed out, no
            // events pending: it was in a free list) and was removed from the table above, so it is
            // freed once and nothing uses it.
            match unsafe { self.source.free(ptr, size) } {
                Ok(()) => returned.push((size, started.elapsed())),
                Err(error) => {
                    // Keep the rest cached: nothing is lost.
                    let mut state = self.state.lock();
                    for &(addr, size) in &freed[at..] {
                        state.blocks.insert(
                            addr,
                            HostBlock {
                                size,
                                allocated: false,
                                streams: Vec::new(),
                                event_count: 0,
                            },
                        );
                        state.free[size.trailing_zeros() as usize].push(addr);
                    }
                    result = Err(error.into());
                    break;
                }
            }
        }
        let mut state = self.state.lock();
        for (size, took) in returned {
            let stats = &mut state.stats;
            stats.num_host_free += 1;
            stats.host_free_time.add(took);
            adjust(&mut stats.allocations, -1);
            adjust(&mut stats.allocated_bytes, -(size as i64));
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

    /// Frees the blocks whose events completed, oldest first, up to the first event still pending
    /// (PyTorch's `process_events`).
    fn process_events(&self, state: &mut State<D::Event>) -> Result<()> {
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
                let size = block.size;
                Self::make_free(state, addr, size);
            }
        }
        Ok(())
    }

    /// A block no stream uses any more: into its free list.
    fn make_free(state: &mut State<D::Event>, addr: usize, size: usize) {
        state.free[size.trailing_zeros() as usize].push(addr);
        adjust(&mut state.stats.active_requests, -1);
        adjust(&mut state.stats.active_bytes, -(size as i64));
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
