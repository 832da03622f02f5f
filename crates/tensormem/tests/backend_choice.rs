//! The allocator backend of the device API, chosen once per process from the allocator
//! configuration, as PyTorch chooses it. Each case runs in a child process of this test binary
//! (`tensormem_test_support::child::run`) with the configuration variables it names and no others. Needs no GPU: the
//! backend is read without the driver, and `backend:cudaMallocAsync` refuses what PyTorch refuses
//! before any device is touched. The serving itself is tested on a GPU in `gpu.rs`.
#![cfg(feature = "cuda")]

use tensormem::cuda::{self, AsyncUnsupported, Error, MemPool, MempoolId, PoolOptions};
use tensormem::cuda_alloc::config::Backend;
// The variables the allocator configuration is read from: a child gets none but those it is given.
use tensormem::cuda_alloc::config::ENV_VARS as CONFIG_VARS;
use tensormem_test_support::child;

/// `result` is the refusal `what`.
#[track_caller]
fn refused<T: std::fmt::Debug>(result: cuda::Result<T>, what: AsyncUnsupported) {
    match result {
        Err(Error::AsyncUnsupported(got)) => assert_eq!(got, what),
        other => panic!("expected the refusal {what:?}, got {other:?}"),
    }
}

#[test]
fn without_a_configuration_the_caching_allocator_serves() {
    if !child::is_child() {
        return child::run(
            "without_a_configuration_the_caching_allocator_serves",
            &CONFIG_VARS,
            &[],
        );
    }
    assert_eq!(cuda::get_allocator_backend().unwrap(), Backend::Native);
    assert_eq!(cuda::get_allocator_backend().unwrap().name(), "native");
    for what in AsyncUnsupported::ALL {
        cuda::backend_supports(what).unwrap();
    }
    // The caching path gives its own errors (no driver here), never a refusal of the async backend.
    for result in [
        cuda::memory_snapshot().map(drop),
        cuda::record_memory_history(true, 8),
        cuda::caching_allocator(None).map(drop),
        MemPool::new(None).map(drop),
    ] {
        assert!(
            !matches!(result, Err(Error::AsyncUnsupported(_))),
            "{result:?}"
        );
    }
    match cuda::set_allocator_settings("backend:cudaMallocAsync") {
        Err(Error::BackendChanged { asked, running }) => {
            assert_eq!(
                (asked, running),
                (Backend::CudaMallocAsync, Backend::Native)
            );
        }
        other => panic!("switching to backend:cudaMallocAsync at run time gave {other:?}"),
    }
}

#[test]
fn tensormems_own_variable_decides_before_pytorchs() {
    if !child::is_child() {
        return child::run(
            "tensormems_own_variable_decides_before_pytorchs",
            &CONFIG_VARS,
            &[
                ("TENSORMEM_ALLOC_CONF", "backend:native"),
                ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync"),
            ],
        );
    }
    assert_eq!(cuda::get_allocator_backend().unwrap(), Backend::Native);
}

#[test]
fn a_malformed_configuration_is_an_error_not_a_backend() {
    if !child::is_child() {
        return child::run(
            "a_malformed_configuration_is_an_error_not_a_backend",
            &CONFIG_VARS,
            &[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMalloc")],
        );
    }
    let err = cuda::get_allocator_backend().unwrap_err();
    assert!(matches!(err, Error::Alloc(_)), "{err:?}");
    assert!(err.to_string().contains("PYTORCH_CUDA_ALLOC_CONF"), "{err}");
    assert!(matches!(
        cuda::backend_supports(AsyncUnsupported::Snapshot),
        Err(Error::Alloc(_))
    ));
}

#[test]
fn under_cuda_malloc_async_what_pytorch_refuses_is_refused() {
    if !child::is_child() {
        for var in [
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
            "TENSORMEM_ALLOC_CONF",
        ] {
            child::run(
                "under_cuda_malloc_async_what_pytorch_refuses_is_refused",
                &CONFIG_VARS,
                &[(
                    var,
                    "backend:cudaMallocAsync,pinned_use_cuda_host_register:True",
                )],
            );
        }
        return;
    }
    assert_eq!(
        cuda::get_allocator_backend().unwrap(),
        Backend::CudaMallocAsync
    );
    assert_eq!(
        cuda::get_allocator_backend().unwrap().to_string(),
        "cudaMallocAsync"
    );
    for what in AsyncUnsupported::ALL {
        refused(cuda::backend_supports(what), what);
    }
    refused(cuda::memory_snapshot(), AsyncUnsupported::Snapshot);
    refused(
        cuda::memory_snapshot_with(Some(MempoolId(0, 1)), false),
        AsyncUnsupported::Snapshot,
    );
    refused(
        cuda::dump_snapshot(std::env::temp_dir().join("tensormem-never-written.pickle")),
        AsyncUnsupported::Snapshot,
    );
    refused(
        cuda::record_memory_history(true, 100),
        AsyncUnsupported::RecordHistory,
    );
    refused(
        cuda::record_memory_history(false, 100),
        AsyncUnsupported::RecordHistory,
    );
    refused(
        cuda::record_memory_history_with_context(true, 100, cuda::RecordContext::All),
        AsyncUnsupported::RecordHistory,
    );
    // Pinned host memory alone (`record_cuda=False`) is the host allocator's: not refused.
    let host_only = cuda::HistoryScope {
        cuda: false,
        pinned_host_memory: true,
    };
    let result = cuda::record_memory_history_in(true, 100, cuda::RecordContext::Never, host_only);
    assert!(
        !matches!(result, Err(Error::AsyncUnsupported(_))),
        "{result:?}"
    );
    refused(
        cuda::attach_out_of_memory_observer(|_| {}),
        AsyncUnsupported::AttachOutOfMemoryObserver,
    );
    refused(MemPool::new(None), AsyncUnsupported::CreateOrIncrefPool);
    refused(
        MemPool::with_options(
            PoolOptions {
                use_on_oom: true,
                ..PoolOptions::default()
            },
            Some(0),
        ),
        AsyncUnsupported::CreateOrIncrefPool,
    );
    refused(
        cuda::caching_allocator(None),
        AsyncUnsupported::CachingAllocator,
    );
    let pool = MempoolId(0, 1);
    refused(
        cuda::sleep_pool(pool, true, None),
        AsyncUnsupported::CachingAllocator,
    );
    refused(
        cuda::wake_pool(pool, None),
        AsyncUnsupported::CachingAllocator,
    );
    refused(
        cuda::is_pool_asleep(pool, None),
        AsyncUnsupported::CachingAllocator,
    );
    refused(
        cuda::asleep_bytes(None, None),
        AsyncUnsupported::CachingAllocator,
    );
    // The message is PyTorch's, then what to do.
    let message = MemPool::new(None).unwrap_err().to_string();
    assert!(
        message.starts_with(
            "cudaMallocAsync does not yet support createOrIncrefPool. If you need it, please file \
             an issue describing your use case."
        ),
        "{message}"
    );
    assert!(message.contains("TENSORMEM_ALLOC_CONF"), "{message}");
    // The backend cannot change at run time.
    match cuda::set_allocator_settings("backend:native") {
        Err(Error::BackendChanged { asked, running }) => {
            assert_eq!(
                (asked, running),
                (Backend::Native, Backend::CudaMallocAsync)
            );
        }
        other => panic!("switching to backend:native at run time gave {other:?}"),
    }
    // Read once: the environment changing afterwards changes nothing.
    std::env::set_var("TENSORMEM_ALLOC_CONF", "backend:native");
    assert_eq!(cuda::configured_backend().unwrap(), Backend::Native);
    assert_eq!(
        cuda::get_allocator_backend().unwrap(),
        Backend::CudaMallocAsync
    );
    refused(cuda::memory_snapshot(), AsyncUnsupported::Snapshot);
}
