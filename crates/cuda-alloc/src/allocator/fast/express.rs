//! The express lane of a hot pair: the same block freed and handed out again, with nothing else
//! changed in between, skips the decisions it made the last time.
//!
//! Everything a free's parking decision reads is either fixed for the block's life or covered by
//! the memo ([`HotPair::still_valid`] lists each):
//!
//! - its neighbours, and whether they are free: a neighbour that is freed, allocated, split or
//!   merged changes the pool's free set (one whose free parks it instead is settled into the free
//!   set by the lock of the next free);
//! - the settings (caching on or off, `max_split_size`, expandable segments): their version;
//! - the amounts the free writes to the record (the block's size, its request, the split figures):
//!   equal while the record's stamp stands still, since the block's request is the one its last
//!   free recorded (`express` is only set when the allocation asked for exactly that);
//! - the shard's stack tables, the block's other-stream uses and the size handed out last: read
//!   directly.
//!
//! So an express free writes what the usual path would (the block no longer allocated, the
//! record's flag, the split figures where the merged block stays split, the parked block with the
//! clock's reading and the limits' epoch) without deciding anything, and an express allocation
//! undoes it the way `Locked::unpark` does for a block whose checks it remembered and whose
//! figures it restores.

use std::sync::atomic::Ordering::Relaxed;

use super::state::{HotPair, Lane, Parked, Verdict};
use crate::allocator::{Allocation, Locked};
use crate::block::NIL;
use crate::device::Device;

impl<D: Device> Locked<'_, D> {
    /// Whether a block of `size` bytes handed back for a request of `orig` bytes (its free recorded
    /// `requested`) may take the express lane next time: the same request, and no oversize count
    /// to keep ([`policy::is_oversize`](crate::allocator::policy::is_oversize)).
    #[inline(always)]
    pub(super) fn express_after(&self, size: usize, orig: usize, requested: u64) -> bool {
        orig as u64 == requested
            && !crate::allocator::policy::is_oversize(size, self.a.settings.max_split_size())
    }

    /// Frees allocated block `index` by the express lane if the shard's memo names it and is
    /// [still valid](HotPair::still_valid) for an express free: parks it as the usual path would,
    /// and returns `true`; otherwise changes nothing and returns `false`. For quiet calls only,
    /// after the pointer index was updated.
    #[inline(always)]
    pub(crate) fn park_express(&mut self, index: u32) -> bool {
        let st = &*self.st;
        let Some(hot) = &st.fast.hot else {
            return false;
        };
        if hot.verdict.block != index || !hot.express {
            return false;
        }
        debug_assert!(
            st.fast.parked.is_none(),
            "the free's lock settles a parked block"
        );
        let b = &st.blocks[index];
        let p = &st.pools[b.pool as usize];
        let figures = &self.shard.figures;
        let now = Verdict {
            block: index,
            next: hot.verdict.next,
            pool: b.pool,
            free_version: p.free.version(),
            settings_version: self.a.settings.version(),
        };
        let lane = Lane::ExpressFree {
            block: b,
            figures,
            recent_size: st.fast.recent_size,
            stacks_kept: &|| !st.stacks.is_empty() || !st.free_stacks.is_empty(),
        };
        if !hot.still_valid(&now, lane) {
            return false;
        }
        let (size, small, hot) = (b.size, p.small, *hot);
        // With garbage collection off, no best fit ticked any clock since the hand-back: collection
        // only ever turns on through the settings (whose version is unchanged) or a memory fraction
        // (which, once set, stays set), so it was off all along. The clock still reads `hot.clock`,
        // which saves the pair a load of the shared clock.
        let gc_base = if self.a.gc_enabled() {
            p.gc_now()
        } else {
            hot.clock
        };
        self.st.blocks[index].allocated = false;
        if hot.split {
            self.parked_split_freed(small, size, hot.verdict.next == NIL);
        }
        figures.defer_same_free();
        self.st.fast.parked = Some(Parked {
            block: index,
            next: hot.verdict.next,
            gc_base,
            limits_epoch: figures.limits_epoch(),
        });
        #[cfg(test)]
        self.a.express_frees.fetch_add(1, Relaxed);
        true
    }

    /// Hands `parked` back by the express lane (of `size` bytes, for a request of `orig`; the
    /// caller found the memo `hot` still valid for an express allocation): what `Locked::unpark`
    /// does for a checked block whose figures it restores, less what the last pair already wrote
    /// (the memo, the blocks' requests, the head's clock reading).
    #[inline(always)]
    pub(super) fn unpark_express(
        &mut self,
        hot: HotPair,
        parked: Parked,
        size: usize,
        orig: usize,
    ) -> Allocation {
        let gc = self.a.gc_enabled();
        let st = &mut *self.st;
        let pool = st.blocks[parked.block].pool;
        let p = &st.pools[pool as usize];
        // Best fit's clock tick. The clock readings the usual path then writes (the remainder's,
        // and the handed-out block's) are never read: garbage collection only looks at free blocks
        // that are whole segments, and both are replaced before either can become one.
        if gc {
            p.gc_clock.fetch_add(1, Relaxed);
        }
        let small = p.small;
        st.fast.parked = None;
        let b = &mut st.blocks[parked.block];
        b.allocated = true;
        b.generation = b.generation.wrapping_add(1);
        let (addr, generation) = (b.addr, b.generation);
        if hot.split {
            self.parked_split_taken::<true>(small, size as u64, parked.next == NIL);
        }
        self.shard.figures.complete_pair();
        if self.a.pointer_index_on() {
            self.st.allocated.insert(addr, parked.block);
        }
        self.handle(addr, size as u64, orig, parked.block, generation)
    }
}
