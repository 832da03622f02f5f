//! The express lane of a hot pair: the same block freed and handed out again, with nothing else
//! changed in between, skips the decisions it made the last time.
//!
//! A parked block handed back after its checks leaves a [`HotPair`]: the [`Verdict`] of those
//! checks (the block, its free next neighbour, its pool, the version numbers of the pool's free set
//! and of the settings), the stamp of the shard's record of deferred figures, the pool clock's
//! reading, and whether the block's next free and allocation may take the express lane at all.
//! Everything a free's parking decision reads is then either fixed for the block's life or covered
//! by one of those numbers:
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
//! undoes it the way [`Locked::unpark`] does for a block whose checks it remembered and whose
//! figures it restores. Both run only on quiet calls (no trace entry, no stack to keep). The unit
//! test `deferred_merges_decide_alike` (in `parked.rs`) compares every call, statistic and snapshot
//! with an allocator that never defers; the tests below check that the lane is taken, and that each
//! change it must notice sends the next free the usual way.

use std::sync::atomic::Ordering::Relaxed;

use super::parked::Verdict;
use super::{Allocation, Locked, Parked};
use crate::block::NIL;
use crate::device::Device;
use crate::stats::peaks::{Figures, PeakBook};

/// What the last parked block handed back after its checks leaves for the next pair (see the
/// module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HotPair {
    /// The checks' verdict: [`Locked::unpark`] hands the same block back without them while it
    /// holds.
    pub(super) verdict: Verdict,
    /// The record's [`stamp`](Figures::record_stamp) when the block was handed back.
    record: i64,
    /// The block was handed back for the request its free recorded, and is smaller than
    /// `max_split_size` (no oversize count to keep): its next free and allocation may take the
    /// express lane.
    express: bool,
    /// The merged block (or the whole one, with no free neighbour) is part of a split segment.
    split: bool,
    /// The block's pool clock right after the hand-back (garbage collection's, ticked by every best
    /// fit while collection is on): what an express free takes as the clock while collection is
    /// off, without loading it (see [`Locked::park_express`]). Express allocations leave it as it
    /// is: one that ticks the clock has collection on, and it cannot be off at the next free.
    clock: u64,
}

impl HotPair {
    /// The pair `verdict` describes, handed back now (`figures`: the shard's). Puts the shard on
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
}

impl<D: Device> Locked<'_, D> {
    /// Whether a block of `size` bytes handed back for a request of `orig` bytes (its free recorded
    /// `requested`) may take the express lane next time.
    #[inline(always)]
    pub(super) fn express_after(&self, size: usize, orig: usize, requested: u64) -> bool {
        orig as u64 == requested && size < self.a.settings.max_split_size()
    }

    /// Frees allocated block `index` by the express lane if the shard's [`HotPair`] names it and
    /// nothing it depends on changed: parks it as the usual path would, and returns `true`;
    /// otherwise changes nothing and returns `false`. For quiet calls only, after the pointer index
    /// was updated.
    #[inline(always)]
    pub(super) fn park_express(&mut self, index: u32) -> bool {
        let st = &*self.st;
        let Some(hot) = st.hot else {
            return false;
        };
        if hot.verdict.block != index || !hot.express {
            return false;
        }
        debug_assert!(
            st.parked.is_none(),
            "the free's lock settles a parked block"
        );
        let b = &st.blocks[index];
        let p = &st.pools[b.pool as usize];
        let figures = &self.shard.figures;
        if b.pool != hot.verdict.pool
            || p.free.version() != hot.verdict.free_version
            || self.a.settings.version() != hot.verdict.settings_version
            || figures.record_stamp() != hot.record
            || b.size != st.recent_size
            || b.used_elsewhere
            || !st.stacks.is_empty()
            || !st.free_stacks.is_empty()
            || !self.a.defers_merges()
        {
            return false;
        }
        let (size, small) = (b.size, p.small);
        // With garbage collection off, no best fit ticked any clock since the hand-back: collection
        // only ever turns on through the settings (whose version is unchanged) or a memory fraction
        // (which, once set, stays set), so it was off all along. The clock still reads `hot.clock`,
        // and loading it costs the pair time (0.66 -> 0.60 s per 20 M pairs on the dev box).
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
        self.st.parked = Some(Parked {
            block: index,
            next: hot.verdict.next,
            gc_base,
            limits_epoch: figures.limits_epoch(),
        });
        #[cfg(test)]
        self.a.express_frees.fetch_add(1, Relaxed);
        true
    }

    /// Whether [`unpark_express`](Self::unpark_express) may hand `parked` back for a request of
    /// `orig` bytes: the shard's `hot` pair (whose verdict the caller found to be that of
    /// `parked`) allows the lane, the request is the one the free recorded and the limits did not
    /// change since (the figures are restored, as [`Locked::unpark`]'s `restores`).
    #[inline(always)]
    pub(super) fn may_unpark_express(&self, hot: HotPair, parked: Parked, orig: usize) -> bool {
        hot.express
            && self.st.blocks[parked.block].requested == orig as u64
            && parked.limits_epoch == self.shard.figures.limits_epoch()
    }

    /// Hands `parked` back by the express lane (of `size` bytes, for a request of `orig`; see
    /// [`may_unpark_express`](Self::may_unpark_express)): what [`Locked::unpark`] does for a
    /// checked block whose figures it restores, less what the last pair already wrote (the
    /// verdict, the blocks' requests, the head's clock reading).
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
        st.parked = None;
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

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use super::super::parked::tests::{allocator, run, Op, STREAMS};
    use crate::RecordContext;

    /// The hot pair of `size` bytes on stream 0, `pairs` times after its first allocation: the
    /// first free parks, the allocation after it leaves the [`HotPair`](super::HotPair), and
    /// every later pair may take the express lane.
    fn hot_pairs(size: usize, pairs: usize) -> Vec<Op> {
        let mut ops = vec![Op::Alloc { size, stream: 0 }];
        ops.extend(again(pairs));
        ops
    }

    /// `n` hot pairs of the newest allocation: free it, allocate the same again.
    fn again(n: usize) -> impl Iterator<Item = Op> {
        (0..n).flat_map(|_| [Op::FreeNewest, Op::Again])
    }

    /// `ops` after a hot pair of `size` bytes that took the express lane once (the pair's block is
    /// the newest live allocation).
    fn after_express(size: usize, ops: &[Op]) -> Vec<Op> {
        let mut all = hot_pairs(size, 2);
        all.extend_from_slice(ops);
        all.push(Op::Check);
        all
    }

    /// Hot pairs of blocks split from a segment (512 B, 1 MiB, 3 MiB: merged with the free rest)
    /// and of a whole segment (64 MiB, with no free neighbour) take the lane, and the statistics
    /// and snapshots agree with an allocator that never defers (`run` compares them after every
    /// call).
    #[test]
    fn hot_pairs_take_the_express_lane() {
        for size in [512, 1 << 20, 3 << 20, 64 << 20] {
            let mut ops = hot_pairs(size, 10);
            ops.push(Op::Check);
            let express = run("", &ops).expect("decides as the plain allocator");
            assert_eq!(
                express, 10,
                "{size} B: every free after the first hand-back"
            );
        }
    }

    /// Pointer-API hot pairs (`raw_alloc` / `raw_free`) take the lane exactly as handle pairs do,
    /// with the pointer index kept (the run's checks compare it with the allocated blocks).
    #[test]
    fn raw_hot_pairs_take_the_express_lane() {
        for size in [512, 1 << 20, 64 << 20] {
            let mut raw = vec![Op::RawAlloc { size, stream: 0 }];
            for _ in 0..10 {
                raw.extend([Op::RawFreeNewest, Op::RawAlloc { size, stream: 0 }]);
            }
            raw.push(Op::Check);
            let mut handles = hot_pairs(size, 10);
            handles.push(Op::Check);
            let express = run("", &raw).expect("decides as the plain allocator");
            assert!(express > 0, "{size} B: no raw free took the lane");
            assert_eq!(
                express,
                run("", &handles).expect("decides as the plain allocator"),
                "{size} B"
            );
        }
    }

    /// The lane is taken in the garbage-collection configuration too (the clock's readings), for
    /// blocks below its `max_split_size` (40 MiB).
    #[test]
    fn the_express_lane_keeps_the_clock() {
        let config = "garbage_collection_threshold:0.5,max_split_size_mb:40";
        for size in [512, 3 << 20, 32 << 20] {
            let mut ops = hot_pairs(size, 5);
            ops.push(Op::Check);
            assert!(run(config, &ops).expect("decides alike") > 0, "{size} B");
        }
    }

    /// The block before the hot 512 B one freed meanwhile: a 1 KiB block is freed by the usual path
    /// (the size handed out last is 512), a 512 B one is parked and then settled by the hot block's
    /// free taking the lock. Either way the free set changes, and the hot block must merge with it.
    /// Fails if the lane ignores the free set's version.
    #[test]
    fn a_neighbour_freed_meanwhile_stops_the_lane() {
        for before in [1024, 512] {
            let alloc = |size| Op::Alloc { size, stream: 0 };
            let ops = [
                alloc(before),
                alloc(512),
                Op::FreeNewest,
                Op::Again,
                Op::FreeNewest,
                Op::Again,
                Op::Free { pick: 0 },
                Op::FreeNewest,
                Op::Check,
            ];
            let express = run("", &ops).expect("decides as the plain allocator");
            assert_eq!(express, 1, "{before} B before: the second pair's free only");
        }
    }

    /// A block used by another stream stays active after its free until that stream's work
    /// completes. Fails if the lane ignores the block's other-stream uses.
    #[test]
    fn a_block_used_elsewhere_leaves_by_the_usual_path() {
        let ops = after_express(
            512,
            &[
                Op::RecordStream { pick: 0, stream: 1 },
                Op::FreeNewest,
                Op::Check,
                Op::Complete { stream: 1 },
                Op::Check,
            ],
        );
        run("", &ops).expect("decides as the plain allocator");
    }

    /// `max_split_size_mb:20` set between two pairs of a whole 20 MiB segment: the free counts the
    /// block as an oversize allocation leaving (PyTorch's figures follow the settings of the moment).
    /// Fails if the lane ignores the settings' version.
    #[test]
    fn new_settings_stop_the_lane() {
        let ops = after_express(20 << 20, &[Op::Reconfigure(1), Op::FreeNewest, Op::Check]);
        run("", &ops).expect("decides as the plain allocator");
    }

    /// A block of `max_split_size` or more never takes the lane (its frees and allocations count
    /// oversize allocations). Fails if `express_after` ignores the limit.
    #[test]
    fn oversize_blocks_keep_their_counts() {
        let ops = after_express(20 << 20, &[Op::FreeNewest, Op::Again, Op::Check]);
        let express = run("max_split_size_mb:20", &ops).expect("decides as the plain allocator");
        assert_eq!(express, 0);
    }

    /// A block handed back for a request other than the one its free recorded does not take the
    /// lane at its next free (the record holds the old request's bytes). Fails if `express_after`
    /// ignores the request.
    #[test]
    fn another_request_leaves_by_the_usual_path() {
        let size = (3 << 20) - 100;
        let mut ops = hot_pairs(size, 1);
        ops.extend([
            Op::FreeNewest,
            Op::Alloc {
                size: 3 << 20,
                stream: 0,
            },
            Op::FreeNewest,
            Op::Check,
        ]);
        run("", &ops).expect("decides as the plain allocator");
    }

    /// The express allocation restores figures without comparing them with the limits only while
    /// the limits stand still: another stream's new peak meanwhile must be seen (as
    /// `a_hot_pair_rechecks_limits_that_changed` for the usual path). Fails if
    /// `may_unpark_express` ignores the limits' epoch.
    #[test]
    fn the_express_allocation_rechecks_limits_that_changed() {
        let mut ops = hot_pairs(3 << 20, 2);
        ops.extend([
            Op::FreeNewest,
            Op::Alloc {
                size: 8 << 20,
                stream: 1,
            },
            Op::Again,
            Op::Free { pick: 0 },
            Op::Check,
        ]);
        assert!(run("", &ops).expect("decides as the plain allocator") > 0);
    }

    /// A larger request of the same rounded size after an express free: compared with its limit by
    /// the usual path. Fails if `may_unpark_express` ignores the request.
    #[test]
    fn a_larger_request_after_an_express_free_is_compared() {
        let size = (3 << 20) - 100;
        let mut ops = hot_pairs(size, 2);
        ops.extend([
            Op::FreeNewest,
            Op::Alloc {
                size: 3 << 20,
                stream: 0,
            },
            Op::Check,
        ]);
        assert!(run("", &ops).expect("decides as the plain allocator") > 0);
    }

    /// A block handed back while history kept stacks keeps its stack until its free; the free
    /// after history stopped must drop it (the usual path), or the block's next allocation would
    /// show it in snapshots. Fails if the lane ignores the stack tables.
    #[test]
    fn kept_stacks_leave_by_the_usual_path() {
        type Sim = crate::CachingAllocator<crate::backend::sim::SimDevice>;
        let (a, plain) = (allocator("", true), allocator("", false));
        let both = |f: &dyn Fn(&Sim)| {
            f(&a);
            f(&plain);
        };
        let pair = |x: &Sim| {
            let b = x.allocate(512, STREAMS[0]).expect("allocates");
            x.free(b).expect("frees");
        };
        // Parked with no stack, handed back with one: the pair is hot, its block has a stack.
        both(&|x| pair(x));
        both(&|x| x.record_history_with_context(true, 1000, RecordContext::State));
        let (x, y) = (
            a.allocate(512, STREAMS[0]).expect("allocates"),
            plain.allocate(512, STREAMS[0]).expect("allocates"),
        );
        assert!(a
            .streams
            .get(STREAMS[0])
            .expect("shard")
            .state
            .lock()
            .hot
            .is_some());
        both(&|x| x.record_history(false, 1));
        a.free(x).expect("frees");
        plain.free(y).expect("frees");
        assert_eq!(
            a.express_frees.load(Relaxed),
            0,
            "the kept stack sent the free the usual way"
        );
        both(&|x| pair(x));
        both(&|x| pair(x));
        let (x, y) = (
            a.allocate(512, STREAMS[0]).expect("allocates"),
            plain.allocate(512, STREAMS[0]).expect("allocates"),
        );
        assert_eq!(a.snapshot(), plain.snapshot());
        assert!(
            a.express_frees.load(Relaxed) > 0,
            "later pairs took the lane"
        );
        a.free(x).expect("frees");
        plain.free(y).expect("frees");
        assert_eq!(a.memory_stats(), plain.memory_stats());
    }

    /// A block between two blocks in use (it parks whole, in a split segment) takes the lane with
    /// both inactive-split figures. Fails if the lane leaves out `inactive_split`.
    #[test]
    fn a_block_between_two_in_use_takes_the_lane() {
        let alloc = Op::Alloc {
            size: 512,
            stream: 0,
        };
        let mut ops = vec![
            alloc.clone(),
            alloc.clone(),
            alloc,
            Op::Free { pick: 1 },
            Op::Again,
        ];
        ops.extend(again(3));
        ops.push(Op::Check);
        assert_eq!(run("", &ops).expect("decides as the plain allocator"), 3);
    }

    /// The record's amounts changed meanwhile without the hot block's pool changing: a block of
    /// the hot size, for another request, parked in a private pool (a capture on the stream) and
    /// settled there. The hot block's free must write its own amounts. Fails if the lane ignores
    /// the record's stamp.
    #[test]
    fn a_record_changed_elsewhere_stops_the_lane() {
        let (a, plain) = (allocator("", true), allocator("", false));
        let pool = crate::MempoolId(1, 1);
        let mut live = Vec::new();
        for x in [&a, &plain] {
            for _ in 0..3 {
                let b = x.allocate(512, STREAMS[0]).expect("allocates");
                x.free(b).expect("frees");
            }
            let hot = x.allocate(512, STREAMS[0]).expect("allocates");
            x.begin_allocate_to_pool(pool, |s| s == STREAMS[0])
                .expect("capture begins");
            let other = x.allocate(500, STREAMS[0]).expect("allocates");
            x.free(other).expect("frees");
            x.end_allocate_to_pool(pool).expect("capture ends");
            // Takes every lock: settles the private pool's parked block.
            let _ = x.snapshot();
            live.push(hot);
        }
        let (y, x) = (live.pop().expect("plain's"), live.pop().expect("a's"));
        assert_eq!(
            a.express_frees.load(Relaxed),
            2,
            "the pairs before took the lane"
        );
        a.free(x).expect("frees");
        plain.free(y).expect("frees");
        assert_eq!(
            a.express_frees.load(Relaxed),
            2,
            "the free took the usual path"
        );
        assert_eq!(a.memory_stats(), plain.memory_stats());
        assert_eq!(a.snapshot(), plain.snapshot());
    }

    /// Garbage collection releases the whole free segments whose age (the pool's clock ticks, one
    /// per best fit anywhere, since their free) is at least the average: `X` and `Z` (on stream 1),
    /// freed before five express pairs on stream 0, are older than `Y`, freed after them, so only
    /// they go. Fails if the express allocation leaves out best fit's clock tick (all three would
    /// be as old, and all three would go).
    #[test]
    fn express_allocations_tick_the_clock() {
        let alloc = |size: usize, stream: usize| Op::Alloc { size, stream };
        // W1, W2, X, Z, Y on stream 1; the hot block B on stream 0, handed back once by each path.
        let mut ops = vec![alloc(64 << 20, 1); 5];
        ops.extend([
            alloc(3 << 20, 0),
            Op::FreeNewest,
            Op::Again,
            Op::FreeNewest,
            Op::Again,
        ]);
        ops.extend([Op::Free { pick: 2 }, Op::Free { pick: 2 }]);
        ops.extend(again(5));
        // W1, W2, Y, B live: Y goes, then a request no free block fits collects garbage.
        ops.extend([Op::Free { pick: 2 }, alloc(100 << 20, 0), Op::Check]);
        let express = run("garbage_collection_threshold:0.5", &ops).expect("decides alike");
        assert!(express >= 6, "{express} express frees");
    }

    /// A whole segment parked by the express lane keeps the clock's reading of its free: `B` (on
    /// stream 0, parked last) is younger than `X` (on stream 1, freed two pairs before), so
    /// garbage collection releases only `X`. Fails if the lane parks with another reading.
    #[test]
    fn an_express_free_keeps_its_clock_reading() {
        let alloc = |size: usize, stream: usize| Op::Alloc { size, stream };
        // W1, W2, W3, X on stream 1; the hot whole segment B on stream 0.
        let mut ops = vec![alloc(64 << 20, 1); 4];
        ops.push(alloc(32 << 20, 0));
        ops.extend(again(3));
        ops.push(Op::Free { pick: 3 });
        ops.extend(again(2));
        // B parks; a request no free block fits collects garbage.
        ops.extend([Op::FreeNewest, alloc(200 << 20, 1), Op::Check]);
        let express = run("garbage_collection_threshold:0.5", &ops).expect("decides alike");
        assert!(express >= 4, "{express} express frees");
    }

    /// An express free while garbage collection is off takes the clock's reading from the hand-back
    /// without loading it; it must be the clock's, which stood still since. Here the clock ran
    /// during hot pairs on stream 1 with collection on; collection goes off (settings), `B` (a
    /// whole 32 MiB segment on stream 0) takes the lane and stays parked; collection comes back on
    /// and a request no free block fits collects: `B` and the 20 MiB segment parked before the
    /// switch are as old, and both go. Fails if the lane parks `B` with a clock of 0 (it would be
    /// the oldest, and go alone).
    #[test]
    fn an_express_free_with_collection_off_keeps_the_clock() {
        let alloc = |size: usize, stream: usize| Op::Alloc { size, stream };
        let mut ops = vec![alloc(64 << 20, 1); 3];
        ops.push(alloc(3 << 20, 1));
        ops.extend(again(5));
        ops.extend([Op::FreeNewest, Op::Reconfigure(0), alloc(32 << 20, 0)]);
        ops.extend(again(3));
        // Reserved: 3 x 64 + 20 + 32 MiB, 13.6 MiB over half of 90% of the device's 512 MiB.
        ops.extend([
            Op::FreeNewest,
            Op::Reconfigure(3),
            alloc(100 << 20, 0),
            Op::Check,
        ]);
        let express = run("garbage_collection_threshold:0.5", &ops).expect("decides alike");
        assert!(express >= 6, "{express} express frees");
    }
}
