//! Tokenizing and parsing a configuration string into an [`AllocatorConfig`].
//!
//! The grammar is PyTorch's: the string splits into tokens at `,` `:` `[` `]` (each its own token),
//! ASCII whitespace is dropped everywhere (also inside words), and the tokens form `key:value` pairs
//! separated by `,`, where a value is one token or a bracketed list. Numbers are read as PyTorch
//! reads them ([`number`](super::number)). Token indices in error messages count every token from 0,
//! as PyTorch's do.

use super::number::{self, NumberError, Prefix};
use super::{
    AllocatorConfig, Backend, ConfigError, ConfigResult, KNOWN_KEYS,
    LARGE_SEGMENT_EXCLUSIVE_MIN_MB, MAX_PINNED_REGISTER_THREADS, MB,
};

/// Splits a configuration string into tokens.
fn tokenize(config: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    for ch in config.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                tokens.push(std::mem::take(&mut word));
            }
            tokens.push(ch.to_string());
        } else if !u8::try_from(ch).is_ok_and(number::is_c_space) {
            word.push(ch);
        }
    }
    if !word.is_empty() {
        tokens.push(word);
    }
    tokens
}

/// A cursor over the tokens.
struct Tokens {
    tokens: Vec<String>,
}

impl Tokens {
    fn get(&self, index: usize) -> Option<&str> {
        self.tokens.get(index).map(String::as_str)
    }

    /// Checks that token `index` is the separator `expected`.
    fn expect(&self, index: usize, expected: char) -> ConfigResult<()> {
        let found = self.get(index);
        let mut buf = [0u8; 4];
        if found == Some(&*expected.encode_utf8(&mut buf)) {
            return Ok(());
        }
        Err(ConfigError::ExpectedToken {
            expected,
            after: index
                .checked_sub(1)
                .and_then(|i| self.get(i))
                .unwrap_or_default()
                .to_owned(),
            found: found.map(str::to_owned),
        })
    }

    /// The value token at `index` for `key`.
    fn value(&self, index: usize, key: &str) -> ConfigResult<&str> {
        self.get(index).ok_or_else(|| ConfigError::MissingValue {
            key: key.to_owned(),
        })
    }

    fn unsigned(&self, index: usize, key: &str) -> ConfigResult<u64> {
        let text = self.value(index, key)?;
        parse_unsigned(text, key)
    }

    fn float(&self, index: usize, key: &str) -> ConfigResult<f64> {
        let text = self.value(index, key)?;
        let read = number::stod(text).map_err(|error| ConfigError::InvalidNumber {
            key: key.to_owned(),
            value: text.to_owned(),
            expected: match error {
                NumberError::NoNumber => "a decimal number such as 0.5",
                NumberError::OutOfRange => "a decimal number within a double's range",
            },
        })?;
        warn_if_partly_read(key, text, &read);
        Ok(read.value)
    }

    fn boolean(&self, index: usize, key: &str) -> ConfigResult<bool> {
        match self.value(index, key)? {
            "True" => Ok(true),
            "False" => Ok(false),
            other => Err(ConfigError::ExpectedBool {
                index,
                found: other.to_owned(),
            }),
        }
    }
}

/// A whole number as PyTorch reads it (`std::stoull`: `64abc` is 64, `-1` is 2^64 - 1).
fn parse_unsigned(text: &str, key: &str) -> ConfigResult<u64> {
    let read = number::stoull(text).map_err(|error| ConfigError::InvalidNumber {
        key: key.to_owned(),
        value: text.to_owned(),
        expected: match error {
            NumberError::NoNumber => "a whole number",
            NumberError::OutOfRange => "a whole number of at most 2^64 - 1",
        },
    })?;
    warn_if_partly_read(key, text, &read);
    Ok(read.value)
}

/// PyTorch takes a number from the start of a value and ignores the rest, and wraps a negative
/// whole number around; so does this parser, and it says so where that happened.
fn warn_if_partly_read<T: std::fmt::Display>(key: &str, text: &str, read: &Prefix<T>) {
    if read.len < text.len() || read.wrapped {
        tracing::warn!(
            key,
            value = text,
            read = %read.value,
            "read a configuration value as PyTorch reads it (the number it starts with, a negative \
             whole number wrapped around to 2^64 minus its magnitude): write the number alone"
        );
    }
}

/// Applies every `key:value` pair of `config` to `target`, in order. Returns whether any option of the
/// native allocator (any key but `backend`) was given.
///
/// As in PyTorch, `large_segment_size_mb` is applied before the other keys wherever it stands: it
/// resets `max_non_split_rounding_mb` and is the smallest value `max_split_size_mb` and
/// `max_non_split_rounding_mb` accept, so those two are checked once every pair is read.
///
/// Keys outside `scope` are checked to be known and well formed (a value, or a closed list) and
/// otherwise left alone, as PyTorch's device-generic and CUDA parsers each skip the other's keys.
pub(super) fn apply_tokens(
    target: &mut AllocatorConfig,
    config: &str,
    scope: Scope,
) -> ConfigResult<bool> {
    let tokens = Tokens {
        tokens: tokenize(config),
    };
    let mut native_options = false;
    let mut large_segment_given = false;
    let mut max_split_mb = None;
    let mut max_non_split_mb = None;
    let mut i = 0;
    while i < tokens.tokens.len() {
        let key = tokens.tokens[i].clone();
        if !KNOWN_KEYS.contains(&key.as_str()) {
            return Err(ConfigError::UnknownKey { key });
        }
        tokens.expect(i + 1, ':')?;
        let value = i + 2;
        // Each arm leaves `i` on the last token of the value.
        i = value;
        let skipped = !scope.covers(&key);
        if skipped {
            i = skip_value(&tokens, value, &key)?;
        }
        match key.as_str() {
            _ if skipped => {}
            "backend" => {
                target.backend = match tokens.value(value, &key)? {
                    "native" => Backend::Native,
                    "cudaMallocAsync" => Backend::CudaMallocAsync,
                    other => {
                        return Err(ConfigError::UnknownBackend {
                            value: other.to_owned(),
                        })
                    }
                };
            }
            "max_split_size_mb" => max_split_mb = Some(tokens.unsigned(value, &key)?),
            "max_non_split_rounding_mb" => max_non_split_mb = Some(tokens.unsigned(value, &key)?),
            "large_segment_size_mb" => {
                let mb = tokens.unsigned(value, &key)?;
                if mb <= LARGE_SEGMENT_EXCLUSIVE_MIN_MB {
                    return Err(ConfigError::LargeSegmentSizeTooSmall { mb });
                }
                target.large_segment_size = megabytes(mb);
                large_segment_given = true;
            }
            "garbage_collection_threshold" => {
                let threshold = tokens.float(value, &key)?;
                if !(threshold > 0.0 && threshold < 1.0) {
                    return Err(ConfigError::GarbageCollectionThreshold { value: threshold });
                }
                target.garbage_collection_threshold = threshold;
            }
            "roundup_power2_divisions" => {
                i = parse_divisions(&tokens, value, &mut target.roundup_power2_divisions)?;
            }
            "expandable_segments" => target.expandable_segments = tokens.boolean(value, &key)?,
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                target.release_lock_on_cudamalloc = tokens.boolean(value, &key)?;
            }
            "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                target.pinned_use_cuda_host_register = tokens.boolean(value, &key)?;
            }
            "pinned_num_register_threads" => {
                let threads = tokens.unsigned(value, &key)?;
                if !threads.is_power_of_two() {
                    return Err(ConfigError::RegisterThreadsNotPowerOf2 { value: threads });
                }
                if threads > MAX_PINNED_REGISTER_THREADS as u64 {
                    return Err(ConfigError::TooManyRegisterThreads { value: threads });
                }
                target.pinned_num_register_threads = threads as usize;
            }
            "pinned_use_background_threads" => {
                target.pinned_use_background_threads = tokens.boolean(value, &key)?;
            }
            "pinned_reserve_segment_size_mb" => {
                let mb = tokens.unsigned(value, &key)?;
                if mb == 0 {
                    return Err(ConfigError::PinnedReserveSegmentSizeZero);
                }
                target.pinned_reserve_segment_size_mb = usize::try_from(mb).unwrap_or(usize::MAX);
            }
            "pinned_max_round_threshold_mb" => {
                target.pinned_max_round_threshold = megabytes(tokens.unsigned(value, &key)?);
            }
            "pinned_max_cached_size_mb" => {
                target.pinned_max_cached_size = megabytes(tokens.unsigned(value, &key)?);
            }
            "graph_capture_record_stream_reuse" => {
                target.graph_capture_record_stream_reuse = tokens.boolean(value, &key)?;
            }
            "per_process_memory_fraction" => {
                let fraction = tokens.float(value, &key)?;
                if !(0.0..=1.0).contains(&fraction) {
                    return Err(ConfigError::MemoryFraction { value: fraction });
                }
                target.per_process_memory_fraction = fraction;
            }
            "pinned_free_catch_all" => {
                target.pinned_free_catch_all = tokens.boolean(value, &key)?
            }
            "throw_on_cudamalloc_oom" => {
                target.throw_on_cudamalloc_oom = tokens.boolean(value, &key)?
            }
            "expandable_segments_reserve" => {
                let text = tokens.value(value, &key)?;
                // PyTorch ignores a malformed reserve (with a warning) and keeps the default.
                if reserve_spec(text, &key) {
                    target.other.insert(key.clone(), text.to_owned());
                }
            }
            "expandable_segments_reserve_by_class" => {
                let (text, end) = reserve_classes(&tokens, value, &key)?;
                target.other.insert(key.clone(), text);
                i = end;
            }
            _ => return Err(ConfigError::UnknownKey { key }),
        }
        native_options |= !skipped && key != "backend";
        if i + 1 < tokens.tokens.len() {
            tokens.expect(i + 1, ',')?;
            i += 1;
        }
        i += 1;
    }
    if large_segment_given {
        target.max_non_split_rounding_size = target.large_segment_size;
    }
    let min_mb = (target.large_segment_size / MB) as u64;
    if let Some(mb) = max_split_mb {
        if mb < min_mb {
            return Err(ConfigError::MaxSplitSizeTooSmall { mb, min_mb });
        }
        target.max_split_size = megabytes(mb);
    }
    if let Some(mb) = max_non_split_mb {
        if mb < min_mb {
            return Err(ConfigError::MaxNonSplitRoundingTooSmall { mb, min_mb });
        }
        target.max_non_split_rounding_size = megabytes(mb);
    }
    Ok(native_options)
}

/// Which keys a parse acts on: PyTorch reads its device-generic keys and its CUDA keys
/// ([`CUDA_KEYS`](super::CUDA_KEYS)) from different variables when more than one is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scope {
    /// Every key.
    All,
    /// Every key but the CUDA keys.
    Generic,
    /// Only the CUDA keys.
    Cuda,
}

impl Scope {
    fn covers(self, key: &str) -> bool {
        let cuda = super::CUDA_KEYS.contains(&key);
        match self {
            Scope::All => true,
            Scope::Generic => !cuda,
            Scope::Cuda => cuda,
        }
    }
}

/// Skips the value of `key` at token `index` (one token, or a list to its `]`); returns the index
/// of its last token.
fn skip_value(tokens: &Tokens, index: usize, key: &str) -> ConfigResult<usize> {
    if tokens.value(index, key)? != "[" {
        return Ok(index);
    }
    (index + 1..tokens.tokens.len())
        .find(|&i| tokens.get(i) == Some("]"))
        .ok_or(ConfigError::UnclosedList)
}

/// A `*_mb` size in bytes, capped at what `usize` can hold (PyTorch caps at `SIZE_MAX / 1 MiB` MiB).
fn megabytes(mb: u64) -> usize {
    let mb = usize::try_from(mb)
        .unwrap_or(usize::MAX)
        .min(usize::MAX / MB);
    mb * MB
}

/// Whether `text` is a valid expandable-segment reserve (PyTorch's `parseReserveSpec`): a positive,
/// finite fraction of the device's memory (`0.5`), or a size in GiB with a `G` or `g` suffix (`40G`).
/// Logs a warning naming `key` for anything else, as PyTorch does before ignoring the value.
fn reserve_spec(text: &str, key: &str) -> bool {
    let number = text.strip_suffix(['G', 'g']).unwrap_or(text);
    let valid = number
        .parse::<f64>()
        .is_ok_and(|value| value.is_finite() && value > 0.0);
    if !valid {
        tracing::warn!(
            key,
            value = text,
            "ignoring an invalid expandable-segment reserve: write a positive fraction of the \
             device's memory such as 0.5, or a size in GiB such as 40G"
        );
    }
    valid
}

/// Parses an `expandable_segments_reserve_by_class` list (`[name:reserve,...]`) starting at token
/// `index`: returns the list of its valid entries as text (a malformed reserve is left out with a
/// warning, as PyTorch leaves it out) and the index of the closing `]`.
fn reserve_classes(tokens: &Tokens, index: usize, key: &str) -> ConfigResult<(String, usize)> {
    tokens.value(index, key)?;
    tokens.expect(index, '[')?;
    let mut entries = Vec::new();
    let mut i = index;
    loop {
        i += 1;
        let name = tokens.get(i).ok_or(ConfigError::UnclosedList)?;
        if name == "]" {
            break;
        }
        tokens.expect(i + 1, ':')?;
        let reserve = tokens.get(i + 2).ok_or(ConfigError::UnclosedList)?;
        if reserve_spec(reserve, key) {
            entries.push(format!("{name}:{reserve}"));
        }
        i += 2;
        match tokens.get(i + 1) {
            Some("]") => {}
            Some(_) => {
                tokens.expect(i + 1, ',')?;
                i += 1;
            }
            None => return Err(ConfigError::UnclosedList),
        }
    }
    Ok((format!("[{}]", entries.join(",")), i))
}

/// Parses a `roundup_power2_divisions` value starting at token `index` into `table`; returns the index of
/// the value's last token.
///
/// A single number `n` (a power of two) sets every interval. The list form `[b:n, ..., >:n]` takes
/// boundaries `b` in MiB (powers of two): its first entry also sets every interval below its own, later
/// entries set their own interval, and `>` sets every interval after the last boundary listed.
fn parse_divisions(tokens: &Tokens, index: usize, table: &mut [usize]) -> ConfigResult<usize> {
    const KEY: &str = "roundup_power2_divisions";
    if tokens.value(index, KEY)? != "[" {
        let divisions = tokens.unsigned(index, KEY)?;
        if !divisions.is_power_of_two() {
            return Err(ConfigError::DivisionsNotPowerOf2 {
                value: divisions,
                in_list: false,
            });
        }
        table.fill(usize::try_from(divisions).unwrap_or(usize::MAX));
        return Ok(index);
    }
    let mut i = index;
    let mut last_index = 0;
    let mut first = true;
    loop {
        i += 1;
        let boundary = tokens.get(i).ok_or(ConfigError::UnclosedList)?;
        if boundary == "]" {
            return Ok(i);
        }
        tokens.expect(i + 1, ':')?;
        i += 2;
        let divisions = match tokens.get(i) {
            Some(text) => parse_unsigned(text, KEY)?,
            None => return Err(ConfigError::UnclosedList),
        };
        if divisions != 0 && !divisions.is_power_of_two() {
            return Err(ConfigError::DivisionsNotPowerOf2 {
                value: divisions,
                in_list: true,
            });
        }
        let divisions = usize::try_from(divisions).unwrap_or(usize::MAX);
        if boundary == ">" {
            // PyTorch fills from the interval after the last one listed (from 1 when none was).
            if let Some(rest) = table.get_mut(last_index + 1..) {
                rest.fill(divisions);
            }
        } else {
            let boundary_mb = parse_unsigned(boundary, KEY)?;
            if !boundary_mb.is_power_of_two() {
                return Err(ConfigError::IntervalNotPowerOf2 {
                    boundary: boundary_mb,
                });
            }
            let interval = (boundary_mb.ilog2() as usize).min(table.len() - 1);
            if first {
                table[..interval].fill(divisions);
                first = false;
            }
            table[interval] = divisions;
            last_index = interval;
        }
        match tokens.get(i + 1) {
            Some("]") => {}
            Some(_) => {
                tokens.expect(i + 1, ',')?;
                i += 1;
            }
            None => return Err(ConfigError::UnclosedList),
        }
    }
}
