//! The `PYTORCH_CUDA_ALLOC_CONF` grammar.

use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::AllocatorSettings;

/// Parses `data` (as UTF-8) as a configuration string. A configuration that parses must print as a
/// string that parses back to it, and survive the snapshot's `allocator_settings`; a string that does
/// not parse must leave the settings it was applied to unchanged.
///
/// # Panics
/// When the parser panics or one of those properties fails.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match AllocatorConfig::parse(text) {
        Ok(config) => {
            let shown = config.to_string();
            let back = AllocatorConfig::parse(&shown).unwrap_or_else(|e| {
                panic!("{text:?} parsed, but its display {shown:?} does not: {e}")
            });
            assert_eq!(back, config, "{text:?} does not survive display {shown:?}");
            let settings = AllocatorSettings::from_config(&config);
            let restored = settings
                .to_config()
                .unwrap_or_else(|e| panic!("settings of {text:?} do not convert back: {e}"));
            assert_eq!(
                AllocatorSettings::from_config(&restored),
                settings,
                "allocator_settings of {text:?} do not survive a round trip"
            );
        }
        Err(error) => {
            assert!(!error.to_string().is_empty(), "an empty error message");
            // Applied at run time, a bad string changes nothing.
            let mut applied =
                AllocatorConfig::parse("expandable_segments:True,max_split_size_mb:40")
                    .expect("a valid configuration");
            let before = applied.clone();
            assert!(
                applied.apply(text).is_err(),
                "apply accepts what parse refuses"
            );
            assert_eq!(applied, before, "a refused string changed the settings");
        }
    }
}
