//! `backend:cudaMallocAsync` on a real GPU: [`AsyncAllocator`] on the device's default memory pool.
//!
//! Every test is `#[ignore]`d, so a plain `cargo test` lists it as ignored; `cargo xtask test-gpu` runs
//! them with `--include-ignored`. Without a CUDA driver and device a test prints `skipped: no CUDA
//! driver/device (...)` on stderr and passes, unless `TENSORMEM_REQUIRE_GPU=1`, which makes it fail.
//! The tests hold one lock while they run: they read the pool's figures, so two of them must not
//! allocate at the same time.
#![cfg(feature = "cuda")]

#[path = "gpu/harness.rs"]
#[allow(dead_code)]
mod harness;

use std::sync::mpsc;
use std::time::Duration;

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{check, BackendStream, CudaBackend};
use tensormem_cuda_alloc::{AsyncAllocator, Device, DeviceAddress, DeviceError, Error, StreamId};

use harness::{gpu, mib};

const MIB: usize = 1 << 20;

/// An allocator on device 0 whose pool starts trimmed and with its peaks reset.
fn allocator() -> AsyncAllocator {
    let alloc = AsyncAllocator::new(CudaBackend::new(0).unwrap()).unwrap();
    alloc.empty_cache().unwrap();
    alloc.reset_peak_stats().unwrap();
    alloc
}

/// Holds `stream` in a host function until the returned sender is dropped or sent to (or 30 s pass).
fn block(stream: &BackendStream) -> mpsc::Sender<()> {
    let (release, wait) = mpsc::channel::<()>();
    // SAFETY: the closure makes no CUDA call.
    unsafe {
        stream
            .launch_host_fn(move || {
                let _ = wait.recv_timeout(Duration::from_secs(30));
            })
            .unwrap();
    }
    release
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn allocations_on_two_streams_are_freed_on_their_streams() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator();
    let (s1, s2) = (
        alloc.device().create_stream().unwrap(),
        alloc.device().create_stream().unwrap(),
    );
    let a = alloc.allocate(MIB, s1.id()).unwrap();
    let b = alloc.allocate(3 * MIB, s2.id()).unwrap();
    let c = alloc.allocate(4096, StreamId::DEFAULT).unwrap();
    assert_ne!(a, b);
    assert_eq!(alloc.allocation_size(b), Some(3 * MIB));
    assert_eq!(alloc.used_bytes(), (4 * MIB + 4096) as u64);
    // SAFETY: each pointer is live, of the given size, and used only by its own stream.
    unsafe {
        s1.memset_d8(a, 1, MIB).unwrap();
        s2.memset_d8(b, 2, 3 * MIB).unwrap();
    }
    let mut back = vec![0u8; 3 * MIB];
    // SAFETY: `b` is live and 3 MiB long; the copy is ordered after the fill on the same stream.
    unsafe { s2.copy_to_host(&mut back, b).unwrap() };
    assert!(back.iter().all(|&x| x == 2));
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    alloc.free(c).unwrap();
    assert!(matches!(alloc.free(a), Err(Error::InvalidPointer { .. })));
    assert_eq!(alloc.live_allocations(), 0);
    assert_eq!(alloc.used_bytes(), 0);
    alloc.free(DeviceAddress(0)).unwrap();
    assert_eq!(alloc.allocate(0, s1.id()).unwrap(), DeviceAddress(0));
    alloc.device().synchronize().unwrap();
    let pool = alloc.pool_stats().unwrap().default_pool;
    assert_eq!(pool.used_current, 0, "everything went back to the pool");
    assert!(pool.reserved_current >= 4 * MIB as u64, "and stays there");
    // A stream the backend does not know is refused.
    assert!(matches!(
        alloc.allocate(MIB, StreamId(0xdead_0000)),
        Err(Error::Device(DeviceError::UnknownStream { .. }))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_recorded_streams_work_completes_before_the_memory_is_reused() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator();
    let (s1, s2) = (
        alloc.device().create_stream().unwrap(),
        alloc.device().create_stream().unwrap(),
    );
    let size = 2 * MIB;
    let a = alloc.allocate(size, s1.id()).unwrap();
    s1.synchronize().unwrap();
    let release = block(&s2); // s2's "work" using `a` runs until released
    alloc.record_stream(a, s2.id()).unwrap();
    alloc.record_stream(a, s1.id()).unwrap(); // the allocation stream: no effect
    alloc.free(a).unwrap();

    let b = alloc.allocate(size, s1.id()).unwrap();
    let after = alloc.device().create_event().unwrap();
    s1.record(&after).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let overlaps = b.0 < a.0 + size as u64 && a.0 < b.0 + size as u64;
    if overlaps {
        // The pool may hand the range out again only with s1 made to wait for the free.
        assert!(
            !after.query().unwrap(),
            "the memory was reused on s1 while s2 was still using it"
        );
    }
    eprintln!(
        "allocation after the free {} the freed range",
        if overlaps {
            "reuses (ordered)"
        } else {
            "avoids"
        }
    );
    release.send(()).unwrap();
    after.synchronize().unwrap();
    alloc.free(b).unwrap();
    alloc.device().synchronize().unwrap();

    // Without the blocked stream, the range comes back on the allocation stream.
    let c = alloc.allocate(size, s1.id()).unwrap();
    alloc.free(c).unwrap();
    assert!(matches!(
        alloc.record_stream(c, s2.id()),
        Err(Error::InvalidPointer { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn statistics_are_pytorchs_six_pool_figures() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator();
    let stream = alloc.device().create_stream().unwrap();
    let before = alloc.memory_stats().unwrap();
    let size = 8 * MIB as i64;
    let a = alloc.allocate(8 * MIB, stream.id()).unwrap();
    let stats = alloc.memory_stats().unwrap();
    let flat = stats.to_flat();
    let six = [
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "active_bytes.all.current",
        "active_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
    ];
    for (key, value) in &flat {
        if !six.contains(&key.as_str()) {
            assert_eq!(*value, 0, "{key} is not reported by this backend");
        }
    }
    let used = stats.allocated_bytes.all.current;
    assert!(
        used >= before.allocated_bytes.all.current + size,
        "used {used}"
    );
    assert_eq!(stats.active_bytes.all, stats.allocated_bytes.all);
    assert!(stats.reserved_bytes.all.current >= used);
    assert!(stats.allocated_bytes.all.peak >= used);
    assert!(stats.reserved_bytes.all.peak >= stats.reserved_bytes.all.current);
    eprintln!("with 8 MiB allocated: {flat:?}");

    alloc.free(a).unwrap();
    stream.synchronize().unwrap();
    let freed = alloc.memory_stats().unwrap();
    assert_eq!(
        freed.allocated_bytes.all.current,
        before.allocated_bytes.all.current
    );
    assert!(freed.allocated_bytes.all.peak >= used, "the peak stays");
    assert!(
        freed.reserved_bytes.all.current >= size,
        "the pool keeps it"
    );
    alloc.reset_peak_stats().unwrap();
    let reset = alloc.memory_stats().unwrap();
    assert_eq!(
        reset.allocated_bytes.all.peak,
        reset.allocated_bytes.all.current
    );
    assert_eq!(
        reset.reserved_bytes.all.peak,
        reset.reserved_bytes.all.current
    );
    alloc.reset_accumulated_stats();
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn empty_cache_returns_the_pools_memory_to_the_device() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator();
    let stream = alloc.device().create_stream().unwrap();
    let start = alloc.mem_info().unwrap();
    let size = 256 * MIB;
    let a = alloc.allocate(size, stream.id()).unwrap();
    // SAFETY: `a` is live, `size` bytes long, and used only by this stream.
    unsafe { stream.memset_d8(a, 0, size).unwrap() };
    alloc.free(a).unwrap();
    stream.synchronize().unwrap();
    let kept = alloc.mem_info().unwrap();
    let reserved = alloc.pool_stats().unwrap().default_pool.reserved_current;
    assert!(reserved >= size as u64, "the pool keeps {}", mib(reserved));
    assert!(
        kept.free + (size as u64) <= start.free + 16 * MIB as u64,
        "free memory {} -> {} while the pool holds it",
        mib(start.free),
        mib(kept.free)
    );
    alloc.empty_cache().unwrap();
    let trimmed = alloc.mem_info().unwrap();
    assert_eq!(
        alloc.pool_stats().unwrap().default_pool.reserved_current,
        0,
        "trimmed to nothing"
    );
    assert!(
        trimmed.free >= kept.free + size as u64 - 16 * MIB as u64,
        "free memory {} -> {} after empty_cache",
        mib(kept.free),
        mib(trimmed.free)
    );
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_graph_capture_allocates_and_frees_inside_the_graph() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator();
    let stream = alloc.device().create_stream().unwrap();
    let id = stream.id();
    let outside = alloc.allocate(MIB, id).unwrap();
    stream.synchronize().unwrap();

    alloc.begin_capture().unwrap();
    assert!(matches!(
        alloc.begin_capture(),
        Err(Error::Device(DeviceError::Unsupported { .. }))
    ));
    // SAFETY: the stream is live and not capturing.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(
            stream.as_raw(),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    })
    .unwrap();
    let inside = alloc.allocate(4 * MIB, id);
    let filled = inside.as_ref().ok().map(|&ptr| {
        // SAFETY: the pointer is the graph's allocation, used only by the captured stream.
        unsafe { stream.memset_d8(ptr, 0x5A, 4 * MIB) }
    });
    let freed = inside.as_ref().ok().map(|&ptr| alloc.free(ptr));
    // A pointer from before the capture is not freed inside it: deferred until the capture ends.
    let deferred = alloc.free(outside);
    let ended_books = alloc.end_capture(id);
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing; `graph` is a valid out-parameter.
    let ended = unsafe { sys::cuStreamEndCapture(stream.as_raw(), &mut graph) };
    inside.expect("allocating during the capture");
    filled.unwrap().expect("capturing a fill");
    freed.unwrap().expect("freeing during the capture");
    deferred.expect("deferring the free of an uncaptured pointer");
    ended_books.expect("end_capture");
    check("cuStreamEndCapture (the capture must stay valid)", ended).unwrap();
    assert!(!alloc.is_capture_underway());
    assert_eq!(
        alloc.live_allocations(),
        1,
        "the deferred pointer is still live"
    );

    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the captured graph; `exec` is a valid out-parameter; both are destroyed after
    // the stream is synchronised.
    unsafe {
        check(
            "cuGraphInstantiateWithFlags",
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
        )
        .unwrap();
        check("cuGraphLaunch", sys::cuGraphLaunch(exec, stream.as_raw())).unwrap();
        check("cuGraphLaunch", sys::cuGraphLaunch(exec, stream.as_raw())).unwrap();
    }
    stream.synchronize().unwrap();
    eprintln!(
        "after two launches: {:?}",
        alloc.pool_stats().unwrap().graph_pool
    );
    // SAFETY: the stream is idle, so the graph is not running.
    unsafe {
        check("cuGraphExecDestroy", sys::cuGraphExecDestroy(exec)).unwrap();
        check("cuGraphDestroy", sys::cuGraphDestroy(graph)).unwrap();
    }
    // The next allocation outside a capture frees the deferred pointer first.
    let next = alloc.allocate(MIB, id).unwrap();
    assert_eq!(alloc.live_allocations(), 1);
    alloc.free(next).unwrap();
    assert_eq!(alloc.live_allocations(), 0);
    assert!(matches!(
        alloc.end_capture(id),
        Err(Error::Device(DeviceError::Unsupported { .. }))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn out_of_memory_the_memory_fraction_and_ipc_are_pytorchs() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator();
    let total = alloc.mem_info().unwrap().total;
    match alloc.allocate(2 * total as usize, StreamId::DEFAULT) {
        Err(Error::OutOfMemory(report)) => {
            assert!(
                report.message().contains("would exceed allowed memory"),
                "{report}"
            );
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    alloc.set_memory_fraction(0.0).unwrap();
    assert!(matches!(
        alloc.allocate(MIB, StreamId::DEFAULT),
        Err(Error::OutOfMemory(_))
    ));
    alloc.set_memory_fraction(1.0).unwrap();
    assert!(matches!(
        alloc.set_memory_fraction(1.5),
        Err(Error::InvalidFraction { .. })
    ));
    let a = alloc.allocate(MIB, StreamId::DEFAULT).unwrap();
    let refused = alloc.ipc_handle(a).unwrap_err();
    assert!(
        matches!(refused, Error::Device(DeviceError::Unsupported { .. })),
        "{refused:?}"
    );
    assert!(refused.to_string().contains("shareIpcHandle"), "{refused}");
    alloc.free(a).unwrap();
    alloc.device().synchronize().unwrap();
}
