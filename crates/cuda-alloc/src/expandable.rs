//! Expandable segments: one reserved address range per stream and pool, backed by physical memory in
//! segment-size chunks as it is needed (PyTorch's `ExpandableSegment`).
//!
//! Instead of one device allocation per segment, the allocator reserves address space for about
//! 1 1/8 times the device's memory and maps physical chunks (2 MiB for the small pool, 20 MiB for the
//! large one) where blocks need them. Allocations then tile one growing segment instead of leaving
//! unusable slivers at the ends of many fixed-size ones, and `empty_cache` can unmap every chunk no
//! block uses, wherever it is in the range.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

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
    /// Start of the reserved range.
    base: u64,
    /// Size of each chunk (2 MiB small pool, 20 MiB large pool).
    segment_size: u64,
    /// Number of chunk slots in the range.
    max_handles: u64,
    /// The chunk mapped at each slot; trailing empty slots are trimmed.
    handles: Vec<Option<Mapped<D>>>,
}

impl<D: Device> std::fmt::Debug for ExpandableSegment<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpandableSegment")
            .field("base", &format_args!("{:#x}", self.base))
            .field("segment_size", &self.segment_size)
            .field("max_handles", &self.max_handles)
            .field("mapped", &self.handles.iter().flatten().count())
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
        Ok(ExpandableSegment {
            base: base.0,
            segment_size,
            max_handles,
            handles: Vec::new(),
        })
    }

    /// Start of the reserved range.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Size of the reserved range.
    pub(crate) fn size(&self) -> u64 {
        self.max_handles * self.segment_size
    }

    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.handles.iter().flatten().count() as u64 * self.segment_size
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
    /// none). The caller has made sure no queued device work uses the range.
    pub(crate) fn unmap(&mut self, device: &D, addr: u64, size: u64) -> DeviceResult<(u64, u64)> {
        let (start, len) = self.unmappable(addr, size);
        if len == 0 {
            return Ok((addr, 0));
        }
        let begin = self.slot_of(start);
        self.unmap_slots(device, begin, begin + len / self.segment_size)?;
        self.trim();
        Ok((start, len))
    }

    fn unmap_slots(&mut self, device: &D, begin: u64, end: u64) -> DeviceResult<()> {
        for i in begin..end {
            if let Some(Mapped { chunk, .. }) = self.handles[i as usize].take() {
                let at = DeviceAddress(self.base + i * self.segment_size);
                // SAFETY: `chunk` was mapped at slot `i` by `map` with the segment size, and the
                // caller guarantees no queued work uses it.
                unsafe { device.unmap(at, self.segment_size as usize, chunk)? };
            }
        }
        Ok(())
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

    /// Releases the reserved range. Every chunk must have been unmapped.
    pub(crate) fn release(self, device: &D) -> DeviceResult<()> {
        debug_assert!(self.handles.iter().all(Option::is_none));
        // SAFETY: the range came from `reserve_address_range` with this size, and nothing is mapped
        // in it (every slot is empty).
        unsafe { device.release_address_range(DeviceAddress(self.base), self.size() as usize) }
    }
}
