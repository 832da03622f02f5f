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
            max_split_size: Some(i64::try_from(config.max_split_size).unwrap_or(-1)),
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
            config.max_split_size = if max_split < 0 {
                usize::MAX
            } else {
                usize::try_from(max_split).map_err(|_| SnapshotError::Config {
                    reason: format!(
                        "max_split_size {max_split} does not fit this machine's address space"
                    ),
                    source: None,
                })?
            };
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
