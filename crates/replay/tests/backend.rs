//! A trace recorded under `backend:cudaMallocAsync` is refused (PyTorch records no history under
//! it), and so is a run checked against the record under it; a what-if asking for it runs through
//! the model of the driver's pool (`tests/async_model.rs`).

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
            assert!(message.contains("no memory history"), "{message}");
            assert!(
                message.contains("--config backend:cudaMallocAsync"),
                "{message}"
            );
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
fn a_what_if_runs_through_the_model_and_a_checked_run_is_refused() {
    let replay = Replay::new(&recorded()).unwrap();
    let config = replay.what_if_config("backend:cudaMallocAsync").unwrap();
    assert_eq!(config.backend, Backend::CudaMallocAsync);
    let run = replay.run_with("backend:cudaMallocAsync").unwrap();
    assert!(run.devices[0].async_model.is_some());
    assert_eq!(run.matches_record(), None);
    let mut options = RunOptions::new(AllocatorConfig {
        backend: Backend::CudaMallocAsync,
        ..AllocatorConfig::default()
    });
    assert!(replay.run(&options).is_ok());
    options.check = true;
    assert!(is_unsupported(replay.run(&options)));
    // The native backend still runs.
    assert!(replay.run_with("backend:native").is_ok());
}
