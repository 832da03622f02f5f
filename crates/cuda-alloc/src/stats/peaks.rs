//! Device-wide statistics kept per stream, with exact device-wide peaks.
//!
//! PyTorch updates one `DeviceStats` under its device lock. Here each stream shard keeps its own
//! figures ([`Figures`]), written only while the shard's lock is held, so streams used from different
//! threads never write the same cache line. The device-wide value of a figure is the sum over shards,
//! computed when read.
//!
//! The hard part is the **peak**: the highest the *sum* has ever been. Summing on every increase
//! would touch every shard; an atomic device-wide sum would be a shared cache line on the hot path.
//! Instead every shard holds a *limit* per figure, and the limits keep this invariant:
//!
//! > the sum of all shards' limits is at most the recorded peak, and each shard's current value is at
//! > most its limit.
//!
//! So while every shard stays under its limit the sum cannot exceed the recorded peak, and an increase
//! that stays under the limit needs no device-wide work at all. An increase that passes its shard's
//! limit takes the book's lock ([`PeakBook`]), sums the figure over all shards exactly, raises the
//! peak if the sum is higher, and hands the remaining headroom (`peak - sum`) out again: an equal share
//! to every shard on top of its current value. Peaks are therefore exact for a caller on one thread,
//! whatever streams it uses (the decisions and figures a PyTorch trace replay checks).
//!
//! With several threads an increase may race with a redistribution (a shard may read its old, larger
//! limit); the peak can then lag the true maximum by at most the headroom handed out, and is caught up
//! with the current sum whenever statistics are read. Cumulative totals (`allocated`, `freed`) are
//! plain per-shard counters, summed on read.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use parking_lot::Mutex;

use super::{MemoryStats, Stat, StatArray};

/// The nine statistics PyTorch keeps per pool type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub(crate) enum Kind {
    Allocation = 0,
    Segment,
    Active,
    InactiveSplit,
    AllocatedBytes,
    ReservedBytes,
    ActiveBytes,
    InactiveSplitBytes,
    RequestedBytes,
}

/// Figure index of `oversize_allocations`.
pub(crate) const OVERSIZE_ALLOCATIONS: usize = 27;
/// Figure index of `oversize_segments`.
pub(crate) const OVERSIZE_SEGMENTS: usize = 28;
/// Number of figures: 9 kinds x (all, small, large), plus the two oversize counts.
pub(crate) const FIGURES: usize = 29;

/// The figure of `kind` for all pools.
#[inline]
pub(crate) const fn all(kind: Kind) -> usize {
    kind as usize * 3
}

/// The figure of `kind` for the small or large pool.
#[inline]
pub(crate) const fn pool(kind: Kind, small: bool) -> usize {
    kind as usize * 3 + if small { 1 } else { 2 }
}

/// One shard's figures. Written only by the holder of the shard's lock, except `limit`, which only
/// the holder of the [`PeakBook`] lock writes; read by anyone (relaxed atomics: plain loads and stores
/// on the hot path).
#[derive(Debug)]
pub(crate) struct Figures {
    current: [AtomicI64; FIGURES],
    limit: [AtomicI64; FIGURES],
    allocated: [AtomicI64; FIGURES],
    freed: [AtomicI64; FIGURES],
}

/// Every shard's figures, for the rare device-wide passes.
pub(crate) trait FigureSet {
    /// Calls `f` with each shard's figures, in a fixed order.
    fn for_each_figures(&self, f: &mut dyn FnMut(&Figures));
}

impl Default for Figures {
    fn default() -> Self {
        Figures {
            current: std::array::from_fn(|_| AtomicI64::new(0)),
            limit: std::array::from_fn(|_| AtomicI64::new(0)),
            allocated: std::array::from_fn(|_| AtomicI64::new(0)),
            freed: std::array::from_fn(|_| AtomicI64::new(0)),
        }
    }
}

#[inline]
fn bump(cell: &AtomicI64, by: i64) -> i64 {
    let value = cell.load(Relaxed) + by;
    cell.store(value, Relaxed);
    value
}

impl Figures {
    /// Adds `amount` to figure `f` (PyTorch's `increase_stat`). Caller holds the shard's lock.
    #[inline]
    pub(crate) fn increase(&self, f: usize, amount: u64, book: &PeakBook, set: &dyn FigureSet) {
        let amount = amount as i64;
        let current = bump(&self.current[f], amount);
        bump(&self.allocated[f], amount);
        if current > self.limit[f].load(Relaxed) {
            book.overflow(self, f, set);
        }
    }

    /// Subtracts `amount` from figure `f` (PyTorch's `decrease_stat`). Caller holds the shard's lock.
    #[inline]
    pub(crate) fn decrease(&self, f: usize, amount: u64) {
        let amount = amount as i64;
        let current = bump(&self.current[f], -amount);
        debug_assert!(current >= i64::MIN / 2);
        bump(&self.freed[f], amount);
    }

    /// The current value of figure `f` in this shard.
    pub(crate) fn current(&self, f: usize) -> i64 {
        self.current[f].load(Relaxed)
    }

    /// Zeroes the cumulative totals. Caller holds the shard's lock.
    pub(crate) fn reset_accumulated(&self) {
        for f in 0..FIGURES {
            self.allocated[f].store(0, Relaxed);
            self.freed[f].store(0, Relaxed);
        }
    }
}

/// The device-wide peaks and the lock under which limits are handed out.
#[derive(Debug)]
pub(crate) struct PeakBook {
    peaks: Mutex<[i64; FIGURES]>,
}

impl Default for PeakBook {
    fn default() -> Self {
        PeakBook {
            peaks: Mutex::new([0; FIGURES]),
        }
    }
}

impl PeakBook {
    /// Shard `me` passed its limit for figure `f`: record the exact device-wide sum as the peak if it
    /// is higher, and share out the headroom again.
    #[cold]
    #[inline(never)]
    fn overflow(&self, me: &Figures, f: usize, set: &dyn FigureSet) {
        let mut peaks = self.peaks.lock();
        let mut sum = 0i64;
        let mut shards = 0i64;
        set.for_each_figures(&mut |fig| {
            sum += fig.current[f].load(Relaxed);
            shards += 1;
        });
        if sum > peaks[f] {
            peaks[f] = sum;
        }
        let headroom = peaks[f] - sum;
        let share = headroom / shards.max(1);
        set.for_each_figures(&mut |fig| {
            fig.limit[f].store(fig.current[f].load(Relaxed) + share, Relaxed);
        });
        let extra = headroom - share * shards.max(1);
        me.limit[f].store(me.limit[f].load(Relaxed) + extra, Relaxed);
    }

    /// Sets every peak to the current sum (PyTorch's `reset_peak_stat`), leaving no headroom.
    pub(crate) fn reset_peaks(&self, set: &dyn FigureSet) {
        let mut peaks = self.peaks.lock();
        *peaks = [0; FIGURES];
        set.for_each_figures(&mut |fig| {
            for f in 0..FIGURES {
                let current = fig.current[f].load(Relaxed);
                peaks[f] += current;
                fig.limit[f].store(current, Relaxed);
            }
        });
    }

    /// The device-wide figures: sums of the shards' values, with the recorded peaks.
    pub(crate) fn read(&self, set: &dyn FigureSet, into: &mut MemoryStats) {
        let peaks = self.peaks.lock();
        let mut stats = [Stat::default(); FIGURES];
        set.for_each_figures(&mut |fig| {
            for (f, stat) in stats.iter_mut().enumerate() {
                stat.current += fig.current[f].load(Relaxed);
                stat.allocated += fig.allocated[f].load(Relaxed);
                stat.freed += fig.freed[f].load(Relaxed);
            }
        });
        for (f, stat) in stats.iter_mut().enumerate() {
            stat.peak = peaks[f].max(stat.current);
        }
        let array = |kind: Kind| StatArray {
            all: stats[all(kind)],
            small_pool: stats[pool(kind, true)],
            large_pool: stats[pool(kind, false)],
        };
        into.allocation = array(Kind::Allocation);
        into.segment = array(Kind::Segment);
        into.active = array(Kind::Active);
        into.inactive_split = array(Kind::InactiveSplit);
        into.allocated_bytes = array(Kind::AllocatedBytes);
        into.reserved_bytes = array(Kind::ReservedBytes);
        into.active_bytes = array(Kind::ActiveBytes);
        into.inactive_split_bytes = array(Kind::InactiveSplitBytes);
        into.requested_bytes = array(Kind::RequestedBytes);
        into.oversize_allocations = stats[OVERSIZE_ALLOCATIONS];
        into.oversize_segments = stats[OVERSIZE_SEGMENTS];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Set<'a>(Vec<&'a Figures>);
    impl FigureSet for Set<'_> {
        fn for_each_figures(&self, f: &mut dyn FnMut(&Figures)) {
            for fig in &self.0 {
                f(fig);
            }
        }
    }

    #[test]
    fn peak_is_the_peak_of_the_sum() {
        let (a, b) = (Figures::default(), Figures::default());
        let book = PeakBook::default();
        let set = Set(vec![&a, &b]);
        let f = all(Kind::AllocatedBytes);
        a.increase(f, 100, &book, &set);
        a.decrease(f, 100);
        b.increase(f, 60, &book, &set);
        a.increase(f, 30, &book, &set); // sum 90 < 100
        b.decrease(f, 60);
        b.increase(f, 50, &book, &set); // sum 80
        a.increase(f, 30, &book, &set); // sum 110: new peak
        let mut stats = MemoryStats::default();
        book.read(&set, &mut stats);
        assert_eq!(stats.allocated_bytes.all.peak, 110);
        assert_eq!(stats.allocated_bytes.all.current, 110);
        assert_eq!(stats.allocated_bytes.all.allocated, 270);
        assert_eq!(stats.allocated_bytes.all.freed, 160);
        a.decrease(f, 60);
        book.reset_peaks(&set);
        book.read(&set, &mut stats);
        assert_eq!(stats.allocated_bytes.all.peak, 50);
        b.increase(f, 1, &book, &set);
        book.read(&set, &mut stats);
        assert_eq!(stats.allocated_bytes.all.peak, 51);
    }

    #[test]
    fn every_sequence_matches_a_single_counter() {
        // A deterministic pseudo-random walk over three shards, checked against one global counter.
        let shards = [Figures::default(), Figures::default(), Figures::default()];
        let book = PeakBook::default();
        let set = Set(shards.iter().collect());
        let f = pool(Kind::ActiveBytes, true);
        let (mut sum, mut peak) = (0i64, 0i64);
        let mut values = [0i64; 3];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let shard = (x % 3) as usize;
            let amount = (x >> 8) % 1000;
            if x & 0x100 != 0 || values[shard] < amount as i64 {
                shards[shard].increase(f, amount, &book, &set);
                values[shard] += amount as i64;
                sum += amount as i64;
                peak = peak.max(sum);
            } else {
                shards[shard].decrease(f, amount);
                values[shard] -= amount as i64;
                sum -= amount as i64;
            }
            let mut stats = MemoryStats::default();
            book.read(&set, &mut stats);
            assert_eq!(stats.active_bytes.small_pool.peak, peak);
        }
    }
}
