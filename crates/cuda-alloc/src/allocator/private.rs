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

use super::{CachingAllocator, Capture};
use crate::device::{Device, StreamId};
use crate::error::{Error, Result};
use crate::pool_id::MempoolId;

/// A private pool's device-wide bookkeeping (its blocks live in the stream shards).
#[derive(Debug)]
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
    /// [`Error::Pool`] if a capture is already allocating to `pool`, or if the pool was released.
    pub fn begin_allocate_to_pool(
        &self,
        pool: MempoolId,
        filter: impl Fn(StreamId) -> bool + Send + Sync + 'static,
    ) -> Result<()> {
        let mut captures = self.captures.write();
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
        let mut pools = self.private.lock();
        match pools.get_mut(&pool) {
            Some(p) if p.use_count > 0 => {
                p.use_count += 1;
                Ok(())
            }
            Some(_) => Err(Error::Pool {
                pool,
                message: "createOrIncrefPool: the pool was released by every user",
            }),
            None => {
                pools.insert(
                    pool,
                    PrivatePool {
                        use_count: 1,
                        segments: 0,
                        freeable: false,
                        small_clock: Arc::new(AtomicU64::new(0)),
                        large_clock: Arc::new(AtomicU64::new(0)),
                    },
                );
                Ok(())
            }
        }
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
