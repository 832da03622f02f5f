//! What the process-wide IPC state does when the process exits normally.
//!
//! PyTorch keeps its IPC state in a static (`CudaIPCGlobalEntities`) whose destructor runs at
//! static destruction: it collects what consumers released, warns ("Producer process has been
//! terminated before all shared CUDA tensors released") if they still hold memory, and closes the
//! ref-counter files, the last closer unlinking each name. Rust never drops statics, so a producer
//! that lives as long as the process (the process runtime's, which `tensormem-runtime` keeps in a
//! static) would leave its files in `/dev/shm` at every exit and
//! never warn. Such producers register here
//! ([`IpcProducer::register_exit_hook`](crate::IpcProducer::register_exit_hook)), and one
//! `atexit(3)` hook, installed with the first registration, runs
//! [`IpcProducer::close_at_exit`](crate::IpcProducer::close_at_exit) on those still alive. The
//! same hook removes the version channels of [weights publications](crate::weights) still open.
//!
//! The hook runs after `main` returned or `std::process::exit` was called, while other threads
//! may still run and after other libraries' exit handlers may have torn their state down (the CUDA
//! driver's among them). So it makes no driver call, frees nothing, drops no producer, never waits
//! long for a lock, and never unwinds: it only touches ref-counter files and logs.

use std::ffi::c_int;
use std::sync::{Once, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tensormem_shm::ShmName;

/// How long the exit hook waits for a lock another thread holds before skipping that work.
pub(crate) const EXIT_LOCK_WAIT: Duration = Duration::from_millis(200);

/// A producer the exit hook closes.
pub(crate) trait CloseAtExit: Send + Sync {
    /// [`IpcProducer::close_at_exit`](crate::IpcProducer::close_at_exit).
    fn close_at_exit(&self) -> usize;
}

/// The producers registered, alive or not (dead ones are dropped at the next registration).
static REGISTERED: Mutex<Vec<Weak<dyn CloseAtExit>>> = Mutex::new(Vec::new());

unsafe extern "C" {
    /// `atexit(function)`: registers `function` to run when the process exits normally (a return
    /// from `main`, `exit(3)`), after those registered later. See `atexit(3)`.
    fn atexit(function: extern "C" fn()) -> c_int;
}

/// Shared-memory files of this process removed at normal exit (the version channels of weights
/// publications, whose publishers may live in process-wide tables that are never dropped).
static FILES: Mutex<Vec<ShmName>> = Mutex::new(Vec::new());

/// Removes the file `name` at normal process exit unless [`keep_at_exit`] took it back first.
pub(crate) fn unlink_at_exit(name: &ShmName) {
    install();
    FILES.lock().push(name.clone());
}

/// Takes `name` back from [`unlink_at_exit`] (its owner removes it itself).
pub(crate) fn keep_at_exit(name: &ShmName) {
    FILES.lock().retain(|n| n != name);
}

/// Adds `producer` to those closed at normal process exit (once; installing the hook with the
/// first registration of the process).
pub(crate) fn register(producer: Weak<dyn CloseAtExit>) {
    install();
    let mut registered = REGISTERED.lock();
    registered.retain(|p| p.strong_count() > 0);
    if !registered.iter().any(|p| Weak::ptr_eq(p, &producer)) {
        registered.push(producer);
    }
}

/// Installs the `atexit` hook, once per process.
fn install() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: `atexit` only records the function pointer. `close_registered_at_exit` is a
        // function of the program (or of this shared object: glibc's `atexit` registers with the
        // caller's `__dso_handle`, so an unloaded object's hook runs at `dlclose`), takes no
        // arguments and never unwinds (it catches panics).
        if unsafe { atexit(close_registered_at_exit) } != 0 {
            tracing::warn!(target: "tensormem_ipc",
                "atexit refused the IPC exit hook: ref-counter files of this process will stay in \
                 /dev/shm after it exits (call IpcProducer::close_at_exit before exiting)");
        }
    });
}

/// The `atexit` hook: closes every registered producer still alive.
extern "C" fn close_registered_at_exit() {
    if let Err(payload) = std::panic::catch_unwind(close_registered) {
        // Dropping a panic's payload can itself panic; at exit, leaking it is free.
        std::mem::forget(payload);
    }
}

fn close_registered() {
    if let Some(mut files) = FILES.try_lock_for(EXIT_LOCK_WAIT) {
        for name in files.drain(..) {
            // A consumer that mapped it keeps its mapping; a new one cannot join a producer
            // that is gone anyway.
            let _ = tensormem_shm::unlink_shm(&name);
        }
    }
    let producers: Vec<_> = match REGISTERED.try_lock_for(EXIT_LOCK_WAIT) {
        Some(mut registered) => std::mem::take(&mut *registered),
        None => return,
    };
    for producer in producers.iter().filter_map(Weak::upgrade) {
        producer.close_at_exit();
        // Never the last reference dropped here: dropping a producer frees memory through the
        // driver, which may be gone at this point.
        std::mem::forget(producer);
    }
}
