//! Looking at the allocator: statistics, snapshots, pointer lookups.

use std::sync::atomic::Ordering::Relaxed;

use super::shard::Shard;
use super::CachingAllocator;
use crate::block::NIL;
use crate::device::{Device, DeviceAddress, StreamId};
use crate::error::{Error, Result};
use crate::pool_id::MempoolId;
use crate::size::ONE_EXABYTE;
use crate::snapshot::TraceAction;
use crate::snapshot::{AllocatorSettings, Block, BlockState, Segment, SegmentType, Snapshot};
use crate::stats::MemoryStats;

impl<D: Device> CachingAllocator<D> {
    /// The statistics (`torch.cuda.memory_stats()`; [`MemoryStats::to_flat`] gives its key names).
    #[must_use]
    pub fn memory_stats(&self) -> MemoryStats {
        let mut stats = MemoryStats::default();
        self.book.read(&self.streams, &mut stats);
        let c = &self.counters;
        stats.num_alloc_retries = c.num_alloc_retries.load(Relaxed);
        stats.num_ooms = c.num_ooms.load(Relaxed);
        stats.num_sync_all_streams = c.num_sync_all_streams.load(Relaxed);
        stats.num_device_alloc = c.num_device_alloc.load(Relaxed);
        stats.num_device_free = c.num_device_free.load(Relaxed);
        stats.max_split_size = self.max_split_size_at_start;
        stats
    }

    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_stats(&self) {
        self.book.reset_peaks(&self.streams);
    }

    /// Zeroes the cumulative totals and counters (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated_stats(&self) {
        let (_guard, locks) = self.lock_all();
        for locked in &locks {
            locked.shard.figures.reset_accumulated();
        }
        let c = &self.counters;
        for counter in [
            &c.num_alloc_retries,
            &c.num_ooms,
            &c.num_sync_all_streams,
            &c.num_device_alloc,
            &c.num_device_free,
        ] {
            counter.store(0, Relaxed);
        }
    }

    /// Bytes reserved from the device right now.
    #[must_use]
    pub fn reserved_bytes(&self) -> u64 {
        self.counters.reserved.load(Relaxed)
    }

    /// The size of the largest free cached block in any pool (0 if none).
    #[must_use]
    pub fn largest_cached_block(&self) -> u64 {
        self.streams
            .iter()
            .map(|shard| {
                let st = shard.lock_settled();
                st.pools
                    .iter()
                    .filter_map(|p| p.free.iter().map(|(size, _, _)| size).max())
                    .max()
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
    }

    /// PyTorch's `cacheInfo`: the larger of the device's free memory and the largest cached block.
    ///
    /// # Errors
    /// [`Error::Device`] if the device's memory cannot be queried.
    pub fn cache_info(&self) -> Result<u64> {
        Ok(self
            .device
            .mem_info()?
            .free
            .max(self.largest_cached_block()))
    }

    /// Whether allocated blocks are indexed by pointer (see
    /// [`enable_pointer_index`](Self::enable_pointer_index)).
    #[inline]
    pub(crate) fn pointer_index_on(&self) -> bool {
        self.pointer_index.load(Relaxed)
    }

    /// Starts indexing allocated blocks by pointer, for the calls that name memory by pointer
    /// ([`raw_free`](Self::raw_free), [`base_allocation`](Self::base_allocation), ...). Callers that
    /// only use [`Allocation`](crate::Allocation) handles never pay for the index; the first
    /// pointer-based call builds it from the blocks allocated so far and keeps it from then on.
    #[inline]
    pub(crate) fn enable_pointer_index(&self) {
        if !self.pointer_index_on() {
            self.build_pointer_index();
        }
    }

    /// Builds the pointer index (the first pointer-based call).
    #[cold]
    #[inline(never)]
    fn build_pointer_index(&self) {
        let (_guard, mut locks) = self.lock_all();
        for locked in &mut locks {
            let st = &mut *locked.st;
            st.allocated.clear();
            for (index, b) in st.blocks.iter() {
                if b.allocated {
                    st.allocated.insert(b.addr, index);
                }
            }
        }
        // Published under every shard lock: a call that takes a shard lock afterwards sees it.
        self.pointer_index.store(true, Relaxed);
    }

    /// The shard owning the segment or reservation that contains `ptr`.
    pub(crate) fn route(&self, ptr: DeviceAddress) -> Option<&Shard<D>> {
        let routes = self.routes.read();
        let (_, route) = routes.range(..=ptr.0).next_back()?;
        (ptr.0 < route.end)
            .then_some(route.shard)
            .and_then(|index| self.streams.by_index(index))
    }

    /// The device allocation an allocated pointer lies in: its base address and size (PyTorch's
    /// `getBaseAllocation`; CUDA IPC shares whole device allocations).
    ///
    /// # Errors
    /// [`Error::InvalidPointer`] if `ptr` is not a live allocation; [`Error::ExpandableNotShareable`]
    /// if it lies in an expandable segment.
    pub fn base_allocation(&self, ptr: DeviceAddress) -> Result<(DeviceAddress, usize)> {
        self.enable_pointer_index();
        let Some(shard) = self.route(ptr) else {
            // An allocation made while caching was off is a device allocation of its own.
            return self
                .uncached_allocation(ptr)
                .ok_or(Error::InvalidPointer { ptr });
        };
        let st = shard.lock_settled();
        let &index = st
            .allocated
            .get(&ptr.0)
            .ok_or(Error::InvalidPointer { ptr })?;
        if st.blocks[index].is_expandable() {
            return Err(Error::ExpandableNotShareable { ptr });
        }
        let mut head = index;
        while st.blocks[head].prev != NIL {
            head = st.blocks[head].prev;
        }
        let mut size = 0;
        let mut at = head;
        while at != NIL {
            size += st.blocks[at].size;
            at = st.blocks[at].next;
        }
        Ok((DeviceAddress(st.blocks[head].addr), size as usize))
    }

    /// A snapshot of every segment and the trace (`torch.cuda.memory._snapshot()`), in the model that
    /// pickles into the file PyTorch's `_memory_viz` opens. Records a `snapshot` trace entry after the
    /// trace is copied, as PyTorch does.
    #[must_use]
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_with(None, true)
    }

    /// The snapshot of PyTorch's `snapshot(mempool_id, include_traces)` (`MemPool.snapshot`,
    /// `torch.cuda.memory_snapshot(mempool_id, include_traces)`): only the segments of `pool` when it
    /// is given and not the default id `(0, 0)`; the trace (whole: PyTorch does not filter it by
    /// pool) only when `include_traces`, else `device_traces` is an empty list and the trace is not
    /// copied. A `snapshot` trace entry is recorded either way, as PyTorch does.
    #[must_use]
    pub fn snapshot_with(&self, pool: Option<MempoolId>, include_traces: bool) -> Snapshot {
        let pool = pool.filter(|&p| p != MempoolId::DEFAULT);
        let device_traces = if include_traces {
            vec![self.trace.entries()]
        } else {
            Vec::new()
        };
        let (guard, locks) = self.lock_all();
        let mut segments = Vec::new();
        // Stacks of blocks, symbolized after the locks are released: (segment, block, stack).
        let mut stacks = Vec::new();
        for locked in &locks {
            let st = &locked.st;
            for (index, head) in st.blocks.iter() {
                // One segment per contiguous mapped range: heads are mapped blocks with no mapped
                // block before them.
                if !head.mapped || (head.prev != NIL && st.blocks[head.prev].mapped) {
                    continue;
                }
                let owner = &st.pools[head.pool as usize];
                let id = owner.private_id().unwrap_or(MempoolId::DEFAULT);
                if pool.is_some_and(|p| p != id) {
                    continue;
                }
                let mut segment = Segment {
                    device: i64::from(self.device.index()),
                    address: head.addr,
                    stream: locked.shard.stream.0,
                    segment_type: if owner.small {
                        SegmentType::Small
                    } else {
                        SegmentType::Large
                    },
                    segment_pool_id: (id.0, id.1),
                    is_expandable: head.is_expandable(),
                    ..Segment::default()
                };
                if let Some(stack) = st.segment_stacks.get(&head.addr) {
                    stacks.push((segments.len(), usize::MAX, stack.clone()));
                }
                let mut at = index;
                while at != NIL && st.blocks[at].mapped {
                    let b = &st.blocks[at];
                    let state = if b.allocated {
                        BlockState::ActiveAllocated
                    } else if b.is_active() {
                        BlockState::ActivePendingFree
                    } else {
                        BlockState::Inactive
                    };
                    segment.total_size += b.size;
                    if b.allocated {
                        segment.allocated_size += b.size;
                    }
                    if state != BlockState::Inactive {
                        segment.active_size += b.size;
                        segment.requested_size += b.requested;
                    }
                    if let Some(stack) = st.stacks.get(&u64::from(at)) {
                        stacks.push((segments.len(), segment.blocks.len(), stack.clone()));
                    }
                    segment.blocks.push(Block {
                        address: b.addr,
                        size: b.size,
                        requested_size: b.requested,
                        state,
                        ..Block::default()
                    });
                    at = b.next;
                }
                segments.push(segment);
            }
        }
        drop(locks);
        drop(guard);
        for (segment, block, stack) in stacks {
            let frames = stack.frames().to_vec();
            match segments[segment].blocks.get_mut(block) {
                Some(block) => block.frames = frames,
                None => segments[segment].frames = frames, // the segment's own (usize::MAX)
            }
        }
        segments.sort_by_key(|s| s.address);
        let total_active = segments.iter().map(|s| s.active_size).sum();
        // PyTorch's entry names the pool the snapshot was asked for (`(0, 0)`: all of them).
        self.trace.record_in(
            TraceAction::Snapshot,
            0,
            total_active,
            StreamId(0),
            pool.unwrap_or(MempoolId::DEFAULT),
        );
        Snapshot {
            segments,
            device_traces,
            allocator_settings: Some(AllocatorSettings::from_config(&self.settings.config())),
            external_annotations: Some(Vec::new()),
            ..Snapshot::default()
        }
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Whether [`allocate(size, stream)`](Self::allocate) would be served right now by a block the
    /// cache already holds, without asking the device for memory (PyTorch's `get_free_block`
    /// succeeding on the first look).
    ///
    /// The answer applies the allocator's own policy: the size is rounded as `allocate` rounds it
    /// (512 B granularity, `roundup_power2_divisions`), the pool is the one the request would go to
    /// (small or large; a private pool while a capture claims `stream`), and the best fit must pass
    /// the oversize rules (`max_split_size`, `max_non_split_rounding_size`). Only blocks free now
    /// count: a block freed while other streams still use it counts once `allocate` would have
    /// reclaimed it, which this query does not do (it changes nothing: no events are processed,
    /// no statistics or garbage-collection ages move, no trace entry is written).
    ///
    /// Under expandable segments with a `max_split_size`, a request the first look refuses (it may
    /// not take an oversize block) can still be served without new memory: the allocator then
    /// takes the free, mapped end of an expandable segment, after checking the memory fraction as
    /// for new memory. This query answers the first look.
    ///
    /// A zero-sized request, or one of 1 EB or more, is never served from the cache (`allocate`
    /// returns a null allocation or an error for those). A stream the allocator has never seen has
    /// no cached blocks.
    ///
    /// ```
    /// use tensormem_cuda_alloc::backend::sim::SimDevice;
    /// use tensormem_cuda_alloc::{CachingAllocator, StreamId};
    ///
    /// let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
    /// let s = StreamId(0);
    /// assert!(!alloc.would_serve_from_cache(4096, s)); // nothing cached yet
    /// let a = alloc.allocate(4096, s)?; // a new 2 MiB segment; the rest stays cached
    /// assert!(alloc.would_serve_from_cache(4096, s));
    /// assert!(!alloc.would_serve_from_cache(4 << 20, s)); // the large pool is empty
    /// assert!(!alloc.would_serve_from_cache(4096, StreamId(3))); // blocks never change streams
    /// alloc.free(a)?;
    /// # Ok::<(), tensormem_cuda_alloc::Error>(())
    /// ```
    #[must_use]
    pub fn would_serve_from_cache(&self, size: usize, stream: StreamId) -> bool {
        if size == 0 || size >= ONE_EXABYTE || self.bypasses_cache::<false>(stream) {
            return false;
        }
        let Some(shard) = self.streams.get(stream) else {
            return false;
        };
        let rounded = super::policy::round_size(size, &self.settings);
        let choice = self.pool_choice(stream);
        let mut locked = self.lock(shard);
        let pool = locked.pool_index(choice, super::policy::small_pool(rounded));
        locked.best_fit(pool, rounded).is_some()
    }
}
