//! The device API on a real GPU. Each test is `#[ignore]`d (`cargo xtask test-gpu` and the bundle's
//! `run.sh` run them with `--include-ignored`); run without a device, it says
//! `skipped: no CUDA driver/device (...)`, and fails instead with `TENSORMEM_REQUIRE_GPU=1` (which they
//! set). The per-device allocators are process-wide, so the tests hold one lock while they run.
#![cfg(feature = "cuda")]

use std::sync::MutexGuard;

use tensormem::cuda::{self, Error, Stream};
// The variables the allocator configuration is read from: a child gets none but those it is given.
use tensormem::cuda_alloc::config::ENV_VARS as CONFIG_VARS;
use tensormem::cuda_alloc::snapshot::{BlockState, Snapshot, TraceAction};
use tensormem_test_support::{child, gpu};

const MIB: usize = 1 << 20;

/// The number of devices, holding the test lock, or `None` after saying why the test is skipped.
fn gpus() -> Option<(u32, MutexGuard<'static, ()>)> {
    let lock = gpu::lock();
    Some((gpu::devices(cuda::device_count())?, lock))
}

/// Runs `f` on a fresh thread (whose current device and streams are the defaults) and returns its result.
fn on_new_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().expect("the thread panicked")
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn the_current_device_is_per_thread_and_guards_restore_it() {
    let Some((count, _lock)) = gpus() else { return };
    on_new_thread(move || {
        assert_eq!(cuda::current_device().unwrap(), 0);
        let last = count - 1;
        cuda::set_device(last).unwrap();
        assert_eq!(cuda::current_device().unwrap(), last);
        assert_eq!(
            on_new_thread(|| cuda::current_device().unwrap()),
            0,
            "another thread's device changed"
        );
        assert_eq!(cuda::exchange_device(0).unwrap(), last);
        {
            let _guard = cuda::device_guard(last).unwrap();
            assert_eq!(cuda::current_device().unwrap(), last);
        }
        assert_eq!(cuda::current_device().unwrap(), 0);
        match cuda::set_device(count) {
            Err(Error::InvalidDevice { device, count: c }) => {
                assert_eq!((device, c), (count, count))
            }
            other => panic!("set_device({count}) of {count} devices gave {other:?}"),
        }
        assert_eq!(
            cuda::current_device().unwrap(),
            0,
            "a failed set_device changed the device"
        );
    });
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn properties_peer_queries_memory_info_and_synchronize() {
    let Some((count, _lock)) = gpus() else { return };
    let props = cuda::get_device_properties(Some(0)).unwrap();
    assert_eq!(cuda::get_device_name(Some(0)).unwrap(), props.name);
    assert_eq!(
        cuda::get_device_capability(Some(0)).unwrap(),
        (props.major, props.minor)
    );
    let info = cuda::mem_get_info(Some(0)).unwrap();
    assert_eq!(info.total, props.total_memory);
    assert!(info.free <= info.total);
    assert!(!cuda::can_device_access_peer(0, 0).unwrap());
    assert!(matches!(
        cuda::can_device_access_peer(0, count),
        Err(Error::InvalidDevice { .. })
    ));
    cuda::synchronize(None).unwrap();
    assert!(cuda::is_available());
    assert!(!cuda::is_in_bad_fork());
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn current_streams_are_per_thread_and_per_device() {
    let Some(_) = gpus() else { return };
    on_new_thread(|| {
        let default = cuda::current_stream(None).unwrap();
        assert!(default.is_default());
        assert_eq!(default, cuda::default_stream(None).unwrap());
        let stream = Stream::new(None).unwrap();
        assert!(!stream.is_default());
        cuda::set_stream(&stream).unwrap();
        assert_eq!(cuda::current_stream(Some(0)).unwrap(), stream);
        assert!(on_new_thread(|| cuda::current_stream(None)
            .unwrap()
            .is_default()));
        stream.synchronize().unwrap();
        assert!(stream.query().unwrap());
        default.synchronize().unwrap();
        cuda::set_stream(&default).unwrap();
        assert!(cuda::current_stream(None).unwrap().is_default());
    });
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn caching_allocator_alloc_and_delete_show_in_stats_and_snapshots() {
    let Some(_) = gpus() else { return };
    on_new_thread(|| {
        cuda::record_memory_history(true, 1000).unwrap();
        let stream = Stream::new(Some(0)).unwrap();
        let before = cuda::memory_allocated(Some(0)).unwrap();
        cuda::reset_peak_memory_stats(Some(0)).unwrap();
        let ptr = cuda::caching_allocator_alloc(3 * MIB, Some(&stream)).unwrap();
        assert_eq!(
            cuda::memory_allocated(Some(0)).unwrap(),
            before + 3 * MIB as u64
        );
        assert!(cuda::max_memory_allocated(Some(0)).unwrap() >= before + 3 * MIB as u64);
        assert!(cuda::memory_reserved(Some(0)).unwrap() >= 3 * MIB as u64);
        let stats = cuda::memory_stats(Some(0)).unwrap();
        assert_eq!(
            stats["allocated_bytes.all.current"],
            (before + 3 * MIB as u64) as i64
        );

        let snapshot = cuda::memory_snapshot().unwrap();
        let block = snapshot
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .find(|b| b.address == ptr.addr());
        assert_eq!(
            block.map(|b| b.state),
            Some(BlockState::ActiveAllocated),
            "{snapshot:?}"
        );
        assert!(snapshot.device_traces[0]
            .iter()
            .any(|e| e.action == TraceAction::Alloc && e.addr == ptr.addr()));

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("snapshot.pickle");
        cuda::dump_snapshot(&file).unwrap();
        let read = Snapshot::read_file(&file).unwrap();
        assert_eq!(read.segments.len(), snapshot.segments.len());

        cuda::caching_allocator_record_stream(ptr, &cuda::default_stream(Some(0)).unwrap())
            .unwrap();
        cuda::caching_allocator_delete(ptr).unwrap();
        assert!(matches!(
            cuda::caching_allocator_delete(ptr),
            Err(Error::Alloc(
                tensormem::cuda_alloc::Error::InvalidPointer { .. }
            ))
        ));
        cuda::synchronize(Some(0)).unwrap();
        cuda::empty_cache().unwrap();
        assert_eq!(cuda::memory_allocated(Some(0)).unwrap(), before);
        cuda::reset_accumulated_memory_stats(Some(0)).unwrap();
        assert_eq!(cuda::memory_stats(Some(0)).unwrap()["num_device_alloc"], 0);
        cuda::record_memory_history(false, 1).unwrap();
    });
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn the_memory_fraction_and_settings_apply_to_the_device_allocator() {
    let Some(_) = gpus() else { return };
    on_new_thread(|| {
        let total = cuda::mem_get_info(Some(0)).unwrap().total as usize;
        cuda::set_per_process_memory_fraction(0.5, Some(0)).unwrap();
        match cuda::caching_allocator_alloc(total / 10 * 6, None) {
            Err(Error::Alloc(tensormem::cuda_alloc::Error::OutOfMemory(oom))) => {
                assert_eq!(oom.allowed, Some(total as u64 / 2));
            }
            other => panic!("60% of the device under a 0.5 fraction gave {other:?}"),
        }
        cuda::set_per_process_memory_fraction(1.0, Some(0)).unwrap();
        assert!(matches!(
            cuda::set_per_process_memory_fraction(2.0, None),
            Err(Error::Alloc(_))
        ));

        cuda::set_allocator_settings("garbage_collection_threshold:0.6").unwrap();
        assert!(
            (cuda::allocator_settings(Some(0))
                .unwrap()
                .garbage_collection_threshold
                - 0.6)
                .abs()
                < 1e-9
        );
        assert!(cuda::set_allocator_settings("garbage_collection_threshold:7").is_err());
        assert!(
            (cuda::allocator_settings(Some(0))
                .unwrap()
                .garbage_collection_threshold
                - 0.6)
                .abs()
                < 1e-9
        );
    });
}

#[test]
#[ignore = "needs two CUDA GPUs (cargo xtask test-gpu runs it)"]
fn two_devices_have_their_own_allocators_and_can_share_memory() {
    let Some((count, _lock)) = gpus() else { return };
    if count < 2 {
        eprintln!("skipped: this test needs 2 CUDA devices, this machine has {count}");
        return;
    }
    on_new_thread(move || {
        let (s0, s1) = (Stream::new(Some(0)).unwrap(), Stream::new(Some(1)).unwrap());
        let (before0, before1) = (
            cuda::memory_allocated(Some(0)).unwrap(),
            cuda::memory_allocated(Some(1)).unwrap(),
        );
        let p0 = cuda::caching_allocator_alloc(MIB, Some(&s0)).unwrap();
        let p1 = cuda::caching_allocator_alloc(2 * MIB, Some(&s1)).unwrap();
        assert_eq!(
            cuda::memory_allocated(Some(0)).unwrap(),
            before0 + MIB as u64
        );
        assert_eq!(
            cuda::memory_allocated(Some(1)).unwrap(),
            before1 + 2 * MIB as u64
        );
        if cuda::can_device_access_peer(1, 0).unwrap() {
            cuda::enable_peer_access(1, 0).unwrap();
        }
        let (d0, d1) = (
            cuda::caching_allocator(Some(0)).unwrap().device(),
            cuda::caching_allocator(Some(1)).unwrap().device(),
        );
        let c1 = s1.as_cuda_stream().unwrap();
        let mut back = vec![0u8; MIB];
        // SAFETY: both pointers are live allocations of at least 1 MiB; the copy is synchronised.
        unsafe {
            s0.as_cuda_stream()
                .unwrap()
                .memset_d8(p0, 0x9C, MIB)
                .unwrap();
            s0.synchronize().unwrap();
            c1.copy_peer(p1, d1, p0, d0, MIB).unwrap();
            c1.copy_to_host(&mut back, p1).unwrap();
        }
        assert!(back.iter().all(|&b| b == 0x9C));
        // Deleting by pointer finds the right device's allocator.
        cuda::caching_allocator_delete(p1).unwrap();
        cuda::caching_allocator_delete(p0).unwrap();
        assert_eq!(
            cuda::memory_snapshot().unwrap().device_traces.len(),
            count as usize
        );
    });
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn is_current_stream_capturing_follows_a_capture_of_the_current_stream() {
    use cudarc::driver::sys;
    let Some((_, _lock)) = gpus() else { return };
    on_new_thread(|| {
        let stream = Stream::new(Some(0)).unwrap();
        cuda::set_stream(&stream).unwrap();
        assert!(!cuda::is_current_stream_capturing().unwrap());
        let raw = stream.as_cuda_stream().unwrap().as_raw();
        // SAFETY: the stream is live and not capturing.
        let began = unsafe {
            sys::cuStreamBeginCapture_v2(
                raw,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            )
        };
        assert_eq!(began, sys::CUresult::CUDA_SUCCESS);
        let during = cuda::is_current_stream_capturing();
        // A new segment for the capturing stream (the device's allocator caches nothing this big).
        let made = cuda::caching_allocator_alloc(300 * MIB, None);
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing; `graph` is a valid out-parameter.
        let ended = unsafe { sys::cuStreamEndCapture(raw, &mut graph) };
        assert!(during.unwrap(), "the current stream was capturing");
        let ptr = made.expect("a new segment during a global-mode capture");
        assert_eq!(
            ended,
            sys::CUresult::CUDA_SUCCESS,
            "the capture stayed valid"
        );
        // SAFETY: the graph was never instantiated.
        let destroyed = unsafe { sys::cuGraphDestroy(graph) };
        assert_eq!(destroyed, sys::CUresult::CUDA_SUCCESS);
        assert!(!cuda::is_current_stream_capturing().unwrap());
        cuda::caching_allocator_delete(ptr).unwrap();
        cuda::empty_cache().unwrap();
    });
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn cuda_malloc_async_at_run_time_is_refused_and_the_backend_reported_is_native() {
    use tensormem::cuda_alloc::config::Backend;
    let Some((_, _lock)) = gpus() else { return };
    let before = cuda::allocator_settings(Some(0)).unwrap();
    match cuda::set_allocator_settings("backend:cudaMallocAsync") {
        Err(Error::BackendChanged { asked, running }) => {
            assert_eq!(
                (asked, running),
                (Backend::CudaMallocAsync, Backend::Native)
            );
        }
        other => panic!("backend:cudaMallocAsync gave {other:?}"),
    }
    assert_eq!(cuda::allocator_settings(Some(0)).unwrap(), before);
    assert_eq!(cuda::get_allocator_backend().unwrap(), Backend::Native);
    assert_eq!(cuda::get_allocator_backend().unwrap().name(), "native");
    assert!(matches!(
        cuda::device_allocator(Some(0)).unwrap(),
        cuda::DeviceAllocator::Native(_)
    ));
}

/// The six statistics PyTorch fills under `backend:cudaMallocAsync`.
const ASYNC_STATS: [&str; 6] = [
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "active_bytes.all.current",
    "active_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
];

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn with_backend_cuda_malloc_async_configured_the_device_api_serves_from_the_pool() {
    use tensormem::cuda::{AsyncUnsupported, DeviceAllocator, MemPool};
    use tensormem::cuda_alloc::config::Backend;
    if !child::is_child() {
        // The backend is chosen once per process: this test's half below runs in a child whose
        // configuration asks for it.
        let Some(_) = gpus() else { return };
        return child::run(
            "with_backend_cuda_malloc_async_configured_the_device_api_serves_from_the_pool",
            &CONFIG_VARS,
            &[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
        );
    }
    let Some(_) = gpus() else { return };
    assert_eq!(
        cuda::get_allocator_backend().unwrap(),
        Backend::CudaMallocAsync
    );
    // Devices, streams and the pinned host allocator work as under the native backend.
    cuda::set_device(0).unwrap();
    cuda::synchronize(None).unwrap();
    assert!(cuda::mem_get_info(None).unwrap().total > 0);
    assert!(!cuda::is_current_stream_capturing().unwrap());
    let pinned = cuda::alloc_pinned(4096).unwrap();
    cuda::free_pinned(pinned).unwrap();
    let DeviceAllocator::Async(pool) = cuda::device_allocator(Some(0)).unwrap() else {
        panic!("device 0 is not served by its AsyncAllocator");
    };
    assert!(std::ptr::eq(pool, cuda::async_allocator(Some(0)).unwrap()));
    assert_eq!(
        cuda::allocator_settings(Some(0)).unwrap().backend,
        Backend::CudaMallocAsync
    );

    let stream = Stream::new(Some(0)).unwrap();
    let other = Stream::new(Some(0)).unwrap();
    cuda::empty_cache().unwrap();
    cuda::reset_peak_memory_stats(Some(0)).unwrap();
    let ptr = cuda::caching_allocator_alloc(3 * MIB, Some(&stream)).unwrap();
    assert_ne!(ptr.addr(), 0);
    assert_eq!(pool.allocation_size(ptr), Some(3 * MIB));
    let stats = cuda::memory_stats(Some(0)).unwrap();
    for (key, value) in &stats {
        if ASYNC_STATS.contains(&key.as_str()) {
            assert!(*value >= 3 * MIB as i64, "{key} = {value}");
        } else {
            assert_eq!(
                *value, 0,
                "{key} is not filled under backend:cudaMallocAsync"
            );
        }
    }
    assert_eq!(
        stats["allocated_bytes.all.current"],
        stats["active_bytes.all.current"]
    );
    assert!(cuda::memory_allocated(Some(0)).unwrap() >= 3 * MIB as u64);
    assert!(cuda::max_memory_reserved(Some(0)).unwrap() >= 3 * MIB as u64);
    cuda::caching_allocator_record_stream(ptr, &other).unwrap();
    cuda::reset_accumulated_memory_stats(Some(0)).unwrap(); // no effect, no error
    cuda::caching_allocator_delete(ptr).unwrap();
    assert!(matches!(
        cuda::caching_allocator_delete(ptr),
        Err(Error::Alloc(
            tensormem::cuda_alloc::Error::InvalidPointer { .. }
        ))
    ));
    // empty_cache synchronizes and trims the pool to nothing: no memory of this process is live.
    cuda::empty_cache().unwrap();
    assert_eq!(cuda::memory_reserved(Some(0)).unwrap(), 0);
    assert_eq!(cuda::memory_allocated(Some(0)).unwrap(), 0);
    cuda::reset_peak_memory_stats(Some(0)).unwrap();
    assert_eq!(cuda::max_memory_reserved(Some(0)).unwrap(), 0);

    // The memory fraction limits what the allocator hands out, with that backend's message.
    cuda::set_per_process_memory_fraction(0.01, Some(0)).unwrap();
    let total = cuda::mem_get_info(Some(0)).unwrap().total;
    let too_big = usize::try_from(total / 50).unwrap();
    match cuda::caching_allocator_alloc(too_big, Some(&stream)) {
        Err(Error::Alloc(tensormem::cuda_alloc::Error::OutOfMemory(oom))) => {
            assert!(
                oom.message().contains("would exceed allowed memory"),
                "{}",
                oom.message()
            );
        }
        other => panic!("{too_big} bytes past a 1% fraction gave {other:?}"),
    }
    cuda::set_per_process_memory_fraction(1.0, Some(0)).unwrap();
    let ptr = cuda::caching_allocator_alloc(too_big, None).unwrap();
    cuda::caching_allocator_delete(ptr).unwrap();

    // What PyTorch refuses for this backend, with its messages.
    for (result, what) in [
        (
            cuda::memory_snapshot().map(drop),
            AsyncUnsupported::Snapshot,
        ),
        (
            cuda::record_memory_history(true, 10),
            AsyncUnsupported::RecordHistory,
        ),
        (
            MemPool::new(Some(0)).map(drop),
            AsyncUnsupported::CreateOrIncrefPool,
        ),
        (
            cuda::attach_out_of_memory_observer(|_| {}),
            AsyncUnsupported::AttachOutOfMemoryObserver,
        ),
    ] {
        match result {
            Err(Error::AsyncUnsupported(got)) => assert_eq!(got, what),
            other => panic!("expected {what:?}, got {other:?}"),
        }
    }
    // Run-time settings keep the backend.
    cuda::set_allocator_settings("backend:cudaMallocAsync,pinned_use_cuda_host_register:False")
        .unwrap();
    assert!(matches!(
        cuda::set_allocator_settings("backend:native"),
        Err(Error::BackendChanged { .. })
    ));
    cuda::synchronize(Some(0)).unwrap();
    cuda::empty_cache().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn has_primary_context_is_true_once_a_device_is_used() {
    let Some((count, _lock)) = gpus() else { return };
    cuda::caching_allocator(Some(0)).unwrap();
    assert!(cuda::has_primary_context(0).unwrap());
    assert!(matches!(
        cuda::has_primary_context(count),
        Err(Error::InvalidDevice { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn an_out_of_memory_observer_hears_of_every_devices_errors() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let Some((_, _lock)) = gpus() else { return };
    let heard = Arc::new(AtomicU64::new(0));
    let sink = Arc::clone(&heard);
    cuda::attach_out_of_memory_observer(move |event| {
        assert_eq!(event.device, 0);
        sink.fetch_add(1, Ordering::Relaxed);
    })
    .unwrap();
    let total = cuda::mem_get_info(Some(0)).unwrap().total as usize;
    on_new_thread(move || {
        let refused = cuda::caching_allocator_alloc(total + (1 << 30), None);
        assert!(matches!(refused, Err(Error::Alloc(_))), "{refused:?}");
    });
    assert_eq!(heard.load(Ordering::Relaxed), 1);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn pinned_host_memory_is_cached_per_device_with_pytorchs_host_keys() {
    let Some((_, _lock)) = gpus() else { return };
    on_new_thread(|| {
        let stream = Stream::new(Some(0)).unwrap();
        let mut buffer = cuda::alloc_pinned(3 * MIB).unwrap();
        buffer.as_mut_slice().fill(9);
        cuda::record_pinned_stream(&buffer, &stream).unwrap();
        let first = buffer.as_ptr();
        cuda::free_pinned(buffer).unwrap();
        stream.synchronize().unwrap();
        let again = cuda::alloc_pinned(4 * MIB).unwrap();
        assert_eq!(
            again.as_ptr(),
            first,
            "the 4 MiB class, reused once the stream is idle"
        );
        let stats = cuda::host_memory_stats().unwrap();
        assert_eq!(stats["active_requests.current"], 1);
        assert!(stats["allocated_bytes.current"] >= (4 * MIB) as i64);
        cuda::free_pinned(again).unwrap();
        cuda::host_empty_cache().unwrap();
        assert_eq!(cuda::host_memory_stats().unwrap()["allocations.current"], 0);
    });
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn the_accelerator_surface_answers_as_the_cuda_one() {
    use tensormem::accelerator;
    let Some((count, _lock)) = gpus() else { return };
    assert_eq!(accelerator::current_accelerator(), Some("cuda"));
    assert_eq!(accelerator::device_count().unwrap(), count);
    let (free, total) = accelerator::get_memory_info(Some(0)).unwrap();
    assert!(free > 0 && free <= total);
    let before = accelerator::memory_allocated(Some(0)).unwrap();
    let _device = accelerator::device_index(0).unwrap();
    let ptr = cuda::caching_allocator_alloc(3 << 20, None).unwrap();
    assert_eq!(
        accelerator::memory_allocated(Some(0)).unwrap(),
        before + (3 << 20)
    );
    assert_eq!(
        accelerator::memory_stats(Some(0)).unwrap()["allocated_bytes.all.current"] as u64,
        before + (3 << 20)
    );
    assert!(accelerator::max_memory_reserved(Some(0)).unwrap() >= 3 << 20);
    cuda::caching_allocator_delete(ptr).unwrap();
    accelerator::empty_cache().unwrap();
    accelerator::reset_peak_memory_stats(Some(0)).unwrap();
    assert_eq!(
        accelerator::max_memory_allocated(Some(0)).unwrap(),
        accelerator::memory_allocated(Some(0)).unwrap()
    );
    assert!(accelerator::host_memory_stats().is_ok());
}
