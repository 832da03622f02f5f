//! Why the snapshot reader is our own: a small pickle of deeply nested lists. Our reader refuses it
//! with a typed error on a small stack; serde-pickle 1.x (which otherwise could read snapshots: it
//! keeps tuples as `Value::Tuple` and writes its `Value` with `value_to_vec`) converts its parsed
//! values recursively, one stack frame per level, and overflows the stack, which aborts the process.
//! serde-pickle runs in a child process here, so the abort cannot take the test harness down.

#![cfg(feature = "snapshot-io")]

use tensormem_cuda_alloc::snapshot::{Snapshot, SnapshotError, MAX_DEPTH};
use tensormem_test_support::child;

/// Lists nested `depth` deep, 3 bytes a level: `]` (empty list) `depth` times, then `a` (append the
/// top to the list below) `depth - 1` times.
fn nested_lists(depth: usize) -> Vec<u8> {
    let mut pickle = vec![0x80, 4];
    pickle.extend(std::iter::repeat_n(b']', depth));
    pickle.extend(std::iter::repeat_n(b'a', depth - 1));
    pickle.push(b'.');
    pickle
}

/// 300 kB of pickle.
const DEPTH: usize = 100_000;

/// A stack as small as a worker thread's might be; the reader does not recurse, so it is enough.
const SMALL_STACK: usize = 256 << 10;

/// Runs `f` on a thread with a small stack.
fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(SMALL_STACK)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

#[test]
fn our_reader_refuses_deep_nesting_with_a_typed_error() {
    let pickle = nested_lists(DEPTH);
    let e = on_small_stack(move || Snapshot::from_pickle_bytes(&pickle).unwrap_err());
    assert!(matches!(e, SnapshotError::UnsupportedPickle { .. }), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("more than {MAX_DEPTH} levels")),
        "{e}"
    );
    // Nesting PyTorch's snapshots use (5 levels) is far below the limit.
    let shallow = nested_lists(MAX_DEPTH);
    let e = on_small_stack(move || Snapshot::from_pickle_bytes(&shallow).unwrap_err());
    assert!(matches!(e, SnapshotError::NotASnapshot { .. }), "{e}");
}

/// Set in the child process that runs serde-pickle.
const CHILD: &str = "TENSORMEM_SERDE_PICKLE_CHILD";

#[test]
fn serde_pickle_overflows_its_stack_on_the_same_file() {
    if std::env::var_os(CHILD).is_some() {
        // The child: serde-pickle reads the file on the same small stack. This aborts the process.
        let pickle = nested_lists(DEPTH);
        let outcome = on_small_stack(move || {
            serde_pickle::value_from_slice(&pickle, serde_pickle::DeOptions::new()).is_ok()
        });
        println!("serde-pickle returned (ok: {outcome})");
        return;
    }
    let child = child::this_test("serde_pickle_overflows_its_stack_on_the_same_file")
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&child.stdout);
    let stderr = String::from_utf8_lossy(&child.stderr);
    assert!(
        !stdout.contains("serde-pickle returned"),
        "serde-pickle returned on {DEPTH} nested lists; if it now limits recursion, docs/dependencies.md \
         should say so. stdout: {stdout}"
    );
    assert!(
        stderr.contains("has overflowed its stack"),
        "the child should abort on a stack overflow; status {:?}, stderr: {stderr}",
        child.status
    );
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            child.status.signal(),
            Some(libc_sigabrt()),
            "{:?}",
            child.status
        );
    }
}

/// `SIGABRT`, with which Rust's stack-overflow handler ends the process.
const fn libc_sigabrt() -> i32 {
    6
}
