//! Memory statistics: every counter of `torch.cuda.memory_stats()`, with its key names.
//!
//! [`MemoryStats`] is the typed form; [`MemoryStats::to_flat`] gives the flat map PyTorch's
//! `memory_stats()` returns (`"allocated_bytes.all.current"`, `"num_alloc_retries"`, ...).
//!
//! # How the figures are kept
//!
//! PyTorch updates its statistics under its device lock. Here every stream keeps its own figures,
//! written under that stream's lock only, and a device-wide value is the sum over streams, computed
//! when read. Peaks (the highest a *sum* has been) stay exact without touching the other streams on
//! every call: each stream holds a limit per figure, the limits add up to at most the recorded peak,
//! and only an increase past its stream's limit takes a device-wide lock to sum the figure, raise the
//! peak if needed and hand out limits again. A caller on one thread therefore sees exactly PyTorch's
//! peaks; with several threads a peak may lag the true maximum by the increases that race with a
//! redistribution of limits (until the shard that rose increases again), and is never below the
//! current value.

pub(crate) mod peaks;

use std::collections::BTreeMap;

/// One statistic: its current value, its highest value since the last peak reset, and the totals
/// added and removed since the last accumulated reset (PyTorch's `Stat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: i64,
    /// The highest value since creation or the last [`reset_peak_stats`](crate::CachingAllocator::reset_peak_stats).
    pub peak: i64,
    /// Total added since the last accumulated reset.
    pub allocated: i64,
    /// Total removed since the last accumulated reset.
    pub freed: i64,
}

/// A statistic for all pools together and for the small and large pools separately (PyTorch's
/// `StatArray`, indexed by `StatType`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Both pools (`all`).
    pub all: Stat,
    /// The small pool (`small_pool`: requests of at most 1 MiB).
    pub small_pool: Stat,
    /// The large pool (`large_pool`).
    pub large_pool: Stat,
}

/// The allocator's statistics for one device (PyTorch's `DeviceStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Allocations handed out to callers (count).
    pub allocation: StatArray,
    /// Segments obtained from the device with `malloc` (count; expandable segments are not counted).
    pub segment: StatArray,
    /// Active blocks: allocated, or freed while other streams still use them (count).
    pub active: StatArray,
    /// Free blocks that are part of a split segment and so cannot be returned to the device (count;
    /// not counted in expandable segments).
    pub inactive_split: StatArray,
    /// Bytes in allocated blocks.
    pub allocated_bytes: StatArray,
    /// Bytes obtained from the device (segments plus mapped expandable memory).
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes callers asked for (before rounding) in active blocks.
    pub requested_bytes: StatArray,
    /// Device allocations that failed and were retried after releasing every cached block.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors raised.
    pub num_ooms: i64,
    /// Allocated blocks of at least `max_split_size` bytes (count).
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size` bytes (count).
    pub oversize_segments: Stat,
    /// Times every outstanding event was waited for (`synchronize_and_free_events`).
    pub num_sync_all_streams: i64,
    /// Device memory allocations: `malloc` calls plus expandable-segment mappings.
    pub num_device_alloc: i64,
    /// Device memory releases: `free` calls plus expandable-segment unmappings.
    pub num_device_free: i64,
    /// The `max_split_size` setting when the allocator was created (`-1`: unlimited).
    pub max_split_size: i64,
}

impl MemoryStats {
    /// The statistics PyTorch's `backend:cudaMallocAsync` reports from its memory pool's figures:
    /// used memory `(current, high)` as `allocated_bytes.all` and `active_bytes.all`, reserved
    /// memory `(current, high)` as `reserved_bytes.all`, every other figure 0.
    ///
    /// ```
    /// use tensormem_cuda_alloc::stats::MemoryStats;
    ///
    /// let stats = MemoryStats::from_pool_usage((3 << 20, 5 << 20), (4 << 20, 6 << 20));
    /// assert_eq!(stats.allocated_bytes.all.peak, 5 << 20);
    /// assert_eq!(stats.reserved_bytes.all.current, 4 << 20);
    /// assert_eq!(stats.num_alloc_retries, 0);
    /// ```
    #[must_use]
    pub fn from_pool_usage(used: (u64, u64), reserved: (u64, u64)) -> MemoryStats {
        let stat = |(current, peak): (u64, u64)| Stat {
            current: i64::try_from(current).unwrap_or(i64::MAX),
            peak: i64::try_from(peak).unwrap_or(i64::MAX),
            allocated: 0,
            freed: 0,
        };
        let mut stats = MemoryStats::default();
        stats.allocated_bytes.all = stat(used);
        stats.active_bytes.all = stat(used);
        stats.reserved_bytes.all = stat(reserved);
        stats
    }

    /// The statistics under the flat key names of `torch.cuda.memory_stats()`, sorted by key:
    /// `"<stat>.<all|small_pool|large_pool>.<current|peak|allocated|freed>"` for the nine arrays,
    /// `"oversize_allocations.<...>"` and `"oversize_segments.<...>"`, and the plain counters
    /// `"num_alloc_retries"`, `"num_ooms"`, `"num_sync_all_streams"`, `"num_device_alloc"`,
    /// `"num_device_free"`, `"max_split_size"`.
    #[must_use]
    pub fn to_flat(&self) -> BTreeMap<String, i64> {
        let mut flat = BTreeMap::new();
        let mut stat = |prefix: &str, s: &Stat| {
            for (name, value) in [
                ("current", s.current),
                ("peak", s.peak),
                ("allocated", s.allocated),
                ("freed", s.freed),
            ] {
                flat.insert(format!("{prefix}.{name}"), value);
            }
        };
        for (name, array) in self.arrays() {
            stat(&format!("{name}.all"), &array.all);
            stat(&format!("{name}.small_pool"), &array.small_pool);
            stat(&format!("{name}.large_pool"), &array.large_pool);
        }
        stat("oversize_allocations", &self.oversize_allocations);
        stat("oversize_segments", &self.oversize_segments);
        for (name, value) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("max_split_size", self.max_split_size),
        ] {
            flat.insert(name.to_owned(), value);
        }
        flat
    }

    /// The nine per-pool statistics with their PyTorch names.
    #[must_use]
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_keys_are_pytorchs() {
        let mut stats = MemoryStats {
            max_split_size: -1,
            ..MemoryStats::default()
        };
        stats.allocated_bytes.all.peak = 42;
        let flat = stats.to_flat();
        assert_eq!(flat.len(), 9 * 3 * 4 + 2 * 4 + 6);
        assert_eq!(flat["allocated_bytes.all.peak"], 42);
        assert_eq!(flat["max_split_size"], -1);
        for key in [
            "requested_bytes.small_pool.freed",
            "inactive_split_bytes.large_pool.current",
            "oversize_allocations.peak",
            "oversize_segments.allocated",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
            "num_ooms",
            "num_alloc_retries",
        ] {
            assert!(flat.contains_key(key), "{key}");
        }
    }
}
