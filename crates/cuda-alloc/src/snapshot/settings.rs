//! `allocator_settings` and [`AllocatorConfig`]: what a snapshot records of the configuration, both ways.

use super::model::AllocatorSettings;
use super::{SnapshotError, SnapshotResult};
use crate::config::{AllocatorConfig, ROUNDUP_POWER2_INTERVALS};

impl AllocatorSettings {
    /// The settings PyTorch records for `config`. `config_string` is the canonical string of `config`.
    #[must_use]
    pub fn from_config(config: &AllocatorConfig) -> AllocatorSettings {
        AllocatorSettings {
            config_string: Some(config.to_string()),
            max_split_size: Some(recorded_max_split_size(config.max_split_size)),
            garbage_collection_threshold: Some(config.garbage_collection_threshold),
            expandable_segments: Some(config.expandable_segments),
            pinned_num_register_threads: Some(config.pinned_num_register_threads as u64),
            release_lock_on_cudamalloc: Some(config.release_lock_on_cudamalloc),
            pinned_use_cuda_host_register: Some(config.pinned_use_cuda_host_register),
            graph_capture_record_stream_reuse: Some(config.graph_capture_record_stream_reuse),
            roundup_power2_divisions: Some(
                config
                    .roundup_power2_divisions
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| (1u64 << i, d as u64))
                    .collect(),
            ),
            other: Vec::new(),
        }
    }

    /// The configuration the snapshot's allocator ran with: the recorded configuration string parsed, then
    /// overridden by every setting recorded on its own (those are what the allocator used; the string
    /// also carries settings PyTorch does not record separately, such as `max_non_split_rounding_mb`).
    ///
    /// # Errors
    /// [`SnapshotError::Config`] when the recorded string does not parse (a newer PyTorch's key) or a
    /// recorded value is out of range.
    pub fn to_config(&self) -> SnapshotResult<AllocatorConfig> {
        let mut config = match &self.config_string {
            Some(text) => AllocatorConfig::parse(text).map_err(|source| SnapshotError::Config {
                reason: format!("its configuration string '{text}' does not parse"),
                source: Some(source),
            })?,
            None => AllocatorConfig::default(),
        };
        if let Some(max_split) = self.max_split_size {
            config.max_split_size = max_split_size_from_record(max_split)?;
        }
        if let Some(threshold) = self.garbage_collection_threshold {
            config.garbage_collection_threshold = threshold;
        }
        if let Some(flag) = self.expandable_segments {
            config.expandable_segments = flag;
        }
        if let Some(threads) = self.pinned_num_register_threads {
            config.pinned_num_register_threads = usize::try_from(threads).unwrap_or(usize::MAX);
        }
        if let Some(flag) = self.release_lock_on_cudamalloc {
            config.release_lock_on_cudamalloc = flag;
        }
        if let Some(flag) = self.pinned_use_cuda_host_register {
            config.pinned_use_cuda_host_register = flag;
        }
        if let Some(flag) = self.graph_capture_record_stream_reuse {
            config.graph_capture_record_stream_reuse = flag;
        }
        if let Some(table) = &self.roundup_power2_divisions {
            let mut divisions = [0usize; ROUNDUP_POWER2_INTERVALS];
            for &(start_mb, d) in table {
                let interval = if start_mb.is_power_of_two() {
                    start_mb.ilog2() as usize
                } else {
                    usize::MAX
                };
                let slot = divisions.get_mut(interval).ok_or_else(|| SnapshotError::Config {
                    reason: format!(
                        "roundup_power2_divisions has an interval starting at {start_mb} MiB; expected powers of two \
                         from 1 to {}",
                        1u64 << (ROUNDUP_POWER2_INTERVALS - 1)
                    ),
                    source: None,
                })?;
                *slot = usize::try_from(d).unwrap_or(usize::MAX);
            }
            config.roundup_power2_divisions = divisions;
        }
        Ok(config)
    }
}

/// `max_split_size` as PyTorch records it: the `size_t` converted to `int64_t`, so that "unlimited"
/// (`SIZE_MAX`) reads -1 and a clamped huge `max_split_size_mb` (`SIZE_MAX / MB * MB`) reads -1048576.
fn recorded_max_split_size(bytes: usize) -> i64 {
    // Two's-complement reinterpretation, as the C++ conversion: the inverse is `max_split_size_from_record`.
    bytes as u64 as i64
}

/// The inverse of [`recorded_max_split_size`]: a negative record is a `size_t` beyond `i64::MAX`.
fn max_split_size_from_record(recorded: i64) -> SnapshotResult<usize> {
    usize::try_from(recorded as u64).map_err(|_| SnapshotError::Config {
        reason: format!("max_split_size {recorded} does not fit this machine's address space"),
        source: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_split_size_is_recorded_as_pytorch_converts_it_and_reads_back_exactly() {
        let clamped = usize::MAX / (1 << 20) * (1 << 20); // max_split_size_mb beyond size_t's range
        for (bytes, recorded) in [
            (usize::MAX, -1),
            (clamped, -(1 << 20)),
            (200 << 20, 200 << 20),
        ] {
            assert_eq!(recorded_max_split_size(bytes), recorded);
            assert_eq!(max_split_size_from_record(recorded).unwrap(), bytes);
        }
    }

    #[test]
    fn a_huge_max_split_size_survives_the_snapshot_settings() {
        let config = AllocatorConfig::parse("max_split_size_mb:488888888888888888").unwrap();
        let settings = AllocatorSettings::from_config(&config);
        let restored = settings.to_config().unwrap();
        assert_eq!(restored.max_split_size, config.max_split_size);
        assert_eq!(AllocatorSettings::from_config(&restored), settings);
    }
}
