//! Freeing (PyTorch's `free`, `free_block`, `try_merge_blocks`) and cross-stream uses
//! (`recordStream`, `insert_events`, `process_events`, `synchronize_and_free_events`).

use std::sync::atomic::Ordering::Relaxed;

use super::fast::Freed;
use super::{policy, Allocation, CachingAllocator, Locked};
use crate::block::NIL;
use crate::device::{Device, DeviceAddress, StreamId};
use crate::error::{Error, Result};
use crate::events::{BlockRef, PendingEvent};
use crate::pool_id::MempoolId;
use crate::snapshot::TraceAction;
use crate::stack::{RecordContext, Stack};
use crate::stats::peaks::{Kind, OVERSIZE_ALLOCATIONS};

impl<D: Device> CachingAllocator<D> {
    /// Frees an allocation (PyTorch's `free`). If the block was used on other streams
    /// ([`record_stream`](Self::record_stream)), it returns to its pool only once their work recorded
    /// so far has completed; otherwise at once.
    ///
    /// # Errors
    /// [`Error::ForeignAllocation`] if another allocator handed it out (nothing is freed);
    /// [`Error::InvalidPointer`] if the allocation was already freed by pointer
    /// ([`raw_free`](Self::raw_free)); [`Error::Device`] if recording an event fails and the device
    /// cannot be synchronized instead.
    pub fn free(&self, allocation: Allocation) -> Result<()> {
        if !cfg!(tensormem_ab_no_quiet_twins) && self.quiet() {
            self.free_in::<true>(allocation)
        } else {
            self.free_in::<false>(allocation)
        }
    }

    /// [`free`](Self::free), compiled once for calls that start [`quiet`](Self::quiet) and once for
    /// the others (see [`allocate`](Self::allocate)).
    #[inline(never)]
    fn free_in<const QUIET: bool>(&self, allocation: Allocation) -> Result<()> {
        // Consumed whatever the outcome (the debug-build leak check must not fire).
        let allocation = std::mem::ManuallyDrop::new(allocation);
        if allocation.shard == Allocation::EMPTY {
            return Ok(());
        }
        self.check_owner(&allocation)?;
        if allocation.shard == Allocation::UNCACHED {
            std::hint::cold_path();
            return self.free_uncached(allocation.ptr, Some(allocation.block));
        }
        let shard =
            self.streams
                .by_index(allocation.shard)
                .ok_or_else(|| Error::InvalidPointer {
                    ptr: allocation.ptr,
                })?;
        let stack = if QUIET {
            None
        } else {
            self.trace.gather(RecordContext::All)
        };
        let mut locked = self.lock(shard);
        let index = allocation.block;
        let st = &mut *locked.st;
        let valid = st.blocks.is_live(index) && {
            let b = &st.blocks[index];
            b.allocated && b.addr == allocation.ptr.0 && b.generation == allocation.generation
        };
        if !valid {
            return Err(Error::InvalidPointer {
                ptr: allocation.ptr,
            });
        }
        if locked.a.pointer_index_on() {
            st.allocated.forget(allocation.ptr.0);
        }
        if locked.express_open::<QUIET>() && locked.park_express(index) {
            return Ok(());
        }
        locked.free_allocated::<QUIET>(index, stack)
    }

    /// Frees memory by pointer (PyTorch's `raw_delete`). The null pointer is ignored.
    ///
    /// # Errors
    /// [`Error::InvalidPointer`] for a pointer this allocator did not hand out or already took back;
    /// otherwise as [`free`](Self::free).
    pub fn raw_free(&self, ptr: DeviceAddress) -> Result<()> {
        if ptr.0 == 0 {
            return Ok(());
        }
        self.enable_pointer_index();
        if !cfg!(tensormem_ab_no_quiet_twins) && self.quiet() {
            self.raw_free_in::<true>(ptr)
        } else {
            self.raw_free_in::<false>(ptr)
        }
    }

    /// [`raw_free`](Self::raw_free), compiled once for calls that start [`quiet`](Self::quiet) and
    /// once for the others (see [`free`](Self::free)): a quiet one takes a hot pair's express lane as
    /// [`free`](Self::free) does (it was the generic path, 590 instructions a pointer-API hot pair).
    #[inline(never)]
    fn raw_free_in<const QUIET: bool>(&self, ptr: DeviceAddress) -> Result<()> {
        let stack = if QUIET {
            None
        } else {
            self.trace.gather(RecordContext::All)
        };
        // Most pointers are freed by the thread that allocated them: its last shard first.
        if let Some(shard) = self.remembered_shard() {
            let mut locked = self.lock(shard);
            if let Some(index) = locked.take_indexed(ptr) {
                if locked.express_open::<QUIET>() && locked.park_express(index) {
                    return Ok(());
                }
                return locked.free_allocated::<QUIET>(index, stack);
            }
        }
        let Some(shard) = self.route(ptr) else {
            // Not in a segment of the pools: an allocation made while caching was off, or none.
            return self.free_uncached(ptr, None);
        };
        self.remember_shard(shard.index);
        let mut locked = self.lock(shard);
        let index = locked
            .take_indexed(ptr)
            .ok_or(Error::InvalidPointer { ptr })?;
        if locked.express_open::<QUIET>() && locked.park_express(index) {
            return Ok(());
        }
        locked.free_allocated::<QUIET>(index, stack)
    }

    /// Marks an allocation as used by `stream` (PyTorch's `recordStream`): when it is freed, the
    /// memory is not reused until the work enqueued on `stream` by then has completed. Uses on the
    /// allocation's own stream need no record and are ignored.
    ///
    /// # Errors
    /// [`Error::ForeignAllocation`] if another allocator handed it out; [`Error::InvalidPointer`] if
    /// the allocation is no longer live; [`Error::Device`] with
    /// [`DeviceError::UnknownStream`](crate::DeviceError::UnknownStream) if the device does not know
    /// `stream`.
    pub fn record_stream(&self, allocation: &Allocation, stream: StreamId) -> Result<()> {
        if allocation.shard == Allocation::EMPTY {
            return Ok(());
        }
        self.check_owner(allocation)?;
        if allocation.shard == Allocation::UNCACHED {
            return self.record_stream_uncached(allocation.ptr, Some(allocation.block), stream);
        }
        if stream != allocation.stream {
            self.device.check_stream(stream)?;
        }
        let invalid = Error::InvalidPointer {
            ptr: allocation.ptr,
        };
        let shard = self.streams.by_index(allocation.shard).ok_or(invalid)?;
        let mut locked = self.lock(shard);
        let index = allocation.block;
        let st = &locked.st;
        if !(st.blocks.is_live(index)
            && st.blocks[index].allocated
            && st.blocks[index].generation == allocation.generation)
        {
            return Err(Error::InvalidPointer {
                ptr: allocation.ptr,
            });
        }
        locked.record_stream_use(index, stream);
        Ok(())
    }

    /// [`record_stream`](Self::record_stream) by pointer. The null pointer is ignored.
    ///
    /// # Errors
    /// [`Error::InvalidPointer`] for a pointer that is not a live allocation of this allocator.
    pub fn record_stream_ptr(&self, ptr: DeviceAddress, stream: StreamId) -> Result<()> {
        if ptr.0 == 0 {
            return Ok(());
        }
        self.enable_pointer_index();
        let Some(shard) = self.route(ptr) else {
            return self.record_stream_uncached(ptr, None, stream);
        };
        if stream != shard.stream {
            self.device.check_stream(stream)?;
        }
        let mut locked = self.lock(shard);
        let index = *locked
            .st
            .allocated
            .get(&ptr.0)
            .ok_or(Error::InvalidPointer { ptr })?;
        locked.record_stream_use(index, stream);
        Ok(())
    }

    /// Returns blocks whose events have all completed to their pools (PyTorch's `process_events`),
    /// after recording the events deferred while captures were underway.
    #[cold]
    pub(crate) fn process_events(&self) -> Result<()> {
        let deferred = {
            let mut events = self.events.lock();
            let deferred = std::mem::take(&mut events.deferred);
            self.pending.store(events.outstanding(), Relaxed);
            deferred
        };
        for block in deferred {
            if let Some(shard) = self.streams.by_index(block.shard) {
                self.lock(shard).insert_deferred_events(block.block)?;
            }
        }
        let mut done = Vec::new();
        {
            let mut guard = self.events.lock();
            let events = &mut *guard;
            for queue in events.queues.values_mut() {
                while let Some(front) = queue.front() {
                    if !self.device.query_event(&front.event)? {
                        break;
                    }
                    let PendingEvent { event, block } = queue.pop_front().expect("front exists");
                    events.spare.push(event);
                    done.push(block);
                }
            }
            events.queues.retain(|_, queue| !queue.is_empty());
            self.pending.store(events.outstanding(), Relaxed);
        }
        for block in done {
            if let Some(shard) = self.streams.by_index(block.shard) {
                self.lock(shard).event_completed(block.block);
            }
        }
        Ok(())
    }

    /// Waits for every outstanding event (only those of pool `only`, if given) and frees their
    /// blocks (PyTorch's `synchronize_and_free_events`). `locks` holds every shard.
    pub(crate) fn synchronize_and_free_events(
        &self,
        locks: &mut [Locked<'_, D>],
        only: Option<MempoolId>,
    ) -> Result<()> {
        self.counters.num_sync_all_streams.fetch_add(1, Relaxed);
        let deferred = if self.capturing() {
            // Events may not be recorded during a capture: deferred blocks wait for its end.
            Vec::new()
        } else {
            let mut events = self.events.lock();
            // Blocks of shards made after the locks were taken stay deferred for the next pass.
            let (ours, later): (Vec<BlockRef>, Vec<BlockRef>) =
                std::mem::take(&mut events.deferred)
                    .into_iter()
                    .partition(|b| locks.iter().any(|l| l.shard.index == b.shard));
            events.deferred = later;
            self.pending.store(events.outstanding(), Relaxed);
            ours
        };
        for block in deferred {
            if let Some(locked) = locks.iter_mut().find(|l| l.shard.index == block.shard) {
                locked.insert_deferred_events(block.block)?;
            }
        }
        let mut waited = Vec::new();
        {
            let mut events = self.events.lock();
            for queue in events.queues.values_mut() {
                let mut keep = std::collections::VecDeque::new();
                for pending in queue.drain(..) {
                    // Only blocks of the locked shards: a stream first used after the locks were
                    // taken keeps its events for the next pass.
                    let wanted = locks
                        .iter()
                        .find(|l| l.shard.index == pending.block.shard)
                        .is_some_and(|l| {
                            only.is_none_or(|id| {
                                let b = &l.st.blocks[pending.block.block];
                                l.st.pools[b.pool as usize].private_id() == Some(id)
                            })
                        });
                    if wanted {
                        waited.push(pending);
                    } else {
                        keep.push_back(pending);
                    }
                }
                *queue = keep;
            }
            events.queues.retain(|_, queue| !queue.is_empty());
            self.pending.store(events.outstanding(), Relaxed);
        }
        for PendingEvent { event, block } in waited {
            self.device.synchronize_event(&event)?;
            self.events.lock().spare.push(event);
            if let Some(locked) = locks.iter_mut().find(|l| l.shard.index == block.shard) {
                locked.event_completed(block.block);
            }
        }
        Ok(())
    }
}

impl<D: Device> Locked<'_, D> {
    /// Removes `ptr` from the pointer index and returns its block, if it names an allocated block of
    /// this shard. The block is checked as well as the index (a live, allocated block starting at
    /// `ptr`): a wrong index entry must not free a block that is not allocated.
    #[inline(always)]
    fn take_indexed(&mut self, ptr: DeviceAddress) -> Option<u32> {
        let index = self.st.allocated.remove(&ptr.0)?;
        let st = &self.st;
        let sound = st.blocks.is_live(index) && {
            let b = &st.blocks[index];
            b.allocated && b.addr == ptr.0
        };
        debug_assert!(
            sound,
            "pointer index entry {ptr} names block {index}, not allocated there"
        );
        sound.then_some(index)
    }

    /// Frees an allocated block whose pointer mapping was already removed.
    #[inline(always)]
    /// `stack`: the freeing call's stack (context level `All`), recorded on its `free_requested` and
    /// `free_completed` entries instead of the allocation's.
    pub(crate) fn free_allocated<const QUIET: bool>(
        &mut self,
        index: u32,
        stack: Option<Stack>,
    ) -> Result<()> {
        let (pool, size, addr, requested, used_elsewhere) = {
            let b = &mut self.st.blocks[index];
            b.allocated = false;
            (b.pool, b.size, b.addr, b.requested, b.used_elsewhere)
        };
        if let Some(stack) = stack {
            std::hint::cold_path();
            self.st.free_stacks.insert(u64::from(index), stack);
        }
        if !QUIET {
            // The stack is only wanted for the entry (a quiet call records none).
            let entry_stack = self.entry_stack(index);
            self.note::<QUIET>(
                TraceAction::FreeRequested,
                addr,
                requested,
                pool,
                entry_stack.as_ref(),
            );
        }
        if policy::is_oversize(size as usize, self.a.settings.max_split_size()) {
            std::hint::cold_path();
            self.shard
                .figures
                .decrease(OVERSIZE_ALLOCATIONS, 1, &self.a.book);
        }
        if used_elsewhere {
            std::hint::cold_path();
            // The block stays active until its uses complete; it is no longer allocated. (Without
            // other uses, `free_block_with` decreases these figures with the block's others.)
            let small = self.st.pools[pool as usize].small;
            self.shard.figures.decrease_kinds(
                small,
                [(Kind::Allocation, 1), (Kind::AllocatedBytes, size)],
                &self.a.book,
            );
            if !QUIET && self.a.capturing() {
                // Events recorded during a capture may not be queried: record them after it.
                let mut events = self.a.events.lock();
                events.deferred.push(BlockRef {
                    shard: self.shard.index,
                    block: index,
                });
                self.a.pending.store(events.outstanding(), Relaxed);
            } else {
                self.insert_events(index)?;
            }
        } else {
            self.free_block_with::<QUIET>(index, true);
        }
        Ok(())
    }

    /// Records `stream` as a user of allocated block `index`.
    fn record_stream_use(&mut self, index: u32, stream: StreamId) {
        if stream == self.shard.stream {
            return;
        }
        let uses = self.st.uses.entry(u64::from(index)).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
        self.st.blocks[index].used_elsewhere = true;
        if self.a.capturing() {
            let during = self.st.capture_uses.entry(u64::from(index)).or_default();
            if !during.contains(&stream) {
                during.push(stream);
            }
        }
    }

    /// Records an event on every stream that used block `index` (PyTorch's `insert_events`).
    fn insert_events(&mut self, index: u32) -> Result<()> {
        let streams = self.st.uses.remove(&u64::from(index)).unwrap_or_default();
        self.st.blocks[index].used_elsewhere = false;
        // Uses recorded during a capture that ended before this free need events like any other.
        self.st.capture_uses.remove(&u64::from(index));
        let device = &self.a.device;
        let mut events = self.a.events.lock();
        let mut failure = None;
        for stream in streams {
            let event = match events.spare.pop() {
                Some(event) => Ok(event),
                None => device.create_event(),
            };
            match event.and_then(|e| device.record_event(&e, stream).map(|()| e)) {
                Ok(event) => {
                    self.st.blocks[index].event_count += 1;
                    events
                        .queues
                        .entry(stream)
                        .or_default()
                        .push_back(PendingEvent {
                            event,
                            block: BlockRef {
                                shard: self.shard.index,
                                block: index,
                            },
                        });
                }
                Err(e) => failure = Some(e),
            }
        }
        self.a.pending.store(events.outstanding(), Relaxed);
        drop(events);
        if let Some(error) = failure {
            // Without the event the block would never be freed: wait for the device instead.
            tracing::warn!(%error, "recording a stream-use event failed; synchronizing the device");
            device.synchronize()?;
            if self.st.blocks[index].event_count == 0 {
                self.free_block(index);
            }
        }
        Ok(())
    }

    /// Records the events of a block freed during a capture, leaving out the streams recorded during
    /// the capture (their work is in the graph). Frees the block if no event remains.
    fn insert_deferred_events(&mut self, index: u32) -> Result<()> {
        if let Some(during) = self.st.capture_uses.remove(&u64::from(index)) {
            if let Some(uses) = self.st.uses.get_mut(&u64::from(index)) {
                uses.retain(|s| !during.contains(s));
                if uses.is_empty() {
                    self.st.uses.remove(&u64::from(index));
                    self.st.blocks[index].used_elsewhere = false;
                }
            }
        }
        self.insert_events(index)?;
        if self.st.blocks[index].event_count == 0 {
            self.free_block(index);
        }
        Ok(())
    }

    /// One of block `index`'s events completed; frees it when it was the last.
    fn event_completed(&mut self, index: u32) {
        let b = &mut self.st.blocks[index];
        b.event_count -= 1;
        if b.event_count == 0 {
            self.free_block(index);
        }
    }

    /// Returns block `index` to its pool, merging it with free neighbours (PyTorch's `free_block`).
    /// Always inlined: the second half of every free.
    #[inline(always)]
    pub(crate) fn free_block(&mut self, index: u32) {
        self.free_block_with::<false>(index, false);
    }

    /// [`free_block`](Self::free_block), or where allowed (`may_park`, and the block has a free next
    /// neighbour and no free previous one) the same with the merge deferred ([`Locked::try_park`],
    /// the fast path). Only the free calls, which return right after, may park; for them
    /// (`may_park`) the block was allocated until now, and its `allocation` and `allocated_bytes`
    /// figures are decreased here too, in one group with its other figures (the pool type decided
    /// once).
    #[inline(always)]
    fn free_block_with<const QUIET: bool>(&mut self, index: u32, may_park: bool) {
        // A parked block is settled when the lock is taken; one parked in this lock's hold (by an
        // earlier free in the same pass) is settled before any other block moves.
        self.st.settle(&self.shard.figures);
        let (pool, addr, original_size, requested, prev, next, mapped) = {
            let b = &self.st.blocks[index];
            debug_assert!(!b.is_active());
            (
                b.pool,
                b.addr,
                b.size,
                b.requested,
                b.prev,
                b.next,
                b.mapped,
            )
        };
        let entry_stack = self.entry_stack(index);
        let had_stack = entry_stack.is_some();
        if let Some(stack) = entry_stack {
            std::hint::cold_path();
            self.st.stacks.remove(&u64::from(index));
            self.st.free_stacks.remove(&u64::from(index));
            self.note::<QUIET>(
                TraceAction::FreeCompleted,
                addr,
                requested,
                pool,
                Some(&stack),
            );
        } else {
            self.note::<QUIET>(TraceAction::FreeCompleted, addr, requested, pool, None);
        }
        // Whether each neighbour can merge into the block (`policy::may_merge`): both read before
        // either is acted on (see `Arena::clamped`). Merging one neighbour does not change
        // the other.
        let (small, prev_free, next_free) = {
            let st = &*self.st;
            (
                st.pools[pool as usize].small,
                (prev != NIL) & policy::may_merge(st.blocks.clamped(prev), mapped),
                (next != NIL) & policy::may_merge(st.blocks.clamped(next), mapped),
            )
        };
        if may_park
            && self.try_park(
                index,
                Freed {
                    size: original_size,
                    requested,
                    prev,
                    next,
                    prev_free,
                    next_free,
                    had_stack,
                    small,
                },
            )
        {
            return;
        }
        let mut net_blocks = 0i64;
        let mut net_bytes = 0i64;
        let st = &mut *self.st;
        let blocks = &mut st.blocks;
        // The pool once (each `pools[pool]` is a bounds check, repeated after every store).
        let pool_state = &mut st.pools[pool as usize];
        // Merge with free neighbours (PyTorch's `try_merge_blocks` on both sides). A merged
        // neighbour's free-set entry is reused for the result, so that the common case (one free
        // neighbour) updates the set in place.
        let mut reuse: Option<(u64, u64)> = None;
        if prev_free {
            let (p_size, p_addr) = blocks.absorb_prev(index);
            reuse = Some((p_size, p_addr));
            net_blocks -= 1;
            net_bytes -= p_size as i64;
        }
        if next_free {
            let (n_size, n_addr) = blocks.absorb_next(index);
            if reuse.is_some() {
                pool_state.free.remove(n_size, n_addr);
            } else {
                reuse = Some((n_size, n_addr));
            }
            net_blocks -= 1;
            net_bytes -= n_size as i64;
        }
        let b = &mut blocks[index];
        b.gc_count_base = pool_state.gc_now();
        let (size, new_addr, split, expandable) = (b.size, b.addr, b.is_split(), b.is_expandable());
        let free = &mut pool_state.free;
        match reuse {
            Some(old) => free.rekey(old, (size, new_addr), index),
            None => free.insert(size, new_addr, index),
        }
        if split {
            net_blocks += 1;
            net_bytes += size as i64;
        }
        if !expandable {
            // Fully free chunks of expandable segments can always be released, so expandable
            // segments are left out of the inactive-split figures. (The decreases are covered by
            // `decrease_kinds` below.)
            match net_blocks {
                n if n > 0 => self.inc(Kind::InactiveSplit, small, n as u64),
                n if n < 0 => self.dec_covered(Kind::InactiveSplit, small, n.unsigned_abs()),
                _ => {}
            }
            match net_bytes {
                n if n > 0 => self.inc(Kind::InactiveSplitBytes, small, n as u64),
                n if n < 0 => self.dec_covered(Kind::InactiveSplitBytes, small, n.unsigned_abs()),
                _ => {}
            }
        }
        if may_park {
            self.shard.figures.decrease_kinds(
                small,
                [
                    (Kind::Allocation, 1),
                    (Kind::AllocatedBytes, original_size),
                    (Kind::Active, 1),
                    (Kind::ActiveBytes, original_size),
                    (Kind::RequestedBytes, requested),
                ],
                &self.a.book,
            );
        } else {
            self.shard.figures.decrease_kinds(
                small,
                [
                    (Kind::Active, 1),
                    (Kind::ActiveBytes, original_size),
                    (Kind::RequestedBytes, requested),
                ],
                &self.a.book,
            );
        }
        if self.a.settings.uncached() {
            std::hint::cold_path();
            // Caching is off: the segment (one allocation's own) goes back to the device now. On
            // failure it stays cached, for `empty_cache` to return later. Private pools keep theirs
            // (a captured graph may still use them).
            if !expandable && !split && self.st.pools[pool as usize].private_id().is_none() {
                if let Err(error) = self.release_block(index) {
                    tracing::warn!(%error, addr, "returning an uncached allocation to the device failed");
                }
            }
        }
    }

    /// The stack for a free entry of block `index`: the freeing call's if kept, else the allocation's
    /// (PyTorch's `context ? context : block->context_when_allocated`). One emptiness check when no
    /// stacks are recorded (always inlined; the look-up is out of line).
    #[inline(always)]
    fn entry_stack(&self, index: u32) -> Option<Stack> {
        if self.st.stacks.is_empty() && self.st.free_stacks.is_empty() {
            return None;
        }
        self.entry_stack_kept(index)
    }

    /// [`entry_stack`](Self::entry_stack) when some stacks are kept.
    #[cold]
    #[inline(never)]
    fn entry_stack_kept(&self, index: u32) -> Option<Stack> {
        let key = u64::from(index);
        self.st
            .free_stacks
            .get(&key)
            .or_else(|| self.st.stacks.get(&key))
            .cloned()
    }

    /// Merges free neighbour `src` into `dst` when both are free alike (mapped or unmapped);
    /// returns the bytes gained, or 0 (PyTorch's `try_merge_blocks`). `dst` is in no free set.
    pub(crate) fn try_merge(&mut self, dst: u32, src: u32) -> u64 {
        if src == NIL {
            return 0;
        }
        let st = &mut *self.st;
        let s = &st.blocks[src];
        if !policy::may_merge(s, st.blocks[dst].mapped) {
            return 0;
        }
        let (s_mapped, pool) = (s.mapped, s.pool);
        let (s_size, s_addr) = if st.blocks[dst].prev == src {
            st.blocks.absorb_prev(dst)
        } else {
            st.blocks.absorb_next(dst)
        };
        let p = &mut st.pools[pool as usize];
        let removed = if s_mapped {
            p.free.remove(s_size, s_addr)
        } else {
            p.unmapped.remove(&s_addr)
        };
        debug_assert_eq!(removed, Some(src), "merged block was not in its set");
        s_size
    }
}
