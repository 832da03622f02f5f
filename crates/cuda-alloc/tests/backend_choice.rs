//! `backend:cudaMallocAsync`: the grammar accepts it (PyTorch's snapshots record it), every way of
//! configuring a running allocator refuses it with a typed error, and the allocator's settings say
//! `native`, which is what serves.

mod common;

use common::env;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::{AllocatorConfig, Backend, ConfigError, MB};
use tensormem_cuda_alloc::{CachingAllocator, Error};

#[test]
fn the_grammar_accepts_it_and_check_supported_refuses_it() {
    let parsed = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap();
    assert_eq!(parsed.backend, Backend::CudaMallocAsync);
    assert!(matches!(
        parsed.check_supported(),
        Err(ConfigError::UnsupportedBackend {
            backend: Backend::CudaMallocAsync
        })
    ));
    assert!(AllocatorConfig::parse("backend:native")
        .unwrap()
        .check_supported()
        .is_ok());
}

#[test]
fn the_environment_asking_for_it_is_refused_naming_the_variable_and_the_way_out() {
    for var in [
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
        "TENSORMEM_ALLOC_CONF",
    ] {
        let vars = [(var, "expandable_segments:True,backend:cudaMallocAsync")];
        let error = AllocatorConfig::from_env_with(env(&vars)).unwrap_err();
        match &error {
            ConfigError::Env { var: named, source } => {
                assert_eq!(*named, var);
                assert!(matches!(
                    **source,
                    ConfigError::UnsupportedBackend {
                        backend: Backend::CudaMallocAsync
                    }
                ));
            }
            other => panic!("{var}: expected an Env error, got {other:?}"),
        }
        let message = error.to_string();
        assert!(message.contains(var), "{message}");
        assert!(message.contains("backend:cudaMallocAsync"), "{message}");
        assert!(message.contains("TENSORMEM_ALLOC_CONF"), "{message}");
    }
    // PyTorch keeps its backend; tensormem gets its own configuration, read first.
    let both = AllocatorConfig::from_env_with(env(&[
        ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync"),
        ("TENSORMEM_ALLOC_CONF", "max_split_size_mb:40"),
    ]))
    .unwrap();
    assert_eq!(both.backend, Backend::Native);
    assert_eq!(both.max_split_size, 40 * MB);
}

#[test]
fn apply_settings_refuses_it_and_changes_nothing() {
    let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
    alloc.apply_settings("max_split_size_mb:60").unwrap();
    let before = alloc.config();
    for config in [
        "backend:cudaMallocAsync",
        "max_split_size_mb:40,backend:cudaMallocAsync",
    ] {
        let error = alloc.apply_settings(config).unwrap_err();
        assert!(
            matches!(
                error,
                Error::Config(ConfigError::UnsupportedBackend {
                    backend: Backend::CudaMallocAsync
                })
            ),
            "{config}: {error:?}"
        );
        assert_eq!(alloc.config(), before, "{config} changed the settings");
    }
    alloc.apply_settings("backend:native").unwrap();
    assert_eq!(alloc.config().backend, Backend::Native);
}

#[test]
fn a_hand_built_configuration_asking_for_it_is_served_natively_and_says_so() {
    let asked = AllocatorConfig {
        backend: Backend::CudaMallocAsync,
        expandable_segments: true,
        ..AllocatorConfig::default()
    };
    let alloc = CachingAllocator::with_config(SimDevice::new(1 << 30), asked.clone());
    let served = alloc.config();
    assert_eq!(served.backend, Backend::Native);
    assert!(served.expandable_segments, "the other settings are kept");
    alloc.set_config(&asked);
    assert_eq!(alloc.config().backend, Backend::Native);
    let block = alloc.allocate(4096, Default::default()).unwrap();
    alloc.free(block).unwrap();
}
