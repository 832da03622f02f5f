//! `AllocatorConfig::from_env` against the real process environment. One test in its own binary, so no
//! other test reads the environment while this one changes it.

use tensormem_cuda_alloc::config::{AllocatorConfig, ConfigError, ENV_VARS, MB};

#[test]
fn from_env_reads_the_process_environment() {
    for var in ENV_VARS {
        std::env::remove_var(var);
    }
    assert_eq!(
        AllocatorConfig::from_env().unwrap(),
        AllocatorConfig::default()
    );

    std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
    assert!(AllocatorConfig::from_env().unwrap().expandable_segments);

    std::env::set_var("TENSORMEM_ALLOC_CONF", "max_split_size_mb:64");
    let config = AllocatorConfig::from_env().unwrap();
    assert_eq!(config.max_split_size, 64 * MB);
    assert!(
        !config.expandable_segments,
        "TENSORMEM_ALLOC_CONF wins over PYTORCH_CUDA_ALLOC_CONF"
    );

    std::env::set_var("TENSORMEM_ALLOC_CONF", "max_split_size_mb:2");
    let error = AllocatorConfig::from_env().unwrap_err();
    assert!(
        matches!(
            error,
            ConfigError::Env {
                var: "TENSORMEM_ALLOC_CONF",
                ..
            }
        ),
        "{error}"
    );

    for var in ENV_VARS {
        std::env::remove_var(var);
    }
}
