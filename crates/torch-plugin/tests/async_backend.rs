//! The C functions under `backend:cudaMallocAsync`, at the boundary: what PyTorch refuses for that
//! backend fails with a status code and PyTorch's message (never a panic, never a pointer PyTorch
//! would take for a success), before any device is touched, so these run without a GPU; contexts
//! handed over are destroyed exactly once; and the library names the backend as PyTorch does. The
//! backend is chosen once per process, so each case runs in a child process of this test binary
//! (`tensormem_test_support::child::run`). The serving itself is tested on a GPU in `gpu.rs`.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

// The variables the allocator configuration is read from: a child gets none but those it is given.
use tensormem_cuda_alloc::config::ENV_VARS as CONFIG_VARS;
use tensormem_test_support::child;
use tensormem_torch::native::{
    tensormem_allocator_name, tensormem_attach_trace_tracker, tensormem_backend_supports,
    tensormem_history, tensormem_ipc_open, tensormem_ipc_share, tensormem_pool_check_live,
    tensormem_pool_checkpoint, tensormem_pool_create_or_incref,
    tensormem_pool_create_with_allocator, tensormem_pool_is_asleep, tensormem_pool_peer_access,
    tensormem_pool_restore, tensormem_pool_set_no_split, tensormem_pool_set_use_on_oom,
    tensormem_pool_sleep, tensormem_pool_use_count, tensormem_set_allocator_settings,
    tensormem_set_oom_observer, tensormem_snapshot_take, TorchTraceEntry, HANDLE_LEN,
    POOL_ALLOC_OK, TM_ERROR, TM_OK, TM_UNSUPPORTED,
};
use tensormem_torch::{
    tensormem_clear_last_error, tensormem_dump_snapshot, tensormem_last_error,
    tensormem_last_error_code, tensormem_record_history,
};

fn last_error() -> String {
    let ptr = tensormem_last_error();
    assert!(!ptr.is_null(), "a failed call keeps its message");
    // SAFETY: non-null, NUL-terminated, valid until the next failure on this thread.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// PyTorch's message for a method `cudaMallocAsync` does not support.
fn not_yet(method: &str) -> String {
    format!(
        "cudaMallocAsync does not yet support {method}. If you need it, please file an issue \
         describing your use case."
    )
}

/// `rc` is a failure, a refusal of PyTorch's (code [`TM_UNSUPPORTED`]) whose message's first line is
/// `message`, PyTorch's, word for word (the C++ layer raises it so), followed by what to do.
#[track_caller]
fn refused(rc: impl Into<i64>, failed: i64, message: &str) {
    assert_eq!(rc.into(), failed, "{message}");
    let error = last_error();
    assert_eq!(error.lines().next(), Some(message), "{error}");
    assert!(error.contains("TENSORMEM_ALLOC_CONF"), "{error}");
    assert_eq!(tensormem_last_error_code(), TM_UNSUPPORTED, "{error}");
    tensormem_clear_last_error();
    assert_eq!(tensormem_last_error_code(), TM_OK, "cleared");
}

fn name() -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(tensormem_allocator_name()) }
        .to_string_lossy()
        .into_owned()
}

fn supports(method: &CStr) -> c_int {
    // SAFETY: a NUL-terminated string.
    unsafe { tensormem_backend_supports(method.as_ptr()) }
}

static DROPPED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count_drop(_: *mut c_void) {
    DROPPED.fetch_add(1, Ordering::SeqCst);
}

unsafe extern "C" fn never_malloc(_: *mut c_void, _: usize, _: *mut *mut c_void) -> c_int {
    unreachable!("no segment is asked for")
}

unsafe extern "C" fn never_free(_: *mut c_void, _: *mut c_void, _: usize) -> c_int {
    POOL_ALLOC_OK
}

unsafe extern "C" fn ignore_trace(_: *const TorchTraceEntry) {}

unsafe extern "C" fn ignore_oom(_: c_int, _: u64, _: u64, _: u64) {}

#[test]
fn under_the_native_backend_nothing_is_refused() {
    if !child::is_child() {
        return child::run(
            "under_the_native_backend_nothing_is_refused",
            &CONFIG_VARS,
            &[],
        );
    }
    assert_eq!(name(), "tensormem");
    for method in [
        c"getExpandableSegmentSizes",
        c"isHistoryEnabled",
        c"attachOutOfMemoryObserver",
    ] {
        assert_eq!(supports(method), TM_OK, "{method:?}");
    }
    assert_eq!(
        tensormem_pool_peer_access(0, 1),
        TM_OK,
        "nothing to do, no device touched"
    );
    // A failing native call fails for its own reason (no GPU here), not as a refusal.
    if tensormem_pool_create_or_incref(0, 0, 1) != TM_OK {
        assert!(
            !last_error().contains("cudaMallocAsync"),
            "{}",
            last_error()
        );
    }
}

#[test]
fn under_cuda_malloc_async_pytorchs_refusals_come_back_as_status_codes() {
    if !child::is_child() {
        return child::run(
            "under_cuda_malloc_async_pytorchs_refusals_come_back_as_status_codes",
            &CONFIG_VARS,
            &[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
        );
    }
    let (fail, refuse) = (i64::from(TM_ERROR), |rc: c_int, m: &str| refused(rc, -1, m));
    assert_eq!(name(), "cudaMallocAsync");

    // What the C++ layer asks before serving on its own.
    refuse(
        supports(c"getExpandableSegmentSizes"),
        "CUDAMallocAsyncAllocator does not yet support getExpandableSegmentSizes.",
    );
    refuse(supports(c"isHistoryEnabled"), &not_yet("recordHistory"));
    refuse(
        supports(c"attachOutOfMemoryObserver"),
        &not_yet("attachOutOfMemoryObserver"),
    );
    assert_eq!(supports(c"raw_alloc"), TM_ERROR);
    assert!(last_error().contains("raw_alloc"), "{}", last_error());
    assert_eq!(
        tensormem_last_error_code(),
        TM_ERROR,
        "tensormem's own error, not a refusal of PyTorch's"
    );

    // Snapshots and history.
    let snapshot = tensormem_snapshot_take(0, 0, 1);
    assert!(snapshot.is_null());
    assert!(
        last_error()
            .starts_with("Calling snapshot with backend:cudaMallocAsync is not meaningful."),
        "{}",
        last_error()
    );
    refuse(tensormem_history(1, 1000), &not_yet("recordHistory"));
    refuse(tensormem_history(0, 1), &not_yet("recordHistory"));
    refuse(tensormem_record_history(1, 1000), &not_yet("recordHistory"));
    let path = c"/nonexistent/tensormem-never-written.pickle";
    // SAFETY: a NUL-terminated path.
    refuse(
        unsafe { tensormem_dump_snapshot(path.as_ptr()) },
        "Calling snapshot with backend:cudaMallocAsync is not meaningful. (For backend:native, \
         snapshot returns a detailed summary of all blocks tracked by the allocator, but the \
         cudaMallocAsync backend does not track individual blocks.)",
    );

    // Private pools and their checkpoints.
    refuse(
        tensormem_pool_create_or_incref(0, 0, 1),
        &not_yet("createOrIncrefPool"),
    );
    let before = DROPPED.load(Ordering::SeqCst);
    // SAFETY: the functions may be called with the (unused) context until it is dropped.
    let rc = unsafe {
        tensormem_pool_create_with_allocator(
            0,
            0,
            2,
            Some(never_malloc),
            Some(never_free),
            Some(count_drop),
            std::ptr::null_mut(),
        )
    };
    refuse(rc, &not_yet("createOrIncrefPool"));
    assert_eq!(
        DROPPED.load(Ordering::SeqCst),
        before + 1,
        "the pool allocator's context is destroyed once"
    );
    refuse(
        tensormem_pool_set_use_on_oom(0, 0, 1, 1),
        &not_yet("setUseOnOOM"),
    );
    refuse(tensormem_pool_set_no_split(0, 0, 1), &not_yet("setNoSplit"));
    refused(
        tensormem_pool_use_count(0, 0, 1),
        -1,
        &not_yet("getPoolUseCount"),
    );
    // SAFETY: no pointers are read for a count of 0.
    refuse(
        unsafe { tensormem_pool_check_live(0, 1, 0, std::ptr::null(), 0) },
        &not_yet("checkPoolLiveAllocations"),
    );
    assert!(tensormem_pool_checkpoint(0, 1, 0).is_null());
    assert!(
        last_error().starts_with(&not_yet("getCheckpointState")),
        "{}",
        last_error()
    );
    // SAFETY: refused before the (null) checkpoint is looked at.
    let rc =
        unsafe { tensormem_pool_restore(0, std::ptr::null(), None, None, std::ptr::null_mut()) };
    refuse(rc, &not_yet("setCheckpointPoolState"));
    // Sleeping pools are tensormem's, on the caching allocator.
    // SAFETY: a null `released` is allowed.
    let rc = unsafe { tensormem_pool_sleep(0, 0, 1, 1, std::ptr::null_mut()) };
    refuse(
        rc,
        "the native caching allocator does not serve this process (backend:cudaMallocAsync does): \
         caching_allocator, sleeping and waking private pools need it",
    );
    refuse(
        tensormem_pool_is_asleep(0, 0, 1),
        "the native caching allocator does not serve this process (backend:cudaMallocAsync does): \
         caching_allocator, sleeping and waking private pools need it",
    );

    // CUDA IPC, both ways.
    let (mut len, mut offset) = (0usize, 0isize);
    let mut buf = [0u8; HANDLE_LEN];
    // SAFETY: valid out-parameters and buffer.
    let rc = unsafe {
        tensormem_ipc_share(
            0x1000 as *mut c_void,
            buf.as_mut_ptr(),
            buf.len(),
            &mut len,
            &mut offset,
        )
    };
    refuse(rc, &not_yet("shareIpcHandle"));
    let mut out = std::ptr::dangling_mut::<c_void>();
    // SAFETY: valid handle bytes and out-parameter.
    let rc = unsafe { tensormem_ipc_open(buf.as_ptr(), buf.len(), 0, &mut out) };
    refuse(rc, &not_yet("getIpcDevPtr"));

    // Trace trackers are refused; the library's own out-of-memory hook (set when the C++ layer is
    // installed) is not, so that installing works.
    refuse(
        tensormem_attach_trace_tracker(Some(ignore_trace)),
        &not_yet("attachAllocatorTraceTracker"),
    );
    assert_eq!(tensormem_set_oom_observer(Some(ignore_oom)), TM_OK);

    // The backend cannot change at run time.
    // SAFETY: a NUL-terminated string.
    let rc = unsafe { tensormem_set_allocator_settings(c"backend:native".as_ptr()) };
    assert_eq!(i64::from(rc), fail);
    assert!(
        last_error().starts_with(
            "Allocator async backend parsed at runtime != allocator async backend parsed at load \
             time, 0 != 1"
        ),
        "{}",
        last_error()
    );
}
