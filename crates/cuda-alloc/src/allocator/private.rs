//! Private pools: memory set aside for CUDA graphs (PyTorch's `beginAllocateToPool`,
//! `endAllocateToPool`, `releasePool`).
//!
//! A graph bakes addresses in, so the memory it used during capture must stay its own for as long as
//! the graph may replay. While a capture is underway, allocations on the streams its filter accepts
//! come from the capture's private pool, whose blocks never serve other pools. Once every graph using
//! a pool has released it, `empty_cache` returns the pool's free segments to the device, and the pool
//! disappears when it has none left.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::{CachingAllocator, Capture, Locked, PoolChoice};
use crate::device::{Device, StreamId};
use crate::error::{Error, Result};
use crate::pool::{Pool, PoolOwner};
use crate::pool_id::MempoolId;
use crate::pool_options::{PoolAllocator, PoolOptions};
use crate::stack::Stack;
use crate::Allocation;

/// A private pool's device-wide bookkeeping (its blocks live in the stream shards).
pub(crate) struct PrivatePool {
    /// Captures (graphs) using the pool.
    pub(crate) use_count: i64,
    /// Device allocations made for the pool and not yet returned (PyTorch's `cudaMalloc_count`).
    pub(crate) segments: i64,
    /// No capture uses the pool any more: its free segments may be released.
    pub(crate) freeable: bool,
    /// Garbage-collection clocks of its small and large parts.
    pub(crate) small_clock: Arc<AtomicU64>,
    pub(crate) large_clock: Arc<AtomicU64>,
    /// Allocations outside any pool may use its free blocks before out-of-memory.
    pub(crate) use_on_oom: bool,
    /// Its blocks are never split.
    pub(crate) no_split: bool,
    /// Where its segments come from, when not from the device.
    pub(crate) allocator: Option<Arc<dyn PoolAllocator>>,
}

impl std::fmt::Debug for PrivatePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrivatePool")
            .field("use_count", &self.use_count)
            .field("segments", &self.segments)
            .field("freeable", &self.freeable)
            .field("use_on_oom", &self.use_on_oom)
            .field("no_split", &self.no_split)
            .field("own_allocator", &self.allocator.is_some())
            .finish_non_exhaustive()
    }
}

impl PrivatePool {
    fn new(allocator: Option<Arc<dyn PoolAllocator>>) -> Self {
        PrivatePool {
            use_count: 1,
            segments: 0,
            freeable: false,
            small_clock: Arc::new(AtomicU64::new(0)),
            large_clock: Arc::new(AtomicU64::new(0)),
            use_on_oom: false,
            no_split: false,
            allocator,
        }
    }

    /// A stream's part of this pool (of pool id `id`), small or large.
    pub(crate) fn part(&self, id: MempoolId, small: bool) -> Pool {
        let clock = if small {
            &self.small_clock
        } else {
            &self.large_clock
        };
        let mut pool = Pool::new(small, PoolOwner::Private(id), Arc::clone(clock));
        pool.no_split = self.no_split;
        pool.allocator.clone_from(&self.allocator);
        pool
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Starts sending allocations on the streams `filter` accepts to private pool `pool` (PyTorch's
    /// `beginAllocateToPool`, called when a graph capture begins). The pool is made if it does not
    /// exist; otherwise the capture shares it.
    ///
    /// While any capture is underway, blocks freed with uses on other streams wait for the end of
    /// the capture before their events are recorded, and the allocation path neither queries events
    /// nor releases all cached blocks on out-of-memory.
    ///
    /// # Errors
    /// [`Error::Pool`] if a capture is already allocating to `pool`, or if the pool was released;
    /// [`Error::Sleep`] if the pool is asleep ([`sleep_pool`](Self::sleep_pool)).
    pub fn begin_allocate_to_pool(
        &self,
        pool: MempoolId,
        filter: impl Fn(StreamId) -> bool + Send + Sync + 'static,
    ) -> Result<()> {
        let mut captures = self.captures.write();
        self.refuse_if_asleep(pool)?;
        if captures.iter().any(|c| c.pool == pool) {
            return Err(Error::Pool {
                pool,
                message: "beginAllocateToPool: already recording to mempool_id",
            });
        }
        self.create_or_incref_pool(pool).map_err(|_| Error::Pool {
            pool,
            message: "beginAllocateToPool: the pool was released by every capture",
        })?;
        captures.push(Capture {
            pool,
            filter: Box::new(filter),
        });
        self.captures_active.store(captures.len(), Relaxed);
        Ok(())
    }

    /// Stops sending allocations to private pool `pool` (PyTorch's `endAllocateToPool`, called when
    /// a capture ends).
    ///
    /// # Errors
    /// [`Error::Pool`] if no capture is allocating to `pool`.
    pub fn end_allocate_to_pool(&self, pool: MempoolId) -> Result<()> {
        let mut captures = self.captures.write();
        let Some(at) = captures.iter().position(|c| c.pool == pool) else {
            return Err(Error::Pool {
                pool,
                message: "endAllocatePool: not currently recording to mempool_id",
            });
        };
        captures.remove(at);
        self.captures_active.store(captures.len(), Relaxed);
        Ok(())
    }

    /// One user of private pool `pool` is done with it (PyTorch's `releasePool`, called when a graph
    /// is destroyed). When none is left, the pool's free segments become releasable by
    /// [`empty_cache`](Self::empty_cache); its live allocations stay valid until freed.
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool does not exist or was already released by every user.
    pub fn release_pool(&self, pool: MempoolId) -> Result<()> {
        let mut pools = self.private.lock();
        let Some(p) = pools.get_mut(&pool) else {
            return Err(Error::Pool {
                pool,
                message: "releasePool: no such private pool",
            });
        };
        if p.use_count <= 0 {
            return Err(Error::Pool {
                pool,
                message: "releasePool: the pool was already released",
            });
        }
        p.use_count -= 1;
        if p.use_count == 0 {
            p.freeable = true;
        }
        Ok(())
    }

    /// Makes private pool `pool` with one user, or adds a user to it if it exists (PyTorch's
    /// `createOrIncrefPool`, called when a `torch.cuda.MemPool` is made). Each user gives the pool up
    /// with [`release_pool`](Self::release_pool).
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool exists but every user released it (its memory is waiting to be
    /// returned, and a released pool is never used again).
    pub fn create_or_incref_pool(&self, pool: MempoolId) -> Result<()> {
        self.create_or_incref_pool_with(pool, None)
    }

    /// [`create_or_incref_pool`](Self::create_or_incref_pool) with the pool's own allocator
    /// (PyTorch's `createOrIncrefPool(device, id, allocator)`): a new pool takes its segments from
    /// `allocator` rather than the device.
    ///
    /// # Errors
    /// As [`create_or_incref_pool`](Self::create_or_incref_pool); [`Error::Pool`] also if the pool
    /// exists and `allocator` is given (an allocator is the pool's from when it is made; make a pool
    /// with a new id instead).
    pub fn create_or_incref_pool_with(
        &self,
        pool: MempoolId,
        allocator: Option<Arc<dyn PoolAllocator>>,
    ) -> Result<()> {
        let mut pools = self.private.lock();
        match pools.get_mut(&pool) {
            Some(_) if allocator.is_some() => Err(Error::Pool {
                pool,
                message:
                    "createOrIncrefPool: the pool exists; an allocator can only be given when \
                          the pool is made (use a new pool id)",
            }),
            Some(p) if p.use_count > 0 => {
                p.use_count += 1;
                Ok(())
            }
            Some(_) => Err(Error::Pool {
                pool,
                message: "createOrIncrefPool: the pool was released by every user",
            }),
            None => {
                pools.insert(pool, PrivatePool::new(allocator));
                Ok(())
            }
        }
    }

    /// Makes memory pool `pool` with `options` (PyTorch's `MemPool(allocator, use_on_oom,
    /// no_split)`: `createOrIncrefPool`, then `setUseOnOOM` and `setNoSplit` where asked), or adds a
    /// user to it if it exists (then `options.allocator` must be `None`). Give it up with
    /// [`release_pool`](Self::release_pool).
    ///
    /// # Errors
    /// As [`create_or_incref_pool_with`](Self::create_or_incref_pool_with).
    pub fn create_pool(&self, pool: MempoolId, options: PoolOptions) -> Result<()> {
        self.create_or_incref_pool_with(pool, options.allocator)?;
        if options.use_on_oom {
            self.set_use_on_oom(pool, true)?;
        }
        if options.no_split {
            self.set_no_split(pool)?;
        }
        Ok(())
    }

    /// Lets allocations outside any pool use `pool`'s free blocks as a last resort before
    /// out-of-memory, or stops it (PyTorch's `setUseOnOOM`). On the allocation path, once no cached
    /// block serves a request for the default pools and the device has no room for a new segment,
    /// the free blocks of such pools (in pool-id order) are searched before any cached block is
    /// released, as in PyTorch 2.10 and later; a block found is handed out as the pool's (freeing it
    /// returns it to the pool). Requests that are already for a private pool never fall back.
    ///
    /// # Errors
    /// [`Error::Pool`] when turning it on for a pool that does not exist (make the pool first);
    /// turning it off is always granted (PyTorch does it for every pool it destroys).
    pub fn set_use_on_oom(&self, pool: MempoolId, use_on_oom: bool) -> Result<()> {
        match self.private.lock().get_mut(&pool) {
            Some(p) => {
                p.use_on_oom = use_on_oom;
                Ok(())
            }
            None if !use_on_oom => Ok(()),
            None => Err(Error::Pool {
                pool,
                message: "setUseOnOOM: no such private pool; make the pool (create_pool, \
                          create_or_incref_pool) before setting use_on_oom",
            }),
        }
    }

    /// Stops `pool` from splitting its blocks (PyTorch's `setNoSplit`): from now on every allocation
    /// from the pool gets a whole free block or a whole new segment. Meant for a new pool, as
    /// `torch.cuda.MemPool(no_split=True)` sets it; blocks split before stay split.
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool does not exist (make it first).
    pub fn set_no_split(&self, pool: MempoolId) -> Result<()> {
        match self.private.lock().get_mut(&pool) {
            Some(p) => p.no_split = true,
            None => {
                return Err(Error::Pool {
                    pool,
                    message: "setNoSplit: no such private pool; make the pool (create_pool, \
                              create_or_incref_pool) before setting no_split",
                })
            }
        }
        // The shards' parts made before now; parts made later read the flag when they are made.
        // (The private-pool lock is let go first: the allocation path takes it under a shard lock.)
        for shard in self.streams.iter() {
            let mut st = shard.lock_settled();
            for part in st.pools.iter_mut() {
                if part.owner == PoolOwner::Private(pool) {
                    part.no_split = true;
                }
            }
        }
        Ok(())
    }

    /// The options `pool` was made with or was given since (`None` if there is no such pool).
    #[must_use]
    pub fn pool_options(&self, pool: MempoolId) -> Option<PoolOptions> {
        self.private.lock().get(&pool).map(|p| PoolOptions {
            use_on_oom: p.use_on_oom,
            no_split: p.no_split,
            allocator: p.allocator.clone(),
        })
    }

    /// The last resort before out-of-memory for a request that went to the default pools (PyTorch's
    /// `try_mempool_fallback`): the first free block of a `use_on_oom` pool, in pool-id order, that
    /// best fit finds for `size` bytes on `stream`, handed out as that pool's.
    pub(crate) fn try_use_on_oom_pools(
        &self,
        choice: PoolChoice,
        stream: StreamId,
        small: bool,
        (size, orig): (usize, usize),
        stack: Option<&Stack>,
    ) -> Result<Option<Allocation>> {
        if !matches!(choice, PoolChoice::Default) || self.settings.uncached() {
            return Ok(None);
        }
        let candidates: Vec<MempoolId> = self
            .private
            .lock()
            .iter()
            .filter(|(_, p)| p.use_on_oom && p.use_count > 0)
            .map(|(&id, _)| id)
            .collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        let shard = self.shard(stream)?;
        for id in candidates {
            let mut locked: Locked<'_, D> = self.lock(shard);
            let pool = locked.pool_index(PoolChoice::Private(id), small);
            if locked.st.pools[pool as usize].owner != PoolOwner::Private(id) {
                // Released and emptied meanwhile.
                continue;
            }
            if let Some((block, source)) = locked.get_free_block(pool, size) {
                return Ok(Some(
                    locked.hand_out::<false>(pool, block, size, orig, source, stack),
                ));
            }
        }
        Ok(None)
    }

    /// How many users hold private pool `pool` (PyTorch's `getPoolUseCount`); 0 for a pool that does
    /// not exist or that every user released.
    #[must_use]
    pub fn pool_use_count(&self, pool: MempoolId) -> i64 {
        self.private
            .lock()
            .get(&pool)
            .map_or(0, |p| p.use_count.max(0))
    }

    /// Private pools that exist, with how many captures use each.
    #[must_use]
    pub fn private_pools(&self) -> Vec<(MempoolId, i64)> {
        self.private
            .lock()
            .iter()
            .map(|(&id, p)| (id, p.use_count))
            .collect()
    }

    /// Counts device allocations made (`+1`) or returned (`-1`) for private pool `pool`.
    pub(crate) fn adjust_private_segments(&self, pool: MempoolId, by: i64) {
        if let Some(p) = self.private.lock().get_mut(&pool) {
            p.segments = (p.segments + by).max(0);
        }
    }
}
