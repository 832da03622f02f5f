//! The C functions behind the C++ `CUDAAllocator` layer, at the boundary: every failure is a status
//! code with a message (never a panic, never a pointer PyTorch would use), out-of-memory errors are
//! told apart from other failures, layouts are checked, and a pool filter handed over is destroyed
//! exactly once even when the call fails. Runs without a GPU.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use tensormem_torch::native::{
    tensormem_device_stats, tensormem_ipc_close, tensormem_ipc_open, tensormem_ipc_share,
    tensormem_malloc, tensormem_pool_begin, tensormem_pool_create_with_allocator,
    tensormem_pool_set_no_split, tensormem_pool_set_use_on_oom, tensormem_raw_delete,
    tensormem_snapshot_free, tensormem_snapshot_segment_count, tensormem_snapshot_take,
    TorchDeviceStats, EXPANDABLE_HANDLE_HEADER_LEN, HANDLE_LEN, POOL_ALLOC_ERROR, POOL_ALLOC_OK,
    POOL_ALLOC_OUT_OF_MEMORY, TM_ERROR, TM_OK, TM_OUT_OF_MEMORY, TM_UNSUPPORTED,
};
use tensormem_torch::{tensormem_last_error, tensormem_last_error_code, Error};

fn last_error() -> String {
    let ptr = tensormem_last_error();
    assert!(!ptr.is_null(), "a failed call keeps its message");
    // SAFETY: non-null, NUL-terminated, valid until the next failure on this thread.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// The C header the C++ layer compiles against, embedded at build time: this test runs from the GPU
/// bundle too, on a host without the sources (`tests/c_abi.rs` checks the rest of the header against
/// the sources, where they are).
const HEADER: &str = include_str!("../csrc/tensormem_abi.h");

#[test]
fn status_codes_are_distinct_and_the_cpp_layer_has_them() {
    let codes = [
        ("TM_OK", TM_OK),
        ("TM_OUT_OF_MEMORY", TM_OUT_OF_MEMORY),
        ("TM_ERROR", TM_ERROR),
        ("TM_UNSUPPORTED", TM_UNSUPPORTED),
    ];
    let distinct: std::collections::HashSet<_> = codes.iter().map(|&(_, code)| code).collect();
    assert_eq!(distinct.len(), codes.len());
    // The C++ layer reads the codes (and answers a pool allocator's calls) with the header's
    // spelling; it must be these.
    let pool_codes = [
        ("POOL_ALLOC_OK", POOL_ALLOC_OK),
        ("POOL_ALLOC_OUT_OF_MEMORY", POOL_ALLOC_OUT_OF_MEMORY),
        ("POOL_ALLOC_ERROR", POOL_ALLOC_ERROR),
    ];
    for (name, code) in codes.into_iter().chain(pool_codes) {
        let spelled = format!("{name} = {code}");
        assert!(
            HEADER
                .lines()
                .any(|line| line.trim().trim_end_matches(',') == spelled),
            "csrc/tensormem_abi.h lacks `{spelled}`"
        );
    }
}

#[test]
fn a_failed_calls_code_tells_tensormems_errors_from_pytorchs_refusals() {
    // SAFETY: a null `out` is refused before anything is read.
    let rc = unsafe { tensormem_malloc(1024, 0, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(rc, TM_ERROR);
    assert_eq!(tensormem_last_error_code(), TM_ERROR, "{}", last_error());
}

#[test]
fn a_null_out_pointer_is_an_error_not_a_crash() {
    // SAFETY: a null `out` is what is being tested; the stream is the default one.
    let rc = unsafe { tensormem_malloc(1024, 0, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(rc, TM_ERROR);
    assert!(
        last_error().contains("out is a null pointer"),
        "{}",
        last_error()
    );
}

#[test]
fn zero_bytes_give_null_without_touching_a_device() {
    let mut out = std::ptr::dangling_mut::<c_void>();
    // SAFETY: `out` is a valid out-parameter.
    let rc = unsafe { tensormem_malloc(0, 0, std::ptr::null_mut(), &mut out) };
    assert_eq!(rc, TM_OK);
    assert!(out.is_null());
}

#[test]
fn a_failed_allocation_leaves_null_and_a_reason() {
    if tensormem::cuda::device_count().is_ok_and(|n| n > 0) {
        eprintln!("skipped: a GPU is here; this checks the failure path without one");
        return;
    }
    let mut out = std::ptr::dangling_mut::<c_void>();
    // SAFETY: `out` is a valid out-parameter; the default stream.
    let rc = unsafe { tensormem_malloc(4096, 0, std::ptr::null_mut(), &mut out) };
    assert_eq!(rc, TM_ERROR, "no driver is not an out-of-memory error");
    assert!(out.is_null());
    assert!(!last_error().is_empty());
}

#[test]
fn a_negative_device_is_refused() {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is a valid out-parameter.
    let rc = unsafe { tensormem_malloc(4096, -2, std::ptr::null_mut(), &mut out) };
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("device -2"), "{}", last_error());
}

#[test]
fn a_pointer_nobody_handed_out_is_refused() {
    // SAFETY: the pointer is not used, only looked up.
    let rc = unsafe { tensormem_raw_delete(0xdead_0000 as *mut c_void) };
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("0xdead0000"), "{}", last_error());
}

#[test]
fn device_stats_check_the_callers_layout() {
    let mut stats = TorchDeviceStats::default();
    // SAFETY: `stats` is valid for writes of its size; the size passed is wrong on purpose.
    let rc = unsafe { tensormem_device_stats(0, &mut stats, 8) };
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("rebuild"), "{}", last_error());
    // PyTorch's DeviceStats: 9 arrays of 3 stats of 4 int64, 6 int64 and 2 stats.
    assert_eq!(
        std::mem::size_of::<TorchDeviceStats>(),
        (9 * 3 * 4 + 6 + 2 * 4) * 8
    );
}

#[test]
fn out_of_memory_errors_are_told_apart() {
    let oom = Error::Device(tensormem_cuda_alloc::DeviceError::OutOfMemory { bytes: 1 << 40 });
    assert!(oom.is_out_of_memory());
    assert_eq!(oom.code(), TM_OUT_OF_MEMORY);
    let other = Error::InvalidDevice { device: -1 };
    assert!(!other.is_out_of_memory());
    assert_eq!(other.code(), TM_ERROR);
    let refusal = Error::Cuda(tensormem::cuda::Error::AsyncUnsupported(
        tensormem::cuda::AsyncUnsupported::RecordHistory,
    ));
    assert!(refusal.is_backend_refusal() && !refusal.is_out_of_memory());
    assert_eq!(refusal.code(), TM_UNSUPPORTED);
}

#[test]
fn a_snapshot_of_no_device_is_empty() {
    let snapshot = tensormem_snapshot_take(0, 0, 1);
    assert!(!snapshot.is_null(), "{}", last_error());
    // SAFETY: a live snapshot, freed once.
    unsafe {
        assert_eq!(tensormem_snapshot_segment_count(snapshot), 0);
        tensormem_snapshot_free(snapshot);
    }
}

static DROPPED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn accept_all(_: *mut c_void, _: cudarc::driver::sys::CUstream) -> c_int {
    1
}

unsafe extern "C" fn count_drop(_: *mut c_void) {
    DROPPED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn a_pool_filter_is_destroyed_once_when_the_pool_cannot_open() {
    // SAFETY: the filter accepts any thread; its context is unused.
    let rc = unsafe {
        tensormem_pool_begin(
            -1,
            1,
            0,
            Some(accept_all),
            Some(count_drop),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, TM_ERROR);
    assert_eq!(DROPPED.load(Ordering::SeqCst), 1);
}

#[test]
fn ipc_share_checks_its_arguments_and_names_the_pointer() {
    let (mut len, mut offset) = (0usize, 0isize);
    let mut out = [0u8; HANDLE_LEN];
    // SAFETY: `len` is null on purpose; the other arguments are valid.
    let rc = unsafe {
        tensormem_ipc_share(
            0xdead_0000 as *mut c_void,
            out.as_mut_ptr(),
            out.len(),
            std::ptr::null_mut(),
            &mut offset,
        )
    };
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("null pointer"), "{}", last_error());
    // SAFETY: a null buffer with a capacity is refused before anything is written.
    let rc = unsafe {
        tensormem_ipc_share(
            0xdead_0000 as *mut c_void,
            std::ptr::null_mut(),
            16,
            &mut len,
            &mut offset,
        )
    };
    assert_eq!(rc, TM_ERROR);
    // SAFETY: every out-parameter is valid; the pointer is only looked up.
    let rc = unsafe {
        tensormem_ipc_share(
            0xdead_0000 as *mut c_void,
            out.as_mut_ptr(),
            out.len(),
            &mut len,
            &mut offset,
        )
    };
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("0xdead0000"), "{}", last_error());
}

/// PyTorch's handle of expandable-segment memory: `[2]['e']`, pid, padding, chunk size, count, fds.
fn expandable_handle(pid: i32, chunk_size: u64, fds: &[i32]) -> Vec<u8> {
    let mut bytes = vec![2, b'e'];
    bytes.extend_from_slice(&pid.to_ne_bytes());
    bytes.extend_from_slice(&[0; 4]);
    bytes.extend_from_slice(&chunk_size.to_ne_bytes());
    bytes.extend_from_slice(&(fds.len() as u64).to_ne_bytes());
    for fd in fds {
        bytes.extend_from_slice(&fd.to_ne_bytes());
    }
    bytes
}

fn open(handle: &[u8]) -> (c_int, *mut c_void) {
    let mut out = std::ptr::dangling_mut::<c_void>();
    // SAFETY: `handle` is valid for its length; `out` is a valid out-parameter.
    let rc = unsafe { tensormem_ipc_open(handle.as_ptr(), handle.len(), 0, &mut out) };
    (rc, out)
}

#[test]
fn ipc_open_refuses_handles_nobody_wrote_and_names_the_problem() {
    let handle = expandable_handle(i32::MAX - 7, 2 << 20, &[3, 4]);
    assert_eq!(handle.len(), EXPANDABLE_HANDLE_HEADER_LEN + 8);
    let (rc, _) = open(&handle);
    assert_eq!(rc, TM_ERROR);
    let err = last_error();
    assert!(
        err.contains("gone") || err.contains("no descriptor socket"),
        "{err}"
    );
    let (rc, _) = open(&handle[..handle.len() - 1]);
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("descriptors"), "{}", last_error());
    let (rc, _) = open(&expandable_handle(1, 3 << 20, &[3]));
    assert_eq!(rc, TM_ERROR, "a chunk size PyTorch never uses");
    let (rc, _) = open(&[1, 2, 3]);
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("3 bytes"), "{}", last_error());
    // SAFETY: a null handle is refused before it is read.
    let rc = unsafe { tensormem_ipc_open(std::ptr::null(), 66, 0, &mut std::ptr::null_mut()) };
    assert_eq!(rc, TM_ERROR);
}

#[test]
fn ipc_close_of_memory_never_opened_is_refused() {
    assert_eq!(tensormem_ipc_close(0xbeef_0000 as *mut c_void), TM_ERROR);
    assert!(last_error().contains("0xbeef0000"), "{}", last_error());
}

static ALLOCATOR_DROPPED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn no_room(_: *mut c_void, _: usize, out: *mut *mut c_void) -> c_int {
    // SAFETY: the library passes a valid out-parameter.
    unsafe { *out = std::ptr::null_mut() };
    POOL_ALLOC_OUT_OF_MEMORY
}

unsafe extern "C" fn free_nothing(_: *mut c_void, _: *mut c_void, _: usize) -> c_int {
    POOL_ALLOC_OK
}

unsafe extern "C" fn count_allocator_drop(_: *mut c_void) {
    ALLOCATOR_DROPPED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn a_pool_allocator_is_destroyed_once_when_the_pool_cannot_be_made() {
    assert_ne!(POOL_ALLOC_OK, POOL_ALLOC_ERROR);
    assert_ne!(POOL_ALLOC_OUT_OF_MEMORY, POOL_ALLOC_ERROR);
    // SAFETY: the functions ignore their context; a bad device on purpose.
    let rc = unsafe {
        tensormem_pool_create_with_allocator(
            -1,
            0,
            1,
            Some(no_room),
            Some(free_nothing),
            Some(count_allocator_drop),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("device -1"), "{}", last_error());
    assert_eq!(ALLOCATOR_DROPPED.load(Ordering::SeqCst), 1);
    // A missing function is refused before any device is touched, and the context goes too.
    // SAFETY: as above.
    let rc = unsafe {
        tensormem_pool_create_with_allocator(
            0,
            0,
            1,
            None,
            Some(free_nothing),
            Some(count_allocator_drop),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, TM_ERROR);
    assert!(last_error().contains("null pointer"), "{}", last_error());
    assert_eq!(ALLOCATOR_DROPPED.load(Ordering::SeqCst), 2);
}

#[test]
fn pool_options_on_a_bad_device_are_errors_with_a_reason() {
    assert_eq!(tensormem_pool_set_use_on_oom(-3, 0, 1, 1), TM_ERROR);
    assert!(last_error().contains("device -3"), "{}", last_error());
    assert_eq!(tensormem_pool_set_no_split(-3, 0, 1), TM_ERROR);
    assert!(last_error().contains("device -3"), "{}", last_error());
}
