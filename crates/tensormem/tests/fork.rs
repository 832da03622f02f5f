//! The bad-fork guard, without a GPU: a child forked after the parent's first CUDA call (successful or
//! not: the guard is armed before the driver is touched) refuses to use CUDA; a child forked before it
//! does not.
//!
//! This file holds one test on purpose: the guard is process-wide, so the "before" half must run before
//! anything in this executable touches CUDA.
#![cfg(feature = "cuda")]

use tensormem::cuda::{self, Error};

/// Forks; the child runs `child` (async-signal-safe work only: it must not allocate or lock) and exits
/// with its answer as status; the parent returns whether the child answered `true`.
fn in_child(child: fn() -> bool) -> bool {
    // SAFETY: the child only runs `child` (atomic loads and a match on a unit error variant, no
    // allocation, no locks) and leaves with `_exit`, so no state of the parent's other threads is used.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let ok = child();
        // SAFETY: `_exit` ends the child without running the parent's atexit handlers or destructors.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-parameter.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

fn refuses_cuda() -> bool {
    cuda::is_in_bad_fork() && matches!(cuda::device_count(), Err(Error::ForkedChild))
}

fn not_flagged() -> bool {
    !cuda::is_in_bad_fork()
}

#[test]
fn children_forked_after_cuda_initialisation_refuse_cuda() {
    assert!(
        in_child(not_flagged),
        "a child forked before any CUDA call was flagged as a bad fork"
    );

    let parent = cuda::device_count();
    assert!(!matches!(parent, Err(Error::ForkedChild)));
    assert!(
        !cuda::is_in_bad_fork(),
        "the parent itself is not a bad fork"
    );

    assert!(
        in_child(refuses_cuda),
        "a child forked after CUDA initialisation did not refuse CUDA"
    );
    let message = Error::ForkedChild.to_string();
    assert!(
        message.starts_with("Cannot re-initialize CUDA in forked subprocess"),
        "{message}"
    );
    // Where the parent's attempt failed (no driver here), the message says so.
    assert_eq!(
        message.contains("that attempt failed"),
        parent.is_err(),
        "{message}"
    );

    // The parent is unaffected.
    assert!(!cuda::is_in_bad_fork());
    assert_eq!(cuda::device_count().is_ok(), parent.is_ok());
}
