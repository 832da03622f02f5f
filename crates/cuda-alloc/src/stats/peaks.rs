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
//! limit takes the book's lock ([`PeakBook`]). The book keeps the sum of all limits, so the other
//! shards' limits are known at once: if the passing shard's value fits under the peak with them,
//! there is no new peak and the shard takes what they leave (shards taking turns settle this way).
//! Otherwise the book needs the exact sum, and it reads only the *loose* shards: those that may be
//! below a limit. Every other shard is *tight* (each value equal to its limit), so its limits are its
//! values; a shard becomes loose when it decreases a figure or is handed a limit above its value, and
//! tight again when the book reads it and sets its limits to its values. The sum is then exact, the
//! peak is raised if it is higher, and the passing shard takes the rest. A new peak therefore costs
//! the shards that changed since the book last read them, not every shard of the device. Peaks are
//! exact for a caller on one thread, whatever streams it uses (the decisions and figures a PyTorch
//! trace replay checks).
//!
//! With several threads an increase may race with the book: a shard may compare against its old,
//! larger limit while the book lowers it. Limits are still set from the values the book read once
//! (never from values read again), so they always add up to exactly the recorded peak; only such racing
//! rises (each shard's rise over the value the book summed for it, until its next increase passes its
//! new limit) can take the sum past the recorded peak unseen, and the peak is caught up with the
//! current sum whenever statistics are read. Likewise a decrease that races with the book making its
//! shard tight may find the shard still marked loose and stay unseen until the shard's next decrease
//! or passed limit: until then the book counts that shard at the value it read, which the shard did
//! reach. Cumulative totals (`allocated`, `freed`) are
//! plain per-shard counters, summed on read. Only the small- and large-pool figures are stored; an
//! `all` figure is their sum, with a limit of its own.
//!
//! Two shortcuts for a shard's hot pair (the same block freed and handed out again, see
//! `allocator/parked.rs`): the free's figures go to the shard's record of deferred figures
//! ([`Deferred`]), which every reader adds to the stored values, and the allocation that undoes
//! them only counts a pair there, provided the shard's limits did not change in between
//! ([`Figures::limits_epoch`]): values that were within unchanged limits still are.

#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::Relaxed};

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicI64, Ordering::Relaxed};
#[cfg(not(loom))]
use parking_lot::Mutex;

#[cfg(loom)]
use crate::loom_sync::Mutex;

use super::{MemoryStats, Stat, StatArray};

mod deferred;

use deferred::Deferred;

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

/// Where a figure lives in a shard: pool figures are stored, `all` figures are the sum of the two
/// pool figures of their kind.
#[derive(Clone, Copy, Debug)]
enum Slot {
    /// A stored figure (a pool figure or an oversize count), by index into `Figures::stored`.
    Stored(usize),
    /// The `all` figure of a kind.
    All(Kind),
}

/// The stored figure of `kind` for a pool type.
#[inline]
const fn stored(kind: Kind, small: bool) -> usize {
    kind as usize * 2 + if small { 0 } else { 1 }
}

/// Stored index of `oversize_allocations`.
const STORED_OVERSIZE_ALLOCATIONS: usize = 18;
/// Number of stored figures.
const STORED: usize = 20;
/// Number of kinds.
const KINDS: usize = 9;

/// The slot of book figure `f`.
fn slot(f: usize) -> Slot {
    match f {
        OVERSIZE_ALLOCATIONS => Slot::Stored(STORED_OVERSIZE_ALLOCATIONS),
        OVERSIZE_SEGMENTS => Slot::Stored(STORED_OVERSIZE_ALLOCATIONS + 1),
        f => {
            let kind = KIND_ORDER[f / 3];
            match f % 3 {
                0 => Slot::All(kind),
                1 => Slot::Stored(stored(kind, true)),
                _ => Slot::Stored(stored(kind, false)),
            }
        }
    }
}

const KIND_ORDER: [Kind; KINDS] = [
    Kind::Allocation,
    Kind::Segment,
    Kind::Active,
    Kind::InactiveSplit,
    Kind::AllocatedBytes,
    Kind::ReservedBytes,
    Kind::ActiveBytes,
    Kind::InactiveSplitBytes,
    Kind::RequestedBytes,
];

/// One stored figure of one shard, in one place so that an update touches one cache line.
///
/// The cumulative total added since the last accumulated reset is not stored: it is
/// `current - base + freed`, where `base` is `current` at the reset. That keeps an increase to one
/// store.
#[derive(Debug, Default)]
struct Figure {
    current: AtomicI64,
    limit: AtomicI64,
    freed: AtomicI64,
    base: AtomicI64,
}

/// One shard's figures: the small- and large-pool figures of each kind and the two oversize counts,
/// plus the limits of the `all` figures (whose values are the sums of the pool figures). Written only
/// by the holder of the shard's lock, except the limits, which only the holder of the [`PeakBook`]
/// lock writes; read by anyone (relaxed atomics: plain loads and stores on the hot path).
#[derive(Debug)]
pub(crate) struct Figures {
    stored: [Figure; STORED],
    all_limits: [AtomicI64; KINDS],
    /// A hot pair's allocation figures, not yet applied to `stored` (see [`Deferred`]).
    deferred: Deferred,
    /// Counts the changes of this shard's limits (written under the book's lock). While it stands
    /// still, values that were within the limits are still within them: see
    /// [`complete_pair`](Self::complete_pair).
    limits_epoch: AtomicI64,
    /// The shard's index in its [`FigureSet`] (what the book's list of loose shards holds).
    index: u32,
    /// Whether the shard is on the book's list of loose shards (written under the book's lock).
    /// A shard off the list is *tight*: every value equals its limit (see [`PeakBook`]).
    loose: AtomicBool,
}

/// Every shard's figures: all of them for the rare device-wide passes, one by index for the book's
/// list of loose shards.
pub(crate) trait FigureSet {
    /// Calls `f` with each shard's figures, in a fixed order.
    fn for_each_figures(&self, f: &mut dyn FnMut(&Figures));
    /// The figures of the shard with the given index (see [`Figures::new`]).
    fn figures(&self, index: u32) -> Option<&Figures>;
}

impl Figures {
    /// The figures of a new shard, the one with index `index` in its [`FigureSet`]: every value and
    /// every limit zero (tight).
    pub(crate) fn new(index: u32) -> Self {
        Figures {
            stored: std::array::from_fn(|_| Figure::default()),
            all_limits: std::array::from_fn(|_| AtomicI64::new(0)),
            deferred: Deferred::default(),
            limits_epoch: AtomicI64::new(0),
            index,
            loose: AtomicBool::new(false),
        }
    }

    /// Puts the shard on the book's list of loose shards if it is not there: what every decrease
    /// does (a tight shard that decreases is below its limits, and the book must read it again).
    /// Caller holds the shard's lock.
    #[inline(always)]
    pub(crate) fn loosen(&self, book: &PeakBook) {
        if !self.loose.load(Relaxed) {
            std::hint::cold_path();
            book.enlist(self);
        }
    }

    /// Adds `amount` to statistic `kind` of the pool type (and so to its `all` figure): PyTorch's
    /// `increase_stat` on both. Caller holds the shard's lock.
    #[inline(always)]
    pub(crate) fn increase_kind(
        &self,
        kind: Kind,
        small: bool,
        amount: u64,
        book: &PeakBook,
        set: &dyn FigureSet,
    ) {
        let i = stored(kind, small);
        let fig = &self.stored[i];
        let current = fig.current.load(Relaxed) + amount as i64;
        fig.current.store(current, Relaxed);
        let all_current = current + self.stored[i ^ 1].current.load(Relaxed);
        if (current > fig.limit.load(Relaxed))
            | (all_current > self.all_limits[kind as usize].load(Relaxed))
        {
            std::hint::cold_path();
            book.overflow_kind(self, kind, small, set);
        }
    }

    /// The number of changes of this shard's limits so far.
    #[inline(always)]
    pub(crate) fn limits_epoch(&self) -> i64 {
        self.limits_epoch.load(Relaxed)
    }

    /// A block handed out: `allocation`, `allocated_bytes`, `active`, `active_bytes` and
    /// `requested_bytes` go up (the updates of PyTorch's `alloc_found_block`). Always inlined: as a
    /// call it spent a sixth of its instructions saving and restoring registers.
    ///
    /// The pool type is decided once, and each pool type's five updates are compiled with constant
    /// figure offsets (with `small` as a run-time value every update selected its two addresses).
    #[inline(always)]
    pub(crate) fn on_alloc(
        &self,
        small: bool,
        size: u64,
        requested: u64,
        book: &PeakBook,
        set: &dyn FigureSet,
    ) {
        if cfg!(tensormem_ab_no_small_twins) {
            self.on_alloc_in(small, size, requested, book, set);
        } else if small {
            self.on_alloc_in(true, size, requested, book, set);
        } else {
            self.on_alloc_in(false, size, requested, book, set);
        }
    }

    /// [`on_alloc`](Self::on_alloc) for the pool type `small`, a constant in each copy (the `small`
    /// twins; a run-time value in a `--cfg tensormem_ab_no_small_twins` build).
    #[inline(always)]
    pub(crate) fn on_alloc_in(
        &self,
        small: bool,
        size: u64,
        requested: u64,
        book: &PeakBook,
        set: &dyn FigureSet,
    ) {
        self.increase_kind(Kind::Allocation, small, 1, book, set);
        self.increase_kind(Kind::AllocatedBytes, small, size, book, set);
        self.increase_kind(Kind::Active, small, 1, book, set);
        self.increase_kind(Kind::ActiveBytes, small, size, book, set);
        self.increase_kind(Kind::RequestedBytes, small, requested, book, set);
    }

    /// Subtracts from statistics of the pool type, `(kind, amount)` each, the pool type decided once
    /// (see [`on_alloc`](Self::on_alloc)), and puts the shard on the book's list of loose shards
    /// ([`loosen`](Self::loosen)). Caller holds the shard's lock.
    #[inline(always)]
    pub(crate) fn decrease_kinds<const N: usize>(
        &self,
        small: bool,
        changes: [(Kind, u64); N],
        book: &PeakBook,
    ) {
        if small {
            for (kind, amount) in changes {
                self.decrease_stored(stored(kind, true), amount);
            }
        } else {
            for (kind, amount) in changes {
                self.decrease_stored(stored(kind, false), amount);
            }
        }
        self.loosen(book);
    }

    /// Subtracts `amount` from statistic `kind` of the pool type (PyTorch's `decrease_stat`), and
    /// puts the shard on the book's list of loose shards. Caller holds the shard's lock.
    #[inline(always)]
    pub(crate) fn decrease_kind(&self, kind: Kind, small: bool, amount: u64, book: &PeakBook) {
        self.decrease_stored(stored(kind, small), amount);
        self.loosen(book);
    }

    /// [`decrease_kind`](Self::decrease_kind) without [`loosen`](Self::loosen), for a caller that
    /// covers it before the shard's lock is released: the shard is known to be loose (the express
    /// lane's hand-back: its free found the shard loose, and its limits did not change since; the
    /// book takes a shard off the list only by setting its limits), or the caller goes on to a
    /// decrease that loosens, or to an increase by a positive amount (a tight shard's increase
    /// passes its limit, and the book puts the shard on the list). Caller holds the shard's lock.
    #[inline(always)]
    pub(crate) fn decrease_kind_covered(&self, kind: Kind, small: bool, amount: u64) {
        self.decrease_stored(stored(kind, small), amount);
    }

    /// Adds to an oversize count ([`OVERSIZE_ALLOCATIONS`] or [`OVERSIZE_SEGMENTS`]).
    #[inline]
    pub(crate) fn increase(&self, f: usize, amount: u64, book: &PeakBook, set: &dyn FigureSet) {
        let Slot::Stored(i) = slot(f) else {
            unreachable!("only stored figures are increased alone")
        };
        let fig = &self.stored[i];
        let current = fig.current.load(Relaxed) + amount as i64;
        fig.current.store(current, Relaxed);
        if current > fig.limit.load(Relaxed) {
            std::hint::cold_path();
            book.overflow(self, f, set);
        }
    }

    /// Subtracts from an oversize count, and puts the shard on the book's list of loose shards.
    #[inline]
    pub(crate) fn decrease(&self, f: usize, amount: u64, book: &PeakBook) {
        if let Slot::Stored(i) = slot(f) {
            self.decrease_stored(i, amount);
            self.loosen(book);
        }
    }

    #[inline(always)]
    fn decrease_stored(&self, i: usize, amount: u64) {
        let fig = &self.stored[i];
        fig.current
            .store(fig.current.load(Relaxed) - amount as i64, Relaxed);
        fig.freed
            .store(fig.freed.load(Relaxed) + amount as i64, Relaxed);
    }

    /// The value of book figure `f` in this shard (with the deferred record).
    pub(crate) fn current(&self, f: usize) -> i64 {
        match slot(f) {
            Slot::Stored(i) => self.stored[i].current.load(Relaxed) + self.deferred(i).0,
            Slot::All(kind) => self.current(pool(kind, true)) + self.current(pool(kind, false)),
        }
    }

    /// The total added to book figure `f` since the last accumulated reset.
    fn allocated(&self, f: usize) -> i64 {
        match slot(f) {
            Slot::Stored(i) => {
                let fig = &self.stored[i];
                let (current, freed) = self.deferred(i);
                fig.current.load(Relaxed) + current - fig.base.load(Relaxed)
                    + fig.freed.load(Relaxed)
                    + freed
            }
            Slot::All(kind) => self.allocated(pool(kind, true)) + self.allocated(pool(kind, false)),
        }
    }

    /// The total removed from book figure `f` since the last accumulated reset.
    fn freed(&self, f: usize) -> i64 {
        match slot(f) {
            Slot::Stored(i) => self.stored[i].freed.load(Relaxed) + self.deferred(i).1,
            Slot::All(kind) => self.freed(pool(kind, true)) + self.freed(pool(kind, false)),
        }
    }

    /// Sets the limit of book figure `f`. Caller holds the book's lock.
    fn set_limit(&self, f: usize, limit: i64) {
        self.limits_epoch
            .store(self.limits_epoch.load(Relaxed) + 1, Relaxed);
        match slot(f) {
            Slot::Stored(i) => self.stored[i].limit.store(limit, Relaxed),
            Slot::All(kind) => self.all_limits[kind as usize].store(limit, Relaxed),
        }
    }

    /// The limit of book figure `f`.
    fn limit(&self, f: usize) -> i64 {
        match slot(f) {
            Slot::Stored(i) => self.stored[i].limit.load(Relaxed),
            Slot::All(kind) => self.all_limits[kind as usize].load(Relaxed),
        }
    }

    /// Zeroes the cumulative totals. Caller holds the shard's lock.
    pub(crate) fn reset_accumulated(&self) {
        debug_assert_eq!(
            self.deferred.parked.load(Relaxed),
            0,
            "the shard's lock settles a parked free"
        );
        self.deferred.pairs.store(0, Relaxed);
        for fig in &self.stored {
            fig.base.store(fig.current.load(Relaxed), Relaxed);
            fig.freed.store(0, Relaxed);
        }
    }
}

/// The device-wide peaks and the lock under which limits are handed out.
///
/// Besides the peaks, the book keeps the sum of every shard's limit per figure (limits are only
/// written under its lock, so the sum is exact) and a list of the *loose* shards: those that may be
/// below one of their limits. Every shard off the list is *tight*, each of its values equal to its
/// limit. A shard goes on the list when the book hands it a limit above its value (the shard that
/// passed its limit) and when it decreases a figure ([`Figures::loosen`]); it leaves it when the
/// book reads its values and sets its limits to them. A tight shard cannot increase unseen (any
/// increase passes its limit), so with one thread the sum of the shards' values is the sum of the
/// limits less what the loose shards are below theirs: a new peak reads the loose shards only, never
/// the shards that did nothing since the book last read them.
#[derive(Debug)]
pub(crate) struct PeakBook {
    inner: Mutex<Book>,
}

/// What the book's lock guards.
#[derive(Debug)]
struct Book {
    /// The recorded peaks.
    peaks: [i64; FIGURES],
    /// Per figure, the sum of every shard's limit: at most the recorded peak.
    limits: [i64; FIGURES],
    /// The indices of the loose shards (each once, with its `loose` flag set).
    loose: Vec<u32>,
}

impl Default for PeakBook {
    fn default() -> Self {
        PeakBook {
            inner: Mutex::new(Book {
                peaks: [0; FIGURES],
                limits: [0; FIGURES],
                loose: Vec::new(),
            }),
        }
    }
}

impl Book {
    /// Puts `fig` on the list of loose shards, if it is not there.
    fn enlist(&mut self, fig: &Figures) {
        if !fig.loose.load(Relaxed) {
            fig.loose.store(true, Relaxed);
            self.loose.push(fig.index);
        }
    }

    /// Sets limit `f` of shard `fig`, keeping the sum of the limits.
    fn set_limit(&mut self, fig: &Figures, f: usize, limit: i64) {
        self.limits[f] += limit - fig.limit(f);
        fig.set_limit(f, limit);
    }

    /// Reads every loose shard but `me` and sets each of its limits to its value: they leave the
    /// list, tight. Each value is read once, and the limit set is that value (a shard that rose
    /// meanwhile, on another thread, passes its limit on its next increase). The record of deferred
    /// figures gets a new stamp, so that the shard's next hot-pair free takes the usual path, which
    /// puts it back on the list ([`Figures::loosen`]).
    fn tighten_all_but(&mut self, me: &Figures, set: &dyn FigureSet) {
        let loose = std::mem::take(&mut self.loose);
        for &index in &loose {
            if index == me.index {
                continue;
            }
            let Some(fig) = set.figures(index) else {
                continue;
            };
            fig.loose.store(false, Relaxed);
            fig.new_record_stamp();
            for f in 0..FIGURES {
                let value = fig.current(f);
                self.set_limit(fig, f, value);
            }
        }
        self.loose = loose;
        self.loose.retain(|&index| index == me.index);
    }
}

impl PeakBook {
    /// Puts shard `fig` on the list of loose shards (see [`Figures::loosen`]).
    #[cold]
    #[inline(never)]
    fn enlist(&self, fig: &Figures) {
        self.inner.lock().enlist(fig);
    }

    /// Shard `me` may have passed its limit of statistic `kind` for the pool type, or for all pools.
    #[cold]
    #[inline(never)]
    fn overflow_kind(&self, me: &Figures, kind: Kind, small: bool, set: &dyn FigureSet) {
        for f in [pool(kind, small), all(kind)] {
            if me.current(f) > me.limit(f) {
                self.overflow(me, f, set);
            }
        }
    }

    /// Shard `me` passed its limit for figure `f`: record the exact device-wide sum as the peak if it
    /// is higher, and give `me` a new limit.
    ///
    /// The other shards' values add up to at most their limits, whose sum the book keeps. If `me`'s
    /// value fits under the peak with them, there is no new peak, and `me` takes what their limits
    /// leave of the peak (shards taking turns settle this way). Otherwise the loose shards are read
    /// and made tight, so that the others' limits add up to exactly their values: the sum is exact,
    /// the peak is raised to it if it is higher, and `me` takes the rest. Either way the limits add up
    /// to exactly the recorded peak, and `me` is loose.
    #[cold]
    #[inline(never)]
    fn overflow(&self, me: &Figures, f: usize, set: &dyn FigureSet) {
        let mut guard = self.inner.lock();
        let book = &mut *guard;
        book.enlist(me);
        // `me`'s value is stable: the caller holds its shard's lock.
        let mine = me.current(f);
        let others = book.limits[f] - me.limit(f);
        if mine + others <= book.peaks[f] {
            book.set_limit(me, f, book.peaks[f] - others);
            return;
        }
        book.tighten_all_but(me, set);
        let others = book.limits[f] - me.limit(f);
        if mine + others > book.peaks[f] {
            book.peaks[f] = mine + others;
        }
        book.set_limit(me, f, book.peaks[f] - others);
    }

    /// Sets every peak to the current sum (PyTorch's `reset_peak_stat`), leaving no headroom: every
    /// shard tight.
    pub(crate) fn reset_peaks(&self, set: &dyn FigureSet) {
        let mut guard = self.inner.lock();
        let book = &mut *guard;
        book.peaks = [0; FIGURES];
        book.limits = [0; FIGURES];
        book.loose.clear();
        set.for_each_figures(&mut |fig| {
            fig.loose.store(false, Relaxed);
            fig.new_record_stamp();
            for f in 0..FIGURES {
                let current = fig.current(f);
                book.peaks[f] += current;
                book.limits[f] += current;
                fig.set_limit(f, current);
            }
        });
    }

    /// The recorded peak of figure `f` (tests).
    #[cfg(test)]
    fn recorded(&self, f: usize) -> i64 {
        self.inner.lock().peaks[f]
    }

    /// The device-wide figures: sums of the shards' values, with the recorded peaks.
    pub(crate) fn read(&self, set: &dyn FigureSet, into: &mut MemoryStats) {
        let book = self.inner.lock();
        let peaks = &book.peaks;
        let mut stats = [Stat::default(); FIGURES];
        set.for_each_figures(&mut |fig| {
            for (f, stat) in stats.iter_mut().enumerate() {
                stat.current += fig.current(f);
                stat.allocated += fig.allocated(f);
                stat.freed += fig.freed(f);
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

#[cfg(all(test, loom))]
mod loom_models;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Set<'a>(Vec<&'a Figures>);
    impl FigureSet for Set<'_> {
        fn for_each_figures(&self, f: &mut dyn FnMut(&Figures)) {
            for fig in &self.0 {
                f(fig);
            }
        }
        fn figures(&self, index: u32) -> Option<&Figures> {
            self.0.get(index as usize).copied()
        }
    }

    #[test]
    fn peak_is_the_peak_of_the_sum() {
        let (a, b) = (Figures::new(0), Figures::new(1));
        let book = PeakBook::default();
        let set = Set(vec![&a, &b]);
        let k = Kind::AllocatedBytes;
        a.increase_kind(k, true, 100, &book, &set);
        a.decrease_kind(k, true, 100, &book);
        b.increase_kind(k, false, 60, &book, &set);
        a.increase_kind(k, true, 30, &book, &set); // sum 90 < 100
        b.decrease_kind(k, false, 60, &book);
        b.increase_kind(k, true, 50, &book, &set); // sum 80
        a.increase_kind(k, false, 30, &book, &set); // sum 110: new peak
        let mut stats = MemoryStats::default();
        book.read(&set, &mut stats);
        assert_eq!(stats.allocated_bytes.all.peak, 110);
        assert_eq!(stats.allocated_bytes.all.current, 110);
        assert_eq!(stats.allocated_bytes.all.allocated, 270);
        assert_eq!(stats.allocated_bytes.all.freed, 160);
        assert_eq!(stats.allocated_bytes.small_pool.peak, 100);
        assert_eq!(stats.allocated_bytes.large_pool.peak, 60);
        a.decrease_kind(k, true, 30, &book);
        a.decrease_kind(k, false, 30, &book);
        book.reset_peaks(&set);
        book.read(&set, &mut stats);
        assert_eq!(stats.allocated_bytes.all.peak, 50);
        b.increase_kind(k, false, 1, &book, &set);
        book.read(&set, &mut stats);
        assert_eq!(stats.allocated_bytes.all.peak, 51);
    }

    /// Two shards whose set runs `between` once, when the book first looks a shard up: a rise of
    /// another thread's shard racing with an overflow (that reads the loose shards), made
    /// deterministic.
    struct Racing<'a> {
        shards: [&'a Figures; 2],
        between: std::cell::RefCell<Option<Box<dyn FnOnce() + 'a>>>,
    }
    impl FigureSet for Racing<'_> {
        fn for_each_figures(&self, f: &mut dyn FnMut(&Figures)) {
            for fig in self.shards {
                f(fig);
            }
        }
        fn figures(&self, index: u32) -> Option<&Figures> {
            let race = self.between.borrow_mut().take();
            if let Some(race) = race {
                race();
            }
            self.shards.get(index as usize).copied()
        }
    }

    /// Finding F1 (docs/reliability.md): a shard that rises under its old limit while another shard's
    /// overflow redistributes must not get its rise on top of its share.
    #[test]
    fn limits_never_add_up_to_more_than_the_peak() {
        let (a, b) = (Figures::new(0), Figures::new(1));
        let book = PeakBook::default();
        let plain = Set(vec![&a, &b]);
        let k = Kind::AllocatedBytes;
        let f = all(k);
        // B has been at 60 in the large pool, so its next rise to 60 passes only its `all` limit.
        b.increase_kind(k, false, 60, &book, &plain);
        b.decrease_kind(k, false, 60, &book);
        a.increase_kind(k, true, 100, &book, &plain); // peak 100: A's limit 100, B's 0
        a.decrease_kind(k, true, 100, &book);
        assert_eq!((a.limit(f), b.limit(f)), (100, 0));
        let racing = Racing {
            shards: [&a, &b],
            between: std::cell::RefCell::new(None),
        };
        // A rises by 30 (under its limit 100: no lock) while B's overflow of `all` holds the book's lock,
        // as the book is about to read A.
        let race: Box<dyn FnOnce() + '_> = Box::new(|| a.increase_kind(k, true, 30, &book, &plain));
        *racing.between.borrow_mut() = Some(race);
        b.increase_kind(k, false, 60, &book, &racing);
        assert!(racing.between.borrow().is_none(), "the race ran");
        let recorded = book.recorded(f);
        assert_eq!(recorded, 100);
        let limits = a.limit(f) + b.limit(f);
        assert!(
            limits <= recorded,
            "limits {limits} exceed the recorded peak {recorded}"
        );
        // So the shards cannot pass the recorded peak together unseen: with both filled up to their
        // limits the sum is the peak, and one more byte is recorded.
        let (room_a, room_b) = (a.limit(f) - a.current(f), b.limit(f) - b.current(f));
        b.increase_kind(k, false, room_b as u64, &book, &plain);
        a.increase_kind(k, true, room_a as u64 + 1, &book, &plain);
        a.decrease_kind(k, true, 31 + room_a as u64, &book);
        b.decrease_kind(k, false, 60 + room_b as u64, &book);
        let mut stats = MemoryStats::default();
        book.read(&plain, &mut stats);
        assert_eq!(stats.allocated_bytes.all.current, 0);
        assert_eq!(stats.allocated_bytes.all.peak, 101);
    }

    #[test]
    fn every_sequence_matches_a_single_counter() {
        // A deterministic pseudo-random walk over three shards, checked against one global counter.
        let shards = [Figures::new(0), Figures::new(1), Figures::new(2)];
        let book = PeakBook::default();
        let set = Set(shards.iter().collect());
        let k = Kind::ActiveBytes;
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
                shards[shard].increase_kind(k, true, amount, &book, &set);
                values[shard] += amount as i64;
                sum += amount as i64;
                peak = peak.max(sum);
            } else {
                shards[shard].decrease_kind(k, true, amount, &book);
                values[shard] -= amount as i64;
                sum -= amount as i64;
            }
            let mut stats = MemoryStats::default();
            book.read(&set, &mut stats);
            assert_eq!(stats.active_bytes.small_pool.peak, peak);
            assert_eq!(stats.active_bytes.all.peak, peak);
        }
    }
}
