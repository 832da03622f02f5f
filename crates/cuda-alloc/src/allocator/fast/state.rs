//! The fast path's state, held by each shard as one opaque [`FastPath`], and the one test of whether
//! its memo still holds ([`HotPair::still_valid`]).

use crate::block::{Arena, Block, NIL};
use crate::pool::Pool;
use crate::stats::peaks::{Figures, PeakBook};

/// Everything the fast path keeps for one stream, under the stream's lock: the parked block, the
/// memo of the last hand-back, and the size handed out last. The plain path sees it only through
/// the methods below (settle, note a hand-out, switch off).
#[derive(Debug)]
pub(crate) struct FastPath {
    /// Whether frees may park (the run-time switch, [`CachingAllocator::set_fast_path_enabled`]).
    /// While `false`, nothing is parked and there is no memo, so every call takes the plain path.
    ///
    /// [`CachingAllocator::set_fast_path_enabled`]: crate::CachingAllocator::set_fast_path_enabled
    pub(super) enabled: bool,
    /// A freed block whose merge (or insertion into the free set) is deferred. The state under the
    /// lock is defined as the one with it settled; every lock but the allocation path's settles it.
    pub(super) parked: Option<Parked>,
    /// The last parked block handed back after its checks, and what those checks depended on.
    pub(super) hot: Option<HotPair>,
    /// The size of the block handed out last: a free parks only a block of this size, so that
    /// workloads of mixed sizes do not park blocks that the next allocation cannot take back.
    pub(super) recent_size: u64,
}

impl FastPath {
    /// The state of a new shard; `enabled`: the allocator's switch.
    pub(crate) fn new(enabled: bool) -> Self {
        FastPath {
            enabled,
            parked: None,
            hot: None,
            recent_size: 0,
        }
    }

    /// Whether a block is parked (the allocation path asks to unpark it first).
    #[inline(always)]
    pub(crate) fn is_parked(&self) -> bool {
        self.parked.is_some()
    }

    /// The parked block and its free next neighbour ([`NIL`] when it merges with nothing), for the
    /// invariant walk.
    pub(crate) fn parked_pair(&self) -> Option<(u32, u32)> {
        self.parked.map(|p| (p.block, p.next))
    }

    /// Whether a memo of the last hand-back is kept (for the tests that check the lanes).
    #[cfg(test)]
    pub(crate) fn has_memo(&self) -> bool {
        self.hot.is_some()
    }

    /// Whether frees may park.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Switches the fast path on or off. Call with nothing parked (the lock settled): switched off,
    /// the memo goes too, so neither lane can be taken again.
    pub(crate) fn set_enabled(&mut self, enabled: bool) {
        debug_assert!(self.parked.is_none(), "switched with a block parked");
        self.enabled = enabled;
        self.hot = None;
    }

    /// A block of `size` bytes was handed out by the plain path.
    #[inline(always)]
    pub(crate) fn handed_out(&mut self, size: u64) {
        self.recent_size = size;
    }

    /// Carries out a deferred merge, if any: `blocks` and `pools` become what freeing the parked
    /// block would have made them, and `figures` (the shard's) apply their record of the free.
    #[inline(always)]
    pub(crate) fn settle(&mut self, blocks: &mut Arena, pools: &mut [Pool], figures: &Figures) {
        if self.parked.is_some() {
            self.settle_parked(blocks, pools, figures);
        }
    }

    #[cold]
    #[inline(never)]
    fn settle_parked(&mut self, blocks: &mut Arena, pools: &mut [Pool], figures: &Figures) {
        let Some(parked) = self.parked.take() else {
            return;
        };
        figures.apply_deferred_free();
        blocks[parked.block].gc_count_base = parked.gc_base;
        if parked.next == NIL {
            let b = &blocks[parked.block];
            let (size, addr, pool) = (b.size, b.addr, b.pool);
            pools[pool as usize].free.insert(size, addr, parked.block);
            return;
        }
        let (n_size, n_addr) = blocks.absorb_next(parked.block);
        let b = &blocks[parked.block];
        let (size, addr, pool) = (b.size, b.addr, b.pool);
        pools[pool as usize]
            .free
            .rekey((n_size, n_addr), (size, addr), parked.block);
    }
}

/// A freed block whose merge with its free next neighbour is deferred.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Parked {
    /// The freed block: no longer allocated, in no free set.
    pub(super) block: u32,
    /// Its next neighbour: free, in its pool's free set under its own key; [`NIL`] when the block
    /// merges with nothing (its insertion into the free set is what is deferred).
    pub(super) next: u32,
    /// The pool's clock at the free (the `gc_count_base` of the block the free set gets).
    pub(super) gc_base: u64,
    /// The shard's [`limits_epoch`](crate::stats::peaks::Figures::limits_epoch) right after the
    /// free's figure updates: while it stands still, handing the block back restores figures that
    /// were within their limits, and needs no comparison with them.
    pub(super) limits_epoch: i64,
}

/// What the policy checks of handing a parked block back depended on. A block's key changes only
/// with a change of its pool's free set (its own insertion, a merge with a neighbour in the set, a
/// split's re-keyed remainder), and the rules only with the settings, so equal verdicts mean equal
/// answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Verdict {
    pub(super) block: u32,
    pub(super) next: u32,
    /// The block's pool: another pool's version numbers are another count.
    pub(super) pool: u16,
    pub(super) free_version: u64,
    pub(super) settings_version: u64,
}

/// What the last parked block handed back after its checks leaves for the next pair: the memo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HotPair {
    /// The checks' verdict.
    pub(super) verdict: Verdict,
    /// The record's [`stamp`](Figures::record_stamp) when the block was handed back.
    record: i64,
    /// The block was handed back for the request its free recorded, and is smaller than
    /// `max_split_size` (no oversize count to keep): its next free and allocation may take the
    /// express lane.
    pub(super) express: bool,
    /// The merged block (or the whole one, with no free neighbour) is part of a split segment.
    pub(super) split: bool,
    /// The block's pool clock right after the hand-back (garbage collection's, ticked by every best
    /// fit while collection is on): what an express free takes as the clock while collection is
    /// off, without loading it. Express allocations leave it as it is: one that ticks the clock has
    /// collection on, and it cannot be off at the next free.
    pub(super) clock: u64,
}

/// Which use of the memo [`HotPair::still_valid`] is asked about, with where that use reads the
/// state of now (by reference: each is read only if the tests before it passed).
#[derive(Clone, Copy)]
pub(super) enum Lane<'a> {
    /// Handing the parked block back without repeating the policy checks (any call).
    Checks,
    /// Freeing the memo's block by the express lane (a quiet call).
    ExpressFree {
        /// The block.
        block: &'a Block,
        /// The shard's figures (the record's stamp).
        figures: &'a Figures,
        /// The size handed out last.
        recent_size: u64,
        /// Whether the shard keeps any call stack (history was on); asked last, only if every
        /// other test passed.
        stacks_kept: &'a dyn Fn() -> bool,
    },
    /// Handing the parked block back by the express lane (a quiet call).
    ExpressAlloc {
        /// The parked block, and its park.
        block: &'a Block,
        parked: &'a Parked,
        /// This request's size.
        orig: u64,
        /// The shard's figures (the limits' epoch).
        figures: &'a Figures,
    },
}

impl HotPair {
    /// The memo `verdict` describes, handed back now (`figures`: the shard's). Puts the shard on
    /// the book's list of loose shards before it reads the record's stamp: while the stamp stands
    /// still, the shard stays there, so the express lane's free, which decreases without
    /// [`loosen`](Figures::loosen), needs no look at the list (see
    /// [`defer_same_free`](Figures::defer_same_free)).
    #[inline(always)]
    pub(super) fn new(
        verdict: Verdict,
        figures: &Figures,
        book: &PeakBook,
        express: bool,
        split: bool,
        clock: u64,
    ) -> Self {
        figures.loosen(book);
        HotPair {
            verdict,
            record: figures.record_stamp(),
            express,
            split,
            clock,
        }
    }

    /// The fast path's one validity test: whether the memo still answers for `now` (the verdict
    /// the checks would reach on the current state) in `lane`. Every event that invalidates it is
    /// listed here, and nowhere else:
    ///
    /// 1. another block, another free neighbour or another pool (`now`'s first fields);
    /// 2. any change of the pool's free set (its version): a neighbour freed, allocated, split or
    ///    merged; a block inserted, removed or re-keyed anywhere in the pool (which may put a better
    ///    fit below the block);
    /// 3. any change of the settings (their version): caching switched, `max_split_size`,
    ///    `max_non_split_rounding_size`, expandable segments, rounding;
    /// 4. the fast path switched off: the memo is dropped ([`FastPath::set_enabled`]).
    ///
    /// The express lanes skip more than the checks, so they also need:
    ///
    /// 5. the last hand-back allowed them (`express`: the request its free recorded, below
    ///    `max_split_size`);
    /// 6. for a free: the record's amounts unchanged (its stamp), the block of the size handed out
    ///    last, no use on another stream, no call stack kept in the shard;
    /// 7. for an allocation: the request its free recorded, and the limits unchanged since the
    ///    free (their epoch), so the figures it restores were within them.
    #[inline(always)]
    pub(super) fn still_valid(&self, now: &Verdict, lane: Lane<'_>) -> bool {
        let v = &self.verdict;
        if !(v.block == now.block
            && v.next == now.next
            && v.pool == now.pool
            && v.free_version == now.free_version
            && v.settings_version == now.settings_version)
        {
            return false;
        }
        match lane {
            Lane::Checks => true,
            Lane::ExpressFree {
                block,
                figures,
                recent_size,
                stacks_kept,
            } => {
                self.express
                    && figures.record_stamp() == self.record
                    && block.size == recent_size
                    && !block.used_elsewhere
                    && !stacks_kept()
            }
            Lane::ExpressAlloc {
                block,
                parked,
                orig,
                figures,
            } => {
                self.express
                    && block.requested == orig
                    && parked.limits_epoch == figures.limits_epoch()
            }
        }
    }
}
