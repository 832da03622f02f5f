//! Pools of free blocks, ordered for best fit.
//!
//! PyTorch keeps one ordered set of free blocks per pool, sorted by `(stream, size, address)`, and
//! looks a request up with `lower_bound(stream, size)`: the smallest block of that stream that is large
//! enough, ties broken by the lowest address. Here every stream has its own pools (blocks never move
//! between streams), so a pool's set is sorted by `(size, address)` and the lookup is the same.
//!
//! Expandable segments add a second set per pool: the unmapped ranges of its segments, sorted by
//! address.

use std::collections::BTreeMap;

pub(crate) use crate::free_set::FreeSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crate::pool_id::MempoolId;
use crate::pool_options::PoolAllocator;

/// Which default pool, or a private one, a pool is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolOwner {
    /// One of the two default pools every stream has.
    Default,
    /// A private pool (CUDA graphs, memory pools).
    Private(MempoolId),
    /// A private pool's slot after the pool was released; it holds no blocks and may be reused.
    Released,
}

/// One pool of one stream: the free blocks of the small or the large size class of a default or
/// private pool.
pub(crate) struct Pool {
    /// Free mapped blocks.
    pub(crate) free: FreeSet,
    /// Free unmapped ranges of expandable segments: address -> block index.
    pub(crate) unmapped: BTreeMap<u64, u32>,
    /// Small pool (requests of at most 1 MiB) or large pool.
    pub(crate) small: bool,
    /// Default or private.
    pub(crate) owner: PoolOwner,
    /// PyTorch's `get_free_blocks_call_count`: ticks on each lookup while garbage collection is on.
    /// Shared by the pool's parts on every stream (PyTorch has one set per pool for all streams).
    pub(crate) gc_clock: Arc<AtomicU64>,
    /// Its blocks are never split (a memory pool's `no_split`).
    pub(crate) no_split: bool,
    /// Where its segments come from, when not from the device (a memory pool's own allocator).
    pub(crate) allocator: Option<Arc<dyn PoolAllocator>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("free", &self.free)
            .field("unmapped", &self.unmapped)
            .field("small", &self.small)
            .field("owner", &self.owner)
            .field("gc_clock", &self.gc_clock)
            .field("no_split", &self.no_split)
            .field("own_allocator", &self.allocator.is_some())
            .finish()
    }
}

impl Pool {
    /// Whether this pool's new segments are expandable: under `expandable_segments`, unless the
    /// pool takes its segments from its own allocator (which, as in PyTorch, never grows
    /// expandable ones).
    #[inline]
    pub(crate) fn expandable(&self, settings: &crate::settings::Settings) -> bool {
        settings.expandable_segments() && self.allocator.is_none()
    }

    pub(crate) fn new(small: bool, owner: PoolOwner, gc_clock: Arc<AtomicU64>) -> Self {
        Pool {
            free: FreeSet::default(),
            unmapped: BTreeMap::new(),
            small,
            owner,
            gc_clock,
            no_split: false,
            allocator: None,
        }
    }

    /// The garbage-collection clock now.
    #[inline]
    pub(crate) fn gc_now(&self) -> u64 {
        self.gc_clock.load(Relaxed)
    }

    /// The memory pool this pool is part of, as trace entries name it (`pool_id`): the default
    /// pools' [`MempoolId::DEFAULT`] or the private pool's id; `None` for a released slot, which
    /// holds no memory.
    #[inline]
    pub(crate) fn trace_id(&self) -> Option<MempoolId> {
        match self.owner {
            PoolOwner::Default => Some(MempoolId::DEFAULT),
            PoolOwner::Private(id) => Some(id),
            PoolOwner::Released => None,
        }
    }

    /// The private pool this pool belongs to, if any.
    #[inline]
    pub(crate) fn private_id(&self) -> Option<MempoolId> {
        match self.owner {
            PoolOwner::Private(id) => Some(id),
            PoolOwner::Default | PoolOwner::Released => None,
        }
    }
}
