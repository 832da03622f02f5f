//! [`BiasedLock`]: the stream shards' lock. A mutex that the one thread using a stream takes and
//! releases without a single locked instruction, and that still excludes every other thread.
//!
//! A shard's lock is taken once per allocator call, and nearly always by the same thread (a stream
//! is rarely used from several threads at once). A mutex acquires with a locked read-modify-write
//! and, to learn whether to wake a waiter, releases with another: four locked instructions per
//! alloc+free pair, each costing more than the rest of a hot pair's bookkeeping. Here the lock is
//! *biased* towards one thread, its owner (docs/allocator-internals.md, "Stream shards"):
//!
//! - The owner enters by announcing itself (`busy`, a plain store), then checking that it still is
//!   the owner (a plain load); it leaves by clearing `busy` (a plain release store).
//! - Everyone else, and the owner once it lost the bias, goes through a `parking_lot` mutex. The
//!   first such thread *revokes* the bias: it clears `owner`, runs [`barrier::heavy`] (Linux's
//!   `membarrier`, which makes every running thread of the process execute a full memory barrier),
//!   and waits until `busy` is clear.
//!
//! This is Dekker's handshake with its two fences made asymmetric: the owner's side has only a
//! compiler fence ([`barrier::light`]), and the revoker's `membarrier` stands in for the owner's
//! hardware fence. After it, either the owner's `busy` store is visible to the revoker (which then
//! waits for the owner to leave), or the owner's check comes after the barrier and sees `owner`
//! cleared (and the owner takes the mutex, which the revoker holds). The argument is the kernel's
//! own for `membarrier` (kernel/sched/membarrier.c, scenario A); the loom models check the protocol
//! with both fences as `SeqCst` fences (`biased_lock::loom_models`).
//!
//! A thread becomes the owner by taking the lock through the mutex enough times in a row (4 at
//! first, twice as many after every revocation, at most 1024), so two threads taking turns on one
//! stream settle on the mutex instead of revoking each other's bias every time. Where `membarrier`
//! is missing (a kernel before 4.14, a sandbox filtering it, not Linux) nothing is ever biased and
//! the lock is the mutex alone.
//!
//! Taking the lock again on a thread that holds it deadlocks, as with any mutex: the owner sees its
//! own `busy` and takes the mutex path, whose revocation waits for that `busy` to clear.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub(crate) mod barrier;
mod raw;

/// Mutex acquisitions in a row by one thread before it becomes the owner, at first.
const FIRST_NEEDED: u32 = if cfg!(loom) { 1 } else { 4 };
/// The most ever asked for (the number doubles with every revocation).
const MAX_NEEDED: u32 = 1024;

/// A mutual-exclusion lock around a `T`, biased towards the thread that takes it most.
pub(crate) struct BiasedLock<T> {
    /// The way in for every thread but the owner.
    mutex: raw::Mutex,
    /// The owner's [`thread_token`], 0 for none. Changed only with `mutex` held.
    owner: AtomicUsize,
    /// Set by the owner while it holds the lock without the mutex.
    busy: AtomicBool,
    /// Who took the mutex last and how often in a row (only with `mutex` held).
    streak: UnsafeCell<Streak>,
    value: UnsafeCell<T>,
}

/// The bias bookkeeping of the mutex path.
#[derive(Debug)]
struct Streak {
    thread: usize,
    count: u32,
    /// Acquisitions in a row that make `thread` the owner.
    needed: u32,
}

// SAFETY: the lock gives access to `value` (and `streak`) to one thread at a time: through the mutex
// (whose lock and unlock order the critical sections), or to the owner between its `busy` store and
// its clearing `busy` store, which no mutex holder overlaps (module documentation: a mutex holder
// has revoked the bias and seen `busy` clear with `Acquire`, pairing with the owner's `Release`;
// the owner entered only after seeing itself as owner, which it became under the mutex). So sharing
// the lock is sound whenever `T` may move between threads.
unsafe impl<T: Send> Sync for BiasedLock<T> {}
// SAFETY: owning the lock owns `value`.
unsafe impl<T: Send> Send for BiasedLock<T> {}

/// A number unique to the calling thread among live threads, never 0: the address of a
/// thread-local byte.
#[cfg(not(loom))]
#[inline(always)]
fn thread_token() -> usize {
    thread_local! {
        static TOKEN: u8 = const { 0 };
    }
    TOKEN.with(|t| std::ptr::from_ref(t) as usize)
}

/// Under loom: a number handed out on a model thread's first call.
#[cfg(loom)]
fn thread_token() -> usize {
    use std::cell::Cell;
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    loom::thread_local! {
        static TOKEN: Cell<usize> = Cell::new(0);
    }
    TOKEN.with(|t| {
        if t.get() == 0 {
            t.set(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        }
        t.get()
    })
}

impl<T> BiasedLock<T> {
    /// A lock around `value`, not held, biased towards nobody.
    pub(crate) fn new(value: T) -> Self {
        BiasedLock {
            mutex: raw::Mutex::new(),
            owner: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            streak: UnsafeCell::new(Streak {
                thread: 0,
                count: 0,
                needed: FIRST_NEEDED,
            }),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for it if another thread holds it.
    #[inline]
    pub(crate) fn lock(&self) -> BiasedGuard<'_, T> {
        let biased = self.acquire();
        BiasedGuard { lock: self, biased }
    }

    /// Takes the lock: `true` through the bias, `false` through the mutex.
    #[inline]
    fn acquire(&self) -> bool {
        let me = thread_token();
        // Only this thread sets `busy` while it is the owner: seeing it set means this thread holds
        // the lock already, and the mutex path deadlocks as a mutex would.
        if self.owner.load(Ordering::Relaxed) == me && !self.busy.load(Ordering::Relaxed) {
            self.busy.store(true, Ordering::Relaxed);
            barrier::light();
            // Still the owner after announcing itself: no revoker can be past its wait for `busy`.
            // The owner became the owner under the mutex, after every mutex holder before it, so it
            // sees their writes; no later mutex holder got in without revoking first.
            if self.owner.load(Ordering::Relaxed) == me {
                return true;
            }
            self.busy.store(false, Ordering::Release);
        }
        self.acquire_mutex();
        false
    }

    /// The mutex path: take the mutex, revoke the bias if there is one.
    #[cold]
    #[inline(never)]
    fn acquire_mutex(&self) {
        self.mutex.lock();
        if self.owner.load(Ordering::Relaxed) != 0 {
            self.revoke();
        }
    }

    /// Takes the bias away (the mutex held): afterwards the owner is out and stays out.
    #[cold]
    fn revoke(&self) {
        self.owner.store(0, Ordering::Relaxed);
        barrier::heavy();
        let mut waits = 0u32;
        // `Acquire`, pairing with the owner's clearing `Release` store: its writes are seen.
        while self.busy.load(Ordering::Acquire) {
            raw::backoff(waits);
            waits = waits.saturating_add(1);
        }
        // SAFETY: the mutex is held, and the owner is out (see the module documentation).
        let streak = unsafe { &mut *self.streak.get() };
        streak.needed = streak.needed.saturating_mul(2).min(MAX_NEEDED);
        streak.count = 0;
        #[cfg(not(loom))]
        tracing::trace!(
            next_bias_after = streak.needed,
            "shard lock: bias revoked by another thread"
        );
    }

    /// Releases the lock taken as `acquire` said.
    #[inline]
    fn release(&self, biased: bool) {
        if biased {
            self.busy.store(false, Ordering::Release);
        } else {
            self.release_mutex();
        }
    }

    /// Releases the mutex, first making this thread the owner if it took the mutex often enough in
    /// a row.
    #[cold]
    #[inline(never)]
    fn release_mutex(&self) {
        let me = thread_token();
        // SAFETY: the mutex is held by this thread.
        let streak = unsafe { &mut *self.streak.get() };
        if streak.thread == me {
            streak.count = streak.count.saturating_add(1);
        } else {
            streak.thread = me;
            streak.count = 1;
        }
        if streak.count >= streak.needed && barrier::available() {
            streak.count = 0;
            // Seen by this thread's next `acquire`; any other thread reads it under the mutex,
            // after this unlock.
            self.owner.store(me, Ordering::Relaxed);
        }
        // SAFETY: the mutex is held by this thread (taken in `acquire_mutex`).
        unsafe { self.mutex.unlock() };
    }

    /// Whether some thread holds the bias (tests and `Debug`).
    pub(crate) fn is_biased(&self) -> bool {
        self.owner.load(Ordering::Relaxed) != 0
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for BiasedLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BiasedLock")
            .field("biased", &self.is_biased())
            .finish_non_exhaustive()
    }
}

/// Access to a [`BiasedLock`]'s value; releases the lock when dropped.
pub(crate) struct BiasedGuard<'a, T> {
    lock: &'a BiasedLock<T>,
    /// Taken through the bias (else through the mutex).
    biased: bool,
}

impl<T> BiasedGuard<'_, T> {
    /// Lets go of the lock while `f` runs and takes it again afterwards (as
    /// `parking_lot::MutexGuard::unlocked`), also when `f` unwinds.
    pub(crate) fn unlocked<R>(guard: &mut Self, f: impl FnOnce() -> R) -> R {
        struct Relock<'g, 'a, T>(&'g mut BiasedGuard<'a, T>);
        impl<T> Drop for Relock<'_, '_, T> {
            fn drop(&mut self) {
                self.0.biased = self.0.lock.acquire();
            }
        }
        guard.lock.release(guard.biased);
        let _relock = Relock(guard);
        f()
    }
}

impl<T> Deref for BiasedGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: a guard exists only while its thread holds the lock (taken in `lock`, or again
        // after `unlocked`, which borrows the guard mutably meanwhile), so no other thread has a
        // reference to the value.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for BiasedGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.release(self.biased);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{BiasedGuard, BiasedLock};

    #[test]
    fn a_thread_taking_the_lock_again_and_again_becomes_its_owner() {
        let lock = BiasedLock::new(0u64);
        for _ in 0..super::FIRST_NEEDED {
            assert!(!lock.is_biased());
            *lock.lock() += 1;
        }
        assert_eq!(lock.is_biased(), super::barrier::available());
        let guard = lock.lock();
        assert_eq!(guard.biased, super::barrier::available());
    }

    #[test]
    fn counts_from_several_threads_add_up() {
        let lock = BiasedLock::new(0u64);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let lock = &lock;
                s.spawn(move || {
                    // Runs of different lengths, so that biases form and are revoked.
                    for i in 0..20_000u64 {
                        *lock.lock() += 1;
                        if (i + t) % (64 << t) == 0 {
                            std::thread::yield_now();
                        }
                    }
                });
            }
        });
        assert_eq!(*lock.lock(), 80_000);
    }

    #[test]
    fn another_thread_revokes_the_bias_and_sees_the_owners_writes() {
        let lock = BiasedLock::new(Vec::new());
        for i in 0..super::FIRST_NEEDED {
            lock.lock().push(i);
        }
        lock.lock().push(100);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut guard = lock.lock();
                assert!(!guard.biased);
                assert_eq!(guard.last(), Some(&100));
                guard.push(200);
            });
        });
        assert!(!lock.is_biased(), "revoked");
        assert_eq!(lock.lock().last(), Some(&200));
    }

    #[test]
    fn unlocked_lets_another_thread_in() {
        let lock = BiasedLock::new(Vec::new());
        for _ in 0..super::FIRST_NEEDED {
            drop(lock.lock());
        }
        let mut guard = lock.lock();
        guard.push(1);
        BiasedGuard::unlocked(&mut guard, || {
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
