//! A bare `fork()` for tests of what a forked child may do (the bad-fork guard).

/// Forks; the child runs `child` and leaves with `_exit`, its answer as the status; returns
/// whether the child answered `true`.
///
/// `child` must be async-signal-safe in effect (no allocation, no lock another thread of the test
/// process may hold): the child is a copy of a multi-threaded process.
///
/// # Panics
///
/// When `fork` or `waitpid` fails.
pub fn in_child(child: fn() -> bool) -> bool {
    // SAFETY: the child only runs `child`, which the caller keeps free of allocation and locks,
    // and leaves with `_exit`, so no state of the parent's other threads is used.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let ok = child();
        // SAFETY: `_exit` ends the child without running the parent's exit handlers or
        // destructors.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: `pid` is this process's child; `status` is a valid out-parameter.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}
