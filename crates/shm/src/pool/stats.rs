//! The pool's statistics, in the caching allocator's style (`memory_stats()`): every figure has a
//! current value, its peak, and the running totals allocated and freed.

/// One figure: `current`, `peak`, and the totals `allocated` and `freed` (so
/// `current == allocated - freed`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    /// Now.
    pub current: u64,
    /// The highest `current` seen (see [`ShmPool::reset_peak_stats`](super::ShmPool::reset_peak_stats)).
    pub peak: u64,
    /// Everything ever added.
    pub allocated: u64,
    /// Everything ever removed.
    pub freed: u64,
}

impl Stat {
    pub(crate) fn add(&mut self, amount: u64) {
        self.current += amount;
        self.allocated += amount;
        self.peak = self.peak.max(self.current);
    }

    pub(crate) fn sub(&mut self, amount: u64) {
        debug_assert!(self.current >= amount, "stat would go negative");
        self.current = self.current.saturating_sub(amount);
        self.freed += amount;
    }
}

/// What a [`ShmPool`](super::ShmPool) holds and has done.
///
/// - `reserved_bytes` / `regions`: every region the pool holds (cached or in use), by capacity;
/// - `in_use_bytes`: regions handed out and not yet back (held by a [`PoolBuffer`](super::PoolBuffer)
///   or by a consumer's lease);
/// - `cached_bytes`: regions kept for reuse (`reserved - in_use`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes of all regions the pool holds.
    pub reserved_bytes: Stat,
    /// Bytes of regions handed out.
    pub in_use_bytes: Stat,
    /// Bytes of regions kept for reuse.
    pub cached_bytes: Stat,
    /// Number of regions the pool holds.
    pub regions: Stat,
    /// Requests served (`alloc`, `alloc_zeroed`, `copy_from_bytes`).
    pub requests: u64,
    /// Requests served from the cache (no new region, no page allocation).
    pub cache_hits: u64,
    /// Regions released because the cache was full (`max_cached_bytes`).
    pub evictions: u64,
    /// Regions released by [`ShmPool::trim`](super::ShmPool::trim) and friends, or because they
    /// sat idle longer than `idle_release`.
    pub trimmed: u64,
    /// Regions never reused because the connection they were lent over was dropped while a
    /// consumer still held them (released once the consumer's mapping goes).
    pub abandoned: u64,
}

impl PoolStats {
    /// The figures under flat keys shaped like `torch.cuda.memory_stats()`'s
    /// (`reserved_bytes.all.current`, ..., `num_requests`, ...).
    pub fn to_flat(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (name, stat) in [
            ("reserved_bytes", self.reserved_bytes),
            ("in_use_bytes", self.in_use_bytes),
            ("cached_bytes", self.cached_bytes),
            ("regions", self.regions),
        ] {
            for (field, value) in [
                ("current", stat.current),
                ("peak", stat.peak),
                ("allocated", stat.allocated),
                ("freed", stat.freed),
            ] {
                out.push((format!("{name}.all.{field}"), value));
            }
        }
        out.push(("num_requests".to_owned(), self.requests));
        out.push(("num_cache_hits".to_owned(), self.cache_hits));
        out.push(("num_evictions".to_owned(), self.evictions));
        out.push(("num_trimmed".to_owned(), self.trimmed));
        out.push(("num_abandoned".to_owned(), self.abandoned));
        out
    }
}
