//! A program that uses CUDA storages alone (no device API) has the bad-fork guard too: a child
//! forked after the parent's first CUDA call (successful or not: the guard is armed before the
//! driver is touched) is refused CUDA storages. Needs no GPU.
//!
//! One test in this file on purpose: the guard is process-wide.
#![cfg(feature = "cuda")]

use tensormem_storage::{CudaContext, Error};
use tensormem_test_support::fork::in_child;

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
