//! The mutex under a [`BiasedLock`](super::BiasedLock): `parking_lot`'s raw mutex, or under loom a
//! test-and-set lock that yields to loom's scheduler; and the revoker's wait.

#[cfg(not(loom))]
use parking_lot::RawMutex;

/// A raw mutex: `lock`, and `unlock` by its holder.
pub(super) struct Mutex {
    #[cfg(not(loom))]
    raw: RawMutex,
    #[cfg(loom)]
    locked: loom::sync::atomic::AtomicBool,
}

impl Mutex {
    pub(super) fn new() -> Self {
        Mutex {
            #[cfg(not(loom))]
            raw: <RawMutex as parking_lot::lock_api::RawMutex>::INIT,
            #[cfg(loom)]
            locked: loom::sync::atomic::AtomicBool::new(false),
        }
    }

    #[inline]
    pub(super) fn lock(&self) {
        #[cfg(not(loom))]
        parking_lot::lock_api::RawMutex::lock(&self.raw);
        #[cfg(loom)]
        while self
            .locked
            .compare_exchange(
                false,
                true,
                loom::sync::atomic::Ordering::Acquire,
                loom::sync::atomic::Ordering::Relaxed,
            )
            .is_err()
        {
            loom::thread::yield_now();
        }
    }

    /// # Safety
    /// The calling thread holds the mutex.
    #[inline]
    pub(super) unsafe fn unlock(&self) {
        // SAFETY: the caller holds the mutex (this function's contract).
        #[cfg(not(loom))]
        unsafe {
            parking_lot::lock_api::RawMutex::unlock(&self.raw);
        }
        #[cfg(loom)]
        self.locked
            .store(false, loom::sync::atomic::Ordering::Release);
    }
}

/// Spins before a revoker waiting for the owner to leave starts yielding.
#[cfg(not(loom))]
const SPINS: u32 = 64;
/// Yields before it starts napping (the owner may be inside a device call).
#[cfg(not(loom))]
const YIELDS: u32 = 64;

/// One step of a revoker's wait for the owner to leave, the `waits`-th.
#[inline]
pub(super) fn backoff(waits: u32) {
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
            std::thread::sleep(std::time::Duration::from_micros(5));
        }
    }
}
