//! The allocator's settings: PyTorch's `PYTORCH_CUDA_ALLOC_CONF` grammar.
//!
//! PyTorch configures its caching allocator with one string of comma-separated `key:value` pairs, read
//! from the environment at start-up and settable later through `torch.cuda.memory._set_allocator_settings`:
//!
//! ```text
//! max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True
//! ```
//!
//! [`AllocatorConfig`] is that string parsed: [`AllocatorConfig::parse`] reads it (with PyTorch's error
//! messages for malformed values), [`AllocatorConfig::apply`] changes settings at run time the way PyTorch
//! does, [`AllocatorConfig::from_env`] reads `TENSORMEM_ALLOC_CONF` (falling back to PyTorch's own
//! variables, read as PyTorch reads them: [`ENV_VARS`]), and [`Display`](fmt::Display) writes the
//! canonical string that parses back
//! to the same value.
//!
//! ```
//! use tensormem_cuda_alloc::config::AllocatorConfig;
//!
//! let config = AllocatorConfig::parse("max_split_size_mb:128, expandable_segments:True")?;
//! assert_eq!(config.max_split_size, 128 << 20);
//! assert!(config.expandable_segments);
//! assert_eq!(AllocatorConfig::parse(&config.to_string())?, config);
//! # Ok::<(), tensormem_cuda_alloc::config::ConfigError>(())
//! ```
//!
//! Keys ([`KNOWN_KEYS`]: PyTorch's device-generic keys and its CUDA build's): `backend`,
//! `max_split_size_mb`, `max_non_split_rounding_mb`, `large_segment_size_mb`,
//! `garbage_collection_threshold`, `roundup_power2_divisions`, `expandable_segments`,
//! `release_lock_on_cudamalloc` (alias `release_lock_on_hipmalloc`), `pinned_use_cuda_host_register` (alias
//! `pinned_use_hip_host_register`), `pinned_num_register_threads`, `pinned_use_background_threads`,
//! `pinned_reserve_segment_size_mb`, `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb`,
//! `graph_capture_record_stream_reuse`, `per_process_memory_fraction`, `pinned_free_catch_all`,
//! `throw_on_cudamalloc_oom`, and the `expandable_segments_reserve` /
//! `expandable_segments_reserve_by_class` pair, whose valid values are kept in
//! [`AllocatorConfig::other`]. A key outside this list is refused, as PyTorch refuses it. What the
//! allocators do with each key is listed in `docs/allocator.md` ("Configuration keys").

mod number;
mod parse;

use std::collections::BTreeMap;
use std::fmt;

/// One mebibyte: the unit of the `*_mb` keys.
pub const MB: usize = 1 << 20;

/// PyTorch's `kLargeBuffer`: large allocations are packed in 20 MiB segments, and both
/// `max_split_size_mb` and `max_non_split_rounding_mb` must be at least this large.
pub const LARGE_BUFFER: usize = 20 * MB;

/// Number of power-of-two size intervals `roundup_power2_divisions` configures: interval `i` holds sizes in
/// `[2^i MiB, 2^(i+1) MiB)`, from 1 MiB up to 64 GiB; smaller sizes use interval 0 and larger ones the last.
pub const ROUNDUP_POWER2_INTERVALS: usize = 16;

/// Log2 of the first interval's start (1 MiB).
const ROUNDUP_POWER2_START_LOG2: u32 = 20;

/// The largest `pinned_num_register_threads` PyTorch accepts.
pub const MAX_PINNED_REGISTER_THREADS: usize = 128;

/// `large_segment_size_mb` must exceed this many MiB (PyTorch's `kMinLargeAlloc`, 10 MiB: a large
/// segment must hold any request that is packed into one).
const LARGE_SEGMENT_EXCLUSIVE_MIN_MB: u64 = 10;

/// Every key the grammar accepts: PyTorch's device-generic keys (`AcceleratorAllocatorConfig`), its CUDA
/// build's (`CUDAAllocatorConfig`), and the ROCm spellings it also accepts.
pub const KNOWN_KEYS: [&str; 22] = [
    "backend",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "large_segment_size_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
];

/// Environment variables [`AllocatorConfig::from_env`] reads.
///
/// `TENSORMEM_ALLOC_CONF` is tensormem's own: when it is set, it alone is read. Otherwise PyTorch's,
/// as PyTorch 2.11 reads them on a CUDA build (set but empty counts as set): the CUDA keys
/// ([`CUDA_KEYS`]) from the first set of `PYTORCH_CUDA_ALLOC_CONF` and `PYTORCH_ALLOC_CONF`, every
/// other key from the first set of `PYTORCH_CUDA_ALLOC_CONF`, `PYTORCH_HIP_ALLOC_CONF` and
/// `PYTORCH_ALLOC_CONF`. So `PYTORCH_CUDA_ALLOC_CONF` wins over the newer name, and with only
/// `PYTORCH_HIP_ALLOC_CONF` and `PYTORCH_ALLOC_CONF` set, each gives its own half. Set one of
/// PyTorch's variables, or the same string in each, to keep it simple.
pub const ENV_VARS: [&str; 4] = [
    "TENSORMEM_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
];

/// The keys PyTorch's CUDA build reads in its CUDA allocator configuration rather than the
/// device-generic one (`CUDAAllocatorConfig`), which it takes from its own variables
/// ([`ENV_VARS`]); tensormem's keys of the CUDA allocator alone (`pinned_free_catch_all`,
/// `throw_on_cudamalloc_oom`) with them.
pub const CUDA_KEYS: [&str; 11] = [
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
];

/// The variables that turn caching off, for debugging (every allocation straight to the device; see
/// [`caching_disabled_by_env`]).
pub const NO_CACHING_ENV_VARS: [&str; 2] = [
    "TENSORMEM_NO_CUDA_MEMORY_CACHING",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
];

/// Whether the environment turns the caching allocator off: `TENSORMEM_NO_CUDA_MEMORY_CACHING` when it
/// is set (on unless it is empty or `0`, so that it can also switch PyTorch's variable off for
/// tensormem), else `PYTORCH_NO_CUDA_MEMORY_CACHING` set to anything (PyTorch's rule: present means on).
#[must_use]
pub fn caching_disabled_by_env() -> bool {
    caching_disabled_by_env_with(std::env::var_os)
}

/// [`caching_disabled_by_env`] with the environment given as a lookup function.
#[must_use]
pub fn caching_disabled_by_env_with<F>(mut lookup: F) -> bool
where
    F: FnMut(&'static str) -> Option<std::ffi::OsString>,
{
    let [ours, pytorch] = NO_CACHING_ENV_VARS;
    match lookup(ours) {
        Some(value) => !(value.is_empty() || value == "0"),
        None => lookup(pytorch).is_some(),
    }
}

/// Which allocator implementation serves device memory (`backend:native|cudaMallocAsync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum Backend {
    /// The caching allocator (this crate's).
    #[default]
    Native,
    /// CUDA's stream-ordered allocator (`cudaMallocAsync`), served by `AsyncAllocator` (feature
    /// `cuda`): the driver's memory pool instead of a cache of ours. Under it PyTorch ignores the keys
    /// of the caching allocator ([`ASYNC_IGNORED_KEYS`]). The caching allocator cannot serve it:
    /// [`AllocatorConfig::check_supported`] refuses it, and so do [`AllocatorConfig::from_env`] and the
    /// caching allocator's `apply_settings`; [`AllocatorConfig::read_env`] accepts it, for a caller
    /// that picks the allocator from the configuration.
    CudaMallocAsync,
}

impl Backend {
    /// The name PyTorch's grammar uses for this backend.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Native => "native",
            Backend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

/// The keys of the caching allocator that PyTorch's `backend:cudaMallocAsync` ignores: the driver's
/// pool decides splitting, rounding, segment sizes and reuse itself. PyTorch accepts them beside
/// `backend:cudaMallocAsync` with a warning, and so does [`AllocatorConfig::parse`]; the pinned host
/// allocator's keys (`pinned_*`) still configure the host allocator, which does not depend on the
/// device backend. The memory fraction is set on the async allocator by a call
/// (`AsyncAllocator::set_memory_fraction`), as with PyTorch's `set_per_process_memory_fraction`.
pub const ASYNC_IGNORED_KEYS: [&str; 13] = [
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "large_segment_size_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
];

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The caching allocator's settings, with PyTorch's defaults ([`Default`]).
///
/// Fields are plain values so that tests and embedders can build a configuration directly; values built
/// that way are not validated (use [`AllocatorConfig::parse`] for checked input). [`Display`](fmt::Display)
/// writes only the settings that differ from the defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// `backend`: which allocator serves device memory. Default [`Backend::Native`].
    pub backend: Backend,
    /// `max_split_size_mb`, in bytes: blocks at least this large are never split, and a cached block this
    /// large serves a request only if it exceeds the request by less than
    /// [`max_non_split_rounding_size`](Self::max_non_split_rounding_size). `usize::MAX` (the default) means
    /// unlimited. Parsed values are whole MiB, at least [`LARGE_BUFFER`].
    pub max_split_size: usize,
    /// `max_non_split_rounding_mb`, in bytes: how much larger than a request an unsplittable cached block
    /// may be and still serve it. Default [`LARGE_BUFFER`] (20 MiB); a string that sets
    /// `large_segment_size_mb` first resets it to that size, as PyTorch does.
    pub max_non_split_rounding_size: usize,
    /// `large_segment_size_mb`, in bytes: the size of the segments that requests between 1 and 10 MiB
    /// are packed in, and the smallest `max_split_size_mb` and `max_non_split_rounding_mb` accept.
    /// Default [`LARGE_BUFFER`] (20 MiB); parsed values are whole MiB above 10. The device allocator's
    /// segments stay [`LARGE_BUFFER`]: this value is checked and kept, not acted on.
    pub large_segment_size: usize,
    /// `roundup_power2_divisions`: for each power-of-two size interval (see [`ROUNDUP_POWER2_INTERVALS`]),
    /// into how many equal steps the interval is divided when rounding a request up; `0` (the default)
    /// means no such rounding. Read it with [`roundup_divisions_for`](Self::roundup_divisions_for).
    pub roundup_power2_divisions: [usize; ROUNDUP_POWER2_INTERVALS],
    /// `garbage_collection_threshold`: when reserved memory exceeds this fraction of the allowed maximum,
    /// cached blocks are released oldest first before a new segment is allocated. `0.0` (default) is off;
    /// parsed values lie in `(0, 1)`.
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`: one growable segment per stream and pool, mapped in chunks on reserved
    /// address space, instead of one device allocation per segment. Default `false`.
    pub expandable_segments: bool,
    /// `release_lock_on_cudamalloc`: drop the allocator lock around the device allocation call.
    /// Default `false`.
    pub release_lock_on_cudamalloc: bool,
    /// `pinned_use_cuda_host_register`: the pinned host allocator uses `malloc` + `cudaHostRegister`
    /// instead of `cudaHostAlloc`. Default `false`.
    pub pinned_use_cuda_host_register: bool,
    /// `pinned_num_register_threads`: threads that page in and register pinned memory (a power of two, at
    /// most [`MAX_PINNED_REGISTER_THREADS`]). Default `1`.
    pub pinned_num_register_threads: usize,
    /// `pinned_use_background_threads`: the pinned host allocator processes its events on a background
    /// thread. Default `false`.
    pub pinned_use_background_threads: bool,
    /// `pinned_reserve_segment_size_mb`: size of the pinned memory segment reserved up front, in MiB;
    /// `0` (default) reserves none. Parsed values are greater than 0.
    pub pinned_reserve_segment_size_mb: usize,
    /// `pinned_max_round_threshold_mb`, in bytes: pinned host requests larger than this are not rounded
    /// up to a power of two (see [`pinned_block_size`](Self::pinned_block_size)). `usize::MAX` (the
    /// default) rounds every request.
    pub pinned_max_round_threshold: usize,
    /// `pinned_max_cached_size_mb`, in bytes: freed pinned host blocks larger than this go back to the
    /// system instead of the cache (see [`pinned_caches`](Self::pinned_caches)), and requests larger
    /// than it are not rounded either. `usize::MAX` (the default) caches every block.
    pub pinned_max_cached_size: usize,
    /// `graph_capture_record_stream_reuse`: while capturing a CUDA graph, decide whether a block freed with
    /// `record_stream` may be reused from the graph's topology instead of waiting for the capture to end.
    /// Default `false`.
    pub graph_capture_record_stream_reuse: bool,
    /// `per_process_memory_fraction`: the fraction of the device's memory this process may reserve, in
    /// `[0, 1]`. Default `1.0`.
    pub per_process_memory_fraction: f64,
    /// `pinned_free_catch_all`: the pinned host allocator accepts frees of pointers it did not hand out.
    /// Default `false`.
    pub pinned_free_catch_all: bool,
    /// `throw_on_cudamalloc_oom`: refuse an allocation up front (an out-of-memory error) when it would
    /// exceed `per_process_memory_fraction`, instead of calling the device. Default `false`.
    pub throw_on_cudamalloc_oom: bool,
    /// Keys PyTorch accepts whose values this crate does not interpret, with their value text as written
    /// (whitespace removed; a list value keeps its brackets): `expandable_segments_reserve` and
    /// `expandable_segments_reserve_by_class`. Kept so a configuration survives a round trip.
    pub other: BTreeMap<String, String>,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            backend: Backend::Native,
            max_split_size: usize::MAX,
            max_non_split_rounding_size: LARGE_BUFFER,
            large_segment_size: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_POWER2_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            pinned_reserve_segment_size_mb: 0,
            pinned_max_round_threshold: usize::MAX,
            pinned_max_cached_size: usize::MAX,
            graph_capture_record_stream_reuse: false,
            per_process_memory_fraction: 1.0,
            pinned_free_catch_all: false,
            throw_on_cudamalloc_oom: false,
            other: BTreeMap::new(),
        }
    }
}

/// What follows PyTorch's message for an unknown key: a did-you-mean and the grammar.
fn unknown_key_hint(key: &str) -> String {
    let grammar = "options are written key:value (a colon, not '='), separated by commas";
    if let Some((name, value)) = key.split_once('=') {
        let name = if KNOWN_KEYS.contains(&name) {
            Some(name)
        } else {
            closest_key(name)
        };
        return match name {
            Some(name) => format!(" Did you mean '{name}:{value}'? The {grammar}."),
            None => format!(" The {grammar}."),
        };
    }
    match closest_key(key) {
        Some(known) => format!(" Did you mean '{known}'? The {grammar}."),
        None => format!(" The {grammar}; the keys are {}.", KNOWN_KEYS.join(", ")),
    }
}

/// The known key closest to `key`: the same but for case, one `key` starts, or one within a third
/// of its length in edits (at least 2).
fn closest_key(key: &str) -> Option<&'static str> {
    let lower = key.to_ascii_lowercase();
    if lower.is_empty() || !lower.chars().any(char::is_alphanumeric) {
        return None;
    }
    if let Some(known) = KNOWN_KEYS.iter().find(|k| **k == lower) {
        return Some(known);
    }
    if lower.len() >= 4 {
        if let Some(known) = KNOWN_KEYS.iter().find(|k| k.starts_with(&lower)) {
            return Some(known);
        }
    }
    let limit = (lower.len() / 3).max(2);
    KNOWN_KEYS
        .iter()
        .map(|known| (edit_distance(&lower, known), *known))
        .filter(|(distance, _)| *distance <= limit)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, known)| known)
}

/// Levenshtein distance between two strings, counted in bytes (the keys are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    let mut current = vec![0; b.len() + 1];
    for (i, &ca) in a.iter().enumerate() {
        current[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

/// Why a configuration string was refused. Messages are PyTorch's where PyTorch has one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key neither PyTorch nor tensormem knows. The message is PyTorch's, followed by the known key
    /// closest to it (edit distance, case, or a prefix) and a reminder of the grammar.
    #[error(
        "Unrecognized key '{key}' in CUDA allocator config.{}",
        unknown_key_hint(key)
    )]
    UnknownKey {
        /// The key as written (whitespace removed).
        key: String,
    },
    /// A separator (`:`, `,`, `[`, `]`) is missing where the grammar needs one.
    #[error(
        "Expected '{expected}' after '{after}' in allocator config but got {}; write key:value pairs \
         separated by commas",
        found.as_deref().map_or_else(|| "the end of the string".to_owned(), |t| format!("'{t}'"))
    )]
    ExpectedToken {
        /// The separator the grammar needs.
        expected: char,
        /// The token before it.
        after: String,
        /// What was there instead (`None`: the string ended).
        found: Option<String>,
    },
    /// A key's value is missing (the string ends after `key:`).
    #[error("Error, expecting {key} value")]
    MissingValue {
        /// The key.
        key: String,
    },
    /// A value that should be a number is not one.
    #[error("invalid value '{value}' for {key}: expected {expected}")]
    InvalidNumber {
        /// The key (or `roundup_power2_divisions` for a list entry).
        key: String,
        /// The value as written.
        value: String,
        /// What kind of number was expected.
        expected: &'static str,
    },
    /// A boolean key's value is not `True` or `False` (PyTorch's spelling, case-sensitive).
    #[error("Expected 'True' or 'False' at index {index} in ConfigTokenizer but got '{found}'")]
    ExpectedBool {
        /// Token index of the value (keys, values and separators counted from 0, as PyTorch does).
        index: usize,
        /// The value as written.
        found: String,
    },
    /// `max_split_size_mb` below the large segment size (20 MiB unless `large_segment_size_mb` says).
    #[error("CachingAllocator option max_split_size_mb too small, must be >= {min_mb}")]
    MaxSplitSizeTooSmall {
        /// The value given, in MiB.
        mb: u64,
        /// The smallest value accepted, in MiB: the large segment size.
        min_mb: u64,
    },
    /// `max_non_split_rounding_mb` below the large segment size (20 MiB unless `large_segment_size_mb`
    /// says).
    #[error("CachingAllocator option max_non_split_rounding_mb too small, must be >= {min_mb}")]
    MaxNonSplitRoundingTooSmall {
        /// The value given, in MiB.
        mb: u64,
        /// The smallest value accepted, in MiB: the large segment size.
        min_mb: u64,
    },
    /// `large_segment_size_mb` of 10 MiB or less.
    #[error(
        "CachingAllocator option large_segment_size_mb must be > {LARGE_SEGMENT_EXCLUSIVE_MIN_MB} MB, \
         got {mb}"
    )]
    LargeSegmentSizeTooSmall {
        /// The value given, in MiB.
        mb: u64,
    },
    /// `garbage_collection_threshold` outside `(0, 1)`.
    #[error("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")]
    GarbageCollectionThreshold {
        /// The value given.
        value: f64,
    },
    /// `per_process_memory_fraction` outside `[0, 1]`.
    #[error("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")]
    MemoryFraction {
        /// The value given.
        value: f64,
    },
    /// A `roundup_power2_divisions` value that is not a power of two (0 is allowed in the list form only).
    #[error("For roundups, the divisions has to be power of 2{}", if *.in_list { " or 0 to disable roundup" } else { "" })]
    DivisionsNotPowerOf2 {
        /// The value given.
        value: u64,
        /// Whether it came from the list form (`[size:divisions,...]`).
        in_list: bool,
    },
    /// A `roundup_power2_divisions` list boundary (in MiB) that is not a power of two.
    #[error("For roundups, the intervals have to be power of 2")]
    IntervalNotPowerOf2 {
        /// The boundary given, in MiB.
        boundary: u64,
    },
    /// A list value without its closing bracket.
    #[error("Expected closing bracket ']' in ConfigTokenizer but reached end of config")]
    UnclosedList,
    /// `backend` names no known allocator.
    #[error("Unknown allocator backend, options are native and cudaMallocAsync")]
    UnknownBackend {
        /// The value given.
        value: String,
    },
    /// The configuration asks the caching allocator (the native backend) for another backend
    /// (`backend:cudaMallocAsync`, which `AsyncAllocator` serves).
    #[error(
        "backend:{backend} is not served by the caching allocator (the native backend): use \
         AsyncAllocator for it, or remove backend:{backend} from the configuration (where \
         PYTORCH_CUDA_ALLOC_CONF must keep it for PyTorch, give tensormem its own TENSORMEM_ALLOC_CONF, \
         which is read first)"
    )]
    UnsupportedBackend {
        /// The backend asked for.
        backend: Backend,
    },
    /// `pinned_num_register_threads` is not a power of two.
    #[error("Number of register threads has to be power of 2, got {value}")]
    RegisterThreadsNotPowerOf2 {
        /// The value given.
        value: u64,
    },
    /// `pinned_num_register_threads` above [`MAX_PINNED_REGISTER_THREADS`].
    #[error("Number of register threads should be less than or equal to {MAX_PINNED_REGISTER_THREADS}, got {value}")]
    TooManyRegisterThreads {
        /// The value given.
        value: u64,
    },
    /// `pinned_reserve_segment_size_mb` is 0.
    #[error("Pinned reserve segment size has to be greater than 0")]
    PinnedReserveSegmentSizeZero,
    /// An environment variable holds a configuration that does not parse.
    #[error("{var} is not a valid allocator configuration: {source}")]
    Env {
        /// The variable read.
        var: &'static str,
        /// What was wrong with its value.
        #[source]
        source: Box<ConfigError>,
    },
    /// An environment variable is set but is not valid Unicode.
    #[error(
        "{var} is not valid UTF-8; set it to a config string such as 'expandable_segments:True'"
    )]
    EnvNotUnicode {
        /// The variable read.
        var: &'static str,
    },
}

/// `Result` with a [`ConfigError`].
pub type ConfigResult<T> = Result<T, ConfigError>;

impl AllocatorConfig {
    /// Parses a configuration string, starting from the defaults.
    ///
    /// ASCII whitespace anywhere is ignored, numbers are read as C++'s `std::stoull` and `std::stod`
    /// read them (the number a value starts with; a negative whole number wraps around, with a
    /// `tracing` warning either way), and an empty string gives the defaults, as in PyTorch.
    ///
    /// # Errors
    /// [`ConfigError`] for an unknown key, a malformed pair or list, or a value out of range.
    pub fn parse(config: &str) -> ConfigResult<Self> {
        let mut parsed = AllocatorConfig::default();
        parsed.apply(config)?;
        Ok(parsed)
    }

    /// Applies a configuration string to these settings at run time, as
    /// `torch.cuda.memory._set_allocator_settings` does.
    ///
    /// Like PyTorch, every call first resets `max_split_size`, `roundup_power2_divisions` and
    /// `garbage_collection_threshold` to their defaults (a key left out of the string goes back to its
    /// default), while the other settings keep their values unless the string names them; a string that
    /// sets `large_segment_size_mb` also resets `max_non_split_rounding_size` to that size before its
    /// other keys are read. Unlike PyTorch, a string with an error changes nothing.
    ///
    /// # Errors
    /// As [`parse`](Self::parse); `self` is then unchanged.
    pub fn apply(&mut self, config: &str) -> ConfigResult<()> {
        let mut next = self.clone();
        let defaults = AllocatorConfig::default();
        next.max_split_size = defaults.max_split_size;
        next.roundup_power2_divisions = defaults.roundup_power2_divisions;
        next.garbage_collection_threshold = defaults.garbage_collection_threshold;
        let native_options = parse::apply_tokens(&mut next, config, parse::Scope::All)?;
        next.warn_if_backend_ignores(native_options);
        *self = next;
        Ok(())
    }

    /// PyTorch's warning when a configuration for `backend:cudaMallocAsync` also gives options of
    /// the native allocator (`native_options`), which that backend ignores.
    fn warn_if_backend_ignores(&self, native_options: bool) {
        if self.backend == Backend::CudaMallocAsync && native_options {
            tracing::warn!(
                config = %self,
                "backend:cudaMallocAsync ignores max_split_size_mb, roundup_power2_divisions, and \
                 garbage_collect_threshold"
            );
        }
    }

    /// Reads the configuration from the environment: `TENSORMEM_ALLOC_CONF` alone when it is set,
    /// else PyTorch's variables as PyTorch reads them (see [`ENV_VARS`]: the CUDA keys and the
    /// others may come from different variables); the defaults if none is set.
    ///
    /// # Errors
    /// [`ConfigError::Env`] naming the variable when its value does not parse, or
    /// [`ConfigError::EnvNotUnicode`].
    pub fn from_env() -> ConfigResult<Self> {
        Self::from_env_with(std::env::var_os)
    }

    /// [`from_env`](Self::from_env) with the environment given as a lookup function (for tests and for
    /// embedders with their own settings source).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_env_with<F>(lookup: F) -> ConfigResult<Self>
    where
        F: FnMut(&'static str) -> Option<std::ffi::OsString>,
    {
        Self::env_config(lookup, true)
    }

    /// Reads the configuration from the environment like [`from_env`](Self::from_env), accepting
    /// either backend: for a caller that picks the allocator by [`backend`](Self::backend) (the
    /// caching allocator for `native`, `AsyncAllocator` for `cudaMallocAsync`). Under
    /// `backend:cudaMallocAsync` the keys in [`ASYNC_IGNORED_KEYS`] are parsed and checked but mean
    /// nothing to the device allocator, as in PyTorch.
    ///
    /// # Errors
    /// [`ConfigError::Env`] naming the variable when its value does not parse, or
    /// [`ConfigError::EnvNotUnicode`].
    pub fn read_env() -> ConfigResult<Self> {
        Self::env_config(std::env::var_os, false)
    }

    /// The environment as [`from_env_with`](Self::from_env_with) reads it; `native_only` refuses a
    /// backend other than the native one.
    fn env_config<F>(mut lookup: F, native_only: bool) -> ConfigResult<Self>
    where
        F: FnMut(&'static str) -> Option<std::ffi::OsString>,
    {
        let mut text_of = |var: &'static str| {
            lookup(var)
                .map(|value| {
                    value
                        .into_string()
                        .map_err(|_| ConfigError::EnvNotUnicode { var })
                })
                .transpose()
                .map(|text| text.map(|text| (var, text)))
        };
        let in_env = |var: &'static str, source: ConfigError| ConfigError::Env {
            var,
            source: Box::new(source),
        };
        // tensormem's own variable alone, else PyTorch's, each half from where PyTorch reads it.
        let (ours, cuda_var, hip_var, generic_var) = match text_of(ENV_VARS[0])? {
            Some(ours) => (Some(ours), None, None, None),
            None => (
                None,
                text_of("PYTORCH_CUDA_ALLOC_CONF")?,
                text_of("PYTORCH_HIP_ALLOC_CONF")?,
                text_of("PYTORCH_ALLOC_CONF")?,
            ),
        };
        let generic = [&ours, &cuda_var, &hip_var, &generic_var]
            .into_iter()
            .find_map(Option::as_ref);
        let cuda = [&ours, &cuda_var, &generic_var]
            .into_iter()
            .find_map(Option::as_ref);
        let same = generic.map(|(var, _)| var) == cuda.map(|(var, _)| var);
        let halves = [
            (
                generic,
                if same {
                    parse::Scope::All
                } else {
                    parse::Scope::Generic
                },
            ),
            (cuda.filter(|_| !same), parse::Scope::Cuda),
        ];
        let mut config = AllocatorConfig::default();
        let mut native_options = false;
        for (var, text, scope) in halves
            .into_iter()
            .filter_map(|(source, scope)| source.map(|(var, text)| (*var, text, scope)))
        {
            tracing::debug!(var, config = %text, ?scope, "allocator configuration from the environment");
            native_options |= parse::apply_tokens(&mut config, text, scope)
                .map_err(|source| in_env(var, source))?;
        }
        config.warn_if_backend_ignores(native_options);
        if native_only {
            config
                .check_supported()
                .map_err(|source| in_env(cuda.map_or(ENV_VARS[0], |(var, _)| *var), source))?;
        }
        Ok(config)
    }

    /// [`read_env`](Self::read_env) with the environment given as a lookup function.
    ///
    /// # Errors
    /// As [`read_env`](Self::read_env).
    pub fn read_env_from<F>(lookup: F) -> ConfigResult<Self>
    where
        F: FnMut(&'static str) -> Option<std::ffi::OsString>,
    {
        Self::env_config(lookup, false)
    }

    /// The keys of [`ASYNC_IGNORED_KEYS`] whose settings here differ from the defaults: what a
    /// `backend:cudaMallocAsync` configuration sets in vain (empty under the native backend, which
    /// reads them all).
    #[must_use]
    pub fn ignored_by_backend(&self) -> Vec<&'static str> {
        if self.backend == Backend::Native {
            return Vec::new();
        }
        let d = AllocatorConfig::default();
        // `release_lock_on_hipmalloc` is the other spelling of `release_lock_on_cudamalloc`: one field.
        [
            ("max_split_size_mb", self.max_split_size != d.max_split_size),
            (
                "max_non_split_rounding_mb",
                self.max_non_split_rounding_size != d.max_non_split_rounding_size,
            ),
            (
                "large_segment_size_mb",
                self.large_segment_size != d.large_segment_size,
            ),
            (
                "garbage_collection_threshold",
                self.garbage_collection_threshold != d.garbage_collection_threshold,
            ),
            (
                "roundup_power2_divisions",
                self.roundup_power2_divisions != d.roundup_power2_divisions,
            ),
            (
                "expandable_segments",
                self.expandable_segments != d.expandable_segments,
            ),
            (
                "release_lock_on_cudamalloc",
                self.release_lock_on_cudamalloc != d.release_lock_on_cudamalloc,
            ),
            (
                "graph_capture_record_stream_reuse",
                self.graph_capture_record_stream_reuse != d.graph_capture_record_stream_reuse,
            ),
            (
                "per_process_memory_fraction",
                self.per_process_memory_fraction != d.per_process_memory_fraction,
            ),
            (
                "throw_on_cudamalloc_oom",
                self.throw_on_cudamalloc_oom != d.throw_on_cudamalloc_oom,
            ),
            (
                "expandable_segments_reserve",
                self.other.contains_key("expandable_segments_reserve"),
            ),
            (
                "expandable_segments_reserve_by_class",
                self.other
                    .contains_key("expandable_segments_reserve_by_class"),
            ),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect()
    }

    /// How many divisions `roundup_power2_divisions` asks for when rounding a request of `size` bytes
    /// (0: no power-of-two rounding). Sizes below 2 MiB use the first interval, sizes of 32 GiB and more
    /// the last.
    #[must_use]
    pub fn roundup_divisions_for(&self, size: usize) -> usize {
        self.roundup_power2_divisions[roundup_interval(size)]
    }

    /// Checks that the caching allocator can serve this configuration: its [`backend`](Self::backend)
    /// is [`Backend::Native`]. The parser accepts `backend:cudaMallocAsync` (it is PyTorch's grammar,
    /// snapshots record it, and `AsyncAllocator` serves it); the places that configure a running
    /// caching allocator refuse it with this check.
    ///
    /// # Errors
    /// [`ConfigError::UnsupportedBackend`] for any other backend.
    pub fn check_supported(&self) -> ConfigResult<()> {
        match self.backend {
            Backend::Native => Ok(()),
            backend => Err(ConfigError::UnsupportedBackend { backend }),
        }
    }

    /// Whether [`max_split_size`](Self::max_split_size) limits splitting (it is not unlimited).
    #[must_use]
    pub fn limits_split_size(&self) -> bool {
        self.max_split_size != usize::MAX
    }

    /// The size of the pinned host block that serves a request of `size` bytes (PyTorch's host
    /// `roundSize`): the next power of two when `size` is at most both
    /// [`pinned_max_round_threshold`](Self::pinned_max_round_threshold) and
    /// [`pinned_max_cached_size`](Self::pinned_max_cached_size), else `size` rounded up to a multiple
    /// of `alignment` (a power of two: the host allocator's block alignment). `None` when that size
    /// does not fit in `usize`.
    #[must_use]
    pub fn pinned_block_size(&self, size: usize, alignment: usize) -> Option<usize> {
        let size = size.max(alignment);
        if size <= self.pinned_max_round_threshold && size <= self.pinned_max_cached_size {
            size.checked_next_power_of_two()
        } else {
            size.checked_next_multiple_of(alignment)
        }
    }

    /// Whether a freed pinned host block of `size` bytes goes back to the host allocator's cache
    /// (`true`) or to the system once its streams are done with it (`false`: larger than
    /// [`pinned_max_cached_size`](Self::pinned_max_cached_size)).
    #[must_use]
    pub fn pinned_caches(&self, size: usize) -> bool {
        size <= self.pinned_max_cached_size
    }
}

/// Index into `roundup_power2_divisions` for a request of `size` bytes.
#[must_use]
pub fn roundup_interval(size: usize) -> usize {
    let log2 = size.checked_ilog2().unwrap_or(0);
    let index = log2.saturating_sub(ROUNDUP_POWER2_START_LOG2) as usize;
    index.min(ROUNDUP_POWER2_INTERVALS - 1)
}

impl fmt::Display for AllocatorConfig {
    /// The canonical configuration string: the settings that differ from the defaults, in a fixed order,
    /// `key:value` separated by `,` (empty for the defaults). It parses back to an equal value for every
    /// configuration [`AllocatorConfig::parse`] can produce.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let defaults = AllocatorConfig::default();
        let mut pairs = PairWriter { f, first: true };
        if self.backend != defaults.backend {
            pairs.pair("backend", self.backend)?;
        }
        if self.max_split_size != defaults.max_split_size {
            pairs.pair("max_split_size_mb", self.max_split_size / MB)?;
        }
        if self.large_segment_size != defaults.large_segment_size {
            pairs.pair("large_segment_size_mb", self.large_segment_size / MB)?;
        }
        // Parsing resets the rounding limit to the large segment size before reading this key.
        if self.max_non_split_rounding_size != self.large_segment_size {
            pairs.pair(
                "max_non_split_rounding_mb",
                self.max_non_split_rounding_size / MB,
            )?;
        }
        if self.roundup_power2_divisions != defaults.roundup_power2_divisions {
            pairs.pair(
                "roundup_power2_divisions",
                DivisionsText(&self.roundup_power2_divisions),
            )?;
        }
        if self.garbage_collection_threshold != defaults.garbage_collection_threshold {
            pairs.pair(
                "garbage_collection_threshold",
                self.garbage_collection_threshold,
            )?;
        }
        let flags = [
            (
                "expandable_segments",
                self.expandable_segments,
                defaults.expandable_segments,
            ),
            (
                "release_lock_on_cudamalloc",
                self.release_lock_on_cudamalloc,
                defaults.release_lock_on_cudamalloc,
            ),
            (
                "pinned_use_cuda_host_register",
                self.pinned_use_cuda_host_register,
                defaults.pinned_use_cuda_host_register,
            ),
            (
                "pinned_use_background_threads",
                self.pinned_use_background_threads,
                defaults.pinned_use_background_threads,
            ),
            (
                "graph_capture_record_stream_reuse",
                self.graph_capture_record_stream_reuse,
                defaults.graph_capture_record_stream_reuse,
            ),
            (
                "pinned_free_catch_all",
                self.pinned_free_catch_all,
                defaults.pinned_free_catch_all,
            ),
            (
                "throw_on_cudamalloc_oom",
                self.throw_on_cudamalloc_oom,
                defaults.throw_on_cudamalloc_oom,
            ),
        ];
        for (key, value, default) in flags {
            if value != default {
                pairs.pair(key, if value { "True" } else { "False" })?;
            }
        }
        if self.pinned_num_register_threads != defaults.pinned_num_register_threads {
            pairs.pair(
                "pinned_num_register_threads",
                self.pinned_num_register_threads,
            )?;
        }
        if self.pinned_reserve_segment_size_mb != defaults.pinned_reserve_segment_size_mb {
            pairs.pair(
                "pinned_reserve_segment_size_mb",
                self.pinned_reserve_segment_size_mb,
            )?;
        }
        if self.pinned_max_round_threshold != defaults.pinned_max_round_threshold {
            pairs.pair(
                "pinned_max_round_threshold_mb",
                self.pinned_max_round_threshold / MB,
            )?;
        }
        if self.pinned_max_cached_size != defaults.pinned_max_cached_size {
            pairs.pair(
                "pinned_max_cached_size_mb",
                self.pinned_max_cached_size / MB,
            )?;
        }
        if self.per_process_memory_fraction != defaults.per_process_memory_fraction {
            pairs.pair(
                "per_process_memory_fraction",
                self.per_process_memory_fraction,
            )?;
        }
        for (key, value) in &self.other {
            pairs.pair(key, value)?;
        }
        Ok(())
    }
}

/// Writes `key:value` pairs separated by commas.
struct PairWriter<'a, 'b> {
    f: &'a mut fmt::Formatter<'b>,
    first: bool,
}

impl PairWriter<'_, '_> {
    fn pair(&mut self, key: &str, value: impl fmt::Display) -> fmt::Result {
        if !self.first {
            self.f.write_str(",")?;
        }
        self.first = false;
        write!(self.f, "{key}:{value}")
    }
}

/// The shortest `roundup_power2_divisions` value that parses back to the given table.
///
/// The list form sets, for its first entry `2^k:v`, intervals `0..=k` to `v`; each later `2^i:v` sets
/// interval `i` only; `>:v` sets every interval after the last one listed. Intervals not mentioned keep 0.
struct DivisionsText<'a>(&'a [usize; ROUNDUP_POWER2_INTERVALS]);

impl fmt::Display for DivisionsText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let table = self.0;
        let last = ROUNDUP_POWER2_INTERVALS - 1;
        // End of the leading run (inclusive) and start of the trailing run.
        let lead_end = table.iter().take_while(|&&v| v == table[0]).count() - 1;
        if lead_end == last {
            // Every interval alike: the single-value form (0 cannot be written that way, but an all-zero
            // table is the default and is not written at all).
            return if table[0] == 0 {
                f.write_str("[1:0]")
            } else {
                write!(f, "{}", table[0])
            };
        }
        let tail_start = last + 1
            - table
                .iter()
                .rev()
                .take_while(|&&v| v == table[last])
                .count();
        // A non-zero trailing run is written as `>:v`; a zero one is left out (intervals default to 0).
        let use_tail = table[last] != 0;
        let explicit_end = if use_tail {
            tail_start
        } else {
            ROUNDUP_POWER2_INTERVALS
        };
        write!(f, "[{}:{}", 1u64 << lead_end, table[0])?;
        for (index, &value) in table
            .iter()
            .enumerate()
            .take(explicit_end)
            .skip(lead_end + 1)
        {
            // Zeros need not be written, except the entry just before `>` (which starts after it).
            if value != 0 || (use_tail && index + 1 == tail_start) {
                write!(f, ",{}:{}", 1u64 << index, value)?;
            }
        }
        if use_tail {
            write!(f, ",>:{}", table[last])?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod async_backend_tests;
#[cfg(test)]
mod tests;
