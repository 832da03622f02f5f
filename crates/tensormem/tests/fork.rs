//! The bad-fork guard, without a GPU: a child forked after the parent's first CUDA call (successful or
//! not: the guard is armed before the driver is touched) refuses to use CUDA; a child forked before it
//! does not.
//!
//! This file holds one test on purpose: the guard is process-wide, so the "before" half must run before
//! anything in this executable touches CUDA.
#![cfg(feature = "cuda")]

use tensormem::cuda::{self, Error};
use tensormem_test_support::fork::in_child;

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
