//! Growing the cache during a CUDA graph capture: a global-mode capture whose allocation needs a new
//! segment (`cuMemAlloc`, or the virtual-memory calls of expandable segments) succeeds, the capture
//! stays valid, the captured graph writes to the memory when launched, and the thread's capture mode is
//! what it was before.

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{check, BackendStream, CudaBackend};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, MempoolId};

use crate::harness::gpu;

const MIB: usize = 1 << 20;

/// The calling thread's capture mode, read by exchanging it with itself.
fn thread_capture_mode() -> sys::CUstreamCaptureMode {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: a valid in/out parameter; the first exchange reads the mode, the second puts it back.
    unsafe {
        check(
            "cuThreadExchangeStreamCaptureMode",
            sys::cuThreadExchangeStreamCaptureMode(&mut mode),
        )
        .unwrap();
        let mut back = mode;
        check(
            "cuThreadExchangeStreamCaptureMode",
            sys::cuThreadExchangeStreamCaptureMode(&mut back),
        )
        .unwrap();
    }
    mode
}

/// Captures, in global mode, an allocation of `size` bytes that the empty cache cannot serve and a fill
/// of it; launches the graph and checks the memory holds the fill. `private`: the capture allocates
/// from a private pool, as PyTorch's graphs do (private pools take whole device allocations, so the
/// expandable case allocates from the default pools).
fn capture_needing_a_new_segment(config: &str, size: usize, private: bool) {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let config = AllocatorConfig::parse(config).unwrap();
    let alloc = CachingAllocator::with_config(CudaBackend::new(0).unwrap(), config);
    let stream: BackendStream = alloc.device().create_stream().unwrap();
    let id = stream.id();
    let pool = MempoolId(1, 0);
    let mode_before = thread_capture_mode();

    if private {
        alloc
            .begin_allocate_to_pool(pool, move |s| s == id)
            .unwrap();
    }
    assert!(!alloc.device().is_capturing(id).unwrap());
    // SAFETY: the stream is live and not capturing.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(
            stream.as_raw(),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    })
    .unwrap();
    assert!(alloc.device().is_capturing(id).unwrap());
    assert_eq!(alloc.reserved_bytes(), 0, "the cache starts empty");

    let block = alloc.allocate(size, id);
    let fill = block.as_ref().ok().map(|block| {
        // SAFETY: the block is live and only this stream uses it; the fill is captured, not run.
        unsafe { stream.memset_d8(block.ptr(), 0xA5, size) }
    });
    // End the capture whatever happened, so that a failure leaves the stream usable.
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing; `graph` is a valid out-parameter.
    let ended = unsafe { sys::cuStreamEndCapture(stream.as_raw(), &mut graph) };
    let block = block.expect("allocating a new segment during a global-mode capture");
    fill.unwrap().expect("capturing a fill of the new block");
    check(
        "cuStreamEndCapture (the capture must not be invalidated)",
        ended,
    )
    .unwrap();
    assert!(!alloc.device().is_capturing(id).unwrap());
    assert!(alloc.reserved_bytes() >= size as u64, "a segment was made");
    assert_eq!(thread_capture_mode(), mode_before, "the mode is restored");

    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the captured graph; `exec` is a valid out-parameter; the launch runs the fill
    // on the live block; everything is destroyed after the stream is synchronised.
    unsafe {
        check(
            "cuGraphInstantiateWithFlags",
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
        )
        .unwrap();
        check("cuGraphLaunch", sys::cuGraphLaunch(exec, stream.as_raw())).unwrap();
    }
    stream.synchronize().unwrap();
    let mut back = vec![0u8; size];
    // SAFETY: the block is live, `size` bytes long, and idle (the stream was synchronised).
    unsafe { stream.copy_to_host(&mut back, block.ptr()).unwrap() };
    assert!(back.iter().all(|&b| b == 0xA5), "the graph wrote the block");
    // SAFETY: the stream is idle, so the graph is not running.
    unsafe {
        check("cuGraphExecDestroy", sys::cuGraphExecDestroy(exec)).unwrap();
        check("cuGraphDestroy", sys::cuGraphDestroy(graph)).unwrap();
    }

    let expandable = alloc.config().expandable_segments;
    let mapped = alloc
        .snapshot()
        .segments
        .iter()
        .any(|segment| segment.is_expandable);
    assert_eq!(mapped, expandable, "the segment is expandable iff expected");
    alloc.free(block).unwrap();
    if private {
        alloc.end_allocate_to_pool(pool).unwrap();
        alloc.release_pool(pool).unwrap();
    }
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_global_mode_capture_can_make_a_new_segment() {
    capture_needing_a_new_segment("", 8 * MIB, true);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_global_mode_capture_can_map_expandable_memory() {
    capture_needing_a_new_segment("expandable_segments:True", 24 * MIB, false);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_segment_made_beside_another_threads_global_capture_succeeds() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = CachingAllocator::new(CudaBackend::new(0).unwrap());
    let capturing: BackendStream = alloc.device().create_stream().unwrap();
    let other: BackendStream = alloc.device().create_stream().unwrap();
    // SAFETY: the stream is live and not capturing.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(
            capturing.as_raw(),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    })
    .unwrap();
    let other_id = other.id();
    let made = std::thread::scope(|s| {
        s.spawn(|| {
            alloc.device().make_current().unwrap();
            alloc.allocate(4 * MIB, other_id)
        })
        .join()
        .unwrap()
    });
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing; `graph` is a valid out-parameter.
    let ended = unsafe { sys::cuStreamEndCapture(capturing.as_raw(), &mut graph) };
    let block = made.expect("a segment on another thread during a global-mode capture");
    check(
        "cuStreamEndCapture (the capture must not be invalidated)",
        ended,
    )
    .unwrap();
    // SAFETY: the graph is not instantiated or used.
    check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) }).unwrap();
    alloc.free(block).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
}
