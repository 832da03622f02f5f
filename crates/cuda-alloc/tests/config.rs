//! `PYTORCH_CUDA_ALLOC_CONF` grammar: every key, valid and invalid values, boundaries, the list form,
//! whitespace, run-time application, environment lookup and the canonical string round trip.

mod common;

use std::ffi::OsString;

use common::env;
use proptest::prelude::*;
use tensormem_cuda_alloc::config::{
    roundup_interval, AllocatorConfig, Backend, ConfigError, KNOWN_KEYS, LARGE_BUFFER, MB,
    ROUNDUP_POWER2_INTERVALS,
};

fn parse(s: &str) -> AllocatorConfig {
    AllocatorConfig::parse(s).unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
}

fn error(s: &str) -> ConfigError {
    match AllocatorConfig::parse(s) {
        Ok(c) => panic!("{s:?} should be refused, parsed as {c:?}"),
        Err(e) => e,
    }
}

fn message(s: &str) -> String {
    error(s).to_string()
}

#[test]
fn defaults_are_pytorchs() {
    let c = AllocatorConfig::default();
    assert_eq!(c.backend, Backend::Native);
    assert_eq!(c.max_split_size, usize::MAX);
    assert!(!c.limits_split_size());
    assert_eq!(c.max_non_split_rounding_size, 20 * 1024 * 1024);
    assert_eq!(c.roundup_power2_divisions, [0; 16]);
    assert_eq!(c.garbage_collection_threshold, 0.0);
    assert!(!c.expandable_segments);
    assert!(!c.release_lock_on_cudamalloc);
    assert!(!c.pinned_use_cuda_host_register);
    assert_eq!(c.pinned_num_register_threads, 1);
    assert!(!c.pinned_use_background_threads);
    assert_eq!(c.pinned_reserve_segment_size_mb, 0);
    assert!(!c.graph_capture_record_stream_reuse);
    assert_eq!(c.per_process_memory_fraction, 1.0);
    assert!(!c.pinned_free_catch_all);
    assert!(!c.throw_on_cudamalloc_oom);
    assert!(c.other.is_empty());
    assert_eq!(parse(""), c);
    assert_eq!(parse("   "), c);
    assert_eq!(c.to_string(), "");
}

#[test]
fn backend() {
    assert_eq!(parse("backend:native").backend, Backend::Native);
    assert_eq!(
        parse("backend:cudaMallocAsync").backend,
        Backend::CudaMallocAsync
    );
    assert_eq!(
        message("backend:hipMallocAsync"),
        "Unknown allocator backend, options are native and cudaMallocAsync"
    );
    assert!(
        matches!(error("backend:Native"), ConfigError::UnknownBackend { value } if value == "Native")
    );
}

#[test]
fn max_split_size_mb() {
    assert_eq!(parse("max_split_size_mb:20").max_split_size, 20 * MB);
    assert_eq!(parse("max_split_size_mb:128").max_split_size, 128 * MB);
    assert!(parse("max_split_size_mb:128").limits_split_size());
    assert_eq!(
        message("max_split_size_mb:19"),
        "CachingAllocator option max_split_size_mb too small, must be >= 20"
    );
    assert_eq!(
        error("max_split_size_mb:0"),
        ConfigError::MaxSplitSizeTooSmall { mb: 0, min_mb: 20 }
    );
    // Values past what fits in bytes are capped, like PyTorch's.
    assert_eq!(
        parse(&format!("max_split_size_mb:{}", u64::MAX)).max_split_size,
        (usize::MAX / MB) * MB
    );
    assert!(matches!(
        error("max_split_size_mb:18446744073709551616"),
        ConfigError::InvalidNumber { .. }
    ));
    // Read as PyTorch reads them (`std::stoull`): -5 wraps around to a size past any device (so
    // no limit), 1.5 is 1 (too small).
    assert_eq!(
        parse("max_split_size_mb:-5").max_split_size,
        (usize::MAX / MB) * MB
    );
    assert_eq!(
        error("max_split_size_mb:1.5"),
        ConfigError::MaxSplitSizeTooSmall { mb: 1, min_mb: 20 }
    );
    assert!(
        matches!(error("max_split_size_mb:abc"), ConfigError::InvalidNumber { key, value, .. }
        if key == "max_split_size_mb" && value == "abc")
    );
    assert_eq!(
        message("max_split_size_mb:"),
        "Error, expecting max_split_size_mb value"
    );
}

#[test]
fn max_non_split_rounding_mb() {
    assert_eq!(
        parse("max_non_split_rounding_mb:20").max_non_split_rounding_size,
        LARGE_BUFFER
    );
    assert_eq!(
        parse("max_non_split_rounding_mb:512").max_non_split_rounding_size,
        512 * MB
    );
    assert_eq!(
        message("max_non_split_rounding_mb:19"),
        "CachingAllocator option max_non_split_rounding_mb too small, must be >= 20"
    );
    assert!(matches!(
        error("max_non_split_rounding_mb:x"),
        ConfigError::InvalidNumber { .. }
    ));
}

#[test]
fn garbage_collection_threshold() {
    assert_eq!(
        parse("garbage_collection_threshold:0.6").garbage_collection_threshold,
        0.6
    );
    assert_eq!(
        parse("garbage_collection_threshold:0.000001").garbage_collection_threshold,
        0.000001
    );
    assert_eq!(
        parse("garbage_collection_threshold:0.999999").garbage_collection_threshold,
        0.999999
    );
    for bad in ["0", "0.0", "1", "1.0", "-0.5", "1.5", "nan", "inf"] {
        assert_eq!(
            message(&format!("garbage_collection_threshold:{bad}")),
            "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
            "{bad}"
        );
    }
    assert!(matches!(
        error("garbage_collection_threshold:half"),
        ConfigError::InvalidNumber { .. }
    ));
}

#[test]
fn per_process_memory_fraction() {
    assert_eq!(
        parse("per_process_memory_fraction:0").per_process_memory_fraction,
        0.0
    );
    assert_eq!(
        parse("per_process_memory_fraction:1").per_process_memory_fraction,
        1.0
    );
    assert_eq!(
        parse("per_process_memory_fraction:0.25").per_process_memory_fraction,
        0.25
    );
    for bad in ["-0.01", "1.01", "nan"] {
        assert_eq!(
            message(&format!("per_process_memory_fraction:{bad}")),
            "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"
        );
    }
}

#[test]
fn boolean_keys() {
    type Get = fn(&AllocatorConfig) -> bool;
    let keys: [(&str, Get); 10] = [
        ("expandable_segments", |c| c.expandable_segments),
        ("release_lock_on_cudamalloc", |c| {
            c.release_lock_on_cudamalloc
        }),
        ("release_lock_on_hipmalloc", |c| {
            c.release_lock_on_cudamalloc
        }),
        ("pinned_use_cuda_host_register", |c| {
            c.pinned_use_cuda_host_register
        }),
        ("pinned_use_hip_host_register", |c| {
            c.pinned_use_cuda_host_register
        }),
        ("pinned_use_background_threads", |c| {
            c.pinned_use_background_threads
        }),
        ("graph_capture_record_stream_reuse", |c| {
            c.graph_capture_record_stream_reuse
        }),
        ("pinned_free_catch_all", |c| c.pinned_free_catch_all),
        ("throw_on_cudamalloc_oom", |c| c.throw_on_cudamalloc_oom),
        ("expandable_segments", |c| c.expandable_segments),
    ];
    for (key, get) in keys {
        assert!(get(&parse(&format!("{key}:True"))), "{key}");
        assert!(!get(&parse(&format!("{key}:False"))), "{key}");
        assert!(
            !get(&parse(&format!("{key}:True,{key}:False"))),
            "{key}: the last value wins"
        );
        for bad in ["true", "1", "yes", "TRUE"] {
            assert_eq!(
                message(&format!("{key}:{bad}")),
                format!("Expected 'True' or 'False' at index 2 in ConfigTokenizer but got '{bad}'")
            );
        }
    }
    // The index counts every token, as PyTorch's does.
    assert_eq!(
        message("max_split_size_mb:100,expandable_segments:on"),
        "Expected 'True' or 'False' at index 6 in ConfigTokenizer but got 'on'"
    );
}

#[test]
fn pinned_num_register_threads() {
    for ok in [1usize, 2, 8, 64, 128] {
        assert_eq!(
            parse(&format!("pinned_num_register_threads:{ok}")).pinned_num_register_threads,
            ok
        );
    }
    assert_eq!(
        message("pinned_num_register_threads:3"),
        "Number of register threads has to be power of 2, got 3"
    );
    assert_eq!(
        message("pinned_num_register_threads:0"),
        "Number of register threads has to be power of 2, got 0"
    );
    assert_eq!(
        message("pinned_num_register_threads:256"),
        "Number of register threads should be less than or equal to 128, got 256"
    );
}

#[test]
fn pinned_reserve_segment_size_mb() {
    assert_eq!(
        parse("pinned_reserve_segment_size_mb:1").pinned_reserve_segment_size_mb,
        1
    );
    assert_eq!(
        parse("pinned_reserve_segment_size_mb:4096").pinned_reserve_segment_size_mb,
        4096
    );
    assert_eq!(
        message("pinned_reserve_segment_size_mb:0"),
        "Pinned reserve segment size has to be greater than 0"
    );
}

#[test]
fn reserve_keys_are_kept_verbatim() {
    let c = parse("expandable_segments_reserve:0.5, expandable_segments_reserve_by_class:[ kv : 40G , act:0.25 ]");
    assert_eq!(
        c.other
            .get("expandable_segments_reserve")
            .map(String::as_str),
        Some("0.5")
    );
    assert_eq!(
        c.other
            .get("expandable_segments_reserve_by_class")
            .map(String::as_str),
        Some("[kv:40G,act:0.25]")
    );
    assert_eq!(parse(&c.to_string()), c);
    assert_eq!(
        error("expandable_segments_reserve_by_class:[kv:40G"),
        ConfigError::UnclosedList
    );
}

#[test]
fn unknown_keys() {
    // PyTorch's message, then the grammar (and the known keys when none is close).
    let foo = message("foo:1");
    assert!(
        foo.starts_with(
            "Unrecognized key 'foo' in CUDA allocator config. The options are written key:value"
        ),
        "{foo}"
    );
    assert!(foo.contains("expandable_segments"), "{foo}");
    assert!(message("foo").starts_with("Unrecognized key 'foo' in CUDA allocator config."));
    // A did-you-mean for a misspelt, truncated or miscased key, and for key=value.
    for (written, meant) in [
        ("expandable_segment:True", "'expandable_segments'"),
        ("max_split_size:128", "'max_split_size_mb'"),
        ("Expandable_Segments:True", "'expandable_segments'"),
        (
            "garbage_colection_threshold:0.5",
            "'garbage_collection_threshold'",
        ),
        ("expandable:True", "'expandable_segments'"),
        ("max_split_size_mb=128", "'max_split_size_mb:128'"),
        ("expandable_segment=True", "'expandable_segments:True'"),
    ] {
        let text = message(written);
        assert!(
            text.contains(&format!("Did you mean {meant}?")),
            "{written}: {text}"
        );
        assert!(text.contains("key:value"), "{written}: {text}");
    }
    assert!(!message("zzzzzz:1").contains("Did you mean"));
    // PyTorch's keys are case-sensitive.
    assert!(matches!(
        error("Expandable_Segments:True"),
        ConfigError::UnknownKey { .. }
    ));
    // `=` is not a separator: the whole pair is one (unknown) key.
    assert_eq!(
        error("max_split_size_mb=128"),
        ConfigError::UnknownKey {
            key: "max_split_size_mb=128".into()
        }
    );
    // Every known key is accepted with a suitable value.
    for key in KNOWN_KEYS {
        let value = match key {
            "backend" => "native",
            "max_split_size_mb"
            | "max_non_split_rounding_mb"
            | "large_segment_size_mb"
            | "pinned_max_round_threshold_mb"
            | "pinned_max_cached_size_mb" => "64",
            "garbage_collection_threshold"
            | "per_process_memory_fraction"
            | "expandable_segments_reserve" => "0.5",
            "roundup_power2_divisions"
            | "pinned_num_register_threads"
            | "pinned_reserve_segment_size_mb" => "4",
            "expandable_segments_reserve_by_class" => "[a:1G]",
            _ => "True",
        };
        AllocatorConfig::parse(&format!("{key}:{value}")).unwrap_or_else(|e| panic!("{key}: {e}"));
    }
}

#[test]
fn separators() {
    assert_eq!(
        error("expandable_segments True"),
        ConfigError::UnknownKey {
            key: "expandable_segmentsTrue".into()
        },
        "whitespace is dropped everywhere, as in PyTorch"
    );
    assert!(matches!(
        error("expandable_segments,True"),
        ConfigError::ExpectedToken { expected: ':', .. }
    ));
    assert!(matches!(
        error("expandable_segments:True:False"),
        ConfigError::ExpectedToken { expected: ',', found: Some(f), .. } if f == ":"
    ));
    assert!(matches!(
        error("expandable_segments"),
        ConfigError::ExpectedToken {
            expected: ':',
            found: None,
            ..
        }
    ));
    assert_eq!(
        message("expandable_segments:"),
        "Error, expecting expandable_segments value"
    );
    // A trailing comma is accepted (PyTorch accepts it); a doubled one is not.
    assert!(parse("expandable_segments:True,").expandable_segments);
    assert!(
        matches!(error("expandable_segments:True,,max_split_size_mb:20"), ConfigError::UnknownKey { key } if key == ",")
    );
    assert!(
        matches!(error(",expandable_segments:True"), ConfigError::UnknownKey { key } if key == ",")
    );
}

#[test]
fn whitespace_is_ignored() {
    let spaced = parse(" max_split_size_mb : 128 ,\texpandable_segments:\nTrue , roundup_power2_divisions : [ 256 : 1 , > : 8 ] ");
    let tight = parse(
        "max_split_size_mb:128,expandable_segments:True,roundup_power2_divisions:[256:1,>:8]",
    );
    assert_eq!(spaced, tight);
    assert_eq!(parse("max_split _size_mb:1 28").max_split_size, 128 * MB);
}

#[test]
fn several_keys() {
    let c = parse(
        "backend:native,max_split_size_mb:100,max_non_split_rounding_mb:40,garbage_collection_threshold:0.5,\
         roundup_power2_divisions:4,expandable_segments:True,release_lock_on_cudamalloc:True,\
         pinned_use_cuda_host_register:True,pinned_num_register_threads:8,per_process_memory_fraction:0.75",
    );
    assert_eq!(c.max_split_size, 100 * MB);
    assert_eq!(c.max_non_split_rounding_size, 40 * MB);
    assert_eq!(c.garbage_collection_threshold, 0.5);
    assert_eq!(c.roundup_power2_divisions, [4; 16]);
    assert!(
        c.expandable_segments && c.release_lock_on_cudamalloc && c.pinned_use_cuda_host_register
    );
    assert_eq!(c.pinned_num_register_threads, 8);
    assert_eq!(c.per_process_memory_fraction, 0.75);
}

#[test]
fn roundup_single_value() {
    assert_eq!(
        parse("roundup_power2_divisions:1").roundup_power2_divisions,
        [1; 16]
    );
    assert_eq!(
        parse("roundup_power2_divisions:8").roundup_power2_divisions,
        [8; 16]
    );
    assert_eq!(
        message("roundup_power2_divisions:3"),
        "For roundups, the divisions has to be power of 2"
    );
    // 0 is refused in the single-value form (PyTorch's check), allowed in the list form.
    assert_eq!(
        error("roundup_power2_divisions:0"),
        ConfigError::DivisionsNotPowerOf2 {
            value: 0,
            in_list: false
        }
    );
    assert_eq!(
        parse("roundup_power2_divisions:[1:0]").roundup_power2_divisions,
        [0; 16]
    );
}

#[test]
fn roundup_list_form() {
    // PyTorch's documented example: 256 MiB is interval 8, 512 MiB interval 9.
    let t = parse("roundup_power2_divisions:[256:1,512:2,>:8]").roundup_power2_divisions;
    assert_eq!(t, [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 8, 8, 8, 8, 8, 8]);
    // PyTorch's documented example: gaps between listed boundaries stay 0.
    let t = parse("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]").roundup_power2_divisions;
    assert_eq!(t, [8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 4, 1, 1, 1, 1, 1]);
    // Without `>`, intervals after the last boundary stay 0.
    let t = parse("roundup_power2_divisions:[1:4,2:2]").roundup_power2_divisions;
    assert_eq!(t, [4, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    // `>` alone starts after interval 0.
    let t = parse("roundup_power2_divisions:[>:2]").roundup_power2_divisions;
    assert_eq!(t, [0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]);
    // Boundaries past 32 GiB land in the last interval.
    let t = parse("roundup_power2_divisions:[1048576:16]").roundup_power2_divisions;
    assert_eq!(t, [16; 16]);
    assert_eq!(
        parse("roundup_power2_divisions:[]").roundup_power2_divisions,
        [0; 16]
    );

    assert_eq!(
        message("roundup_power2_divisions:[256:3]"),
        "For roundups, the divisions has to be power of 2 or 0 to disable roundup"
    );
    assert_eq!(
        message("roundup_power2_divisions:[300:2]"),
        "For roundups, the intervals have to be power of 2"
    );
    assert_eq!(
        error("roundup_power2_divisions:[0:2]"),
        ConfigError::IntervalNotPowerOf2 { boundary: 0 }
    );
    assert_eq!(
        message("roundup_power2_divisions:[256:1,512:2"),
        "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
    );
    assert_eq!(
        error("roundup_power2_divisions:[256:1,"),
        ConfigError::UnclosedList
    );
    assert_eq!(
        error("roundup_power2_divisions:[256:"),
        ConfigError::UnclosedList
    );
    assert!(matches!(
        error("roundup_power2_divisions:[256,1]"),
        ConfigError::ExpectedToken { expected: ':', .. }
    ));
    assert!(matches!(
        error("roundup_power2_divisions:[256:1:2]"),
        ConfigError::ExpectedToken { expected: ',', .. }
    ));
    assert!(matches!(
        error("roundup_power2_divisions:[abc:2]"),
        ConfigError::InvalidNumber { .. }
    ));
    // Keys after a list are still read.
    assert!(parse("roundup_power2_divisions:[256:1],expandable_segments:True").expandable_segments);
}

#[test]
fn roundup_divisions_for_sizes() {
    let c = parse("roundup_power2_divisions:[1:1,2:2,4:4,8:8,>:16]");
    assert_eq!(c.roundup_divisions_for(0), 1);
    assert_eq!(c.roundup_divisions_for(512), 1);
    assert_eq!(c.roundup_divisions_for(2 * MB - 1), 1);
    assert_eq!(c.roundup_divisions_for(2 * MB), 2);
    assert_eq!(c.roundup_divisions_for(4 * MB - 1), 2);
    assert_eq!(c.roundup_divisions_for(4 * MB), 4);
    assert_eq!(c.roundup_divisions_for(8 * MB), 8);
    assert_eq!(c.roundup_divisions_for(16 * MB), 16);
    assert_eq!(c.roundup_divisions_for(usize::MAX), 16);
    assert_eq!(roundup_interval(1), 0);
    assert_eq!(roundup_interval(32 << 30), 15);
    assert_eq!(roundup_interval((32 << 30) - 1), 14);
    assert_eq!(roundup_interval(1 << 62), ROUNDUP_POWER2_INTERVALS - 1);
}

#[test]
fn apply_resets_like_set_allocator_settings() {
    let mut c = parse(
        "max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.5,\
         expandable_segments:True,max_non_split_rounding_mb:30,per_process_memory_fraction:0.5",
    );
    c.apply("release_lock_on_cudamalloc:True").unwrap();
    // The three settings PyTorch resets on every parse go back to their defaults ...
    assert_eq!(c.max_split_size, usize::MAX);
    assert_eq!(c.roundup_power2_divisions, [0; 16]);
    assert_eq!(c.garbage_collection_threshold, 0.0);
    // ... the others keep their values.
    assert!(c.expandable_segments);
    assert_eq!(c.max_non_split_rounding_size, 30 * MB);
    assert_eq!(c.per_process_memory_fraction, 0.5);
    assert!(c.release_lock_on_cudamalloc);
    c.apply("expandable_segments:False").unwrap();
    assert!(!c.expandable_segments);
}

#[test]
fn apply_with_an_error_changes_nothing() {
    let mut c = parse("max_split_size_mb:64,expandable_segments:True");
    let before = c.clone();
    let e = c
        .apply("expandable_segments:False,max_split_size_mb:1")
        .unwrap_err();
    assert_eq!(e, ConfigError::MaxSplitSizeTooSmall { mb: 1, min_mb: 20 });
    assert_eq!(c, before);
}

#[test]
fn environment_precedence() {
    assert_eq!(
        AllocatorConfig::from_env_with(env(&[])).unwrap(),
        AllocatorConfig::default()
    );
    let cuda =
        AllocatorConfig::from_env_with(env(&[("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:30")]))
            .unwrap();
    assert_eq!(cuda.max_split_size, 30 * MB);
    // PyTorch 2.11 reads PYTORCH_CUDA_ALLOC_CONF before the newer name.
    let both = AllocatorConfig::from_env_with(env(&[
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:30"),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:40"),
    ]))
    .unwrap();
    assert_eq!(both.max_split_size, 30 * MB);
    let ours = AllocatorConfig::from_env_with(env(&[
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:30"),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:40"),
        ("TENSORMEM_ALLOC_CONF", "max_split_size_mb:50"),
    ]))
    .unwrap();
    assert_eq!(ours.max_split_size, 50 * MB);
    // An empty variable counts as set (and means the defaults).
    let empty = AllocatorConfig::from_env_with(env(&[
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:30"),
        ("TENSORMEM_ALLOC_CONF", ""),
    ]))
    .unwrap();
    assert_eq!(empty, AllocatorConfig::default());
}

#[test]
fn environment_errors_name_the_variable() {
    let e =
        AllocatorConfig::from_env_with(env(&[("PYTORCH_CUDA_ALLOC_CONF", "bogus:1")])).unwrap_err();
    assert!(matches!(
        &e,
        ConfigError::Env {
            var: "PYTORCH_CUDA_ALLOC_CONF",
            ..
        }
    ));
    assert!(
        e.to_string().starts_with(
            "PYTORCH_CUDA_ALLOC_CONF is not a valid allocator configuration: Unrecognized key 'bogus' in CUDA allocator config."
        ),
        "{e}"
    );
    let e =
        AllocatorConfig::from_env_with(env(&[("TENSORMEM_ALLOC_CONF", "expandable_segments:yes")]))
            .unwrap_err();
    assert!(e.to_string().starts_with(
        "TENSORMEM_ALLOC_CONF is not a valid allocator configuration: Expected 'True'"
    ));
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStringExt;
        let e = AllocatorConfig::from_env_with(|name| {
            (name == "TENSORMEM_ALLOC_CONF").then(|| OsString::from_vec(vec![0xff, 0xfe]))
        })
        .unwrap_err();
        assert_eq!(
            e,
            ConfigError::EnvNotUnicode {
                var: "TENSORMEM_ALLOC_CONF"
            }
        );
    }
}

#[test]
fn canonical_strings() {
    assert_eq!(
        parse("expandable_segments:True").to_string(),
        "expandable_segments:True"
    );
    assert_eq!(
        parse(" expandable_segments : True , max_split_size_mb : 128 ").to_string(),
        "max_split_size_mb:128,expandable_segments:True"
    );
    assert_eq!(
        parse("roundup_power2_divisions:4").to_string(),
        "roundup_power2_divisions:4"
    );
    assert_eq!(
        parse("roundup_power2_divisions:[256:1,512:2,>:8]").to_string(),
        "roundup_power2_divisions:[256:1,512:2,>:8]"
    );
    assert_eq!(
        parse("expandable_segments:False").to_string(),
        "",
        "defaults are not written"
    );
}

fn divisions_value() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), (0u32..8).prop_map(|p| 1usize << p)]
}

fn valid_config() -> impl Strategy<Value = AllocatorConfig> {
    let sizes = (
        prop_oneof![Just(usize::MAX), (20usize..100_000).prop_map(|mb| mb * MB)],
        (20usize..100_000).prop_map(|mb| mb * MB),
        prop_oneof![
            Just([0usize; 16]),
            (0u32..8).prop_map(|p| [1usize << p; 16]),
            proptest::array::uniform16(divisions_value()),
        ],
    );
    let reals = (
        prop_oneof![
            Just(0.0f64),
            (1u32..1_000_000).prop_map(|n| f64::from(n) / 1_000_000.0)
        ],
        prop_oneof![
            Just(1.0f64),
            (0u32..=1000).prop_map(|n| f64::from(n) / 1000.0)
        ],
    );
    let flags = proptest::array::uniform8(any::<bool>());
    let counts = (
        (0u32..=7).prop_map(|p| 1usize << p),
        0usize..10_000,
        any::<bool>(),
        any::<bool>(),
    );
    (sizes, reals, flags, counts).prop_map(
        |(
            (split, rounding, divisions),
            (gc, fraction),
            f,
            (threads, reserve, async_backend, reserve_key),
        )| {
            let mut c = AllocatorConfig {
                backend: if async_backend {
                    Backend::CudaMallocAsync
                } else {
                    Backend::Native
                },
                max_split_size: split,
                max_non_split_rounding_size: rounding,
                roundup_power2_divisions: divisions,
                garbage_collection_threshold: gc,
                expandable_segments: f[0],
                release_lock_on_cudamalloc: f[1],
                pinned_use_cuda_host_register: f[2],
                pinned_num_register_threads: threads,
                pinned_use_background_threads: f[3],
                pinned_reserve_segment_size_mb: reserve,
                graph_capture_record_stream_reuse: f[4],
                per_process_memory_fraction: fraction,
                pinned_free_catch_all: f[5],
                throw_on_cudamalloc_oom: f[6],
                ..AllocatorConfig::default()
            };
            if reserve_key {
                c.other
                    .insert("expandable_segments_reserve".into(), "0.5".into());
            }
            if f[7] {
                c.other.insert(
                    "expandable_segments_reserve_by_class".into(),
                    "[a:1G,b:0.25]".into(),
                );
            }
            c
        },
    )
}

proptest! {
    #[test]
    fn display_parses_back(config in valid_config()) {
        let text = config.to_string();
        let back = AllocatorConfig::parse(&text);
        prop_assert_eq!(back.as_ref(), Ok(&config), "canonical string {:?}", text);
    }

    #[test]
    fn list_form_reconstructs_any_table(table in proptest::array::uniform16(divisions_value())) {
        let c = AllocatorConfig { roundup_power2_divisions: table, ..AllocatorConfig::default() };
        let text = c.to_string();
        prop_assert_eq!(AllocatorConfig::parse(&text).map(|c| c.roundup_power2_divisions), Ok(table), "{}", text);
    }

    #[test]
    fn arbitrary_strings_never_panic(s in "[a-z_:,\\[\\]>0-9. ]{0,64}") {
        let _ = AllocatorConfig::parse(&s);
    }

    #[test]
    fn arbitrary_known_key_values_never_panic(key in proptest::sample::select(KNOWN_KEYS.to_vec()), value in "[\\[\\]:,>0-9a-zA-Z.-]{0,24}") {
        let _ = AllocatorConfig::parse(&format!("{key}:{value}"));
    }
}
