//! The record of a shard's hot-pair figures: what parked frees and their allocations would have
//! changed, kept out of the stored figures (see [`Deferred`]).

#[cfg(not(loom))]
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

#[cfg(loom)]
use loom::sync::atomic::{AtomicI64, Ordering::Relaxed};

use super::{stored, Figures, Kind, PeakBook};

/// The figures of a shard's hot pairs (allocate and free one size again and again, see
/// `allocator/parked.rs`), kept out of the stored figures. A free that parks its block lowers
/// `allocation`, `allocated_bytes`, `active`, `active_bytes` and `requested_bytes` of its pool type
/// by one block of `size` bytes (`requested` asked for), and where its merge with the free next
/// neighbour makes a whole segment, `inactive_split` by `split_count` (1) and
/// `inactive_split_bytes` by `split_bytes`; the allocation that hands the same block out again for
/// the same request raises them by exactly that. So the free only sets `parked`, the
/// allocation clears it and counts a `pair` (whose only lasting effect is on the cumulative
/// totals: the free's amounts are freed, the allocation's allocated), and nothing else is written.
///
/// Every reader adds the record to the stored figures ([`Figures::current`] and the totals), so
/// what is read is what the plain updates would show. The shard's lock holder applies a parked free
/// to the stored figures before any other update of those figures
/// ([`apply_deferred_free`](Figures::apply_deferred_free), from the settling of a parked block),
/// and folds the pairs into the totals before the record describes other amounts. Written only
/// by the shard's lock holder.
#[derive(Debug, Default)]
pub(super) struct Deferred {
    /// 1 while a parked free's figures are not applied, else 0.
    pub(super) parked: AtomicI64,
    /// Frees and allocations of the record's amounts whose totals are not in the stored figures.
    pub(super) pairs: AtomicI64,
    /// The pool type of the record (1: small, 0: large).
    small: AtomicI64,
    /// The block's size and the size asked for.
    size: AtomicI64,
    requested: AtomicI64,
    /// The decrease of `inactive_split` (0 or 1) and of `inactive_split_bytes`.
    split_count: AtomicI64,
    split_bytes: AtomicI64,
    /// Counts the changes of the amounts above, and the times the book made the shard tight
    /// ([`Figures::new_record_stamp`]): equal stamps, equal amounts and no tightening in between
    /// (see [`Figures::record_stamp`]).
    stamp: AtomicI64,
}

impl Figures {
    /// A freed block of `size` bytes (`requested` asked for, pool type `small`) parks: its
    /// allocation figures, and `inactive_split` by `split_count` (0 or 1) and
    /// `inactive_split_bytes` by `split_bytes`, are lowered on the record only (see [`Deferred`]).
    /// Puts the shard on the book's list of loose shards ([`Figures::loosen`]). Caller holds the
    /// shard's lock, with no parked free in the record.
    #[inline(always)]
    pub(crate) fn defer_free(
        &self,
        small: bool,
        size: u64,
        requested: u64,
        split_count: u64,
        split_bytes: u64,
        book: &PeakBook,
    ) {
        let d = &self.deferred;
        let (size, requested, small) = (size as i64, requested as i64, i64::from(small));
        let (split_count, split_bytes) = (split_count as i64, split_bytes as i64);
        let same = d.size.load(Relaxed) == size
            && d.requested.load(Relaxed) == requested
            && d.small.load(Relaxed) == small
            && d.split_count.load(Relaxed) == split_count
            && d.split_bytes.load(Relaxed) == split_bytes;
        if !same {
            self.defer_other(small, size, requested, split_count, split_bytes);
        }
        d.parked.store(1, Relaxed);
        self.loosen(book);
    }

    /// [`defer_free`](Self::defer_free) of amounts other than the record's: its pairs go to the
    /// totals first.
    #[cold]
    #[inline(never)]
    fn defer_other(
        &self,
        small: i64,
        size: i64,
        requested: i64,
        split_count: i64,
        split_bytes: i64,
    ) {
        let d = &self.deferred;
        if d.pairs.load(Relaxed) != 0 {
            self.fold_pairs();
        }
        d.small.store(small, Relaxed);
        d.size.store(size, Relaxed);
        d.requested.store(requested, Relaxed);
        d.split_count.store(split_count, Relaxed);
        d.split_bytes.store(split_bytes, Relaxed);
        d.stamp.fetch_add(1, Relaxed);
    }

    /// Gives the record a new stamp without changing its amounts: the book does so when it makes
    /// the shard tight (its values read, its limits set to them), so that the shard's next hot-pair
    /// free does not take the express lane (which decreases without [`loosen`](Figures::loosen))
    /// but the usual path, which puts the shard back on the book's list of loose shards. Caller
    /// holds the book's lock; the shard's lock holder may be changing the stamp too (both add).
    pub(super) fn new_record_stamp(&self) {
        self.deferred.stamp.fetch_add(1, Relaxed);
    }

    /// The number of times the record's amounts changed so far. While it stands still, a block
    /// whose free once wrote (or found) the record's amounts, asked for again with the same request,
    /// frees with the same amounts: [`defer_same_free`](Self::defer_same_free) instead of
    /// [`defer_free`](Self::defer_free) (the express lane of `allocator/hot_pair.rs`).
    #[inline(always)]
    pub(crate) fn record_stamp(&self) -> i64 {
        self.deferred.stamp.load(Relaxed)
    }

    /// [`defer_free`](Self::defer_free) of the record's own amounts, known equal by the caller
    /// ([`record_stamp`](Self::record_stamp)): only the flag. The shard is on the book's list of
    /// loose shards: it was when the caller read the stamp it compared (the hand-back that took it
    /// put the shard there first), and the book takes a shard off the list only with a new stamp.
    /// Caller holds the shard's lock, with no parked free in the record.
    #[inline(always)]
    pub(crate) fn defer_same_free(&self) {
        self.deferred.parked.store(1, Relaxed);
    }

    /// The parked block is handed out again for the request its free recorded, with the limits
    /// unchanged since ([`limits_epoch`](Self::limits_epoch)): the allocation figures return to
    /// the values the free found, which were within the limits, so nothing is compared; the free
    /// and the allocation count as one more pair of the record. Caller holds the shard's lock.
    #[inline(always)]
    pub(crate) fn complete_pair(&self) {
        let d = &self.deferred;
        d.pairs.store(d.pairs.load(Relaxed) + 1, Relaxed);
        d.parked.store(0, Relaxed);
    }

    /// Applies a parked free's figures to the stored ones, if the record holds one: before any
    /// other update of the shard's figures (its block merged, or handed out another way). Caller
    /// holds the shard's lock.
    #[cold]
    #[inline(never)]
    pub(crate) fn apply_deferred_free(&self) {
        let d = &self.deferred;
        if d.parked.load(Relaxed) == 0 {
            return;
        }
        d.parked.store(0, Relaxed);
        let (small, amounts) = self.deferred_amounts();
        // The values the readers see do not change (the record's share moves into the stored
        // figures): the shard stays where it was on the book's list.
        for (kind, amount) in amounts {
            self.decrease_stored(stored(kind, small), amount as u64);
        }
    }

    /// Moves the record's pairs into the stored totals (before the record changes amounts).
    #[cold]
    #[inline(never)]
    fn fold_pairs(&self) {
        let d = &self.deferred;
        let pairs = d.pairs.load(Relaxed);
        d.pairs.store(0, Relaxed);
        let (small, amounts) = self.deferred_amounts();
        for (kind, amount) in amounts {
            let fig = &self.stored[stored(kind, small)];
            fig.freed
                .store(fig.freed.load(Relaxed) + pairs * amount, Relaxed);
        }
    }

    /// The record's pool type and what one of its frees lowers: each statistic with its amount.
    fn deferred_amounts(&self) -> (bool, [(Kind, i64); 7]) {
        let d = &self.deferred;
        let size = d.size.load(Relaxed);
        let amounts = [
            (Kind::Allocation, 1),
            (Kind::AllocatedBytes, size),
            (Kind::Active, 1),
            (Kind::ActiveBytes, size),
            (Kind::RequestedBytes, d.requested.load(Relaxed)),
            (Kind::InactiveSplit, d.split_count.load(Relaxed)),
            (Kind::InactiveSplitBytes, d.split_bytes.load(Relaxed)),
        ];
        (d.small.load(Relaxed) != 0, amounts)
    }

    /// How much one free of the record lowers stored figure `i` (0 for figures it leaves alone).
    fn deferred_unit(&self, i: usize) -> i64 {
        let (small, amounts) = self.deferred_amounts();
        amounts
            .into_iter()
            .find(|&(kind, _)| stored(kind, small) == i)
            .map_or(0, |(_, amount)| amount)
    }

    /// The record's share of stored figure `i`: `(current, freed)` to add to the stored values.
    #[inline]
    pub(super) fn deferred(&self, i: usize) -> (i64, i64) {
        let d = &self.deferred;
        let (parked, pairs) = (d.parked.load(Relaxed), d.pairs.load(Relaxed));
        if parked == 0 && pairs == 0 {
            return (0, 0);
        }
        let per = self.deferred_unit(i);
        (-parked * per, (parked + pairs) * per)
    }
}
