//! A program that uses CUDA storages alone (no device API) has the bad-fork guard too: a child
//! forked after the parent's first CUDA call (successful or not: the guard is armed before the
//! driver is touched) is refused CUDA storages. Needs no GPU.
//!
//! One test in this file on purpose: the guard is process-wide.
#![cfg(feature = "cuda")]

use tensormem_storage::{CudaContext, Error};

/// Forks; the child runs `child` and exits with its answer as status; the parent returns whether
/// the child answered `true`.
fn in_child(child: fn() -> bool) -> bool {
    // SAFETY: the child only runs `child` (an atomic load in the runtime's fork check, an error
    // value matched; no allocation, no lock) and leaves with `_exit`, so no state of the parent's
    // other threads is used.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let ok = child();
        // SAFETY: `_exit` ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-parameter.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

fn context_refused_as_a_bad_fork() -> bool {
    matches!(
        CudaContext::new(0),
        Err(Error::Runtime {
            source: tensormem_runtime::Error::ForkedChild,
            ..
        })
    )
}

#[test]
fn a_storage_only_program_refuses_cuda_storages_in_a_bad_fork() {
    // The parent's first CUDA storage call: a context, or the driver's error on a machine without
    // one. Either way the guard is armed now.
    let parent = CudaContext::new(0);
    assert!(
        !matches!(
            parent,
            Err(Error::Runtime {
                source: tensormem_runtime::Error::ForkedChild,
                ..
            })
        ),
        "the parent itself is not a bad fork"
    );
    assert!(
        in_child(context_refused_as_a_bad_fork),
        "a child forked after the parent's first CUDA storage call was not refused"
    );
}
