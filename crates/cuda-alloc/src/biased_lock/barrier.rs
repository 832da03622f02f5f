//! The two halves of the biased lock's asymmetric fence: [`light`] on the owner's side (a compiler
//! fence), [`heavy`] on the revoker's (Linux's `membarrier`, private expedited: every running thread
//! of the process executes a full memory barrier before it returns). [`available`] says whether the
//! heavy half exists here; without it no lock is ever biased.
//!
//! Under miri there is no `membarrier`: locks stay plain mutexes there. Under loom both halves are
//! `SeqCst` fences (loom cannot model `membarrier`; with the symmetric
//! fences its models check the handshake's logic).

#[cfg(not(loom))]
use std::sync::atomic::{AtomicU8, Ordering};

/// [`available`] not asked yet.
#[cfg(not(loom))]
const UNKNOWN: u8 = 0;
#[cfg(not(loom))]
const YES: u8 = 1;
#[cfg(not(loom))]
const NO: u8 = 2;

#[cfg(not(loom))]
static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// The owner's half: keeps the compiler from moving its `busy` store after its `owner` check.
#[inline(always)]
pub(crate) fn light() {
    #[cfg(not(loom))]
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    #[cfg(loom)]
    loom::sync::atomic::fence(loom::sync::atomic::Ordering::SeqCst);
}

/// Whether [`heavy`] can be used: the process registered for private expedited `membarrier` (done
/// on the first call). Cheap after the first call.
pub(crate) fn available() -> bool {
    #[cfg(loom)]
    {
        true
    }
    #[cfg(not(loom))]
    {
        match STATE.load(Ordering::Relaxed) {
            YES => true,
            NO => false,
            _ => register(),
        }
    }
}

#[cfg(not(loom))]
#[cold]
fn register() -> bool {
    let ok = os::register();
    if !ok {
        tracing::debug!("membarrier unavailable: stream shard locks stay plain mutexes");
    }
    STATE.store(if ok { YES } else { NO }, Ordering::Relaxed);
    ok
}

/// The revoker's half: after it, every other thread of the process has executed a full barrier
/// (see the module documentation). Only called once [`available`] said yes.
pub(crate) fn heavy() {
    #[cfg(loom)]
    loom::sync::atomic::fence(loom::sync::atomic::Ordering::SeqCst);
    #[cfg(not(loom))]
    if let Err(first) = os::barrier() {
        // Registration is per process; a forked child inherits it, but register again rather than
        // rely on that.
        if !(os::register() && os::barrier().is_ok()) {
            // `available` said yes earlier in this process, so this cannot happen on a kernel
            // that keeps its promises. Continuing could let two threads into one shard.
            tracing::error!(%first, "membarrier failed after registering; aborting");
            eprintln!(
                "tensormem-cuda-alloc: membarrier(PRIVATE_EXPEDITED) failed after it had worked \
                 ({first}); a shard lock cannot be revoked safely, aborting"
            );
            std::process::abort();
        }
    }
}

#[cfg(all(not(loom), not(miri), any(target_os = "linux", target_os = "android")))]
mod os {
    use rustix::thread::{membarrier, MembarrierCommand};

    /// Registers the process for private expedited barriers; whether the kernel agreed.
    pub(super) fn register() -> bool {
        membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
    }

    pub(super) fn barrier() -> rustix::io::Result<()> {
        membarrier(MembarrierCommand::PrivateExpedited)
    }
}

#[cfg(all(
    not(loom),
    any(miri, not(any(target_os = "linux", target_os = "android")))
))]
mod os {
    /// No `membarrier` here (or under miri, which cannot run it): locks are never biased.
    pub(super) fn register() -> bool {
        false
    }

    pub(super) fn barrier() -> std::io::Result<()> {
        Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
    }
}
