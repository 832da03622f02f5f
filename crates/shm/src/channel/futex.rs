//! The doorbell word a side sleeps on: a `u32` in shared memory with Linux `futex(2)` wait and
//! wake (not `FUTEX_PRIVATE_FLAG`: the two processes map the word at different addresses, and the
//! kernel keys a shared futex by the object and offset). Under `cfg(loom)` the same interface
//! is emulated with loom's mutex and condition variable, so the models check the protocol built
//! on it (see `loom_models`).

use std::time::Duration;

#[cfg(not(loom))]
use std::sync::atomic::AtomicU32;

#[cfg(loom)]
use loom::sync::atomic::AtomicU32;

/// Why a [`FutexWord::wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// Woken, interrupted, or the word no longer held the expected value: look again.
    Woken,
    /// The timeout passed.
    TimedOut,
}

/// A futex word. In shared memory it is exactly a `u32` (`repr(transparent)`).
#[cfg(not(loom))]
#[repr(transparent)]
pub(crate) struct FutexWord(pub(crate) AtomicU32);

#[cfg(not(loom))]
impl FutexWord {
    /// Sleeps while the word holds `expected`, at most `timeout` (`None`: no limit).
    pub(crate) fn wait(&self, expected: u32, timeout: Option<Duration>) -> Wake {
        use rustix::thread::futex;
        let spec = timeout.map(|t| futex::Timespec {
            tv_sec: i64::try_from(t.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(t.subsec_nanos()),
        });
        match futex::wait(&self.0, futex::Flags::empty(), expected, spec.as_ref()) {
            Err(rustix::io::Errno::TIMEDOUT) => Wake::TimedOut,
            // Woken, EAGAIN (the value changed before the kernel looked), EINTR: the caller
            // looks at the ring again in every case.
            _ => Wake::Woken,
        }
    }

    /// Wakes one sleeper of the word, if any.
    pub(crate) fn wake(&self) {
        let _ = rustix::thread::futex::wake(&self.0, rustix::thread::futex::Flags::empty(), 1);
    }
}

/// loom's stand-in: the value and a condition variable whose mutex makes "check the value, then
/// sleep" atomic with respect to `wake`, as the kernel's futex hash-bucket lock does.
#[cfg(loom)]
pub(crate) struct FutexWord {
    pub(crate) value: AtomicU32,
    lock: loom::sync::Mutex<()>,
    cond: loom::sync::Condvar,
}

#[cfg(loom)]
impl FutexWord {
    pub(crate) fn new() -> Self {
        Self {
            value: AtomicU32::new(0),
            lock: loom::sync::Mutex::new(()),
            cond: loom::sync::Condvar::new(),
        }
    }

    /// No timeouts in the model: a lost wake-up is a deadlock loom reports.
    pub(crate) fn wait(&self, expected: u32, _timeout: Option<Duration>) -> Wake {
        let guard = self.lock.lock().unwrap();
        if self.value.load(std::sync::atomic::Ordering::SeqCst) == expected {
            drop(self.cond.wait(guard).unwrap());
        }
        Wake::Woken
    }

    pub(crate) fn wake(&self) {
        let _guard = self.lock.lock().unwrap();
        self.cond.notify_all();
    }
}

impl FutexWord {
    /// The atomic value.
    #[inline]
    pub(crate) fn word(&self) -> &AtomicU32 {
        #[cfg(not(loom))]
        {
            &self.0
        }
        #[cfg(loom)]
        {
            &self.value
        }
    }
}
