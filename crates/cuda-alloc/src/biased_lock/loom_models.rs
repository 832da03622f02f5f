//! loom models of [`BiasedLock`]. Run with `RUSTFLAGS="--cfg loom"` (see `docs/reliability.md`).
//!
//! The value behind the lock holds loom's own `UnsafeCell`s, which report any two accesses not
//! ordered by happens-before: an owner inside the lock while a revoker is, or a revoker not seeing
//! the owner's writes, fails a model with a data race; a lost update fails the final count. Under
//! loom a thread becomes the owner after one mutex acquisition, and both halves of the asymmetric
//! fence are `SeqCst` fences (`barrier`), so the models check the handshake's logic: the owner's
//! announce-then-check against the revoker's clear-then-wait, re-biasing, `unlocked`.

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use super::{BiasedGuard, BiasedLock};

/// Two counters, changed only with the lock held.
#[derive(Debug)]
struct Counters {
    a: UnsafeCell<u32>,
    b: UnsafeCell<u32>,
}

impl Counters {
    fn new() -> Self {
        Counters {
            a: UnsafeCell::new(0),
            b: UnsafeCell::new(0),
        }
    }

    /// Adds one to both (two separate read-modify-writes, so that a torn critical section shows).
    fn bump(&self) {
        // SAFETY: only called with the lock held (loom checks the claim).
        self.a.with_mut(|a| unsafe { *a += 1 });
        // SAFETY: as above.
        self.b.with_mut(|b| unsafe { *b += 1 });
    }

    fn read(&self) -> (u32, u32) {
        // SAFETY: only called with the lock held.
        let a = self.a.with(|a| unsafe { *a });
        // SAFETY: as above.
        let b = self.b.with(|b| unsafe { *b });
        (a, b)
    }
}

/// Takes the lock, checks the counters agree, bumps them.
fn visit(lock: &BiasedLock<Counters>) {
    let guard = lock.lock();
    let (a, b) = guard.read();
    assert_eq!(a, b, "a critical section saw another half done");
    guard.bump();
}

#[test]
fn the_owner_and_a_revoker_exclude_each_other() {
    loom::model(|| {
        let lock = Arc::new(BiasedLock::new(Counters::new()));
        // The main thread becomes the owner.
        visit(&lock);
        assert!(lock.is_biased());
        let other = {
            let lock = Arc::clone(&lock);
            thread::spawn(move || visit(&lock))
        };
        // Through the bias, unless the other thread revoked it first.
        visit(&lock);
        other.join().expect("model thread");
        assert_eq!(lock.lock().read(), (3, 3), "an update was lost");
    });
}

#[test]
fn a_revoked_owner_comes_back_and_is_revoked_again() {
    loom::model(|| {
        let lock = Arc::new(BiasedLock::new(Counters::new()));
        visit(&lock);
        let other = {
            let lock = Arc::clone(&lock);
            thread::spawn(move || {
                visit(&lock);
                visit(&lock);
            })
        };
        // Whichever order: biases are taken, revoked and taken again.
        visit(&lock);
        visit(&lock);
        other.join().expect("model thread");
        assert_eq!(lock.lock().read(), (5, 5), "an update was lost");
    });
}

#[test]
fn unlocked_lets_others_in_and_takes_the_lock_back() {
    loom::model(|| {
        let lock = Arc::new(BiasedLock::new(Counters::new()));
        visit(&lock);
        let other = {
            let lock = Arc::clone(&lock);
            thread::spawn(move || visit(&lock))
        };
        {
            // The `release_lock_on_cudamalloc` shape: change the state, let go around a slow call,
            // change it again.
            let mut guard = lock.lock();
            guard.bump();
            BiasedGuard::unlocked(&mut guard, thread::yield_now);
            let (a, b) = guard.read();
            assert_eq!(a, b);
            guard.bump();
        }
        other.join().expect("model thread");
        assert_eq!(lock.lock().read(), (4, 4), "an update was lost");
    });
}
