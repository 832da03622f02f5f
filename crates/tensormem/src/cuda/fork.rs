//! The bad-fork guard: a `fork()` child of a process that had initialised CUDA must not use it.
//!
//! The CUDA driver's state does not survive `fork()`: a child that makes CUDA calls fails in confusing
//! ways or hangs. As in PyTorch (`torch/csrc/cuda/Module.cpp`, `poison_fork`), the first call that
//! initialises CUDA registers a `pthread_atfork` child handler that marks forked children, and every entry
//! point of the device API refuses with [`Error::ForkedChild`] in a marked child. Checking costs one
//! relaxed atomic load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use super::error::{Error, Result};

/// Set in a child forked after [`poison_fork`] ran in an ancestor.
static IN_BAD_FORK: AtomicBool = AtomicBool::new(false);

/// Runs in the child right after `fork()`; only stores an atomic (async-signal-safe).
extern "C" fn forked_child() {
    IN_BAD_FORK.store(true, Ordering::Relaxed);
}

/// Registers the child handler, once per process. Called before the first driver call.
pub(crate) fn poison_fork() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: `forked_child` is a valid `extern "C" fn()` for the life of the process and only
        // performs an atomic store, which is allowed in a child between fork and exec.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "pthread_atfork failed: use of CUDA in forked children will not be detected"
            );
        }
    });
}

/// Whether this process is a child forked after CUDA was initialised in its parent (PyTorch's
/// `torch.cuda._is_in_bad_fork`).
#[must_use]
pub fn is_in_bad_fork() -> bool {
    IN_BAD_FORK.load(Ordering::Relaxed)
}

/// `Err(Error::ForkedChild)` in a bad fork.
#[inline]
pub(crate) fn check_not_forked() -> Result<()> {
    if is_in_bad_fork() {
        Err(Error::ForkedChild)
    } else {
        Ok(())
    }
}
