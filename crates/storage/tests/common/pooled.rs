//! What the pooled tests share: a pool of a test's own and the bytes they send.

use tensormem_shm::pool::PoolConfig;
use tensormem_storage::ShmPool;

/// `n` bytes of a pattern that differs with `seed`, so storages sent in turn tell apart.
pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8 ^ seed).collect()
}

/// A pool for one test: no idle release (statistics stay put), two copy threads.
pub fn pool() -> ShmPool {
    ShmPool::new(PoolConfig {
        idle_release: None,
        threads: 2,
        ..PoolConfig::default()
    })
}
