//! Caching turned off (PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING`, `forceUncachedAllocator`): every
//! allocation is a device allocation of exactly the size asked for, returned to the device when
//! freed, for tools such as compute-sanitizer that check each allocation's bounds.
//!
//! PyTorch then bypasses its allocator: `uncached_allocate` is `cudaMalloc(size)`, `uncached_delete`
//! is `cudaFree`, and nothing is counted, traced or shown in snapshots. The same here: these
//! allocations live in a table of their own, beside the pools, so that statistics, the trace,
//! snapshots, the memory fraction and the invariant walk never see them. What PyTorch leaves to
//! `cudaFree`'s implicit synchronisation is kept explicit: an allocation used on other streams
//! (`record_stream`) goes back to the device only once their work recorded so far has completed, as
//! a cached block would return to its pool.
//!
//! Requests for a private pool (a graph capture or a `MemPool` context; PyTorch forbids the first
//! and ignores the second in this mode) are served by the pool as with caching on.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use super::{Allocation, CachingAllocator};
use crate::device::{Device, DeviceAddress, DeviceError, StreamId};
use crate::error::{Error, Result};
use crate::oom::{OutOfMemory, Source as OomSource};
use crate::pool_id::MempoolId;

/// An allocation made while caching was off.
#[derive(Debug)]
struct Live {
    /// Its size: the size asked for.
    size: u64,
    /// The stream it was allocated on.
    stream: StreamId,
    /// Its handle's serial number (in [`Allocation`]'s block field): a stale handle, one of an
    /// allocation freed since and made again at the same address, is refused.
    serial: u32,
    /// Other streams that used it (`record_stream`).
    uses: Vec<StreamId>,
}

/// A freed allocation that other streams may still be using.
#[derive(Debug)]
struct Waiting<E> {
    addr: u64,
    size: u64,
    /// Streams whose events are still to be recorded (recorded by the next processing outside a
    /// capture).
    uses: Vec<StreamId>,
    /// Events recorded on the streams that used it; the memory goes back once all have completed.
    events: Vec<E>,
}

/// Every allocation made while caching was off and not yet returned to the device. A leaf lock:
/// nothing else of the allocator is locked while it is held.
#[derive(Debug)]
pub(crate) struct UncachedBook<E> {
    live: BTreeMap<u64, Live>,
    waiting: Vec<Waiting<E>>,
    spare: Vec<E>,
    next_serial: u32,
}

impl<E> Default for UncachedBook<E> {
    fn default() -> Self {
        UncachedBook {
            live: BTreeMap::new(),
            waiting: Vec::new(),
            spare: Vec::new(),
            next_serial: 0,
        }
    }
}

impl<E> UncachedBook<E> {
    /// Whether it holds device memory (live or waiting allocations).
    pub(crate) fn holds_memory(&self) -> bool {
        !self.live.is_empty() || !self.waiting.is_empty()
    }

    /// Every device allocation it holds, live or waiting, as (address, size); forgets them all
    /// (for the allocator's teardown).
    pub(crate) fn take_all(&mut self) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = std::mem::take(&mut self.live)
            .into_iter()
            .map(|(addr, live)| (addr, live.size))
            .collect();
        all.extend(
            std::mem::take(&mut self.waiting)
                .into_iter()
                .map(|w| (w.addr, w.size)),
        );
        self.spare.clear();
        all
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Whether a request on `stream` bypasses the pools: caching is off and no private pool claims
    /// the stream. One relaxed load while caching is on.
    #[inline(always)]
    pub(super) fn bypasses_cache<const QUIET: bool>(&self, stream: StreamId) -> bool {
        if !self.settings.uncached() {
            return false;
        }
        std::hint::cold_path();
        QUIET || matches!(self.pool_choice(stream), super::PoolChoice::Default)
    }

    /// `size` bytes straight from the device (`cuMemAlloc` of exactly `size`; PyTorch's
    /// `uncached_allocate`), recorded nowhere but in the table of uncached allocations. When the
    /// device has no room: the free-memory callbacks run and the cache (blocks cached before caching
    /// was turned off, if any) is emptied, and the allocation is tried once more; then
    /// [`Error::OutOfMemory`], with no trace entry, no count and no observer told.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_uncached(&self, size: usize, stream: StreamId) -> Result<Allocation> {
        // The stream is checked and registered as for any allocation (its shard is not used).
        self.shard(stream)?;
        self.process_uncached(false)?;
        let ptr = match self.device.malloc(size) {
            Ok(ptr) => ptr,
            Err(DeviceError::OutOfMemory { .. }) => {
                for callback in self.callbacks.read().clone() {
                    callback.free_memory();
                }
                // Blocks cached before caching was turned off, if any (an allocator that never
                // cached counts no synchronisation, as PyTorch's uncached path never empties a cache).
                if !self.capturing() && self.counters.reserved.load(Relaxed) > 0 {
                    self.release_cached_blocks(MempoolId::DEFAULT)?;
                }
                match self.device.malloc(size) {
                    Ok(ptr) => ptr,
                    Err(DeviceError::OutOfMemory { .. }) => {
                        return Err(self.uncached_out_of_memory(size))
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        };
        let mut book = self.uncached.lock();
        let serial = book.next_serial;
        book.next_serial = book.next_serial.wrapping_add(1);
        let previous = book.live.insert(
            ptr.0,
            Live {
                size: size as u64,
                stream,
                serial,
                uses: Vec::new(),
            },
        );
        debug_assert!(previous.is_none(), "the device handed out {ptr} twice");
        Ok(Allocation::handed_out(
            ptr.0,
            size as u64,
            size as u64,
            stream,
            self.id,
            Allocation::UNCACHED,
            serial,
            0,
        ))
    }

    /// The out-of-memory error of an uncached allocation: the device's figures and the cache's (an
    /// uncached allocation is in neither statistic).
    #[cold]
    fn uncached_out_of_memory(&self, size: usize) -> Error {
        let info = self.device.mem_info().unwrap_or_default();
        let stats = self.memory_stats();
        let oom = OutOfMemory {
            device: self.device.index(),
            alloc_size: size as u64,
            device_total: info.total,
            device_free: info.free,
            allowed: None,
            allocated: stats.allocated_bytes.all.current as u64,
            reserved: stats.reserved_bytes.all.current as u64,
            private_pools: 0,
            processes: self.device.process_memory().unwrap_or_default(),
            source: OomSource::Caching,
            message: String::new(),
        }
        .finish();
        tracing::debug!(%oom, "out of memory (caching off)");
        Error::OutOfMemory(Box::new(oom))
    }

    /// Frees the uncached allocation at `ptr` (of handle serial `serial`, when freed by handle):
    /// back to the device now, or once the streams that used it are done.
    pub(super) fn free_uncached(&self, ptr: DeviceAddress, serial: Option<u32>) -> Result<()> {
        let mut book = self.uncached.lock();
        let Some(live) = book.live.get(&ptr.0) else {
            return Err(Error::InvalidPointer { ptr });
        };
        if serial.is_some_and(|s| s != live.serial) {
            return Err(Error::InvalidPointer { ptr });
        }
        let live = book.live.remove(&ptr.0).expect("looked up above");
        if live.uses.is_empty() {
            drop(book);
            // SAFETY: `ptr` came from `malloc` with this size (the table records exactly what the
            // device handed out), is freed once (just taken out of the table), and no queued work
            // uses it: its only stream is the caller's, whose work the caller ordered before the
            // free (the contract of every free, as with PyTorch's `cudaFree`).
            unsafe { self.device.free(ptr, live.size as usize) }?;
            return Ok(());
        }
        book.waiting.push(Waiting {
            addr: ptr.0,
            size: live.size,
            uses: live.uses,
            events: Vec::new(),
        });
        drop(book);
        self.process_uncached(false)
    }

    /// Records `stream` as a user of the uncached allocation at `ptr` (of handle serial `serial`).
    pub(super) fn record_stream_uncached(
        &self,
        ptr: DeviceAddress,
        serial: Option<u32>,
        stream: StreamId,
    ) -> Result<()> {
        let mut book = self.uncached.lock();
        let live = book
            .live
            .get_mut(&ptr.0)
            .filter(|live| serial.is_none_or(|s| s == live.serial))
            .ok_or(Error::InvalidPointer { ptr })?;
        if stream != live.stream {
            self.device.check_stream(stream)?;
            if !live.uses.contains(&stream) {
                live.uses.push(stream);
            }
        }
        Ok(())
    }

    /// The uncached allocation starting at `ptr`, as (address, size), if there is one.
    pub(super) fn uncached_allocation(&self, ptr: DeviceAddress) -> Option<(DeviceAddress, usize)> {
        let book = self.uncached.lock();
        book.live.get(&ptr.0).map(|live| (ptr, live.size as usize))
    }

    /// Returns to the device the freed uncached allocations whose streams are done: waiting for them
    /// (`wait`) or only those done already. Nothing is done while a capture is underway (events may
    /// be neither recorded nor queried then): allocations freed meanwhile wait for its end.
    pub(super) fn process_uncached(&self, wait: bool) -> Result<()> {
        let mut book = self.uncached.lock();
        if book.waiting.is_empty() || self.capturing() {
            return Ok(());
        }
        let book = &mut *book;
        let mut result = Ok(());
        let mut index = 0;
        while index < book.waiting.len() {
            let entry = &mut book.waiting[index];
            if !entry.uses.is_empty() {
                for stream in std::mem::take(&mut entry.uses) {
                    let event = match book.spare.pop() {
                        Some(event) => Ok(event),
                        None => self.device.create_event(),
                    };
                    match event.and_then(|e| self.device.record_event(&e, stream).map(|()| e)) {
                        Ok(event) => entry.events.push(event),
                        Err(error) => {
                            // Without the event the memory would never go back: wait for the
                            // device instead.
                            tracing::warn!(%error, "recording a stream-use event failed; synchronizing the device");
                            self.device.synchronize()?;
                        }
                    }
                }
            }
            let mut done = entry.uses.is_empty();
            for event in &entry.events {
                if !done {
                    break;
                }
                done = if wait {
                    self.device.synchronize_event(event).map(|()| true)?
                } else {
                    self.device.query_event(event)?
                };
            }
            if !done {
                index += 1;
                continue;
            }
            let entry = book.waiting.swap_remove(index);
            book.spare.extend(entry.events);
            // SAFETY: the memory came from `malloc` with this size, was taken out of the live table
            // when freed (so it is freed once), and every stream that used it has completed the work
            // recorded before the free.
            if let Err(e) = unsafe {
                self.device
                    .free(DeviceAddress(entry.addr), entry.size as usize)
            } {
                result = Err(e.into());
            }
        }
        result
    }

    /// Checks the table of uncached allocations: no two overlap, and none overlaps a segment of
    /// the pools.
    pub(super) fn check_uncached(&self) -> std::result::Result<(), String> {
        let mut ranges: Vec<(u64, u64)> = {
            let book = self.uncached.lock();
            book.live
                .iter()
                .map(|(&addr, live)| (addr, live.size))
                .chain(book.waiting.iter().map(|w| (w.addr, w.size)))
                .collect()
        };
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            if pair[0].0 + pair[0].1 > pair[1].0 {
                return Err(format!(
                    "uncached allocations at {:#x} ({} bytes) and {:#x} overlap",
                    pair[0].0, pair[0].1, pair[1].0
                ));
            }
        }
        for &(addr, _) in &ranges {
            if self.route(DeviceAddress(addr)).is_some() {
                return Err(format!(
                    "uncached allocation at {addr:#x} lies in a segment of the pools"
                ));
            }
        }
        Ok(())
    }
}
