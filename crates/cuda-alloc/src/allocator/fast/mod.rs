//! The fast path: a cache of the plain path's answers for one stream's hot pair (the same size
//! allocated and freed again and again), checked against the plain path, never a restatement of it.
//!
//! # Parked blocks: deferred merges
//!
//! Freeing block `B` whose next neighbour `R` is free (and whose previous one is not) merges them:
//! `R` leaves the arena, `B` grows over it, and `R`'s free-set entry is re-keyed to the merged block.
//! Allocating `B`'s size again then finds the merged block by best fit and splits it back into `B`
//! and `R`. Here the free only *parks* `B` ([`state::Parked`]): everything anyone can see without
//! the stream's lock (statistics, trace entries) reads at once as the merge would make it, but the
//! blocks and the free set are left as they are. The state under the lock is then *defined* as the
//! merged one, and two things keep that true:
//!
//! - every way of taking a shard's lock settles a parked block first ([`FastPath::settle`]: the
//!   merge, as it would have been done at the free), except the allocation path, which first asks
//!   `Locked::unpark`;
//! - `Locked::unpark` hands `B` out again only where the allocator would make exactly that
//!   decision: same pool, `B`'s size, the merged block the best fit (no other free block of at least
//!   that size keyed below it; [`policy::best_fit_allows`](super::policy::best_fit_allows)), and
//!   [`policy::should_split`](super::policy::should_split) splitting it at `B`'s size. Splitting the
//!   merged block there gives back `B` and `R` with their addresses and sizes, so only the figures
//!   and fields the split would set are set (the statistics of the split, `R`'s garbage-collection
//!   age, `B`'s generation). Anything else settles and takes the plain path.
//!
//! A freed block with no free neighbour at all (a whole segment, or one between two blocks in use)
//! is parked the same way with no `next`: what is deferred is its insertion into the free set.
//!
//! The free of a parked block lowers its allocation figures on the shard's record of deferred
//! figures only (`stats::peaks::Deferred`), which every reader of the statistics adds in; handing the
//! block out again for the same request with the shard's limits unchanged since (their epoch) only
//! counts a pair on the record; anything else applies the record first and updates the figures the
//! usual way.
//!
//! # The memo and the express lane
//!
//! The checks of `Locked::unpark` depend only on the two blocks, the pool's free set and the
//! settings, none of which a hot pair changes: a block handed back after its checks leaves a memo
//! ([`state::HotPair`]: the [`state::Verdict`] of the checks, the record's stamp, the pool clock's
//! reading), and the same block parked again against the same verdict is handed back without them.
//! Where nothing else changed either, the block's next free and allocation skip the rest of their
//! decisions too (the express lane, `express.rs`): quiet calls only (no trace entry, no stack).
//! Every event that invalidates the memo is listed in one place, [`state::HotPair::still_valid`].
//!
//! # The switch and the proof
//!
//! [`CachingAllocator::set_fast_path_enabled`](crate::CachingAllocator::set_fast_path_enabled)
//! turns all of it off at run time: nothing parks, so every call takes the plain path. The
//! differential check (the same calls on two allocators, one with the fast path off; every address,
//! error, statistic and snapshot equal) runs in this module's tests, in `tests/proptest_ops.rs`,
//! in the `alloc_ops` fuzz target and in the replay tests; `check_invariants` walks the parked
//! state as it is, without settling it.
//!
//! Blocks keep their arena slots instead of trading them (slots are not visible: snapshots order
//! segments by address, handles carry a generation).
//!
//! Modules: `state` (the data and the validity test; below the shard), `figures` (the statistics
//! of parking and unparking), `express` (the express lane), `park` (the free's side), `unpark`
//! (the allocation's side).

mod express;
mod figures;
mod park;
mod state;
mod unpark;

#[cfg(all(test, not(loom)))]
mod tests;

pub(crate) use park::Freed;
pub(crate) use state::FastPath;
