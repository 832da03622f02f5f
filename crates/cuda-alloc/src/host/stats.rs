//! The host allocator's statistics, under the keys of `torch.cuda.host_memory_stats()`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::stats::Stat;

/// A duration statistic (`host_alloc_time`, `host_free_time`): PyTorch's `DurationStat`, in
/// microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DurationStat {
    /// Sum of the durations.
    pub total: i64,
    /// The longest.
    pub max: i64,
    /// The shortest (0 before the first).
    pub min: i64,
    /// How many.
    pub count: i64,
}

impl DurationStat {
    pub(crate) fn add(&mut self, took: Duration) {
        let us = i64::try_from(took.as_micros()).unwrap_or(i64::MAX);
        self.total = self.total.saturating_add(us);
        self.max = self.max.max(us);
        self.min = if self.count == 0 {
            us
        } else {
            self.min.min(us)
        };
        self.count += 1;
    }

    /// The mean, 0 before the first.
    #[must_use]
    pub fn avg(&self) -> i64 {
        if self.count == 0 {
            0
        } else {
            self.total / self.count
        }
    }
}

/// `torch.cuda.host_memory_stats()`: what the pinned host allocator holds and hands out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    /// `allocations`: blocks held from the system (handed out or cached).
    pub allocations: Stat,
    /// `allocated_bytes`: their bytes.
    pub allocated_bytes: Stat,
    /// `active_requests`: blocks handed out (or freed but still used by streams).
    pub active_requests: Stat,
    /// `active_bytes`: their bytes.
    pub active_bytes: Stat,
    /// `num_host_alloc`: system allocations (`cuMemHostAlloc` / register) made.
    pub num_host_alloc: i64,
    /// `num_host_free`: system allocations returned.
    pub num_host_free: i64,
    /// `host_alloc_time`: time spent allocating from the system, in µs.
    pub host_alloc_time: DurationStat,
    /// `host_free_time`: time spent returning memory to the system, in µs.
    pub host_free_time: DurationStat,
}

impl HostStats {
    /// The flat keys of `torch.cuda.host_memory_stats()` (`"allocations.current"`,
    /// `"host_alloc_time.avg"`, ...).
    #[must_use]
    pub fn to_flat(&self) -> BTreeMap<String, i64> {
        let mut flat = BTreeMap::new();
        for (name, stat) in [
            ("allocations", &self.allocations),
            ("allocated_bytes", &self.allocated_bytes),
            ("active_requests", &self.active_requests),
            ("active_bytes", &self.active_bytes),
        ] {
            flat.insert(format!("{name}.current"), stat.current);
            flat.insert(format!("{name}.peak"), stat.peak);
            flat.insert(format!("{name}.allocated"), stat.allocated);
            flat.insert(format!("{name}.freed"), stat.freed);
        }
        flat.insert("num_host_alloc".to_owned(), self.num_host_alloc);
        flat.insert("num_host_free".to_owned(), self.num_host_free);
        for (name, d) in [
            ("host_alloc_time", &self.host_alloc_time),
            ("host_free_time", &self.host_free_time),
        ] {
            flat.insert(format!("{name}.total"), d.total);
            flat.insert(format!("{name}.max"), d.max);
            flat.insert(format!("{name}.min"), d.min);
            flat.insert(format!("{name}.count"), d.count);
            flat.insert(format!("{name}.avg"), d.avg());
        }
        flat
    }
}

/// Moves a [`Stat`] by `amount` (negative: down), keeping its peak and its allocated/freed sums.
pub(crate) fn adjust(stat: &mut Stat, amount: i64) {
    stat.current += amount;
    if amount > 0 {
        stat.allocated += amount;
        stat.peak = stat.peak.max(stat.current);
    } else {
        stat.freed -= amount;
    }
}
