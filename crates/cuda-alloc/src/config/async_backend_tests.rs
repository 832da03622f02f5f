//! `backend:cudaMallocAsync`: accepted by the grammar and by `read_env`, refused by the caching
//! allocator's ways in, and the caching allocator's keys it ignores.

use super::*;

fn env(pairs: &[(&'static str, &str)]) -> impl FnMut(&'static str) -> Option<std::ffi::OsString> {
    let pairs: Vec<(&'static str, String)> =
        pairs.iter().map(|&(k, v)| (k, v.to_owned())).collect();
    move |var| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| v.into())
}

#[test]
fn both_backends_parse_and_print_back() {
    let asked = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap();
    assert_eq!(asked.backend, Backend::CudaMallocAsync);
    assert_eq!(asked.to_string(), "backend:cudaMallocAsync");
    let native = AllocatorConfig::parse("backend:native").unwrap();
    assert_eq!(native, AllocatorConfig::default());
    assert!(matches!(
        AllocatorConfig::parse("backend:cudaMalloc"),
        Err(ConfigError::UnknownBackend { .. })
    ));
}

#[test]
fn read_env_accepts_it_and_from_env_refuses_it_for_the_caching_allocator() {
    let vars = [(
        "PYTORCH_CUDA_ALLOC_CONF",
        "backend:cudaMallocAsync,pinned_use_cuda_host_register:True",
    )];
    let read = AllocatorConfig::read_env_from(env(&vars)).unwrap();
    assert_eq!(read.backend, Backend::CudaMallocAsync);
    assert!(
        read.pinned_use_cuda_host_register,
        "pinned keys still apply"
    );
    let refused = AllocatorConfig::from_env_with(env(&vars)).unwrap_err();
    let ConfigError::Env { var, source } = &refused else {
        panic!("expected an Env error, got {refused:?}");
    };
    assert_eq!(*var, "PYTORCH_CUDA_ALLOC_CONF");
    assert!(matches!(
        **source,
        ConfigError::UnsupportedBackend {
            backend: Backend::CudaMallocAsync
        }
    ));
    let message = refused.to_string();
    assert!(message.contains("AsyncAllocator"), "{message}");
    assert!(message.contains("TENSORMEM_ALLOC_CONF"), "{message}");
    // A malformed string is refused by both.
    let bad = [("TENSORMEM_ALLOC_CONF", "backend:cudaMallocAsync,nonsense:1")];
    assert!(matches!(
        AllocatorConfig::read_env_from(env(&bad)),
        Err(ConfigError::Env { .. })
    ));
    assert_eq!(
        AllocatorConfig::read_env_from(env(&[])).unwrap(),
        AllocatorConfig::default()
    );
}

#[test]
fn the_caching_allocators_keys_are_parsed_and_reported_as_ignored() {
    let config = AllocatorConfig::parse(
        "backend:cudaMallocAsync,max_split_size_mb:64,expandable_segments:True,\
         roundup_power2_divisions:4,pinned_num_register_threads:8,per_process_memory_fraction:0.5",
    )
    .unwrap();
    assert_eq!(
        config.max_split_size,
        64 * MB,
        "parsed and checked as PyTorch does"
    );
    assert_eq!(
        config.ignored_by_backend(),
        [
            "max_split_size_mb",
            "roundup_power2_divisions",
            "expandable_segments",
            "per_process_memory_fraction"
        ]
    );
    let native = AllocatorConfig {
        backend: Backend::Native,
        ..config.clone()
    };
    assert!(native.ignored_by_backend().is_empty());
    let plain = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap();
    assert!(plain.ignored_by_backend().is_empty());
    // Every listed key is a key of the grammar.
    for key in ASYNC_IGNORED_KEYS {
        assert!(KNOWN_KEYS.contains(&key), "{key}");
        assert!(!key.starts_with("pinned_"), "{key}");
    }
    // Every key of the grammar but `backend` and the pinned ones is ignored.
    for key in KNOWN_KEYS {
        let host_or_backend = key == "backend" || key.starts_with("pinned_");
        assert_eq!(ASYNC_IGNORED_KEYS.contains(&key), !host_or_backend, "{key}");
    }
}

#[test]
fn check_supported_names_the_caching_allocator() {
    let asked = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap();
    let message = asked.check_supported().unwrap_err().to_string();
    assert!(message.contains("caching allocator"), "{message}");
    assert!(message.contains("backend:cudaMallocAsync"), "{message}");
    assert!(AllocatorConfig::default().check_supported().is_ok());
}
