//! Returning cached memory to the device (PyTorch's `release_block`, `release_blocks`,
//! `release_cached_blocks`, `release_available_cached_blocks`, `garbage_collect_cached_blocks`,
//! `emptyCache`).
//!
//! The device-wide passes take the maintenance lock and every shard's lock in stream order, and visit
//! blocks in PyTorch's order (its pools are sets sorted by stream, then size, then address), so a
//! caller on one thread sees the same segments released in the same order.

use std::sync::atomic::Ordering::Relaxed;

use super::shard::{LARGE_POOL, SMALL_POOL};
use super::{policy, CachingAllocator, Locked};
use crate::device::{Device, DeviceAddress};
use crate::error::Result;
use crate::pool::PoolOwner;
use crate::pool_id::MempoolId;
use crate::snapshot::TraceAction;
use crate::stats::peaks::{Kind, OVERSIZE_SEGMENTS};

/// Which pool of every shard a device-wide release visits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PoolSel {
    Default { small: bool },
    Private { id: MempoolId, small: bool },
}

impl<D: Device> CachingAllocator<D> {
    /// Returns every cached block that is not part of a split segment to the device, after waiting for
    /// all outstanding events (PyTorch's `emptyCache`). Unused chunks of expandable segments are
    /// unmapped, and segments left entirely unmapped are released.
    ///
    /// # Errors
    /// [`crate::Error::Device`] if a device call fails; what was released until then stays released.
    pub fn empty_cache(&self) -> Result<()> {
        self.release_cached_blocks(MempoolId::DEFAULT)
    }

    /// Like [`empty_cache`](Self::empty_cache) for one private pool that is no longer used by any
    /// capture (PyTorch's `emptyCache(mempool_id)`).
    ///
    /// # Errors
    /// As [`empty_cache`](Self::empty_cache).
    pub fn empty_pool_cache(&self, pool: MempoolId) -> Result<()> {
        self.release_cached_blocks(pool)
    }

    /// PyTorch's `release_cached_blocks(context, mempool_id)`.
    pub(crate) fn release_cached_blocks(&self, only: MempoolId) -> Result<()> {
        if only.is_default() {
            // Allocations freed while caching was off, waiting for other streams, go back too.
            self.process_uncached(true)?;
        }
        let (_guard, mut locks) = self.lock_all();
        if only.is_default() && !self.capturing() {
            self.synchronize_and_free_events(&mut locks, None)?;
            release_pools(&mut locks, PoolSel::Default { small: false })?;
            release_pools(&mut locks, PoolSel::Default { small: true })?;
        }
        let freeable: Vec<MempoolId> = self
            .private
            .lock()
            .iter()
            .filter(|(_, p)| p.freeable)
            .map(|(&id, _)| id)
            .collect();
        for id in freeable {
            if !only.is_default() {
                if id != only {
                    continue;
                }
                self.synchronize_and_free_events(&mut locks, Some(id))?;
            }
            release_pools(&mut locks, PoolSel::Private { id, small: true })?;
            release_pools(&mut locks, PoolSel::Private { id, small: false })?;
            let mut private = self.private.lock();
            // A pool that ends while asleep leaves the sleep book with it (its backup goes back
            // to the host allocator); one being put to sleep or woken ends at a later release.
            if private.get(&id).is_some_and(|p| p.segments == 0) && self.forget_ended_pool(id) {
                private.remove(&id);
                drop(private);
                for locked in &mut locks {
                    for pool in &mut locked.st.pools {
                        if pool.owner == PoolOwner::Private(id) {
                            debug_assert!(pool.free.is_empty() && pool.unmapped.is_empty());
                            pool.owner = PoolOwner::Released;
                            // Its own allocator (and what it holds) goes with the pool.
                            pool.allocator = None;
                            pool.no_split = false;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Releases unused large blocks, oldest first, until reserved memory is back under
    /// `garbage_collection_threshold` of the allowed maximum (PyTorch's
    /// `garbage_collect_cached_blocks`).
    pub(crate) fn garbage_collect_cached_blocks(&self) -> Result<()> {
        let Some(target) = policy::gc_target(
            self.settings.garbage_collection_threshold(),
            self.counters.allowed.load(Relaxed),
            self.counters.reserved.load(Relaxed),
        ) else {
            return Ok(());
        };
        let (_guard, mut locks) = self.lock_all();
        let mut total_age = 0u64;
        let mut freeable = 0u64;
        for locked in &locks {
            let pool = &locked.st.pools[LARGE_POOL as usize];
            let now = pool.gc_now();
            for (_, _, index) in pool.free.iter() {
                let b = &locked.st.blocks[index];
                if policy::gc_counts(b) {
                    total_age += now - b.gc_count_base;
                    freeable += 1;
                }
            }
        }
        if freeable == 0 {
            return Ok(());
        }
        let mut reclaimed = 0u64;
        let mut freed = true;
        while reclaimed < target && freed && freeable > 0 {
            let age_threshold = total_age as f64 / freeable as f64;
            freed = false;
            for locked in &mut locks {
                let pool = &locked.st.pools[LARGE_POOL as usize];
                let now = pool.gc_now();
                let old: Vec<(u32, u64, u64)> = pool
                    .free
                    .iter()
                    .filter_map(|(size, _, index)| {
                        let b = &locked.st.blocks[index];
                        let age = now - b.gc_count_base;
                        policy::gc_releases(b, age, age_threshold).then_some((index, size, age))
                    })
                    .collect();
                for (index, size, age) in old {
                    freed = true;
                    reclaimed += size;
                    total_age -= age;
                    freeable -= 1;
                    locked.release_block(index)?;
                }
            }
        }
        Ok(())
    }
}

/// PyTorch's `release_blocks` over the pool `which` of every shard: first every unsplit segment is
/// released, then every free block of an expandable segment is unmapped (and segments left entirely
/// unmapped are released).
fn release_pools<D: Device>(locks: &mut [Locked<'_, D>], which: PoolSel) -> Result<()> {
    let mut to_unmap = Vec::with_capacity(locks.len());
    for locked in locks.iter_mut() {
        let Some(pool) = locked.select(which) else {
            to_unmap.push(Vec::new());
            continue;
        };
        let mut unmap = Vec::new();
        let mut release = Vec::new();
        for (_, _, index) in locked.st.pools[pool as usize].free.iter() {
            let b = &locked.st.blocks[index];
            if b.is_expandable() {
                unmap.push(index);
            } else if !b.is_split() {
                release.push(index);
            }
        }
        for index in release {
            locked.release_block(index)?;
        }
        to_unmap.push(unmap);
    }
    for (locked, unmap) in locks.iter_mut().zip(to_unmap) {
        for index in unmap {
            locked.unmap_block(index)?;
            if !locked.st.blocks[index].is_split() {
                locked.release_expandable_segment(index)?;
            }
        }
    }
    Ok(())
}

impl<D: Device> Locked<'_, D> {
    /// The index of pool `which` in this shard, if it has one.
    fn select(&self, which: PoolSel) -> Option<u16> {
        match which {
            PoolSel::Default { small } => Some(if small { SMALL_POOL } else { LARGE_POOL }),
            PoolSel::Private { id, small } => self.st.private_pool(id, small),
        }
    }

    /// Returns an unsplit free segment to the device (PyTorch's `release_block`). A split block is
    /// left alone (it is not a whole device allocation); returns whether the segment was released.
    pub(crate) fn release_block(&mut self, index: u32) -> Result<bool> {
        let (addr, size, pool) = {
            let b = &self.st.blocks[index];
            debug_assert!(!b.is_expandable() && !b.allocated);
            if b.is_split() {
                return Ok(false);
            }
            (b.addr, b.size, b.pool)
        };
        self.a.counters.num_device_free.fetch_add(1, Relaxed);
        // Recorded before the memory goes back, as PyTorch does: a trace tracker that registered
        // the segment somewhere (NCCL) lets go of it while it is still allocated.
        self.record(TraceAction::SegmentFree, addr, size, pool);
        // SAFETY: an unsplit block of a non-expandable segment is the whole allocation `malloc`
        // returned at `addr` with `size` bytes (the pool's own allocator's `malloc` where it has one);
        // it is free (in the free set, no events pending), so no queued work of this allocator's
        // callers uses it, and it is forgotten below.
        unsafe {
            match &self.st.pools[pool as usize].allocator {
                Some(own) => own.free(DeviceAddress(addr), size as usize)?,
                None => self.a.device.free(DeviceAddress(addr), size as usize)?,
            }
        };
        self.a.counters.reserved.fetch_sub(size, Relaxed);
        if let Some(id) = self.st.pools[pool as usize].private_id() {
            self.a.adjust_private_segments(id, -1);
        }
        let small = self.st.pools[pool as usize].small;
        self.dec(Kind::Segment, small, 1);
        self.dec(Kind::ReservedBytes, small, size);
        if size as usize >= self.a.settings.max_split_size() {
            self.shard
                .figures
                .decrease(OVERSIZE_SEGMENTS, 1, &self.a.book);
        }
        self.st.pools[pool as usize].free.remove(size, addr);
        self.st.blocks.remove(index);
        self.a.routes.write().remove(&addr);
        if !self.st.segment_stacks.is_empty() {
            self.st.segment_stacks.remove(&addr);
        }
        Ok(true)
    }

    /// Releases oversize cached blocks of pool `pool` until `size` bytes (at least `max_split_size`)
    /// are freed: one block large enough if there is one, else the largest ones (PyTorch's
    /// `release_available_cached_blocks`). Whether enough was released.
    pub(crate) fn release_available_cached_blocks(
        &mut self,
        pool: u16,
        size: usize,
    ) -> Result<bool> {
        let max_split = self.a.settings.max_split_size();
        if max_split == usize::MAX {
            return Ok(false);
        }
        let key = size.max(max_split) as u64;
        let p = &self.st.pools[pool as usize];
        let first = p.free.at_least(key).next();
        if let Some((_, _, index)) = first {
            if !self.st.blocks[index].is_expandable() {
                return self.release_block(index);
            }
        }
        // No single block is large enough: release oversize blocks from the largest down.
        let below: Vec<(u64, u32)> = match first {
            Some((s, a, _)) => p.free.before(s, a).map(|(s, _, i)| (s, i)).collect(),
            None => p.free.below(key).map(|(s, _, i)| (s, i)).collect(),
        };
        let mut released = 0u64;
        for (block_size, index) in below {
            if released >= key || (block_size as usize) < max_split {
                break;
            }
            if !self.st.blocks[index].is_expandable() && self.release_block(index)? {
                released += block_size;
            }
        }
        Ok(released >= key)
    }
}
