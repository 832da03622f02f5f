//! Every key of the grammar, valid and invalid values, the environment's order, and keys reaching a
//! running allocator on the simulated device.

use super::*;
use crate::backend::sim::SimDevice;
use crate::CachingAllocator;

fn parse(text: &str) -> AllocatorConfig {
    AllocatorConfig::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn error(text: &str) -> ConfigError {
    AllocatorConfig::parse(text).expect_err(text)
}

fn env(pairs: &[(&'static str, &str)]) -> impl FnMut(&'static str) -> Option<std::ffi::OsString> {
    let pairs: Vec<(&'static str, String)> =
        pairs.iter().map(|&(k, v)| (k, v.to_owned())).collect();
    move |var| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| v.into())
}

/// One valid value for each key, and what it sets.
fn valid_value(key: &str) -> &'static str {
    match key {
        "backend" => "cudaMallocAsync",
        "max_split_size_mb" | "max_non_split_rounding_mb" | "large_segment_size_mb" => "64",
        "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" => "0",
        "garbage_collection_threshold" | "per_process_memory_fraction" => "0.5",
        "expandable_segments_reserve" => "40G",
        "roundup_power2_divisions" => "[256:1,>:4]",
        "pinned_num_register_threads" | "pinned_reserve_segment_size_mb" => "8",
        "expandable_segments_reserve_by_class" => "[kv:40G,act:0.25]",
        _ => "True",
    }
}

#[test]
fn every_key_parses_with_a_valid_value_and_round_trips() {
    let mut all = Vec::new();
    for key in KNOWN_KEYS {
        let pair = format!("{key}:{}", valid_value(key));
        let one = parse(&pair);
        assert_ne!(one, AllocatorConfig::default(), "{pair} changes nothing");
        assert_eq!(parse(&one.to_string()), one, "{pair} -> {one}");
        all.push(pair);
    }
    let joined = all.join(",");
    let config = parse(&joined);
    assert_eq!(parse(&config.to_string()), config, "{joined}");
}

#[test]
fn every_key_refuses_a_missing_value() {
    for key in KNOWN_KEYS {
        let error = error(&format!("{key}:"));
        assert_eq!(
            error,
            ConfigError::MissingValue { key: key.into() },
            "{key}: {error}"
        );
    }
}

#[test]
fn every_numeric_key_refuses_text() {
    for key in KNOWN_KEYS.iter().filter(|k| {
        k.ends_with("_mb")
            || matches!(
                **k,
                "garbage_collection_threshold"
                    | "per_process_memory_fraction"
                    | "pinned_num_register_threads"
                    | "roundup_power2_divisions"
            )
    }) {
        assert!(
            matches!(
                error(&format!("{key}:lots")),
                ConfigError::InvalidNumber { .. }
            ),
            "{key}"
        );
        assert!(
            matches!(
                error(&format!("{key}:x64")),
                ConfigError::InvalidNumber { .. }
            ),
            "{key}"
        );
    }
}

/// What PyTorch 2.11's parser makes of such values (`std::stoull` and `std::stod` read the number
/// a value starts with; a negative whole number wraps around).
#[test]
fn numbers_are_read_as_pytorch_reads_them() {
    assert_eq!(
        parse("max_split_size_mb:-1").max_split_size,
        usize::MAX / MB * MB
    );
    assert_eq!(parse("max_split_size_mb:64abc").max_split_size, 64 * MB);
    assert_eq!(parse("max_split_size_mb:64.9").max_split_size, 64 * MB);
    assert_eq!(parse("max_split_size_mb:+00064").max_split_size, 64 * MB);
    assert_eq!(parse("max_split_size_mb:6\t4").max_split_size, 64 * MB);
    for too_small in ["1e3", "-0", "-18446744073709551615"] {
        assert!(
            matches!(
                error(&format!("max_split_size_mb:{too_small}")),
                ConfigError::MaxSplitSizeTooSmall { .. }
            ),
            "{too_small}"
        );
    }
    assert!(matches!(
        error("max_split_size_mb:18446744073709551616"),
        ConfigError::InvalidNumber { .. }
    ));
    // Only ASCII whitespace is dropped.
    assert!(matches!(
        error("max_split_size_mb:\u{a0}64"),
        ConfigError::InvalidNumber { .. }
    ));
    assert_eq!(
        parse("roundup_power2_divisions:-18446744073709551615").roundup_power2_divisions,
        [1; ROUNDUP_POWER2_INTERVALS]
    );
    assert_eq!(
        parse("roundup_power2_divisions:[256:2x,>:1e3]").roundup_divisions_for(1 << 30),
        1
    );
    assert_eq!(
        parse("pinned_num_register_threads:1e3").pinned_num_register_threads,
        1
    );
    assert_eq!(
        parse("garbage_collection_threshold:0.5x").garbage_collection_threshold,
        0.5
    );
    assert_eq!(
        parse("garbage_collection_threshold:0x1p-1").garbage_collection_threshold,
        0.5
    );
    assert_eq!(
        parse("per_process_memory_fraction:-0").per_process_memory_fraction,
        0.0
    );
    for refused in ["nan", "inf", "1e-310", "x"] {
        assert!(
            AllocatorConfig::parse(&format!("garbage_collection_threshold:{refused}")).is_err(),
            "{refused}"
        );
    }
}

#[test]
fn every_boolean_key_takes_only_true_and_false() {
    for key in KNOWN_KEYS.iter().filter(|k| valid_value(k) == "True") {
        assert_ne!(
            parse(&format!("{key}:False")),
            parse(&format!("{key}:True"))
        );
        for wrong in ["true", "1", "yes", "TRUE"] {
            assert_eq!(
                error(&format!("{key}:{wrong}")),
                ConfigError::ExpectedBool {
                    index: 2,
                    found: wrong.into()
                },
                "{key}:{wrong}"
            );
        }
    }
}

#[test]
fn large_segment_size_mb() {
    let c = parse("large_segment_size_mb:11");
    assert_eq!(c.large_segment_size, 11 * MB);
    // It resets the rounding limit to itself, and lowers the smallest split limit PyTorch accepts,
    // wherever it stands in the string.
    assert_eq!(c.max_non_split_rounding_size, 11 * MB);
    let c = parse("max_split_size_mb:12, large_segment_size_mb:12, max_non_split_rounding_mb:15");
    assert_eq!(
        (c.max_split_size, c.max_non_split_rounding_size),
        (12 * MB, 15 * MB)
    );
    assert_eq!(
        error("large_segment_size_mb:40,max_split_size_mb:30"),
        ConfigError::MaxSplitSizeTooSmall { mb: 30, min_mb: 40 }
    );
    assert_eq!(
        error("large_segment_size_mb:40,max_non_split_rounding_mb:39").to_string(),
        "CachingAllocator option max_non_split_rounding_mb too small, must be >= 40"
    );
    assert_eq!(
        error("large_segment_size_mb:10"),
        ConfigError::LargeSegmentSizeTooSmall { mb: 10 }
    );
    assert_eq!(
        error("large_segment_size_mb:0").to_string(),
        "CachingAllocator option large_segment_size_mb must be > 10 MB, got 0"
    );
    // The segment size persists across `apply`, and so does the lower bound it sets.
    let mut c = parse("large_segment_size_mb:12");
    c.apply("max_split_size_mb:13").unwrap();
    assert_eq!((c.large_segment_size, c.max_split_size), (12 * MB, 13 * MB));
}

#[test]
fn pinned_thresholds() {
    let c = parse("pinned_max_round_threshold_mb:64, pinned_max_cached_size_mb:128");
    assert_eq!(c.pinned_max_round_threshold, 64 * MB);
    assert_eq!(c.pinned_max_cached_size, 128 * MB);
    // Zero is accepted: nothing is rounded, nothing is cached.
    let zero = parse("pinned_max_round_threshold_mb:0,pinned_max_cached_size_mb:0");
    assert_eq!(
        (zero.pinned_max_round_threshold, zero.pinned_max_cached_size),
        (0, 0)
    );
    // Values past what fits in bytes are capped.
    assert_eq!(
        parse(&format!("pinned_max_cached_size_mb:{}", u64::MAX)).pinned_max_cached_size,
        (usize::MAX / MB) * MB
    );
    assert_eq!(
        parse("pinned_max_round_threshold_mb:1.5").pinned_max_round_threshold,
        MB
    );
    assert!(matches!(
        error("pinned_max_round_threshold_mb:.5"),
        ConfigError::InvalidNumber { .. }
    ));
    // They persist across `apply` (PyTorch resets only the split, rounding and GC settings).
    let mut c = c;
    c.apply("expandable_segments:True").unwrap();
    assert_eq!(c.pinned_max_round_threshold, 64 * MB);
}

#[test]
fn pinned_block_size_and_caching_follow_pytorch() {
    const PAGE: usize = 4096;
    let defaults = AllocatorConfig::default();
    assert_eq!(defaults.pinned_block_size(3000, PAGE), Some(PAGE));
    assert_eq!(defaults.pinned_block_size(80 * MB, PAGE), Some(128 * MB));
    assert_eq!(defaults.pinned_block_size(usize::MAX, PAGE), None);
    assert!(defaults.pinned_caches(usize::MAX));

    let c = parse("pinned_max_round_threshold_mb:64");
    assert_eq!(c.pinned_block_size(80 * MB + 1, PAGE), Some(80 * MB + PAGE));
    assert_eq!(c.pinned_block_size(10 * MB, PAGE), Some(16 * MB));
    assert_eq!(c.pinned_block_size(64 * MB, PAGE), Some(64 * MB));
    assert!(c.pinned_caches(80 * MB));

    // A request above the cache limit is neither rounded nor cached, whatever the round threshold.
    let c = parse("pinned_max_round_threshold_mb:256,pinned_max_cached_size_mb:128");
    assert_eq!(c.pinned_block_size(130 * MB, PAGE), Some(130 * MB));
    assert!(!c.pinned_caches(130 * MB));
    assert!(c.pinned_caches(128 * MB));
    assert_eq!(c.pinned_block_size(100 * MB, PAGE), Some(128 * MB));
}

#[test]
fn expandable_segment_reserves() {
    let c = parse("expandable_segments_reserve:0.5");
    assert_eq!(
        c.other
            .get("expandable_segments_reserve")
            .map(String::as_str),
        Some("0.5")
    );
    // PyTorch ignores a malformed reserve (warning) and keeps the default: so does tensormem.
    for bad in ["0", "-1", "inf", "nan", "G", "lots", "1.5GG"] {
        let c = parse(&format!("expandable_segments_reserve:{bad}"));
        assert!(c.other.is_empty(), "{bad}");
    }
    // In the per-class list, malformed entries are left out and the others kept.
    let c = parse("expandable_segments_reserve_by_class:[kv:40g, bad:0, act:0.25]");
    assert_eq!(
        c.other
            .get("expandable_segments_reserve_by_class")
            .map(String::as_str),
        Some("[kv:40g,act:0.25]")
    );
    assert_eq!(parse(&c.to_string()), c);
    assert!(matches!(
        error("expandable_segments_reserve_by_class:kv"),
        ConfigError::ExpectedToken { expected: '[', .. }
    ));
    assert!(matches!(
        error("expandable_segments_reserve_by_class:[kv 40G]"),
        ConfigError::ExpectedToken { expected: ':', .. }
    ));
    assert_eq!(
        error("expandable_segments_reserve_by_class:[kv:40G,"),
        ConfigError::UnclosedList
    );
}

#[test]
fn ranges_of_the_older_keys() {
    assert_eq!(
        error("max_split_size_mb:19"),
        ConfigError::MaxSplitSizeTooSmall { mb: 19, min_mb: 20 }
    );
    assert_eq!(
        error("max_non_split_rounding_mb:19"),
        ConfigError::MaxNonSplitRoundingTooSmall { mb: 19, min_mb: 20 }
    );
    for bad in ["0", "1", "1.5", "-0.1"] {
        assert!(matches!(
            error(&format!("garbage_collection_threshold:{bad}")),
            ConfigError::GarbageCollectionThreshold { .. }
        ));
    }
    for bad in ["1.01", "-0.1"] {
        assert!(matches!(
            error(&format!("per_process_memory_fraction:{bad}")),
            ConfigError::MemoryFraction { .. }
        ));
    }
    assert_eq!(
        parse("per_process_memory_fraction:0").per_process_memory_fraction,
        0.0
    );
    assert!(matches!(
        error("roundup_power2_divisions:3"),
        ConfigError::DivisionsNotPowerOf2 { in_list: false, .. }
    ));
    assert!(matches!(
        error("roundup_power2_divisions:[256:3]"),
        ConfigError::DivisionsNotPowerOf2 { in_list: true, .. }
    ));
    assert!(matches!(
        error("roundup_power2_divisions:[100:4]"),
        ConfigError::IntervalNotPowerOf2 { boundary: 100 }
    ));
    assert!(matches!(
        error("pinned_num_register_threads:3"),
        ConfigError::RegisterThreadsNotPowerOf2 { value: 3 }
    ));
    assert!(matches!(
        error("pinned_num_register_threads:256"),
        ConfigError::TooManyRegisterThreads { value: 256 }
    ));
    assert_eq!(
        error("pinned_reserve_segment_size_mb:0"),
        ConfigError::PinnedReserveSegmentSizeZero
    );
    assert!(matches!(
        error("backend:cudaMalloc"),
        ConfigError::UnknownBackend { .. }
    ));
    // The ROCm spellings set the same settings.
    assert_eq!(
        parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:True"),
        parse("release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True")
    );
}

#[test]
fn unknown_keys_are_refused_with_a_hint() {
    let e = error("pinned_max_cache_size_mb:64");
    assert_eq!(
        e,
        ConfigError::UnknownKey {
            key: "pinned_max_cache_size_mb".into()
        }
    );
    let text = e.to_string();
    assert!(
        text.starts_with("Unrecognized key 'pinned_max_cache_size_mb' in CUDA allocator config."),
        "{text}"
    );
    assert!(
        text.contains("Did you mean 'pinned_max_cached_size_mb'?"),
        "{text}"
    );
    let text = error("large_segment_size_mb=40").to_string();
    assert!(
        text.contains("Did you mean 'large_segment_size_mb:40'?"),
        "{text}"
    );
    assert!(text.contains("key:value"), "{text}");
    // A key of another accelerator's build (torch_npu's) is refused like any other unknown key.
    let text = error("pin_memory_expandable_segments:True").to_string();
    assert!(text.contains("key:value"), "{text}");
}

#[test]
fn environment_follows_pytorchs_order() {
    // Observed with PyTorch 2.11 (a CUDA build): which variable's value its parsers report errors
    // for and pick the backend from.
    let generic = ("PYTORCH_ALLOC_CONF", "max_split_size_mb:40");
    let cuda = ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:30");
    let hip = ("PYTORCH_HIP_ALLOC_CONF", "max_split_size_mb:25");
    let ours = ("TENSORMEM_ALLOC_CONF", "max_split_size_mb:50");
    let read = |pairs: &[(&'static str, &str)]| {
        AllocatorConfig::from_env_with(env(pairs))
            .unwrap()
            .max_split_size
            / MB
    };
    assert_eq!(read(&[generic]), 40);
    assert_eq!(read(&[hip]), 25);
    assert_eq!(read(&[hip, generic]), 25);
    assert_eq!(read(&[hip, cuda, generic]), 30);
    assert_eq!(read(&[hip, cuda, generic, ours]), 50);
    // Set but empty counts as set.
    assert_eq!(
        read(&[("PYTORCH_CUDA_ALLOC_CONF", ""), generic]),
        usize::MAX / MB
    );
    // The CUDA keys come from PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF, never the HIP name;
    // the other keys from the first of the three.
    let c = AllocatorConfig::from_env_with(env(&[
        (
            "PYTORCH_HIP_ALLOC_CONF",
            "expandable_segments:True,backend:cudaMallocAsync",
        ),
        (
            "PYTORCH_ALLOC_CONF",
            "pinned_max_cached_size_mb:64,pinned_num_register_threads:4",
        ),
    ]))
    .unwrap();
    assert!(c.expandable_segments);
    assert_eq!(c.backend, Backend::Native);
    assert_eq!(c.pinned_num_register_threads, 4);
    assert_eq!(c.pinned_max_cached_size, usize::MAX);
    // Each half is checked only for its own keys (known, well formed): PyTorch accepts a HIP
    // string with a bad backend when the backend comes from elsewhere.
    let c = AllocatorConfig::from_env_with(env(&[(
        "PYTORCH_HIP_ALLOC_CONF",
        "backend:bogus,max_split_size_mb:64",
    )]))
    .unwrap();
    assert_eq!(c.max_split_size, 64 * MB);
    let e =
        AllocatorConfig::from_env_with(env(&[("PYTORCH_HIP_ALLOC_CONF", "bogus:1")])).unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Env {
                var: "PYTORCH_HIP_ALLOC_CONF",
                ..
            }
        ),
        "{e}"
    );
    let e = AllocatorConfig::from_env_with(env(&[
        ("PYTORCH_HIP_ALLOC_CONF", "expandable_segments:True"),
        ("PYTORCH_ALLOC_CONF", "backend:bogus"),
    ]))
    .unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Env {
                var: "PYTORCH_ALLOC_CONF",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn every_key_reaches_a_running_allocator() {
    let allocator =
        CachingAllocator::with_config(SimDevice::new(1 << 30), AllocatorConfig::default());
    // Every key but `backend:cudaMallocAsync`, which a running allocator refuses.
    let all: Vec<String> = KNOWN_KEYS
        .iter()
        .filter(|key| **key != "backend")
        .map(|key| format!("{key}:{}", valid_value(key)))
        .collect();
    let joined = all.join(",");
    allocator.apply_settings(&joined).unwrap();
    assert_eq!(allocator.config(), parse(&joined));
    // A refused string changes nothing.
    let before = allocator.config();
    assert!(allocator
        .apply_settings("pinned_max_cached_size_mb:1,large_segment_size_mb:5")
        .is_err());
    assert_eq!(allocator.config(), before);
    // The device allocator acts on the keys it has: under a split limit set at run time, a cached
    // oversize block does not serve a small request (a new segment does); without it, it is split.
    for (settings, reserved_mb) in [("max_split_size_mb:20", 26 + 20), ("", 26)] {
        let allocator =
            CachingAllocator::with_config(SimDevice::new(1 << 30), AllocatorConfig::default());
        allocator.apply_settings(settings).unwrap();
        let big = allocator.allocate(25 * MB, crate::StreamId(0)).unwrap();
        allocator.free(big).unwrap();
        let small = allocator.allocate(2 * MB, crate::StreamId(0)).unwrap();
        assert_eq!(
            allocator.memory_stats().reserved_bytes.all.current,
            (reserved_mb * MB) as i64,
            "{settings:?}"
        );
        allocator.free(small).unwrap();
    }
}
