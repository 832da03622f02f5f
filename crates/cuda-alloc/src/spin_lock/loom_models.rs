//! loom models of [`SpinLock`]. Run with `RUSTFLAGS="--cfg loom"` (see `docs/reliability.md`).
//!
//! The value behind the lock holds loom's own `UnsafeCell`s, which report any two accesses not
//! ordered by happens-before: if the lock's acquire (compare-exchange, `Acquire`) and release (plain
//! store, `Release`) did not order the critical sections, loom would fail the model with a data race,
//! and a lost update would fail the final count. Under `cfg(loom)` a waiter yields to loom's
//! scheduler at every step of its wait.

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use super::{SpinGuard, SpinLock};

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

#[test]
fn critical_sections_exclude_each_other() {
    loom::model(|| {
        let lock = Arc::new(SpinLock::new(Counters::new()));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let lock = Arc::clone(&lock);
                thread::spawn(move || {
                    let guard = lock.lock();
                    let (a, b) = guard.read();
                    assert_eq!(a, b, "a critical section saw another half done");
                    guard.bump();
                })
            })
            .collect();
        for t in threads {
            t.join().expect("model thread");
        }
        assert_eq!(lock.lock().read(), (2, 2), "an update was lost");
    });
}

#[test]
fn unlocked_lets_others_in_and_takes_the_lock_back() {
    loom::model(|| {
        let lock = Arc::new(SpinLock::new(Counters::new()));
        let other = {
            let lock = Arc::clone(&lock);
            thread::spawn(move || lock.lock().bump())
        };
        {
            // The `release_lock_on_cudamalloc` shape: change the state, let go around a slow call,
            // change it again.
            let mut guard = lock.lock();
            guard.bump();
            SpinGuard::unlocked(&mut guard, || thread::yield_now());
            let (a, b) = guard.read();
            assert_eq!(a, b);
            guard.bump();
        }
        other.join().expect("model thread");
        assert_eq!(lock.lock().read(), (3, 3), "an update was lost");
    });
}
