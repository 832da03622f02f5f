//! Deferred merges: the repeated alloc+free of one size on one stream without splitting and merging
//! the same two blocks every time.
//!
//! Freeing block `B` whose next neighbour `R` is free (and whose previous one is not) merges them:
//! `R` leaves the arena, `B` grows over it, and `R`'s free-set entry is re-keyed to the merged block.
//! Allocating `B`'s size again then finds the merged block by best fit and splits it back into `B`
//! and `R`. Here the free only *parks* `B` ([`Parked`]): everything anyone can see without the
//! stream's lock (statistics, trace entries) reads at once as the merge would make it, but the
//! blocks and the free set are left as they are. The state under the lock is then *defined* as the
//! merged one, and two things keep that true:
//!
//! - every way of taking a shard's lock settles a parked block first
//!   ([`ShardState::settle`]: the merge, as it would have been done at the free), except the
//!   allocation path, which first asks [`Locked::unpark`];
//! - [`Locked::unpark`] hands `B` out again only where the allocator would make exactly that
//!   decision: same pool, `B`'s size, the merged block the best fit (no other free block of at least
//!   that size keyed below it; the oversize rules pass), and the split rule splitting it at `B`'s
//!   size. Splitting the merged block there gives back `B` and `R` with their addresses and sizes,
//!   so only the figures and fields the split would set are set (the statistics of the split, `R`'s
//!   garbage-collection age, `B`'s generation). Anything else settles and takes the usual path.
//!
//! A freed block with no free neighbour at all (a whole segment, or one between two blocks in use)
//! is parked the same way with no `next`: what is deferred is its insertion into the free set, and
//! [`Locked::unpark`] hands it out again where best fit would take it (no free block of at least its
//! size keyed below it, the oversize rules passing); a block of exactly the request's size is never
//! split.
//!
//! The statistics a hot pair changes mostly come back to where they were. The free of a parked
//! block lowers its allocation figures (`allocation`, `allocated_bytes`, `active`, `active_bytes`,
//! `requested_bytes`) on the shard's record of deferred figures only
//! ([`Deferred`](crate::stats::peaks)), which every reader of the statistics adds in; handing the
//! block out again for the same request with the shard's limits unchanged since (their epoch) only
//! counts a pair on the record; anything else applies the record first and updates the figures the
//! usual way. The split figures go on the record too where the merge would make a whole segment (a
//! decrease); where it stays split they are updated at once (an increase at the free must meet the
//! limits when it happens).
//!
//! The checks of [`Locked::unpark`] depend only on the two blocks, the pool's free set and the
//! settings, none of which a hot pair changes: a block handed back after its checks leaves a
//! [`Verdict`] (the blocks, their pool, the free set's and the settings' version numbers, kept in
//! the shard's [`HotPair`]), and the same block parked again with the same neighbour, against the
//! same versions, is handed back without them. Where nothing else changed either, the block's next
//! free and allocation skip the rest of their decisions too: the express lane of
//! `allocator/hot_pair.rs`.
//!
//! Blocks keep their arena slots instead of trading them (slots are not visible: snapshots order
//! segments by address, handles carry a generation). The unit test `deferred_merges_decide_alike`
//! runs random sequences on two allocators, one with merges deferred and one without, and compares
//! every address, statistic and snapshot.

use std::sync::atomic::Ordering::Relaxed;

use super::hot_pair::HotPair;
use super::policy;
use super::{Allocation, Locked};
use crate::block::NIL;
use crate::device::Device;
use crate::shard::ShardState;
use crate::stack::Stack;
use crate::stats::peaks::{Figures, Kind, OVERSIZE_ALLOCATIONS};
use crate::trace::Action;

/// A freed block whose merge with its free next neighbour is deferred.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Parked {
    /// The freed block: no longer allocated, in no free set.
    pub(crate) block: u32,
    /// Its next neighbour: free, in its pool's free set under its own key; [`NIL`] when the block
    /// merges with nothing (its insertion into the free set is what is deferred).
    pub(crate) next: u32,
    /// The pool's clock at the free (the `gc_count_base` of the block the free set gets).
    pub(crate) gc_base: u64,
    /// The shard's [`limits_epoch`](crate::stats::peaks::Figures::limits_epoch) right after the
    /// free's figure updates: while it stands still, handing the block back restores figures that
    /// were within their limits, and needs no comparison with them.
    pub(crate) limits_epoch: i64,
}

impl<D: Device> ShardState<D> {
    /// Carries out a deferred merge, if any: the state becomes what freeing the parked block would
    /// have made it. Called whenever the shard's lock is taken (see the module documentation).
    /// `figures`: the shard's, whose record of the parked free is applied too.
    #[inline(always)]
    pub(crate) fn settle(&mut self, figures: &Figures) {
        if self.parked.is_some() {
            self.settle_parked(figures);
        }
    }

    #[cold]
    #[inline(never)]
    fn settle_parked(&mut self, figures: &Figures) {
        let Some(parked) = self.parked.take() else {
            return;
        };
        figures.apply_deferred_free();
        let blocks = &mut self.blocks;
        if parked.next == NIL {
            let b = &mut blocks[parked.block];
            b.gc_count_base = parked.gc_base;
            let (size, addr, pool) = (b.size, b.addr, b.pool);
            self.pools[pool as usize]
                .free
                .insert(size, addr, parked.block);
            return;
        }
        let n = &blocks[parked.next];
        let (n_size, n_addr, n_next) = (n.size, n.addr, n.next);
        let b = &mut blocks[parked.block];
        b.next = n_next;
        b.size += n_size;
        b.gc_count_base = parked.gc_base;
        let (size, addr, pool) = (b.size, b.addr, b.pool);
        if n_next != NIL {
            blocks[n_next].prev = parked.block;
        }
        blocks.remove(parked.next);
        self.pools[pool as usize]
            .free
            .rekey((n_size, n_addr), (size, addr), parked.block);
    }
}

/// A parked block that [`Locked::unpark`] handed back after checking it, and what the checks
/// depended on. A block's key changes only with a change of its pool's free set (its own insertion,
/// a merge with a neighbour in the set, a split's re-keyed remainder), and the rules only with the
/// settings, so equal versions mean equal answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(super) block: u32,
    pub(super) next: u32,
    /// The block's pool: another pool's version numbers are another count.
    pub(super) pool: u16,
    pub(super) free_version: u64,
    pub(super) settings_version: u64,
}

impl<D: Device> super::CachingAllocator<D> {
    /// Whether frees may defer merges: always, except in the tests that compare with the plain path.
    #[inline(always)]
    pub(crate) fn defers_merges(&self) -> bool {
        #[cfg(test)]
        {
            self.defer_merges.load(Relaxed)
        }
        #[cfg(not(test))]
        {
            true
        }
    }
}

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
        let parked = self.st.parked?;
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
        let hot = match st.hot {
            Some(hot) if hot.verdict == verdict => Some(hot),
            _ => None,
        };
        let checked = hot.is_some();
        if let Some(hot) = hot {
            if QUIET && self.may_unpark_express(hot, parked, orig) {
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
                    p.small,
                    settings.expandable_segments(),
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
        st.parked = None;
        st.hot = Some(HotPair::new(
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
        if small {
            self.unpark_figures::<true>(already_split, size as u64, n_size, orig as u64, restore);
        } else {
            self.unpark_figures::<false>(already_split, size as u64, n_size, orig as u64, restore);
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
        self.st.parked = None;
        self.st.hot = Some(HotPair::new(
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
        let (addr, generation) = (b.addr, b.generation);
        if let Some(stack) = stack {
            self.st.stacks.insert(u64::from(index), stack.clone());
        }
        self.note::<QUIET>(Action::Alloc, addr, orig as u64, stack);
        if self.a.pointer_index_on() {
            self.st.allocated.insert(addr, index);
        }
        if size >= self.a.settings.max_split_size() {
            self.inc_figure(OVERSIZE_ALLOCATIONS, 1);
        }
        self.handle(addr, size as u64, orig, index, generation)
    }

    /// The inactive-split figures of a parked block of `size` bytes, part of a split segment, as
    /// freeing it makes them: its bytes join the split free blocks', and with no free neighbour
    /// (`whole`) it is one more of them (merged into its free next neighbour, it replaces one).
    #[inline(always)]
    pub(super) fn parked_split_freed(&self, small: bool, size: u64, whole: bool) {
        if whole {
            self.inc(Kind::InactiveSplit, small, 1);
        }
        self.inc(Kind::InactiveSplitBytes, small, size);
    }

    /// The reverse of [`parked_split_freed`](Self::parked_split_freed), for the parked block handed
    /// back. `COVERED`: the caller covers the look at the book's list of loose shards (the express
    /// lane, see [`Locked::dec_covered`]).
    #[inline(always)]
    pub(super) fn parked_split_taken<const COVERED: bool>(
        &self,
        small: bool,
        size: u64,
        whole: bool,
    ) {
        if COVERED {
            self.dec_covered(Kind::InactiveSplitBytes, small, size);
            if whole {
                self.dec_covered(Kind::InactiveSplit, small, 1);
            }
        } else {
            self.dec(Kind::InactiveSplitBytes, small, size);
            if whole {
                self.dec(Kind::InactiveSplit, small, 1);
            }
        }
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

    /// The figures of handing a parked block of `size` bytes out again (pool type `SMALL`): those
    /// of splitting the merged block into it and a remainder of `n_size` bytes (`already_split`:
    /// the merged block was part of a split segment), then of the allocation (`on_alloc`).
    /// `restore`: the increases only undo the free's decreases ([`restores`](Self::restores)).
    #[inline(always)]
    fn unpark_figures<const SMALL: bool>(
        &self,
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
                self.parked_split_taken::<false>(SMALL, size, false);
            }
            figures.complete_pair();
            return;
        }
        figures.apply_deferred_free();
        if already_split {
            self.parked_split_taken::<false>(SMALL, size, false);
        } else {
            self.inc(Kind::InactiveSplitBytes, SMALL, n_size);
            self.inc(Kind::InactiveSplit, SMALL, 1);
        }
        figures.on_alloc_in::<SMALL>(size, orig, &self.a.book, &self.a.streams);
    }
}

#[cfg(all(test, not(loom)))]
pub(super) mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use proptest::prelude::*;

    use crate::backend::sim::SimDevice;
    use crate::config::AllocatorConfig;
    use crate::{Allocation, CachingAllocator, StreamId};

    pub(in crate::allocator) const STREAMS: [StreamId; 2] = [StreamId(0x10), StreamId(0x20)];
    /// Sizes that repeat (so frees park and allocations of the same size follow), across the small
    /// and large pools, the split rules (20 MiB segments filled to their last MiB) and the oversize
    /// limit of the configurations below.
    const SIZES: [usize; 9] = [
        512,
        1536,
        4096,
        (1 << 20) + 1,
        3 << 20,
        8 << 20,
        9 << 20,
        25 << 20,
        64 << 20,
    ];
    const CONFIGS: [&str; 4] = [
        "",
        "max_split_size_mb:20",
        "expandable_segments:True",
        "garbage_collection_threshold:0.5,max_split_size_mb:40,max_non_split_rounding_mb:30",
    ];

    #[derive(Clone, Debug)]
    pub(in crate::allocator) enum Op {
        Alloc {
            size: usize,
            stream: usize,
        },
        /// Allocate the size last freed, on its stream (the hot pair's allocation).
        Again,
        /// `raw_alloc` (the pointer index on from then on).
        RawAlloc {
            size: usize,
            stream: usize,
        },
        /// `raw_free` of the newest pointer.
        RawFreeNewest,
        /// Free the newest live allocation (the hot pair's free).
        FreeNewest,
        Free {
            pick: usize,
        },
        RecordStream {
            pick: usize,
            stream: usize,
        },
        Complete {
            stream: usize,
        },
        EmptyCache,
        /// Replace the settings by one of `CONFIGS` (what a handed-back block was checked against
        /// changes). The invariant walk is skipped afterwards: it counts oversize blocks by the
        /// current `max_split_size`, the figures by the one at the time (as PyTorch's do).
        Reconfigure(usize),
        /// Compare the snapshots and walk the invariants (both take the locks, which settles a
        /// parked block: not after every step, or nothing would stay parked).
        Check,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..SIZES.len(), prop_oneof![4 => Just(0usize), 1 => Just(1usize)])
                .prop_map(|(s, stream)| Op::Alloc { size: SIZES[s], stream }),
            3 => Just(Op::Again),
            1 => (0..SIZES.len(), 0usize..2).prop_map(|(s, stream)| Op::RawAlloc { size: SIZES[s], stream }),
            1 => Just(Op::RawFreeNewest),
            4 => Just(Op::FreeNewest),
            3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
            1 => (any::<usize>(), 0usize..2).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
            1 => (0usize..2).prop_map(|stream| Op::Complete { stream }),
            1 => Just(Op::EmptyCache),
            1 => (0..CONFIGS.len()).prop_map(Op::Reconfigure),
            1 => Just(Op::Check),
        ]
    }

    pub(in crate::allocator) fn allocator(
        config: &str,
        defer: bool,
    ) -> CachingAllocator<SimDevice> {
        let a = CachingAllocator::with_config(
            // The same invented addresses for both allocators.
            SimDevice::with_fixed_addresses(0, 512 << 20),
            AllocatorConfig::parse(config).expect("valid config"),
        );
        if config.contains("garbage_collection") {
            a.set_memory_fraction(0.9).expect("valid fraction");
        }
        a.defer_merges.store(defer, Relaxed);
        a
    }

    /// One allocator defers merges, the other never does: every call must come out the same
    /// (addresses, sizes, errors), and so must the statistics and the snapshot after it. Returns
    /// how many frees of the deferring allocator took the express lane (`hot_pair.rs`).
    pub(in crate::allocator) fn run(config: &str, ops: &[Op]) -> Result<u64, TestCaseError> {
        let fast = allocator(config, true);
        let plain = allocator(config, false);
        let mut live: Vec<(Allocation, Allocation)> = Vec::new();
        let mut last_freed = None;
        let mut raw_live: Vec<(crate::DeviceAddress, crate::DeviceAddress)> = Vec::new();
        let mut reconfigured = false;
        for op in ops {
            let op = match *op {
                Op::Again => match last_freed {
                    Some((size, stream)) => Op::Alloc { size, stream },
                    None => continue,
                },
                ref op => op.clone(),
            };
            match op {
                Op::Alloc { size, stream } => {
                    let (x, y) = (
                        fast.allocate(size, STREAMS[stream]),
                        plain.allocate(size, STREAMS[stream]),
                    );
                    match (x, y) {
                        (Ok(x), Ok(y)) => {
                            prop_assert_eq!((x.ptr(), x.size()), (y.ptr(), y.size()));
                            live.push((x, y));
                        }
                        (Err(x), Err(y)) => prop_assert_eq!(x.to_string(), y.to_string()),
                        (x, y) => prop_assert!(false, "{x:?} against {y:?}"),
                    }
                }
                Op::FreeNewest | Op::Free { .. } if !live.is_empty() => {
                    let at = match op {
                        Op::Free { pick } => pick % live.len(),
                        _ => live.len() - 1,
                    };
                    let (x, y) = live.remove(at);
                    let stream = STREAMS.iter().position(|&s| s == x.stream());
                    last_freed = stream.map(|stream| (x.requested_size(), stream));
                    fast.free(x)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    plain
                        .free(y)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::RecordStream { pick, stream } if !live.is_empty() => {
                    let (x, y) = &live[pick % live.len()];
                    fast.record_stream(x, STREAMS[stream])
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    plain
                        .record_stream(y, STREAMS[stream])
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::Complete { stream } => {
                    fast.device().complete_stream_work(STREAMS[stream]);
                    plain.device().complete_stream_work(STREAMS[stream]);
                }
                Op::EmptyCache => {
                    fast.empty_cache()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    plain
                        .empty_cache()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::Reconfigure(config) => {
                    reconfigured = true;
                    let config = AllocatorConfig::parse(CONFIGS[config]).expect("valid config");
                    fast.set_config(&config);
                    plain.set_config(&config);
                }
                Op::RawAlloc { size, stream } => {
                    match (
                        fast.raw_alloc(size, STREAMS[stream]),
                        plain.raw_alloc(size, STREAMS[stream]),
                    ) {
                        (Ok(x), Ok(y)) => {
                            prop_assert_eq!(x, y);
                            raw_live.push((x, y));
                        }
                        (Err(x), Err(y)) => prop_assert_eq!(x.to_string(), y.to_string()),
                        (x, y) => prop_assert!(false, "{x:?} against {y:?}"),
                    }
                }
                Op::RawFreeNewest if !raw_live.is_empty() => {
                    let (x, y) = raw_live.pop().expect("not empty");
                    fast.raw_free(x)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    plain
                        .raw_free(y)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::Check => {
                    prop_assert_eq!(fast.snapshot(), plain.snapshot());
                    if !reconfigured {
                        fast.check_invariants()
                            .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    }
                }
                _ => {}
            }
            // Statistics are read without the shard locks: they must agree with a block parked.
            prop_assert_eq!(fast.memory_stats(), plain.memory_stats());
        }
        if !reconfigured {
            fast.check_invariants()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        for (x, y) in live {
            fast.free(x)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            plain
                .free(y)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        for (x, y) in raw_live {
            fast.raw_free(x)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            plain
                .raw_free(y)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        prop_assert_eq!(fast.memory_stats(), plain.memory_stats());
        prop_assert_eq!(fast.snapshot(), plain.snapshot());
        Ok(fast.express_frees.load(Relaxed))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn deferred_merges_decide_alike(
            config in 0usize..CONFIGS.len(),
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            run(CONFIGS[config], &ops)?;
        }
    }

    /// A handed-back block's checks are not reused once the free set changed: `X` (512 B, between
    /// two blocks in use) becomes free while `B` is allocated, so the next 512 B request must get
    /// `X`, not `B` parked again.
    #[test]
    fn a_verdict_goes_stale_with_the_free_set() {
        let alloc = Op::Alloc {
            size: 512,
            stream: 0,
        };
        // A, X, C, B; B parked and handed back; X freed (parked, then settled by B's free); again.
        let ops = [
            alloc.clone(),
            alloc.clone(),
            alloc.clone(),
            alloc,
            Op::FreeNewest,
            Op::Again,
            Op::Free { pick: 1 },
            Op::FreeNewest,
            Op::Again,
            Op::Check,
        ];
        run("", &ops).expect("the deferring allocator decides as the plain one");
    }

    /// A hot pair's allocation restores the figures its free lowered without comparing them with
    /// the limits, which is exact only while the limits stand still: here another stream's new peak
    /// hands the parked stream's headroom out meanwhile, and the allocation after it must still
    /// raise the peak (read after the other stream's block is gone, so that reading cannot catch
    /// the peak up with the current sum). Fails if `restores` ignores the limits' epoch.
    #[test]
    fn a_hot_pair_rechecks_limits_that_changed() {
        let ops = [
            Op::Alloc {
                size: 3 << 20,
                stream: 0,
            },
            Op::FreeNewest,
            Op::Alloc {
                size: 8 << 20,
                stream: 1,
            },
            Op::Again,
            Op::Free { pick: 0 },
            Op::Check,
        ];
        run("", &ops).expect("the deferring allocator decides as the plain one");
    }

    /// The same for `requested_bytes`: a hot pair whose second request is larger (the same rounded
    /// size) raises it above where the free found it, so its peak must be compared. Fails if
    /// `restores` ignores the request's size.
    #[test]
    fn a_larger_request_is_compared_with_its_limit() {
        let ops = [
            Op::Alloc {
                size: (3 << 20) - 100,
                stream: 0,
            },
            Op::FreeNewest,
            Op::Alloc {
                size: 3 << 20,
                stream: 0,
            },
            Op::FreeNewest,
            Op::Check,
        ];
        run("", &ops).expect("the deferring allocator decides as the plain one");
    }

    /// A handed-back block's checks are not reused once the settings changed: with
    /// `max_split_size_mb:20` best fit no longer takes the 20 MiB merged block for 3 MiB.
    #[test]
    fn a_verdict_goes_stale_with_the_settings() {
        let ops = [
            Op::Alloc {
                size: 3 << 20,
                stream: 0,
            },
            Op::FreeNewest,
            Op::Again,
            Op::FreeNewest,
            Op::Reconfigure(1),
            Op::Again,
            Op::Check,
        ];
        run("", &ops).expect("the deferring allocator decides as the plain one");
    }

    #[test]
    fn the_hot_pair_parks_and_unparks() {
        let (a, plain) = (allocator("", true), allocator("", false));
        for _ in 0..3 {
            let (x, y) = (
                a.allocate(512, STREAMS[0]).expect("allocates"),
                plain.allocate(512, STREAMS[0]).expect("allocates"),
            );
            assert_eq!(x.ptr(), y.ptr());
            a.free(x).expect("frees");
            plain.free(y).expect("frees");
            let shard = a.streams.get(STREAMS[0]).expect("shard");
            assert!(shard.state.lock().parked.is_some(), "the free parked");
            assert_eq!(a.memory_stats(), plain.memory_stats());
        }
        // A request of another size settles the parked block and takes the usual path.
        let (x, y) = (
            a.allocate(4096, STREAMS[0]).expect("allocates"),
            plain.allocate(4096, STREAMS[0]).expect("allocates"),
        );
        assert_eq!(x.ptr(), y.ptr());
        assert_eq!(a.memory_stats(), plain.memory_stats());
        a.free(x).expect("frees");
        plain.free(y).expect("frees");
        assert_eq!(a.snapshot(), plain.snapshot());
        a.check_invariants().expect("consistent");
    }
}
