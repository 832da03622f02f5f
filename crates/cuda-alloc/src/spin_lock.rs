//! [`SpinLock`]: a test-and-test-and-set lock released by a plain store, the shard lock of builds
//! with the feature `spin-shard-lock` (see [`crate::shard::ShardLock`]).
//!
//! A stream shard's lock is taken once per allocator call and is almost never contended (a stream is
//! rarely used from several threads at once). A general mutex such as `parking_lot`'s must release
//! with a locked read-modify-write, to learn whether a waiter went to sleep and must be woken; that
//! second locked instruction per call costs as much as the acquire (about 12 ns per alloc+free pair
//! on the development box, see docs/allocator-performance.md). Here waiters never sleep *in* the
//! lock: they spin briefly, then yield, then nap for a few microseconds and look again (a holder may
//! be inside a device call, e.g. a `cuMemAlloc` of a new segment, while `release_lock_on_cudamalloc`
//! is off), so nobody needs waking and the release is a plain release store.
//!
//! The price is latency under contention: a waiter that went to nap notices a release up to ~5 µs
//! late. Contention on one stream's lock from several threads is the unusual case the allocator is
//! not tuned for (PyTorch serialises every stream of a device behind one lock).
//!
//! The protocol is checked by loom models (`spin_lock::loom_models`, see docs/reliability.md).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, Ordering};

/// Spins before a waiter starts yielding.
#[cfg(not(loom))]
const SPINS: u32 = 64;
/// Yields before a waiter starts napping.
#[cfg(not(loom))]
const YIELDS: u32 = 64;
/// A waiter's nap once spinning and yielding did not see the lock free.
#[cfg(not(loom))]
const NAP: std::time::Duration = std::time::Duration::from_micros(5);

/// A mutual-exclusion lock around a `T`: acquire by compare-exchange, release by a plain store.
pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock gives access to `value` to one thread at a time (the acquiring compare-exchange
// has `Acquire` ordering and the releasing store `Release`, so each holder sees every write of the
// holders before it), so sharing the lock between threads is sound whenever `T` may move between
// threads.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: owning the lock owns `value`.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    /// A lock around `value`, not held.
    pub(crate) fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for it if another thread holds it.
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        self.acquire();
        SpinGuard { lock: self }
    }

    #[inline]
    fn acquire(&self) {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.acquire_contended();
        }
    }

    /// The wait: test until free (spin, then yield, then nap), then try again.
    #[cold]
    #[inline(never)]
    fn acquire_contended(&self) {
        let mut waits = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                backoff(waits);
                waits = waits.saturating_add(1);
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    #[inline]
    fn release(&self) {
        self.locked.store(false, Ordering::Release);
    }
}

/// One step of a waiter's wait, the `waits`-th.
#[inline]
fn backoff(waits: u32) {
    #[cfg(loom)]
    {
        let _ = waits;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if waits < SPINS {
            std::hint::spin_loop();
        } else if waits < SPINS + YIELDS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP);
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinLock")
            .field("locked", &self.locked.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Access to a [`SpinLock`]'s value; releases the lock when dropped.
pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> SpinGuard<'_, T> {
    /// Lets go of the lock while `f` runs and takes it again afterwards (as
    /// `parking_lot::MutexGuard::unlocked`).
    pub(crate) fn unlocked<R>(guard: &mut Self, f: impl FnOnce() -> R) -> R {
        guard.lock.release();
        // Taken again even if `f` unwinds: the guard's drop releases it once more.
        struct Relock<'b, T>(&'b SpinLock<T>);
        impl<T> Drop for Relock<'_, T> {
            fn drop(&mut self) {
                self.0.acquire();
            }
        }
        let _relock = Relock(guard.lock);
        f()
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: a guard exists only while its thread holds the lock (taken in `lock`, or again
        // after `unlocked`, which borrows the guard mutably meanwhile), so no other thread has a
        // reference to the value.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.release();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::SpinLock;

    #[test]
    fn counts_from_several_threads_add_up() {
        let lock = SpinLock::new(0u64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        *lock.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*lock.lock(), 40_000);
    }

    #[test]
    fn unlocked_lets_another_thread_in() {
        let lock = SpinLock::new(Vec::new());
        let mut guard = lock.lock();
        guard.push(1);
        super::SpinGuard::unlocked(&mut guard, || {
            std::thread::scope(|s| {
                s.spawn(|| lock.lock().push(2));
            });
        });
        guard.push(3);
        drop(guard);
        assert_eq!(*lock.lock(), [1, 2, 3]);
    }
}

#[cfg(all(test, loom))]
mod loom_models;
