//! Expandable segments in the pools (PyTorch's `find_expandable_block`,
//! `try_allocate_expandable_block`, `map_block`, `unmap_block`, `release_expandable_segment`).
//!
//! A segment's reserved range is tiled by blocks like any segment; the blocks not backed by physical
//! memory are *unmapped* and sit in the pool's unmapped set. Growing maps chunks at the lowest address
//! where free and unmapped blocks together have room, so that the segment stays one piece.

use std::sync::atomic::Ordering::Relaxed;

use super::{Locked, Route};
use crate::block::{Block, NIL};
use crate::device::Device;
use crate::error::Result;
use crate::expandable::ExpandableSegment;
use crate::size::{LARGE_BUFFER, SMALL_BUFFER};
use crate::snapshot::TraceAction;
use crate::stats::peaks::Kind;

impl<D: Device> Locked<'_, D> {
    /// A free block that can be used now (not allocated, no uses pending).
    fn allocatable(&self, index: u32) -> bool {
        index != NIL && {
            let b = &self.st.blocks[index];
            !b.is_active()
        }
    }

    /// Whether the free and unmapped blocks from `index` on span at least `size` bytes.
    fn has_room(&self, mut index: u32, size: u64) -> bool {
        let mut bytes = 0;
        while bytes < size && self.allocatable(index) {
            bytes += self.st.blocks[index].size;
            index = self.st.blocks[index].next;
        }
        bytes >= size
    }

    /// The lowest-addressed block of an expandable segment of this pool where `size` bytes of free
    /// and unmapped space begin; a new segment's single unmapped block if there is none.
    fn find_expandable_block(&mut self, pool: u16, size: u64) -> Result<u32> {
        let unmapped: Vec<u32> = self.st.pools[pool as usize]
            .unmapped
            .values()
            .copied()
            .collect();
        for mut candidate in unmapped {
            // The unmapped block may follow a free mapped block that can grow into it.
            let prev = self.st.blocks[candidate].prev;
            if self.allocatable(prev) {
                candidate = prev;
            }
            if self.has_room(candidate, size) {
                return Ok(candidate);
            }
        }
        let small = self.st.pools[pool as usize].small;
        let segment_size = if small { SMALL_BUFFER } else { LARGE_BUFFER } as u64;
        let total = self.a.device.mem_info()?.total;
        let segment = ExpandableSegment::reserve(&self.a.device, segment_size, total)?;
        let (base, reserved) = (segment.base(), segment.size());
        let slot = match self.st.segments.iter().position(Option::is_none) {
            Some(slot) => {
                self.st.segments[slot] = Some(segment);
                slot
            }
            None => {
                self.st.segments.push(Some(segment));
                self.st.segments.len() - 1
            }
        };
        let mut block = Block::new(base, reserved, pool);
        block.mapped = false;
        block.expandable = slot as u32;
        let index = self.st.blocks.insert(block);
        self.st.pools[pool as usize].unmapped.insert(base, index);
        self.a.routes.write().insert(
            base,
            Route {
                end: base + reserved,
                shard: self.shard.index,
            },
        );
        Ok(index)
    }

    /// Maps enough of an expandable segment for `size` bytes and returns the free block holding them,
    /// taken out of the free set; `None` when the device has no memory for it.
    pub(crate) fn try_allocate_expandable_block(
        &mut self,
        pool: u16,
        size: u64,
    ) -> Result<Option<u32>> {
        let mut candidate = self.find_expandable_block(pool, size)?;
        // The candidate is one of: unmapped -> end; unmapped -> free -> ...; free -> unmapped -> ...
        if !self.st.blocks[candidate].mapped {
            let len = self.st.blocks[candidate].size.min(size);
            if !self.map_block(candidate, len)? {
                return Ok(None);
            }
        }
        debug_assert!(self.st.blocks[candidate].mapped);
        while self.st.blocks[candidate].size < size {
            // free -> unmapped -> ...: map part of the unmapped block; it merges with the free one.
            let remaining = size - self.st.blocks[candidate].size;
            let next = self.st.blocks[candidate].next;
            let len = remaining.min(self.st.blocks[next].size);
            if !self.map_block(next, len)? {
                return Ok(None);
            }
            candidate = next;
        }
        let b = &self.st.blocks[candidate];
        let (b_size, b_addr) = (b.size, b.addr);
        self.st.pools[pool as usize].free.remove(b_size, b_addr);
        Ok(Some(candidate))
    }

    /// Maps the first `size` bytes (rounded up to chunks) of unmapped block `index`, splitting off
    /// the rest, and merges the result with free neighbours. `false` when the device is out of
    /// memory.
    fn map_block(&mut self, index: u32, size: u64) -> Result<bool> {
        let (addr, pool, slot, total) = {
            let b = &self.st.blocks[index];
            debug_assert!(!b.mapped && size <= b.size);
            (b.addr, b.pool, b.expandable, b.size)
        };
        let segment = self.st.segments[slot as usize]
            .as_mut()
            .expect("an expandable block's segment is live");
        let (mapped_at, mapped) = segment.map(&self.a.device, addr, size)?;
        if mapped == 0 {
            return Ok(false);
        }
        debug_assert!(mapped_at == addr && mapped >= size);
        let st = &mut *self.st;
        st.pools[pool as usize].unmapped.remove(&addr);
        st.blocks[index].mapped = true;
        if mapped < total {
            let rest_index = st.blocks.split_back(index, total - mapped);
            st.blocks[rest_index].mapped = false;
            st.pools[pool as usize]
                .unmapped
                .insert(addr + mapped, rest_index);
        }
        let (prev, next) = (st.blocks[index].prev, st.blocks[index].next);
        self.try_merge(index, prev);
        self.try_merge(index, next);
        let st = &mut *self.st;
        let gc_now = st.pools[pool as usize].gc_now();
        let b = &mut st.blocks[index];
        b.gc_count_base = gc_now;
        let (b_size, b_addr) = (b.size, b.addr);
        st.pools[pool as usize].free.insert(b_size, b_addr, index);
        self.a.counters.reserved.fetch_add(mapped, Relaxed);
        let small = self.st.pools[pool as usize].small;
        self.inc(Kind::ReservedBytes, small, mapped);
        self.a.counters.num_device_alloc.fetch_add(1, Relaxed);
        self.record(TraceAction::SegmentMap, mapped_at, mapped, pool);
        Ok(true)
    }

    /// Unmaps the whole chunks of free block `index` (in an expandable segment), leaving the mapped
    /// slivers before and after as free blocks (PyTorch's `unmap_block`).
    pub(crate) fn unmap_block(&mut self, index: u32) -> Result<()> {
        let (addr, size, pool, slot) = {
            let b = &self.st.blocks[index];
            (b.addr, b.size, b.pool, b.expandable)
        };
        let segment = self.st.segments[slot as usize]
            .as_ref()
            .expect("an expandable block's segment is live");
        if segment.unmappable(addr, size).1 == 0 {
            return Ok(());
        }
        // Unmapping does not wait for queued work the way freeing does: wait for the stream first.
        self.synchronize_stream()?;
        let segment = self.st.segments[slot as usize]
            .as_mut()
            .expect("an expandable block's segment is live");
        let ((at, len), asleep) = segment.unmap(&self.a.device, addr, size)?;
        let st = &mut *self.st;
        st.pools[pool as usize].free.remove(size, addr);
        let gc_now = st.pools[pool as usize].gc_now();
        let before = at - addr;
        if before > 0 {
            let i = st.blocks.split_front(index, before);
            st.blocks[i].gc_count_base = gc_now;
            st.pools[pool as usize].free.insert(before, addr, i);
        }
        let after = size - before - len;
        if after > 0 {
            let i = st.blocks.split_back(index, after);
            st.blocks[i].gc_count_base = gc_now;
            st.pools[pool as usize].free.insert(after, at + len, i);
        }
        let b = &mut st.blocks[index];
        debug_assert_eq!((b.addr, b.size), (at, len), "the slivers split off");
        b.mapped = false;
        let (prev, next) = (b.prev, b.next);
        self.try_merge(index, prev);
        self.try_merge(index, next);
        let new_addr = self.st.blocks[index].addr;
        self.st.pools[pool as usize]
            .unmapped
            .insert(new_addr, index);
        self.a.counters.reserved.fetch_sub(len, Relaxed);
        let small = self.st.pools[pool as usize].small;
        // Chunks of a sleeping pool left the reserved statistic when they were released.
        self.dec(Kind::ReservedBytes, small, len - asleep);
        if let Some(id) = self.st.pools[pool as usize].private_id() {
            self.a.adjust_private_segments(id, -1);
        }
        self.a.counters.num_device_free.fetch_add(1, Relaxed);
        self.record(TraceAction::SegmentUnmap, at, len, pool);
        Ok(())
    }

    /// Releases the reserved range of an expandable segment that is entirely unmapped (its single
    /// block `index`).
    pub(crate) fn release_expandable_segment(&mut self, index: u32) -> Result<()> {
        let (addr, pool, slot) = {
            let b = &self.st.blocks[index];
            debug_assert!(!b.mapped && !b.is_split());
            (b.addr, b.pool, b.expandable)
        };
        let segment = self.st.segments[slot as usize]
            .take()
            .expect("an expandable block's segment is live");
        debug_assert_eq!(segment.size(), self.st.blocks[index].size);
        if let Err(e) = segment.release(&self.a.device) {
            tracing::warn!(error = %e, addr, "releasing an expandable segment's address range failed");
            return Err(e.into());
        }
        self.st.pools[pool as usize].unmapped.remove(&addr);
        self.st.blocks.remove(index);
        self.a.routes.write().remove(&addr);
        Ok(())
    }

    /// Waits for the work queued on this shard's stream.
    fn synchronize_stream(&mut self) -> Result<()> {
        let device = &self.a.device;
        let spare = self.a.events.lock().spare.pop();
        let event = match spare {
            Some(event) => event,
            None => device.create_event()?,
        };
        device.record_event(&event, self.shard.stream)?;
        device.synchronize_event(&event)?;
        self.a.events.lock().spare.push(event);
        Ok(())
    }
}
