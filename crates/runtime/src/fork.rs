//! The bad-fork guard: a `fork()` child of a process that had initialised CUDA must not use it.
//!
//! The CUDA driver's state does not survive `fork()`: a child that makes CUDA calls fails in confusing
//! ways or hangs. As in PyTorch (`torch/csrc/cuda/Module.cpp`, `poison_fork`), the first call that
//! initialises CUDA registers a `pthread_atfork` child handler that marks forked children, and every entry
//! point of the device API refuses with [`Error::ForkedChild`] in a marked child. Checking costs one
//! relaxed atomic load.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Once;

/// Set in a child forked after [`poison_fork`] ran in an ancestor.
static IN_BAD_FORK: AtomicBool = AtomicBool::new(false);

/// What the first CUDA initialisation of this process (or of the parent it was forked from, whose
/// memory a child inherits) came to: [`NOT_TRIED`], [`FAILED`] or [`INITIALISED`].
static ATTEMPT: AtomicU8 = AtomicU8::new(NOT_TRIED);
const NOT_TRIED: u8 = 0;
const FAILED: u8 = 1;
const INITIALISED: u8 = 2;

/// Records how an attempt to initialise CUDA ended (after [`poison_fork`]); a success stays recorded.
pub(crate) fn record_attempt(initialised: bool) {
    if initialised {
        ATTEMPT.store(INITIALISED, Ordering::Relaxed);
    } else {
        let _ = ATTEMPT.compare_exchange(NOT_TRIED, FAILED, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The message of [`Error::ForkedChild`](crate::Error::ForkedChild): it says whether the parent's CUDA initialisation had
/// failed (no driver, no device), in which case the refusal may surprise.
pub fn forked_child_message() -> &'static str {
    if ATTEMPT.load(Ordering::Relaxed) == FAILED {
        "Cannot re-initialize CUDA in forked subprocess: this process was forked after its parent tried \
         to initialise CUDA, and that attempt failed (no usable CUDA driver or device); the child is \
         refused all the same, as PyTorch refuses it, because the parent touched CUDA. Start workers \
         that use CUDA as fresh processes (spawn, or fork then exec), or fork before the parent's first \
         CUDA call"
    } else {
        "Cannot re-initialize CUDA in forked subprocess: this process was forked after its parent had \
         initialised CUDA. Start workers that use CUDA as fresh processes (spawn, or fork then exec), or \
         fork before the parent's first CUDA call"
    }
}

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
