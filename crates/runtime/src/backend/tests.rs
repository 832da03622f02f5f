//! The backend decision from configuration strings, the check of run-time strings, and the refusals'
//! messages: all decidable without a GPU.

use super::*;

fn env(pairs: &[(&'static str, &str)]) -> impl FnMut(&'static str) -> Option<std::ffi::OsString> {
    let pairs: Vec<(&'static str, String)> =
        pairs.iter().map(|&(k, v)| (k, v.to_owned())).collect();
    move |var| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| v.into())
}

fn backend_of(pairs: &[(&'static str, &str)]) -> Backend {
    decide(env(pairs)).unwrap().backend()
}

#[test]
fn the_default_configuration_is_served_by_the_caching_allocator() {
    assert_eq!(backend_of(&[]), Backend::Native);
    assert_eq!(
        backend_of(&[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")]),
        Backend::Native
    );
    assert_eq!(
        backend_of(&[("PYTORCH_CUDA_ALLOC_CONF", "backend:native")]),
        Backend::Native
    );
}

#[test]
fn each_variable_can_ask_for_cuda_malloc_async() {
    for var in [
        "TENSORMEM_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
        "PYTORCH_CUDA_ALLOC_CONF",
    ] {
        let choice = decide(env(&[(
            var,
            "backend:cudaMallocAsync,pinned_use_cuda_host_register:True",
        )]))
        .unwrap();
        assert_eq!(choice.backend(), Backend::CudaMallocAsync, "{var}");
        assert!(
            choice.config.pinned_use_cuda_host_register,
            "{var}: the pinned keys are kept for the host allocators"
        );
    }
}

#[test]
fn the_backend_comes_from_the_variable_pytorch_reads_it_from() {
    // tensormem's own variable first: PyTorch may keep cudaMallocAsync for itself.
    assert_eq!(
        backend_of(&[
            ("TENSORMEM_ALLOC_CONF", "backend:native"),
            ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync"),
        ]),
        Backend::Native
    );
    // As PyTorch 2.11 picks its backend: PYTORCH_CUDA_ALLOC_CONF wins over the newer name, and the
    // HIP name is never read for it.
    assert_eq!(
        backend_of(&[
            ("PYTORCH_ALLOC_CONF", "expandable_segments:True"),
            ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync"),
        ]),
        Backend::CudaMallocAsync
    );
    assert_eq!(
        backend_of(&[
            ("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync"),
            ("PYTORCH_CUDA_ALLOC_CONF", "backend:native"),
        ]),
        Backend::Native
    );
    assert_eq!(
        backend_of(&[("PYTORCH_HIP_ALLOC_CONF", "backend:cudaMallocAsync")]),
        Backend::Native
    );
    assert_eq!(
        backend_of(&[
            ("PYTORCH_HIP_ALLOC_CONF", "expandable_segments:True"),
            ("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync"),
        ]),
        Backend::CudaMallocAsync
    );
}

#[test]
fn a_malformed_configuration_decides_nothing() {
    let err = decide(env(&[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMalloc")])).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("PYTORCH_CUDA_ALLOC_CONF"), "{message}");
    assert!(message.contains("Unknown allocator backend"), "{message}");
}

#[test]
fn a_run_time_string_keeps_the_backend_or_is_refused() {
    for running in [Backend::Native, Backend::CudaMallocAsync] {
        for same in [
            "",
            "pinned_use_cuda_host_register:True",
            &format!("backend:{running}"),
        ] {
            let kept = check_unchanged(running, same).unwrap();
            assert_eq!(kept.backend, running, "{same:?}");
        }
    }
    let err = check_unchanged(Backend::Native, "backend:cudaMallocAsync").unwrap_err();
    assert!(matches!(
        err,
        Error::BackendChanged {
            asked: Backend::CudaMallocAsync,
            running: Backend::Native
        }
    ));
    let message = err.to_string();
    assert!(
        message.starts_with(
            "Allocator async backend parsed at runtime != allocator async backend parsed at load \
             time, 1 != 0"
        ),
        "{message}"
    );
    assert!(message.contains("TENSORMEM_ALLOC_CONF"), "{message}");
    let err = check_unchanged(Backend::CudaMallocAsync, "backend:native").unwrap_err();
    assert!(err.to_string().contains("0 != 1"), "{err}");
    assert!(matches!(
        check_unchanged(Backend::CudaMallocAsync, "nonsense:1"),
        Err(Error::Alloc(_))
    ));
}

#[test]
fn refusals_carry_pytorchs_messages_and_what_to_do() {
    for what in AsyncUnsupported::ALL {
        let pytorch = what.pytorch_message();
        let error = Error::AsyncUnsupported(what).to_string();
        assert_eq!(
            error.lines().next(),
            Some(pytorch.as_str()),
            "PyTorch's line first"
        );
        assert!(error.contains("backend:cudaMallocAsync"), "{error}");
        assert!(error.contains("TENSORMEM_ALLOC_CONF"), "{error}");
        assert_eq!(AsyncUnsupported::from_method(what.method()), Some(what));
    }
    assert_eq!(
        AsyncUnsupported::CreateOrIncrefPool.pytorch_message(),
        "cudaMallocAsync does not yet support createOrIncrefPool. If you need it, please file an \
         issue describing your use case."
    );
    assert_eq!(
        AsyncUnsupported::ShareIpcHandle.pytorch_message(),
        "cudaMallocAsync does not yet support shareIpcHandle. If you need it, please file an issue \
         describing your use case."
    );
    assert!(AsyncUnsupported::Snapshot
        .pytorch_message()
        .starts_with("Calling snapshot with backend:cudaMallocAsync is not meaningful."));
    assert_eq!(
        AsyncUnsupported::GetExpandableSegmentSizes.pytorch_message(),
        "CUDAMallocAsyncAllocator does not yet support getExpandableSegmentSizes."
    );
    assert_eq!(
        AsyncUnsupported::from_method("isHistoryEnabled"),
        Some(AsyncUnsupported::RecordHistory)
    );
    assert_eq!(AsyncUnsupported::from_method("raw_alloc"), None);
}
