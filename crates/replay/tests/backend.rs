//! A trace recorded under `backend:cudaMallocAsync`, or a what-if asking for it, is refused: the
//! replay simulates the native caching allocator only.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::{AllocatorConfig, Backend};
use tensormem_cuda_alloc::snapshot::{AllocatorSettings, Snapshot};
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_replay::{Error, Replay, RunOptions};

fn recorded() -> Snapshot {
    let allocator = CachingAllocator::new(SimDevice::new(1 << 30));
    allocator.record_history(true, 1000);
    let a = allocator.allocate(3 << 20, StreamId(0)).unwrap();
    allocator.free(a).unwrap();
    allocator.snapshot()
}

fn is_unsupported<T: std::fmt::Debug>(result: Result<T, Error>) -> bool {
    match result {
        Err(error @ Error::UnsupportedBackend { backend }) => {
            assert_eq!(backend, Backend::CudaMallocAsync);
            let message = error.to_string();
            assert!(message.contains("backend:cudaMallocAsync"), "{message}");
            true
        }
        other => panic!("expected UnsupportedBackend, got {other:?}"),
    }
}

#[test]
fn a_trace_recorded_under_cuda_malloc_async_is_refused() {
    let mut snapshot = recorded();
    let asked = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap();
    snapshot.allocator_settings = Some(AllocatorSettings::from_config(&asked));
    assert!(is_unsupported(Replay::new(&snapshot)));
}

#[test]
fn a_what_if_or_run_asking_for_it_is_refused() {
    let replay = Replay::new(&recorded()).unwrap();
    assert!(is_unsupported(
        replay.what_if_config("backend:cudaMallocAsync")
    ));
    assert!(is_unsupported(replay.run_with("backend:cudaMallocAsync")));
    let options = RunOptions::new(AllocatorConfig {
        backend: Backend::CudaMallocAsync,
        ..AllocatorConfig::default()
    });
    assert!(is_unsupported(replay.run(&options)));
    // The native backend still runs.
    assert!(replay.run_with("backend:native").is_ok());
}
