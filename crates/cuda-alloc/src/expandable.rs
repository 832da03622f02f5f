//! Expandable segments: one reserved address range per stream and pool, backed by physical memory in
//! segment-size chunks as it is needed (PyTorch's `ExpandableSegment`).
//!
//! Instead of one device allocation per segment, the allocator reserves address space for about
//! 1 1/8 times the device's memory and maps physical chunks (2 MiB for the small pool, 20 MiB for the
//! large one) where blocks need them. Allocations then tile one growing segment instead of leaving
//! unusable slivers at the ends of many fixed-size ones, and `empty_cache` can unmap every chunk no
//! block uses, wherever it is in the range.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::{Device, DeviceAddress, DeviceError, DeviceResult};

/// A chunk mapped at a slot, with the file descriptor it was exported as (made on the first
/// export, closed when the chunk is unmapped, so that every share of the chunk names the same
/// descriptor while it lives).
struct Mapped<D: Device> {
    chunk: D::PhysicalChunk,
    exported: Option<OwnedFd>,
}

/// The chunks under an allocated block of an expandable segment, exported for another process
/// (see [`CachingAllocator::shareable_segment`](crate::CachingAllocator::shareable_segment)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkExport {
    /// Where the first chunk starts.
    pub base: DeviceAddress,
    /// The size of each chunk in bytes.
    pub chunk_size: u64,
    /// One file descriptor of this process per chunk, in address order. Each stays open while its
    /// chunk is mapped: at least as long as the allocation it was exported for is allocated.
    pub fds: Vec<RawFd>,
}

/// One reserved range and the physical chunks mapped into it.
pub(crate) struct ExpandableSegment<D: Device> {
    /// This segment's identity, unique in the process for its lifetime: a range released and
    /// reserved again at the same address (drivers do hand it out again) is another segment.
    id: u64,
    /// Start of the reserved range.
    base: u64,
    /// Size of each chunk (2 MiB small pool, 20 MiB large pool).
    segment_size: u64,
    /// Number of chunk slots in the range.
    max_handles: u64,
    /// The chunk mapped at each slot; trailing empty slots are trimmed.
    handles: Vec<Option<Mapped<D>>>,
    /// Slots whose chunk was released by [`sleep`](Self::sleep) and that [`wake`](Self::wake)
    /// maps again, ascending. The allocator's books still count them as mapped.
    asleep: Vec<u64>,
}

impl<D: Device> std::fmt::Debug for ExpandableSegment<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpandableSegment")
            .field("id", &self.id)
            .field("base", &format_args!("{:#x}", self.base))
            .field("segment_size", &self.segment_size)
            .field("max_handles", &self.max_handles)
            .field("mapped", &self.handles.iter().flatten().count())
            .field("asleep", &self.asleep.len())
            .finish()
    }
}

impl<D: Device> ExpandableSegment<D> {
    /// Reserves the address range for a new segment: enough chunks of `segment_size` to cover
    /// `device_total + device_total / 8` bytes.
    pub(crate) fn reserve(device: &D, segment_size: u64, device_total: u64) -> DeviceResult<Self> {
        let wanted = device_total + device_total / 8;
        let max_handles = wanted.div_ceil(segment_size).max(1);
        let base = device.reserve_address_range((segment_size * max_handles) as usize)?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Ok(ExpandableSegment {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            base: base.0,
            segment_size,
            max_handles,
            handles: Vec::new(),
            asleep: Vec::new(),
        })
    }

    /// This segment's identity (see the field): what a sleeping pool finds its segments by.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Start of the reserved range.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Size of the reserved range.
    pub(crate) fn size(&self) -> u64 {
        self.max_handles * self.segment_size
    }

    /// Bytes mapped, counting the slots asleep (which the allocator's books count as mapped).
    pub(crate) fn mapped_bytes(&self) -> u64 {
        (self.handles.iter().flatten().count() + self.asleep.len()) as u64 * self.segment_size
    }

    fn slot_of(&self, addr: u64) -> u64 {
        (addr - self.base) / self.segment_size
    }

    fn slot_after(&self, addr: u64) -> u64 {
        (addr - self.base).div_ceil(self.segment_size)
    }

    /// Maps physical memory over `[addr, addr + size)`, rounded out to whole chunks; `addr` is
    /// chunk aligned. Returns the range mapped, of size 0 when the device ran out of memory (nothing
    /// is mapped then).
    pub(crate) fn map(&mut self, device: &D, addr: u64, size: u64) -> DeviceResult<(u64, u64)> {
        let begin = self.slot_of(addr);
        let end = self.slot_after(addr + size);
        debug_assert_eq!(self.base + begin * self.segment_size, addr, "unaligned map");
        if begin == end {
            return Ok((addr, 0));
        }
        while (self.handles.len() as u64) < end {
            self.handles.push(None);
        }
        let chunk_size = self.segment_size as usize;
        for i in begin..end {
            debug_assert!(self.handles[i as usize].is_none(), "slot {i} mapped twice");
            debug_assert!(self.asleep.binary_search(&i).is_err(), "slot {i} is asleep");
            let at = DeviceAddress(self.base + i * self.segment_size);
            let failure = match device.create_physical(chunk_size) {
                Ok(chunk) => {
                    // SAFETY: slot `i` lies in the range this segment reserved and has nothing
                    // mapped (the handle table says so); the chunk was created with this size.
                    match unsafe { device.map(at, chunk_size, &chunk) } {
                        Ok(()) => {
                            self.handles[i as usize] = Some(Mapped {
                                chunk,
                                exported: None,
                            });
                            continue;
                        }
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            // Undo this call's mappings; report running out of memory as an empty range.
            self.unmap_slots(device, begin, i)?;
            self.trim();
            return match failure {
                DeviceError::OutOfMemory { .. } => Ok((addr, 0)),
                other => Err(other),
            };
        }
        Ok((addr, (end - begin) * self.segment_size))
    }

    /// The whole chunks inside `[addr, addr + size)`: the range [`unmap`](Self::unmap) would release.
    pub(crate) fn unmappable(&self, addr: u64, size: u64) -> (u64, u64) {
        let begin = self.slot_after(addr);
        let end = self.slot_of(addr + size);
        if begin >= end {
            (addr, 0)
        } else {
            (
                self.base + begin * self.segment_size,
                (end - begin) * self.segment_size,
            )
        }
    }

    /// Unmaps the whole chunks inside `[addr, addr + size)`; returns the range unmapped (size 0 if
    /// none) and how many of its bytes were asleep (released by [`sleep`](Self::sleep) already).
    /// The caller has made sure no queued device work uses the range.
    pub(crate) fn unmap(
        &mut self,
        device: &D,
        addr: u64,
        size: u64,
    ) -> DeviceResult<((u64, u64), u64)> {
        let (start, len) = self.unmappable(addr, size);
        if len == 0 {
            return Ok(((addr, 0), 0));
        }
        let begin = self.slot_of(start);
        let asleep = self.unmap_slots(device, begin, begin + len / self.segment_size)?;
        self.trim();
        Ok(((start, len), asleep))
    }

    /// Unmaps slots `begin..end`; returns the bytes of those that were asleep.
    fn unmap_slots(&mut self, device: &D, begin: u64, end: u64) -> DeviceResult<u64> {
        // Slots asleep have no chunk left to release: they just stop being owed one.
        let lo = self.asleep.partition_point(|&s| s < begin);
        let hi = self.asleep.partition_point(|&s| s < end);
        let asleep = (hi - lo) as u64 * self.segment_size;
        self.asleep.drain(lo..hi);
        for i in begin..end {
            if let Some(Mapped { chunk, .. }) = self.handles[i as usize].take() {
                let at = DeviceAddress(self.base + i * self.segment_size);
                // SAFETY: `chunk` was mapped at slot `i` by `map` with the segment size, and the
                // caller guarantees no queued work uses it.
                unsafe { device.unmap(at, self.segment_size as usize, chunk)? };
            }
        }
        Ok(asleep)
    }

    fn trim(&mut self) {
        while matches!(self.handles.last(), Some(None)) {
            self.handles.pop();
        }
    }

    /// Unmaps every chunk and releases the range, going on past failures (the allocator is being
    /// dropped); returns the errors met. The caller has made sure no queued work uses the range.
    pub(crate) fn tear_down(mut self, device: &D) -> Vec<DeviceError> {
        let mut errors = Vec::new();
        for i in 0..self.handles.len() {
            if let Some(Mapped { chunk, .. }) = self.handles[i].take() {
                let at = DeviceAddress(self.base + i as u64 * self.segment_size);
                // SAFETY: `chunk` was mapped at slot `i` by `map` with the segment size, and the
                // caller guarantees no queued work uses it.
                if let Err(e) = unsafe { device.unmap(at, self.segment_size as usize, chunk) } {
                    errors.push(e);
                }
            }
        }
        if errors.is_empty() {
            if let Err(e) = self.release(device) {
                errors.push(e);
            }
        }
        errors
    }

    /// The chunks under `[addr, addr + size)` (rounded out to whole chunks), each exported as a
    /// file descriptor once and kept (PyTorch's `ExpandableSegment::share`): the same range always
    /// gives the same descriptors while its chunks stay mapped.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Driver`] with code `-1` if part of the range is not mapped (the allocator
    /// asked for a range no allocated block covers); the device's export error otherwise (nothing
    /// is kept from a failed call but the descriptors exported before it, which later calls reuse).
    pub(crate) fn export(&mut self, device: &D, addr: u64, size: u64) -> DeviceResult<ChunkExport> {
        let begin = self.slot_of(addr);
        let end = self.slot_after(addr + size);
        let mut fds = Vec::with_capacity((end - begin) as usize);
        for i in begin..end {
            let Some(mapped) = self.handles.get_mut(i as usize).and_then(Option::as_mut) else {
                return Err(DeviceError::Driver {
                    call: "cuMemExportToShareableHandle",
                    code: -1,
                    message: format!(
                        "chunk {i} of the expandable segment at {:#x} is not mapped",
                        self.base
                    ),
                });
            };
            let fd = match &mapped.exported {
                Some(fd) => fd.as_raw_fd(),
                None => mapped
                    .exported
                    .insert(device.export_physical(&mapped.chunk)?)
                    .as_raw_fd(),
            };
            fds.push(fd);
        }
        Ok(ChunkExport {
            base: DeviceAddress(self.base + begin * self.segment_size),
            chunk_size: self.segment_size,
            fds,
        })
    }

    /// Whether any mapped chunk was exported to another process (see [`export`](Self::export)):
    /// such a chunk may be in use there and is never released while mapped here.
    pub(crate) fn first_exported(&self) -> Option<DeviceAddress> {
        self.handles
            .iter()
            .position(|h| h.as_ref().is_some_and(|m| m.exported.is_some()))
            .map(|i| DeviceAddress(self.base + i as u64 * self.segment_size))
    }

    /// The mapped parts of the range as `(start, length)` runs of consecutive chunks, ascending.
    pub(crate) fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (i, h) in self.handles.iter().enumerate() {
            if h.is_none() {
                continue;
            }
            let at = self.base + i as u64 * self.segment_size;
            match runs.last_mut() {
                Some((start, len)) if *start + *len == at => *len += self.segment_size,
                _ => runs.push((at, self.segment_size)),
            }
        }
        runs
    }

    /// Bytes of the slots asleep (released by [`sleep`](Self::sleep), owed by
    /// [`wake`](Self::wake)).
    pub(crate) fn asleep_bytes(&self) -> u64 {
        self.asleep.len() as u64 * self.segment_size
    }

    /// Unmaps and releases every mapped chunk, keeping the address range reserved and each slot
    /// owed a fresh chunk by [`wake`](Self::wake); returns the bytes released. Stops at the first
    /// failure (the chunks released before it stay asleep, the rest stay mapped). The caller has
    /// made sure no queued device work uses the range and that no chunk was exported.
    pub(crate) fn sleep(&mut self, device: &D) -> DeviceResult<u64> {
        let mut released = 0;
        for i in 0..self.handles.len() {
            let Some(mapped) = self.handles[i].take() else {
                continue;
            };
            debug_assert!(mapped.exported.is_none(), "an exported chunk put to sleep");
            let at = DeviceAddress(self.base + i as u64 * self.segment_size);
            // SAFETY: the chunk was mapped at slot `i` by `map` or `wake` with the segment size,
            // and the caller guarantees no queued work uses it.
            unsafe { device.unmap(at, self.segment_size as usize, mapped.chunk)? };
            let slot = i as u64;
            let pos = self.asleep.partition_point(|&s| s < slot);
            self.asleep.insert(pos, slot);
            released += self.segment_size;
        }
        Ok(released)
    }

    /// Maps a fresh chunk (with access set) at every slot asleep; returns the bytes mapped. On a
    /// failure, the chunks this call mapped are released again (every slot stays asleep) and the
    /// error is returned: [`DeviceError::OutOfMemory`] when the device has no room for them.
    pub(crate) fn wake(&mut self, device: &D) -> DeviceResult<u64> {
        let chunk_size = self.segment_size as usize;
        let slots = std::mem::take(&mut self.asleep);
        for (n, &i) in slots.iter().enumerate() {
            while self.handles.len() as u64 <= i {
                self.handles.push(None);
            }
            let at = DeviceAddress(self.base + i * self.segment_size);
            let result = device.create_physical(chunk_size).and_then(|chunk| {
                // SAFETY: slot `i` lies in the range this segment reserved and has nothing mapped
                // (its chunk was released by `sleep`); the chunk was created with this size.
                unsafe { device.map(at, chunk_size, &chunk) }.map(|()| chunk)
            });
            match result {
                Ok(chunk) => {
                    self.handles[i as usize] = Some(Mapped {
                        chunk,
                        exported: None,
                    });
                }
                Err(e) => {
                    for &j in &slots[..n] {
                        if let Some(Mapped { chunk, .. }) = self.handles[j as usize].take() {
                            let at = DeviceAddress(self.base + j * self.segment_size);
                            // SAFETY: mapped just above by this call at slot `j`; nothing used
                            // it yet.
                            if let Err(undo) = unsafe { device.unmap(at, chunk_size, chunk) } {
                                tracing::warn!(%undo, "undoing a partial wake failed");
                            }
                        }
                    }
                    self.asleep = slots;
                    return Err(match e {
                        DeviceError::OutOfMemory { .. } => DeviceError::OutOfMemory {
                            bytes: self.asleep_bytes(),
                        },
                        other => other,
                    });
                }
            }
        }
        Ok(slots.len() as u64 * self.segment_size)
    }

    /// Releases the reserved range. Every chunk must have been unmapped.
    pub(crate) fn release(self, device: &D) -> DeviceResult<()> {
        debug_assert!(self.handles.iter().all(Option::is_none));
        // SAFETY: the range came from `reserve_address_range` with this size, and nothing is mapped
        // in it (every slot is empty).
        unsafe { device.release_address_range(DeviceAddress(self.base), self.size() as usize) }
    }
}
