//! The process-wide pool behind `share_memory_`, alone in this binary so that no other test
//! changes its statistics.

use tensormem_storage::{default_pool, set_default_pool, Error, ShmPool, Storage, StorageKind};

const MIB: usize = 1 << 20;

#[test]
fn share_memory_recycles_regions_of_the_process_wide_pool() {
    let pool = default_pool();
    let before = pool.stats();

    let a = Storage::from_vec(vec![1; 3 * MIB]);
    a.share_memory_().unwrap();
    assert_eq!(a.kind(), StorageKind::CpuPooled);
    let region = a.pooled_region_id().unwrap();
    let after_first = pool.stats();
    assert_eq!(after_first.regions.allocated, before.regions.allocated + 1);

    // Dropped (every clone): the region is cached, not freed.
    let clone = a.clone();
    drop(a);
    assert_eq!(
        pool.stats().cached_bytes.current,
        before.cached_bytes.current
    );
    drop(clone);
    let cached = pool.stats();
    assert!(cached.cached_bytes.current > before.cached_bytes.current);
    assert_eq!(cached.in_use_bytes.current, before.in_use_bytes.current);

    // The next share_memory_ of the same size reuses it.
    let b = Storage::from_vec(vec![2; 3 * MIB]);
    b.share_memory_().unwrap();
    assert_eq!(b.pooled_region_id(), Some(region));
    assert_eq!(b.to_vec().unwrap(), vec![2; 3 * MIB]);
    let reused = pool.stats();
    assert_eq!(reused.regions.allocated, after_first.regions.allocated);
    assert_eq!(reused.cache_hits, before.cache_hits + 1);

    // Too late to install another pool: a typed error.
    assert!(matches!(
        set_default_pool(ShmPool::default()),
        Err(Error::DefaultPoolSet)
    ));
}
