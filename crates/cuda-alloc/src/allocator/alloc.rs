//! The allocation path (PyTorch's `malloc`, `get_free_block`, `alloc_found_block`, `alloc_block`).
//!
//! 1. Process completed events of blocks freed while other streams used them (skipped when nothing
//!    is outstanding: one relaxed load).
//! 2. Round the size, pick the pool (small or large; private while a capture is underway).
//! 3. Best fit in the stream's pool; split the block if the remainder is worth keeping. This is the
//!    hot path: one lock (the stream's), no device call, no heap allocation.
//! 4. Otherwise the slow path, step for step PyTorch's: free-memory callbacks and a second look;
//!    garbage collection; a new segment; releasing cached oversize blocks and a retry; releasing every
//!    cached block and a last retry; then the out-of-memory error.

use std::sync::atomic::Ordering::Relaxed;

use super::shard::ShardGuard;
use super::{policy, Allocation, CachingAllocator, Locked, PoolChoice, Route};
use crate::block::{Block, NIL};
use crate::device::{Device, DeviceError, StreamId};
use crate::error::{Error, Result};
use crate::free_set::FreePos;
use crate::oom::{OomEvent, OutOfMemory, Source as OomSource};
use crate::pool::PoolOwner;
use crate::pool_id::MempoolId;
use crate::size::ONE_EXABYTE;
use crate::snapshot::TraceAction;
use crate::stack::{RecordContext, Stack};
use crate::stats::peaks::{Kind, OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS};

/// Where a block about to be handed out comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Source {
    /// A new segment: in no free set.
    New,
    /// Its pool's free set, at this position when best fit knows it (the set unchanged since).
    Free(Option<FreePos>),
}

/// A request, after rounding and pool selection.
#[derive(Clone, Copy, Debug)]
struct Request {
    /// The size asked for.
    orig: usize,
    /// The rounded size.
    size: usize,
    /// The size of a new segment for it.
    alloc_size: usize,
    small: bool,
    choice: PoolChoice,
    stream: StreamId,
}

impl<D: Device> CachingAllocator<D> {
    /// Allocates `size` bytes for use on `stream` (PyTorch's `malloc`).
    ///
    /// A zero-sized request returns a null allocation without touching any pool, as PyTorch does.
    /// While caching is off ([`set_caching_disabled`](Self::set_caching_disabled)) the memory comes
    /// straight from the device, of exactly `size` bytes.
    /// Every `allocate` needs a [`free`](Self::free) (see [`Allocation`]);
    /// [`allocate_owned`](Self::allocate_owned) returns a handle that frees itself.
    ///
    /// # Errors
    /// [`Error::TooLarge`] for a request of 1 EB or more; [`Error::OutOfMemory`] when the device cannot
    /// provide the memory even after every cached block was released; [`Error::Device`] when a device
    /// call fails otherwise (among them [`DeviceError::UnknownStream`](crate::DeviceError::UnknownStream)
    /// for a stream the device does not know); [`Error::TooManyStreams`] when `stream` does not fit the
    /// stream table.
    pub fn allocate(&self, size: usize, stream: StreamId) -> Result<Allocation> {
        if !cfg!(tensormem_ab_no_quiet_twins) && self.quiet() {
            self.allocate_in::<true>(size, stream)
        } else {
            self.allocate_in::<false>(size, stream)
        }
    }

    /// [`allocate`](Self::allocate), compiled once for calls that start [`quiet`](Self::quiet)
    /// (`QUIET`: no trace entry, no stack, no capture to look for) and once for the others. Two
    /// functions rather than both inlined into one: the quiet copy's registers and stack frame are
    /// then its own, not shaped by the other copy's needs (docs/allocator-internals.md, "Quiet
    /// twins").
    #[inline(never)]
    fn allocate_in<const QUIET: bool>(&self, size: usize, stream: StreamId) -> Result<Allocation> {
        if size == 0 {
            return Ok(Allocation::empty(stream));
        }
        if size >= ONE_EXABYTE {
            std::hint::cold_path();
            return Err(Error::TooLarge { bytes: size });
        }
        if self.bypasses_cache::<QUIET>(stream) {
            return self.allocate_uncached(size, stream);
        }
        if self.pending.load(Relaxed) != 0 && (QUIET || !self.capturing()) {
            self.process_events()?;
        }
        let rounded = policy::round_size(size, &self.settings);
        let small = policy::small_pool(rounded);
        let choice = if QUIET {
            PoolChoice::Default
        } else {
            self.pool_choice(stream)
        };
        let shard = self.shard(stream)?;
        let uncached = self.settings.uncached();
        // The stack lives in `gathered`, set only by calls that are not quiet: a quiet call then has
        // no `Option<Stack>` to drop on its way out. (As a plain local, the quiet copy stored `None`
        // and tested it again at every return: its address escapes into the drop, so the compiler
        // could not assume it unchanged.)
        let gathered;
        let stack_ref = if QUIET {
            None
        } else {
            gathered = self.trace.gather(RecordContext::State);
            gathered.as_ref()
        };
        if !uncached {
            let mut locked = self.lock_unsettled(shard);
            let pool = locked.pool_index(choice, small);
            if locked.st.fast.is_parked() {
                if let Some(allocation) = locked.unpark::<QUIET>(pool, rounded, size, stack_ref) {
                    return Ok(allocation);
                }
                locked.st.settle(&locked.shard.figures);
            }
            if let Some((block, source)) = locked.get_free_block(pool, rounded) {
                return Ok(locked.hand_out::<QUIET>(pool, block, rounded, size, source, stack_ref));
            }
        }
        self.allocate_slow(
            Request {
                orig: size,
                size: rounded,
                // Without caching, a device allocation of exactly the rounded size, never split.
                alloc_size: if uncached {
                    rounded
                } else {
                    policy::allocation_size(rounded)
                },
                small,
                choice,
                stream,
            },
            stack_ref,
        )
    }

    /// Allocates and returns only the pointer (PyTorch's `raw_alloc_with_stream`); free it with
    /// [`raw_free`](Self::raw_free). A zero-sized request returns the null pointer.
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate).
    pub fn raw_alloc(&self, size: usize, stream: StreamId) -> Result<crate::DeviceAddress> {
        self.enable_pointer_index();
        let allocation = self.allocate(size, stream)?;
        if allocation.shard < Allocation::UNCACHED {
            self.remember_shard(allocation.shard);
        }
        Ok(allocation.into_ptr())
    }

    /// The pool a request on `stream` goes to: a private pool if a capture underway claims the
    /// stream, else the default pools.
    #[inline]
    pub(super) fn pool_choice(&self, stream: StreamId) -> PoolChoice {
        if !self.capturing() {
            return PoolChoice::Default;
        }
        let captures = self.captures.read();
        captures
            .iter()
            .find(|c| (c.filter)(stream))
            .map_or(PoolChoice::Default, |c| PoolChoice::Private(c.pool))
    }

    #[cold]
    fn allocate_slow(&self, req: Request, stack: Option<&Stack>) -> Result<Allocation> {
        let shard = self.shard(req.stream)?;
        if self.trigger_free_memory_callbacks() && !self.settings.uncached() {
            let mut locked = self.lock(shard);
            let pool = locked.pool_index(req.choice, req.small);
            if let Some((block, source)) = locked.get_free_block(pool, req.size) {
                return Ok(locked.hand_out::<false>(pool, block, req.size, req.orig, source, stack));
            }
        }
        if self.gc_enabled() {
            self.garbage_collect_cached_blocks()?;
        }
        if let Some(allocation) = self.try_new_block(req, false, stack)? {
            return Ok(allocation);
        }
        let sizes = (req.size, req.orig);
        if let Some(a) =
            self.try_use_on_oom_pools(req.choice, req.stream, req.small, sizes, stack)?
        {
            return Ok(a);
        }
        let released = {
            let mut locked = self.lock(shard);
            let pool = locked.pool_index(req.choice, req.small);
            locked.release_available_cached_blocks(pool, req.size)?
        };
        if released {
            if let Some(allocation) = self.try_new_block(req, false, stack)? {
                return Ok(allocation);
            }
        }
        if !self.capturing() {
            self.release_cached_blocks(crate::MempoolId::DEFAULT)?;
            if let Some(allocation) = self.try_new_block(req, true, stack)? {
                return Ok(allocation);
            }
        }
        Err(self.out_of_memory(req))
    }

    /// One attempt at a new segment for `req`; on success the block is handed out at once.
    fn try_new_block(
        &self,
        req: Request,
        retry: bool,
        stack: Option<&Stack>,
    ) -> Result<Option<Allocation>> {
        let shard = self.shard(req.stream)?;
        let mut locked = self.lock(shard);
        let pool = locked.pool_index(req.choice, req.small);
        Ok(locked
            .alloc_block(pool, req.size, req.alloc_size, retry, stack)?
            .map(|block| {
                locked.hand_out::<false>(pool, block, req.size, req.orig, Source::New, stack)
            }))
    }

    /// Asks every registered callback to free memory; whether any did.
    fn trigger_free_memory_callbacks(&self) -> bool {
        let callbacks = self.callbacks.read().clone();
        let mut freed = false;
        for callback in callbacks {
            freed |= callback.free_memory();
        }
        freed
    }

    /// Builds the out-of-memory error, records it and tells the observers.
    #[cold]
    fn out_of_memory(&self, req: Request) -> Error {
        let info = self.device.mem_info().unwrap_or_default();
        let set_fraction = self.counters.set_fraction.load(Relaxed);
        let allowed = set_fraction.then(|| self.counters.allowed.load(Relaxed));
        // The pool the request was for, as PyTorch records it.
        let pool = match req.choice {
            PoolChoice::Default => MempoolId::DEFAULT,
            PoolChoice::Private(id) => id,
        };
        self.trace.record_in(
            TraceAction::Oom,
            info.free,
            req.size as u64,
            req.stream,
            pool,
        );
        self.counters.num_ooms.fetch_add(1, Relaxed);
        let stats = self.memory_stats();
        let private_pools: u64 = self
            .streams
            .iter()
            .map(|shard| {
                let st = shard.lock_settled();
                st.pools
                    .iter()
                    .filter(|p| matches!(p.owner, PoolOwner::Private(_)))
                    .flat_map(|p| p.free.iter())
                    .map(|(size, _, _)| size)
                    .sum::<u64>()
            })
            .sum();
        let event = OomEvent {
            device: self.device.index(),
            alloc_size: req.alloc_size as u64,
            device_total: allowed.unwrap_or(info.total),
            device_free: info.free,
        };
        // Called without any lock held (an observer may call back into the allocator).
        let observers = self.observers.read().clone();
        for observer in observers {
            observer(&event);
        }
        let oom = OutOfMemory {
            device: self.device.index(),
            alloc_size: req.alloc_size as u64,
            device_total: info.total,
            device_free: info.free,
            allowed,
            allocated: stats.allocated_bytes.all.current as u64,
            reserved: stats.reserved_bytes.all.current as u64,
            private_pools,
            // Asked last, without any lock held (NVML may take a few milliseconds).
            processes: self.device.process_memory().unwrap_or_default(),
            source: OomSource::Caching,
            message: String::new(),
        }
        .finish();
        tracing::debug!(%oom, "out of memory");
        Error::OutOfMemory(Box::new(oom))
    }
}

impl<D: Device> Locked<'_, D> {
    /// Best fit in pool `pool`: the smallest free block of at least `size` bytes, lowest address
    /// first, subject to the oversize rules (PyTorch's `get_free_block`). The block stays in the free
    /// set until [`hand_out`](Self::hand_out) takes it. Always inlined: the hot path's other half.
    #[inline(always)]
    pub(crate) fn get_free_block(&mut self, pool: u16, size: usize) -> Option<(u32, Source)> {
        if self.a.gc_enabled() {
            std::hint::cold_path();
            self.st.pools[pool as usize].gc_clock.fetch_add(1, Relaxed);
        }
        self.best_fit(pool, size)
    }

    /// The block [`get_free_block`](Self::get_free_block) would choose, without counting the call
    /// (the garbage collector's clock): the best-fit and oversize rules in one place, shared with
    /// [`CachingAllocator::would_serve_from_cache`].
    /// Returns the block and where it sits in the free set (so that handing it out needs no second
    /// search).
    #[inline(always)]
    pub(crate) fn best_fit(&self, pool: u16, size: usize) -> Option<(u32, Source)> {
        let settings = &self.a.settings;
        let st = &*self.st;
        let p = &st.pools[pool as usize];
        let blocks = &st.blocks;
        let Some((first_size, mut found, pos)) = p.free.first_at_least(size as u64) else {
            std::hint::cold_path();
            return None;
        };
        let mut block_size = first_size as usize;
        let mut source = Source::Free(Some(pos));
        if blocks[found].is_expandable() {
            std::hint::cold_path();
            (found, block_size) = self.expandable_best_fit(pool, size, found)?;
            source = Source::Free(None);
        }
        if !policy::best_fit_allows(settings, size, block_size) {
            std::hint::cold_path();
            return None;
        }
        Some((found, source))
    }

    /// Best fit when the first candidate, `first`, is part of an expandable segment: with expandable
    /// segments on, a block that can still grow counts with the unmapped space after it; with them
    /// off (switched off after some were made), their blocks are skipped. Returns the block and its
    /// size.
    #[cold]
    fn expandable_best_fit(&self, pool: u16, size: usize, first: u32) -> Option<(u32, usize)> {
        let blocks = &self.st.blocks;
        let free = &self.st.pools[pool as usize].free;
        let mut found = first;
        if self.a.settings.expandable_segments() {
            let expandable_size = |i: u32| {
                let b = &blocks[i];
                b.size
                    + if b.next != NIL && !blocks[b.next].mapped {
                        blocks[b.next].size
                    } else {
                        0
                    }
            };
            // Walk the candidates in order (each the successor of the one before) while the next
            // one can grow less than the current one.
            while blocks[found].is_expandable() {
                let b = &blocks[found];
                let Some((_, _, next)) = free.next_after(b.size, b.addr) else {
                    break;
                };
                if expandable_size(next) >= expandable_size(found) {
                    break;
                }
                found = next;
            }
        } else {
            found = free
                .at_least(size as u64)
                .skip(1)
                .find(|&(_, _, i)| !blocks[i].is_expandable())?
                .2;
        }
        Some((found, blocks[found].size as usize))
    }

    /// Whether handing out `size` bytes of `block` should split off the rest (PyTorch's
    /// `should_split`).
    #[inline]
    fn should_split(&self, pool: u16, block: u32, size: usize) -> bool {
        let settings = &self.a.settings;
        let p = &self.st.pools[pool as usize];
        policy::should_split(
            p.no_split,
            p.small,
            p.expandable(settings),
            settings.max_split_size(),
            size,
            self.st.blocks[block].size as usize - size,
        )
    }

    /// Splits `block` if worthwhile and hands out its first `size` bytes. `source`: whether the block
    /// is still in its pool's free set (found by [`get_free_block`](Self::get_free_block)), and where,
    /// or new.
    #[inline(always)]
    pub(crate) fn hand_out<const QUIET: bool>(
        &mut self,
        pool: u16,
        block: u32,
        size: usize,
        orig: usize,
        source: Source,
        stack: Option<&Stack>,
    ) -> Allocation {
        let split = self.should_split(pool, block, size);
        let index = self.alloc_found_block::<QUIET>(
            pool,
            block,
            size as u64,
            orig as u64,
            split,
            source,
            stack,
        );
        let b = &self.st.blocks[index];
        self.handle(b.addr, b.size, orig, index, b.generation)
    }

    /// The handle of this shard's block `index` (at `addr`, `size` bytes, of generation
    /// `generation`), handed out for a request of `orig` bytes.
    #[inline(always)]
    pub(crate) fn handle(
        &self,
        addr: u64,
        size: u64,
        orig: usize,
        index: u32,
        generation: u32,
    ) -> Allocation {
        Allocation::handed_out(
            addr,
            size,
            orig as u64,
            self.shard.stream,
            self.a.id,
            self.shard.index,
            index,
            generation,
        )
    }

    /// Marks a found block allocated, splitting off the remainder first when `split` (PyTorch's
    /// `alloc_found_block`). `source`: whether (and where) the block is still in the free set. Returns
    /// the allocated block's index.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // the hot path's plain values, rather than a struct per call
    pub(crate) fn alloc_found_block<const QUIET: bool>(
        &mut self,
        pool: u16,
        mut block: u32,
        size: u64,
        orig: u64,
        split: bool,
        source: Source,
        stack: Option<&Stack>,
    ) -> u32 {
        let small = self.st.pools[pool as usize].small;
        let found = &self.st.blocks[block];
        let (already_split, expandable) = (found.is_split(), found.is_expandable());
        if split {
            let remaining = block;
            let st = &mut *self.st;
            block = st.blocks.split_front(remaining, size);
            let p = &mut st.pools[pool as usize];
            let r = &mut st.blocks[remaining];
            r.gc_count_base = p.gc_now();
            let (r_size, r_addr) = (r.size, r.addr);
            // The found block's key, from what the split left (nothing held across the split).
            let old = (r_size + size, r_addr - size);
            match source {
                Source::Free(Some(pos)) => p.free.rekey_at(pos, old, (r_size, r_addr), remaining),
                Source::Free(None) => p.free.rekey(old, (r_size, r_addr), remaining),
                Source::New => p.free.insert(r_size, r_addr, remaining),
            }
            if already_split && !expandable {
                // An already split free block shrinks by `size` bytes. (Covered by the allocation's
                // increases below.)
                self.dec_covered(Kind::InactiveSplitBytes, small, size);
            } else if !expandable {
                // A new split free block of the remaining bytes appears.
                self.inc(Kind::InactiveSplitBytes, small, r_size);
                self.inc(Kind::InactiveSplit, small, 1);
            }
        } else {
            match source {
                Source::Free(Some(pos)) => {
                    let removed = self.st.pools[pool as usize].free.remove_at(pos);
                    debug_assert_eq!(removed, block, "best fit's position names another block");
                }
                Source::Free(None) => {
                    let b = &self.st.blocks[block];
                    let (b_size, b_addr) = (b.size, b.addr);
                    self.st.pools[pool as usize].free.remove(b_size, b_addr);
                }
                Source::New => {}
            }
            if already_split && !expandable {
                let b_size = self.st.blocks[block].size;
                // Covered by the allocation's increases below.
                self.dec_covered(Kind::InactiveSplitBytes, small, b_size);
                self.dec_covered(Kind::InactiveSplit, small, 1);
            }
        }
        let b = &mut self.st.blocks[block];
        b.allocated = true;
        b.requested = orig;
        b.generation = b.generation.wrapping_add(1);
        let (addr, b_size) = (b.addr, b.size);
        self.st.fast.handed_out(b_size);
        if let Some(stack) = stack {
            std::hint::cold_path();
            // The allocation's stack, for snapshots and its later trace entries.
            self.st.stacks.insert(u64::from(block), stack.clone());
        }
        self.note::<QUIET>(TraceAction::Alloc, addr, orig, pool, stack);
        if self.a.pointer_index_on() {
            self.st.allocated.insert(addr, block);
        }
        self.inc_alloc(small, b_size, orig);
        if policy::is_oversize(b_size as usize, self.a.settings.max_split_size()) {
            std::hint::cold_path();
            self.inc_figure(OVERSIZE_ALLOCATIONS, 1);
        }
        block
    }

    /// A new segment for a request of `size` bytes (PyTorch's `alloc_block`): `alloc_size` bytes from
    /// the device, or room mapped in an expandable segment. `None` when the device (or the memory
    /// fraction) has no room.
    pub(crate) fn alloc_block(
        &mut self,
        pool: u16,
        size: usize,
        alloc_size: usize,
        retry: bool,
        stack: Option<&Stack>,
    ) -> Result<Option<u32>> {
        let counters = &self.a.counters;
        if retry {
            counters.num_alloc_retries.fetch_add(1, Relaxed);
        }
        let limited = counters.set_fraction.load(Relaxed);
        let allowed = counters.allowed.load(Relaxed);
        let private = self.st.pools[pool as usize].private_id();
        // A pool with its own allocator takes whole segments from it, never expandable ones.
        let own = self.st.pools[pool as usize].allocator.clone();
        // Private pools (CUDA graphs, `MemPool`) grow expandable segments of their own too, as in
        // PyTorch 2.11 (each successful call counts as one device allocation of the pool, each
        // unmap as one release).
        if self.st.pools[pool as usize].expandable(&self.a.settings) {
            if limited && counters.reserved.load(Relaxed) + alloc_size as u64 > allowed {
                return Ok(None);
            }
            let block = self.try_allocate_expandable_block(pool, size as u64)?;
            if block.is_some() {
                if let Some(id) = private {
                    self.a.adjust_private_segments(id, 1);
                }
            }
            return Ok(block);
        }
        // Reserve the budget first so that concurrent segment allocations cannot overshoot the
        // fraction together.
        let before = counters.reserved.fetch_add(alloc_size as u64, Relaxed);
        if limited && before + alloc_size as u64 > allowed {
            counters.reserved.fetch_sub(alloc_size as u64, Relaxed);
            return Ok(None);
        }
        let a = self.a;
        let malloc = || match &own {
            Some(own) => own.malloc(alloc_size),
            None => a.device.malloc(alloc_size),
        };
        let made = if a.settings.release_lock_on_cudamalloc() {
            // `release_lock_on_cudamalloc`: the stream's lock is let go while the driver allocates, so
            // that other calls on this stream (frees, cache hits) need not wait for it. Nothing here
            // depends on the shard's state from before: the new block is inserted after the lock is
            // taken again, and pool indices never change.
            counters.reserving.fetch_add(alloc_size as u64, Relaxed);
            let made = ShardGuard::unlocked(&mut self.st, malloc);
            counters.reserving.fetch_sub(alloc_size as u64, Relaxed);
            // A free meanwhile may have parked a block.
            self.st.settle(&self.shard.figures);
            made
        } else {
            malloc()
        };
        let ptr = match made {
            Ok(ptr) => ptr,
            Err(e) => {
                counters.reserved.fetch_sub(alloc_size as u64, Relaxed);
                return match e {
                    DeviceError::OutOfMemory { .. } => Ok(None),
                    other => Err(other.into()),
                };
            }
        };
        if let Some(id) = private {
            self.a.adjust_private_segments(id, 1);
        }
        let block = self
            .st
            .blocks
            .insert(Block::new(ptr.0, alloc_size as u64, pool));
        self.a.routes.write().insert(
            ptr.0,
            Route {
                end: ptr.0 + alloc_size as u64,
                shard: self.shard.index,
            },
        );
        let small = self.st.pools[pool as usize].small;
        self.inc(Kind::Segment, small, 1);
        self.inc(Kind::ReservedBytes, small, alloc_size as u64);
        if policy::is_oversize(alloc_size, self.a.settings.max_split_size()) {
            self.inc_figure(OVERSIZE_SEGMENTS, 1);
        }
        counters.num_device_alloc.fetch_add(1, Relaxed);
        if let Some(stack) = stack {
            self.st.segment_stacks.insert(ptr.0, stack.clone());
        }
        self.record_with(
            TraceAction::SegmentAlloc,
            ptr.0,
            alloc_size as u64,
            pool,
            stack,
        );
        Ok(Some(block))
    }
}
