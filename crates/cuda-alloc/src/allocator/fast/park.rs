//! The free's side of the fast path: parking a freed block instead of merging it (see the module
//! documentation of `fast`).

use crate::allocator::Locked;
use crate::block::NIL;
use crate::device::Device;

use super::state::Parked;

/// What the plain free path read of a block it frees, handed to [`Locked::try_park`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Freed {
    /// The block's size, and the size its caller had asked for.
    pub(crate) size: u64,
    pub(crate) requested: u64,
    /// Its neighbours.
    pub(crate) prev: u32,
    pub(crate) next: u32,
    /// Whether each neighbour may merge with it ([`policy::may_merge`](crate::allocator::policy::may_merge)).
    pub(crate) prev_free: bool,
    pub(crate) next_free: bool,
    /// A call stack was kept for it (a trace entry with it was written).
    pub(crate) had_stack: bool,
    /// Its pool is of the small class.
    pub(crate) small: bool,
}

impl<D: Device> Locked<'_, D> {
    /// Parks freed block `index` instead of merging it, where that is allowed: the fast path on, the
    /// block of the size handed out last, no stack kept, not part of an expandable segment, no free
    /// previous neighbour, caching on. The figures read at once as the merge (or, with no free
    /// neighbour, the insertion) would make them. Returns whether it parked; if not, nothing
    /// changed. The block was allocated until now (a free call, which returns right after).
    #[inline(always)]
    pub(crate) fn try_park(&mut self, index: u32, freed: Freed) -> bool {
        let st = &*self.st;
        if !(st.fast.enabled
            && freed.size == st.fast.recent_size
            && !freed.had_stack
            && !st.blocks[index].is_expandable()
            && !freed.prev_free
            && !self.a.settings.uncached())
        {
            return false;
        }
        let pool = st.blocks[index].pool;
        let gc_base = st.pools[pool as usize].gc_now();
        let parked_next = if freed.next_free {
            let n = &st.blocks[freed.next];
            let (n_size, n_next) = (n.size, n.next);
            let split = freed.prev != NIL || n_next != NIL;
            if cfg!(tensormem_ab_no_small_twins) {
                self.park_figures(freed.small, split, freed.size, n_size, freed.requested);
            } else if freed.small {
                self.park_figures(true, split, freed.size, n_size, freed.requested);
            } else {
                self.park_figures(false, split, freed.size, n_size, freed.requested);
            }
            freed.next
        } else {
            let split = freed.prev != NIL || freed.next != NIL;
            if cfg!(tensormem_ab_no_small_twins) {
                self.park_whole_figures(freed.small, split, freed.size, freed.requested);
            } else if freed.small {
                self.park_whole_figures(true, split, freed.size, freed.requested);
            } else {
                self.park_whole_figures(false, split, freed.size, freed.requested);
            }
            NIL
        };
        // The limits as of after the figures' updates (one of them may have passed a limit).
        self.st.fast.parked = Some(Parked {
            block: index,
            next: parked_next,
            gc_base,
            limits_epoch: self.shard.figures.limits_epoch(),
        });
        true
    }

    /// The figures of a free that parks a block with no free neighbour (pool type `small`): those
    /// of freeing an allocated block, and (`split`: the block is part of a split segment) of a split
    /// free block appearing.
    #[inline(always)]
    fn park_whole_figures(&self, small: bool, split: bool, size: u64, requested: u64) {
        if split {
            self.parked_split_freed(small, size, true);
        }
        self.shard
            .figures
            .defer_free(small, size, requested, 0, 0, &self.a.book);
    }

    /// The figures of a free that parks its block (pool type `small`): those of freeing an
    /// allocated block (`allocation`, `allocated_bytes`, `active`, `active_bytes`,
    /// `requested_bytes` go down) and of merging its free next neighbour of `n_size` bytes into it
    /// (`split`: the merged block is still part of a split segment).
    #[inline(always)]
    fn park_figures(
        &self,
        small: bool,
        split: bool,
        original_size: u64,
        n_size: u64,
        requested: u64,
    ) {
        let figures = &self.shard.figures;
        if split {
            // One split free block (`next`) becomes another (the merged one): `+ original_size`.
            self.parked_split_freed(small, original_size, false);
            figures.defer_free(small, original_size, requested, 0, 0, &self.a.book);
        } else {
            // A split free block (`next`) becomes a whole segment.
            figures.defer_free(small, original_size, requested, 1, n_size, &self.a.book);
        }
    }
}
