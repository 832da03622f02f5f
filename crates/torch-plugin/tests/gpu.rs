//! The exported C functions on a real GPU, called as PyTorch calls them: raw stream handles the
//! allocator has never seen, a caller whose current context must survive, graph capture into a
//! private pool. Each test is `#[ignore]`d (`cargo xtask test-gpu` and the bundle's `run.sh` run them
//! with `--include-ignored`); run without a driver or device it says `skipped: ...`, and fails instead
//! with `TENSORMEM_REQUIRE_GPU=1` (which they set). The
//! allocators are process-wide, so the tests hold one lock and compare figures before and after.

use std::ffi::{c_int, c_void, CStr};
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaStream};
use tensormem::cuda;
use tensormem_cuda_alloc::MempoolId;
// The variables the allocator configuration is read from: a child gets none but those it is given.
use tensormem_cuda_alloc::config::ENV_VARS as CONFIG_VARS;
use tensormem_test_support::{child, gpu};
use tensormem_torch::*;

const MIB: usize = 1 << 20;

/// The number of devices, holding the test lock, or `None` after saying why the test is skipped.
fn gpus() -> Option<(u32, MutexGuard<'static, ()>)> {
    let lock = gpu::lock();
    Some((gpu::devices(cuda::device_count())?, lock))
}

/// A stream made outside tensormem, as PyTorch makes its pool streams, kept for the whole process (as
/// PyTorch keeps them): one per device.
fn foreign_stream(device: u32) -> sys::CUstream {
    type Kept = Mutex<Vec<(u32, Arc<CudaStream>)>>;
    static STREAMS: OnceLock<Kept> = OnceLock::new();
    let streams = STREAMS.get_or_init(|| Mutex::new(Vec::new()));
    let mut streams = streams.lock().unwrap();
    if let Some((_, s)) = streams.iter().find(|(d, _)| *d == device) {
        return s.cu_stream();
    }
    let ctx = CudaContext::new(device as usize).expect("the device's context");
    let stream = ctx.new_stream().expect("a stream");
    let raw = stream.cu_stream();
    streams.push((device, stream));
    raw
}

fn stat(device: i32, key: &str) -> i64 {
    let json = tensormem_memory_stats_json(device);
    assert!(!json.is_null(), "stats: {}", last_error());
    // SAFETY: a NUL-terminated string from the library, freed once below.
    let text = unsafe { CStr::from_ptr(json) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: returned by tensormem_memory_stats_json, not freed before.
    unsafe { tensormem_string_free(json) };
    let value: serde_json::Value = serde_json::from_str(&text).expect("the stats are JSON");
    value[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} in {text}"))
}

fn last_error() -> String {
    let err = tensormem_last_error();
    if err.is_null() {
        return "(none)".to_owned();
    }
    // SAFETY: a NUL-terminated string valid until the next failure on this thread.
    unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned()
}

fn alloc(size: usize, device: i32, stream: sys::CUstream) -> *mut c_void {
    // SAFETY: `stream` is null or a stream of `device` kept for the whole process.
    let p = unsafe { tensormem_alloc(size, device, stream) };
    assert!(!p.is_null(), "alloc({size}, {device}): {}", last_error());
    p
}

fn free(p: *mut c_void, device: i32) {
    tensormem_clear_last_error();
    // SAFETY: no work uses the memory any more (the tests queue none on it).
    unsafe { tensormem_free(p, 0, device, ptr::null_mut()) };
    assert!(
        tensormem_last_error().is_null(),
        "free({p:p}): {}",
        last_error()
    );
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn memory_on_a_stream_tensormem_never_saw_round_trips() {
    let Some((_, _lock)) = gpus() else { return };
    let stream = foreign_stream(0);
    let before = stat(0, "allocated_bytes.all.current");
    let p = alloc(3 * MIB, 0, stream);
    assert_eq!(
        stat(0, "allocated_bytes.all.current") - before,
        3 * MIB as i64
    );
    // Used on the default stream too, then freed: both streams are known to the allocator now.
    tensormem_clear_last_error();
    // SAFETY: null is the default stream.
    unsafe { tensormem_record_stream(p, ptr::null_mut()) };
    assert!(tensormem_last_error().is_null(), "{}", last_error());
    free(p, 0);
    assert_eq!(stat(0, "allocated_bytes.all.current"), before);
    // The second time the stream is known: same result, no registration.
    let q = alloc(MIB, 0, stream);
    free(q, 0);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn the_callers_current_context_is_left_as_it_was() {
    let Some((count, _lock)) = gpus() else { return };
    let current = || {
        let mut ctx = ptr::null_mut();
        // SAFETY: a valid out-parameter; the driver is initialised (gpus() found a device).
        let result = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
        assert_eq!(result, sys::CUresult::CUDA_SUCCESS);
        ctx
    };
    // SAFETY: null unbinds the calling thread's context.
    unsafe { sys::cuCtxSetCurrent(ptr::null_mut()) };
    let p = alloc(MIB, 0, ptr::null_mut());
    assert!(current().is_null(), "alloc left a context current");
    free(p, 0);
    assert!(current().is_null(), "free left a context current");
    if count > 1 {
        // Memory of device 1 freed while device 0's context is current: device 0 stays current.
        let q = alloc(MIB, 1, ptr::null_mut());
        let ctx0 = CudaContext::new(0).unwrap();
        ctx0.bind_to_thread().unwrap();
        let before = current();
        free(q, 1);
        assert_eq!(
            current(),
            before,
            "freeing on device 1 switched the context"
        );
    }
}

#[test]
#[ignore = "needs two CUDA GPUs (cargo xtask test-gpu runs it)"]
fn a_stream_of_another_device_is_refused() {
    let Some((count, _lock)) = gpus() else { return };
    if count < 2 {
        eprintln!("skipped: needs two devices");
        return;
    }
    let stream = foreign_stream(1);
    // SAFETY: a live stream (of device 1) kept for the whole process.
    let p = unsafe { tensormem_alloc(MIB, 0, stream) };
    assert!(p.is_null());
    assert!(
        last_error().contains("does not belong to device 0"),
        "{}",
        last_error()
    );
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn base_alloc_names_the_segment() {
    let Some((_, _lock)) = gpus() else { return };
    let p = alloc(1000, 0, ptr::null_mut());
    let mut size = 0usize;
    // SAFETY: `size` is valid for writes.
    let base = unsafe { tensormem_base_alloc(p, &mut size) };
    assert!(!base.is_null(), "{}", last_error());
    assert!(base as u64 <= p as u64);
    assert_eq!(size, 2 * MIB, "a small allocation lives in a 2 MiB segment");
    assert!(p as u64 + 1000 <= base as u64 + size as u64);
    free(p, 0);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn allocations_of_a_graph_capture_go_to_its_private_pool() {
    let Some((_, _lock)) = gpus() else { return };
    let stream = foreign_stream(0);
    let pool = TorchMempoolId {
        first: 777,
        second: 0,
    };
    let allocator = cuda::caching_allocator(Some(0)).unwrap();
    // SAFETY: a live stream of device 0, in PyTorch's (global) capture mode.
    let begun = unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    };
    assert_eq!(begun, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: the filter argument is not used.
    unsafe { tensormem_begin_allocate_to_pool(0, pool, ptr::null_mut()) };
    // New segments during a global-mode capture (cuMemAlloc is refused there unless relaxed).
    // SAFETY: a stream of device 0 kept for the process; the default stream.
    let (captured, outside) = unsafe {
        (
            tensormem_alloc(5 * MIB, 0, stream),
            tensormem_alloc(5 * MIB, 0, ptr::null_mut()),
        )
    };
    let error = last_error();
    let mut graph = ptr::null_mut();
    // SAFETY: ends the capture begun above (whatever happened in it); `graph` is a valid
    // out-parameter.
    let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
    tensormem_clear_last_error();
    tensormem_end_allocate_to_pool(0, pool);
    assert!(tensormem_last_error().is_null(), "{}", last_error());
    assert!(!captured.is_null() && !outside.is_null(), "{error}");
    assert_eq!(
        ended,
        sys::CUresult::CUDA_SUCCESS,
        "the capture stayed valid"
    );

    let segments = allocator.snapshot().segments;
    let pool_of = |p: *mut c_void| {
        segments
            .iter()
            .find(|s| s.address <= p as u64 && (p as u64) < s.address + s.total_size)
            .map(|s| s.segment_pool_id)
            .expect("a segment holds the allocation")
    };
    assert_eq!(pool_of(captured), (777, 0));
    assert_eq!(pool_of(outside), (0, 0));
    assert!(allocator.private_pools().contains(&(MempoolId(777, 0), 1)));

    free(captured, 0);
    free(outside, 0);
    tensormem_release_pool(0, pool);
    tensormem_empty_cache();
    assert!(
        !allocator
            .private_pools()
            .iter()
            .any(|&(id, _)| id == MempoolId(777, 0)),
        "the released pool is gone after empty_cache"
    );
    // SAFETY: the graph made by the capture, destroyed once.
    unsafe { sys::cuGraphDestroy(graph) };
}

static FILTERS_DROPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn accept_all(_: *mut c_void, _: sys::CUstream) -> c_int {
    1
}

unsafe extern "C" fn count_filter_drop(_: *mut c_void) {
    FILTERS_DROPPED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// Begins a global-mode capture of `stream`, runs `body`, and ends the capture, which must have
/// stayed valid; the graph is destroyed.
fn captured(stream: sys::CUstream, body: impl FnOnce()) {
    // SAFETY: a live stream of device 0, in PyTorch's (global) capture mode.
    let begun = unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    };
    assert_eq!(begun, sys::CUresult::CUDA_SUCCESS);
    body();
    let mut graph = ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` is a valid out-parameter.
    let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
    assert_eq!(
        ended,
        sys::CUresult::CUDA_SUCCESS,
        "the capture stayed valid"
    );
    // SAFETY: the graph made by the capture, destroyed once.
    unsafe { sys::cuGraphDestroy(graph) };
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn with_backend_cuda_malloc_async_configured_the_functions_serve_from_the_pool() {
    use tensormem::cuda_alloc::DeviceAddress;
    use tensormem_torch::native::*;
    if !child::is_child() {
        // The backend is chosen once per process: this test's half below runs in a child whose
        // configuration asks for it.
        let Some(_) = gpus() else { return };
        return child::run(
            "with_backend_cuda_malloc_async_configured_the_functions_serve_from_the_pool",
            &CONFIG_VARS,
            &[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
        );
    }
    let Some((_, _lock)) = gpus() else { return };
    // SAFETY: a static NUL-terminated string.
    let name = unsafe { CStr::from_ptr(tensormem_allocator_name()) };
    assert_eq!(name.to_str().unwrap(), "cudaMallocAsync");
    let stream = foreign_stream(0);

    // The C++ layer's route: allocation, statistics, record_stream, base allocation, free.
    let mut p = ptr::null_mut();
    // SAFETY: a stream of device 0 kept for the process; `p` is a valid out-parameter.
    let rc = unsafe { tensormem_malloc(3 * MIB, 0, stream, &mut p) };
    assert_eq!(rc, TM_OK, "{}", last_error());
    let cuda::DeviceAllocator::Async(pool) = cuda::device_allocator(Some(0)).unwrap() else {
        panic!("device 0 is not served by its AsyncAllocator");
    };
    assert_eq!(pool.allocation_size(DeviceAddress(p as u64)), Some(3 * MIB));
    let mut stats = TorchDeviceStats::default();
    // SAFETY: `stats` is valid for its size.
    let rc = unsafe { tensormem_device_stats(0, &mut stats, std::mem::size_of_val(&stats)) };
    assert_eq!(rc, TM_OK, "{}", last_error());
    assert!(stats.allocated_bytes[0].current >= 3 * MIB as i64);
    assert_eq!(stats.active_bytes[0], stats.allocated_bytes[0]);
    assert!(stats.reserved_bytes[0].current >= stats.allocated_bytes[0].current);
    assert_eq!(
        stats.allocation[0].current, 0,
        "only six figures are filled"
    );
    assert_eq!(stats.segment[0].current, 0);
    assert_eq!(stats.num_device_alloc, 0);
    assert!(stat(0, "reserved_bytes.all.current") >= 3 * MIB as i64);
    // SAFETY: null is the default stream.
    let rc = unsafe { tensormem_record_stream_checked(p, 0, ptr::null_mut()) };
    assert_eq!(rc, TM_OK, "{}", last_error());
    let mut size = 0usize;
    // SAFETY: `size` is a valid out-parameter.
    let base = unsafe { tensormem_base_alloc(p, &mut size) };
    assert_eq!((base, size), (p, 3 * MIB), "every pointer is its own base");
    // SAFETY: no work uses the memory any more.
    let rc = unsafe { tensormem_raw_delete(p) };
    assert_eq!(rc, TM_OK, "{}", last_error());
    // SAFETY: as above (it is refused: already freed).
    assert_eq!(unsafe { tensormem_raw_delete(p) }, TM_ERROR);
    // empty_cache synchronizes and trims the pool to nothing.
    assert_eq!(tensormem_empty_cache_pool(0, 0), TM_OK, "{}", last_error());
    assert_eq!(stat(0, "reserved_bytes.all.current"), 0);
    assert_eq!(tensormem_reset_peak_stats(0), 0, "{}", last_error());
    assert_eq!(stat(0, "reserved_bytes.all.peak"), 0);
    assert_eq!(tensormem_reset_accumulated_stats(0), TM_OK);

    // The pluggable route.
    let q = alloc(MIB, 0, stream);
    free(q, 0);
    tensormem_empty_cache();
    assert_eq!(stat(0, "reserved_bytes.all.current"), 0);

    // The memory fraction: that backend's limit on what is handed out, and cacheInfo's guess.
    assert_eq!(tensormem_set_memory_fraction_checked(0.5, 0), TM_OK);
    let mut fraction = 0.0;
    // SAFETY: a valid out-parameter.
    let rc = unsafe { tensormem_get_memory_fraction(0, &mut fraction) };
    assert_eq!(rc, TM_OK, "{}", last_error());
    assert!((fraction - 0.5).abs() < 1e-6, "{fraction}");
    let total = cuda::mem_get_info(Some(0)).unwrap().total;
    let mut largest = 0usize;
    // SAFETY: a valid out-parameter.
    let rc = unsafe { tensormem_cache_info(0, &mut largest) };
    assert_eq!(rc, TM_OK, "{}", last_error());
    assert!(largest > 0 && largest as u64 <= total / 2, "{largest}");
    let mut big = ptr::null_mut();
    // SAFETY: as above.
    let rc = unsafe {
        tensormem_malloc(
            usize::try_from(total / 10 * 6).unwrap(),
            0,
            stream,
            &mut big,
        )
    };
    assert_eq!(rc, TM_OUT_OF_MEMORY);
    assert!(big.is_null());
    assert!(
        last_error().contains("would exceed allowed memory"),
        "{}",
        last_error()
    );
    assert_eq!(tensormem_set_memory_fraction_checked(1.0, 0), TM_OK);

    // A graph capture, in PyTorch's order: the bookkeeping ends before the capture does, joining the
    // streams frees were queued on into the capture stream.
    let before = FILTERS_DROPPED.load(std::sync::atomic::Ordering::SeqCst);
    // SAFETY: the filter and its context stay valid until dropped.
    let rc = unsafe {
        tensormem_pool_begin(
            0,
            1,
            0,
            Some(accept_all),
            Some(count_filter_drop),
            ptr::null_mut(),
        )
    };
    assert_eq!(rc, TM_OK, "{}", last_error());
    captured(stream, || {
        let mut inside = ptr::null_mut();
        // SAFETY: the capturing stream of device 0; a valid out-parameter.
        let rc = unsafe { tensormem_malloc(MIB, 0, stream, &mut inside) };
        assert_eq!(rc, TM_OK, "{}", last_error());
        // SAFETY: nothing captured uses it after this free.
        let rc = unsafe { tensormem_raw_delete(inside) };
        assert_eq!(rc, TM_OK, "{}", last_error());
        // SAFETY: the capture stream, kept for the process.
        let rc = unsafe { tensormem_pool_end_on(0, 1, 0, stream) };
        assert_eq!(rc, TM_OK, "{}", last_error());
    });
    assert_eq!(
        FILTERS_DROPPED.load(std::sync::atomic::Ordering::SeqCst),
        before + 1,
        "PyTorch's filter is dropped once"
    );
    assert_eq!(tensormem_pool_release(0, 1, 0), TM_OK);
    // The pluggable hooks, whose end is not told the capture stream.
    let pool_id = TorchMempoolId {
        first: 2,
        second: 0,
    };
    tensormem_clear_last_error();
    // SAFETY: the filter argument is not used.
    unsafe { tensormem_begin_allocate_to_pool(0, pool_id, ptr::null_mut()) };
    assert!(tensormem_last_error().is_null(), "{}", last_error());
    captured(stream, || {
        let inside = alloc(MIB, 0, stream);
        // SAFETY: nothing captured uses it after this free.
        unsafe { tensormem_free(inside, MIB, 0, stream) };
        tensormem_end_allocate_to_pool(0, pool_id);
        assert!(tensormem_last_error().is_null(), "{}", last_error());
    });
    tensormem_release_pool(0, pool_id);

    // Refused with PyTorch's message, on a GPU too.
    assert_eq!(tensormem_pool_create_or_incref(0, 0, 1), TM_ERROR);
    assert!(
        last_error().starts_with("cudaMallocAsync does not yet support createOrIncrefPool."),
        "{}",
        last_error()
    );
    assert!(tensormem_snapshot_take(0, 0, 1).is_null());
    cuda::synchronize(Some(0)).unwrap();
    tensormem_empty_cache();
}
