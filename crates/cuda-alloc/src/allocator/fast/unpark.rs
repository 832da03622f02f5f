//! The allocation's side of the fast path: handing a parked block out again where best fit and
//! the split rule would take exactly it (see the module documentation of `fast`).

use std::sync::atomic::Ordering::Relaxed;

use super::state::{HotPair, Lane, Parked, Verdict};
use crate::allocator::{policy, Allocation, Locked};
use crate::block::NIL;
use crate::device::Device;
use crate::snapshot::TraceAction;
use crate::stack::Stack;
use crate::stats::peaks::{Kind, OVERSIZE_ALLOCATIONS};

impl<D: Device> Locked<'_, D> {
    /// Hands the parked block out again for a request of `size` bytes (rounded; `orig` asked for)
    /// in pool `pool`, if that is exactly what best fit and splitting the merged block would do (see
    /// the module documentation); `None` (nothing changed) otherwise.
    #[inline(always)]
    pub(crate) fn unpark<const QUIET: bool>(
        &mut self,
        pool: u16,
        size: usize,
        orig: usize,
        stack: Option<&Stack>,
    ) -> Option<Allocation> {
        let parked = self.st.fast.parked?;
        let settings = &self.a.settings;
        let st = &*self.st;
        let b = &st.blocks[parked.block];
        if b.pool != pool || b.size != size as u64 {
            return None;
        }
        let verdict = Verdict {
            block: parked.block,
            next: parked.next,
            pool,
            free_version: st.pools[pool as usize].free.version(),
            settings_version: settings.version(),
        };
        // Plain matches rather than `Option::filter`: with one codegen unit the compiler kept
        // `filter` (of a `HotPair`) as a call, a quarter more instructions per hot pair.
        let hot = match st.fast.hot {
            Some(hot) if hot.still_valid(&verdict, Lane::Checks) => Some(hot),
            _ => None,
        };
        let checked = hot.is_some();
        if let Some(hot) = hot {
            let lane = Lane::ExpressAlloc {
                block: b,
                parked: &parked,
                orig: orig as u64,
                figures: &self.shard.figures,
            };
            if self.express_open::<QUIET>() && hot.still_valid(&verdict, lane) {
                return Some(self.unpark_express(hot, parked, size, orig));
            }
        }
        if parked.next == NIL {
            return self.unpark_whole::<QUIET>(parked, size, orig, stack, verdict, checked);
        }
        let n = &st.blocks[parked.next];
        let p = &st.pools[pool as usize];
        let n_size = n.size;
        if !checked {
            let merged = size as u64 + n_size;
            if !policy::best_fit_allows(settings, size, merged as usize)
                || !policy::should_split(
                    p.no_split,
                    p.small,
                    p.expandable(settings),
                    settings.max_split_size(),
                    size,
                    n_size as usize,
                )
                || !p.free.merged_would_be_first(
                    size as u64,
                    Some((n_size, n.addr)),
                    (merged, b.addr),
                )
            {
                return None;
            }
        }
        // Best fit's clock tick (`get_free_block`), then the split's updates.
        if self.a.gc_enabled() {
            p.gc_clock.fetch_add(1, Relaxed);
        }
        let small = p.small;
        let gc_now = p.gc_now();
        let already_split = b.prev != NIL || n.next != NIL;
        let express = self.express_after(size, orig, b.requested);
        let st = &mut *self.st;
        st.fast.parked = None;
        st.fast.hot = Some(HotPair::new(
            verdict,
            &self.shard.figures,
            &self.a.book,
            express,
            already_split,
            gc_now,
        ));
        // The remainder of the split is the merged block, which was `B` grown: it carries `B`'s
        // last requested size (snapshots show it), and the split's clock reading.
        let b_requested = st.blocks[parked.block].requested;
        let r = &mut st.blocks[parked.next];
        r.gc_count_base = gc_now;
        r.requested = b_requested;
        // As a head made by the split (`Block::new`).
        self.st.blocks[parked.block].gc_count_base = 0;
        let restore = self.restores(parked, b_requested, orig);
        let (size64, orig64) = (size as u64, orig as u64);
        if cfg!(tensormem_ab_no_small_twins) {
            self.unpark_figures(small, already_split, size64, n_size, orig64, restore);
        } else if small {
            self.unpark_figures(true, already_split, size64, n_size, orig64, restore);
        } else {
            self.unpark_figures(false, already_split, size64, n_size, orig64, restore);
        }
        Some(self.hand_back::<QUIET>(parked.block, size, orig, stack))
    }

    /// [`unpark`](Self::unpark) for a block parked with no free neighbour (of the request's `size`
    /// and pool, checked): best fit would take it whole if no free block of at least `size` bytes
    /// is keyed below it and the oversize rules pass (`checked`: `verdict` says so already); a block
    /// of exactly the request's size is never split.
    #[inline(always)]
    fn unpark_whole<const QUIET: bool>(
        &mut self,
        parked: Parked,
        size: usize,
        orig: usize,
        stack: Option<&Stack>,
        verdict: Verdict,
        checked: bool,
    ) -> Option<Allocation> {
        let st = &*self.st;
        let b = &st.blocks[parked.block];
        let p = &st.pools[b.pool as usize];
        if !checked
            && (!policy::best_fit_allows(&self.a.settings, size, size)
                || !p
                    .free
                    .merged_would_be_first(size as u64, None, (size as u64, b.addr)))
        {
            return None;
        }
        if self.a.gc_enabled() {
            p.gc_clock.fetch_add(1, Relaxed);
        }
        let (small, already_split, b_requested) = (p.small, b.is_split(), b.requested);
        let express = self.express_after(size, orig, b_requested);
        let gc_now = p.gc_now();
        self.st.fast.parked = None;
        self.st.fast.hot = Some(HotPair::new(
            verdict,
            &self.shard.figures,
            &self.a.book,
            express,
            already_split,
            gc_now,
        ));
        // What the free would have set.
        self.st.blocks[parked.block].gc_count_base = parked.gc_base;
        let figures = &self.shard.figures;
        let restore = self.restores(parked, b_requested, orig);
        if !restore {
            figures.apply_deferred_free();
        }
        if already_split {
            // A split free block leaves the free set (`alloc_found_block` without a split).
            self.parked_split_taken::<false>(small, size as u64, true);
        }
        if restore {
            figures.complete_pair();
        } else {
            figures.on_alloc(
                small,
                size as u64,
                orig as u64,
                &self.a.book,
                &self.a.streams,
            );
        }
        Some(self.hand_back::<QUIET>(parked.block, size, orig, stack))
    }

    /// The end of both unparking paths, their figures done: block `index` (of `size` bytes, for a
    /// request of `orig`) becomes allocated, with its trace entry, stack and pointer-index entry.
    #[inline(always)]
    fn hand_back<const QUIET: bool>(
        &mut self,
        index: u32,
        size: usize,
        orig: usize,
        stack: Option<&Stack>,
    ) -> Allocation {
        let b = &mut self.st.blocks[index];
        b.allocated = true;
        b.requested = orig as u64;
        b.generation = b.generation.wrapping_add(1);
        // The pool is read for the trace entry only (a quiet call drops it): the parked block's,
        // as the plain path's best fit would record.
        let (addr, generation, pool) = (b.addr, b.generation, b.pool);
        if let Some(stack) = stack {
            self.st.stacks.insert(u64::from(index), stack.clone());
        }
        self.note::<QUIET>(TraceAction::Alloc, addr, orig as u64, pool, stack);
        if self.a.pointer_index_on() {
            self.st.allocated.insert(addr, index);
        }
        if policy::is_oversize(size, self.a.settings.max_split_size()) {
            self.inc_figure(OVERSIZE_ALLOCATIONS, 1);
        }
        self.handle(addr, size as u64, orig, index, generation)
    }

    /// Whether handing `parked` out again for a request of `orig` bytes (the block's last request
    /// was `b_requested`) returns every figure the free changed to the value it had, with the
    /// limits of now: the limits unchanged since the free, and the same request (so that
    /// `requested_bytes` comes back to where it was). Then the figures on the shard's record of
    /// deferred ones need no update at all ([`Figures::complete_pair`]).
    #[inline(always)]
    fn restores(&self, parked: Parked, b_requested: u64, orig: usize) -> bool {
        parked.limits_epoch == self.shard.figures.limits_epoch() && orig as u64 == b_requested
    }

    /// The figures of handing a parked block of `size` bytes out again (pool type `small`): those
    /// of splitting the merged block into it and a remainder of `n_size` bytes (`already_split`:
    /// the merged block was part of a split segment), then of the allocation (`on_alloc`).
    /// `restore`: the increases only undo the free's decreases ([`restores`](Self::restores)).
    #[inline(always)]
    fn unpark_figures(
        &self,
        small: bool,
        already_split: bool,
        size: u64,
        n_size: u64,
        orig: u64,
        restore: bool,
    ) {
        let figures = &self.shard.figures;
        if restore {
            // Where the merged block was a whole segment, the free's split figures are on the
            // record too.
            if already_split {
                self.parked_split_taken::<false>(small, size, false);
            }
            figures.complete_pair();
            return;
        }
        figures.apply_deferred_free();
        if already_split {
            self.parked_split_taken::<false>(small, size, false);
        } else {
            self.inc(Kind::InactiveSplitBytes, small, n_size);
            self.inc(Kind::InactiveSplit, small, 1);
        }
        figures.on_alloc_in(small, size, orig, &self.a.book, &self.a.streams);
    }
}
