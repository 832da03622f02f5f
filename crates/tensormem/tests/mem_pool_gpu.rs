//! Memory pools of the device API (`tensormem::cuda::MemPool`, `use_mem_pool`) with PyTorch's options,
//! on a real GPU. Each test is `#[ignore]`d (`cargo xtask test-gpu` runs them with
//! `--include-ignored`); without a device they say `skipped: ...`. The per-device allocators are
//! process-wide, so the tests hold one lock while they run.
#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, MutexGuard};

use tensormem::cuda::{self, FnPoolAllocator, MemPool, PoolOptions};
use tensormem::cuda_alloc::{Device, Error as AllocError};
use tensormem_test_support::gpu;

const MIB: usize = 1 << 20;

fn gpu() -> Option<MutexGuard<'static, ()>> {
    let lock = gpu::lock();
    gpu::devices(cuda::device_count())?;
    Some(lock)
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn no_split_and_use_on_oom_pools_under_a_memory_fraction() {
    let Some(_lock) = gpu() else { return };
    std::thread::spawn(|| {
        cuda::set_device(0).unwrap();
        let a = cuda::caching_allocator(Some(0)).unwrap();
        cuda::empty_cache().unwrap();
        let ns = MemPool::with_options(
            PoolOptions {
                no_split: true,
                ..PoolOptions::default()
            },
            None,
        )
        .unwrap();
        assert!(ns.options().no_split);
        let (small, large) = {
            let _in = cuda::use_mem_pool(&ns).unwrap();
            assert_eq!(ns.use_count(), 2);
            (
                cuda::caching_allocator_alloc(1000, None).unwrap(),
                cuda::caching_allocator_alloc(3 * MIB, None).unwrap(),
            )
        };
        assert_eq!(ns.use_count(), 1);
        let blocks: Vec<(u64, usize)> = a
            .snapshot()
            .segments
            .iter()
            .filter(|s| s.segment_pool_id == (ns.id().0, ns.id().1))
            .map(|s| (s.total_size, s.blocks.len()))
            .collect();
        assert_eq!(blocks.len(), 2);
        assert!(blocks.contains(&(2 * MIB as u64, 1)), "{blocks:?}");
        assert!(blocks.contains(&(20 * MIB as u64, 1)), "{blocks:?}");
        cuda::caching_allocator_delete(small).unwrap();
        cuda::caching_allocator_delete(large).unwrap();
        drop(ns);

        let total = cuda::mem_get_info(Some(0)).unwrap().total;
        let reserved = cuda::memory_reserved(Some(0)).unwrap();
        let budget = reserved + 256 * MIB as u64;
        cuda::set_per_process_memory_fraction(budget as f64 / total as f64, Some(0)).unwrap();
        let pool = MemPool::with_options(
            PoolOptions {
                use_on_oom: true,
                ..PoolOptions::default()
            },
            None,
        )
        .unwrap();
        let p = {
            let _in = cuda::use_mem_pool(&pool).unwrap();
            cuda::caching_allocator_alloc(96 * MIB, None).unwrap()
        };
        cuda::caching_allocator_delete(p).unwrap();
        let hold = cuda::caching_allocator_alloc(128 * MIB, None).unwrap();
        let ooms = a.memory_stats().num_ooms;
        let x = cuda::caching_allocator_alloc(96 * MIB, None).expect("served by the pool");
        assert_eq!(x, p, "the use_on_oom pool's free block");
        assert_eq!(a.memory_stats().num_ooms, ooms);
        match cuda::caching_allocator_alloc(64 * MIB, None) {
            Err(cuda::Error::Alloc(AllocError::OutOfMemory(_))) => {}
            other => panic!("64 MiB over the budget gave {other:?}"),
        }
        cuda::caching_allocator_delete(x).unwrap();
        cuda::caching_allocator_delete(hold).unwrap();
        drop(pool);
        cuda::set_per_process_memory_fraction(1.0, Some(0)).unwrap();
        cuda::empty_cache().unwrap();
    })
    .join()
    .expect("the test thread panicked");
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_pool_with_its_own_allocator_gets_and_returns_segments_through_it() {
    let Some(_lock) = gpu() else { return };
    std::thread::spawn(|| {
        cuda::set_device(0).unwrap();
        let a = cuda::caching_allocator(Some(0)).unwrap();
        let calls = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let (m, f) = (Arc::clone(&calls), Arc::clone(&calls));
        let own = FnPoolAllocator::shared(
            move |size| {
                m.0.fetch_add(1, SeqCst);
                a.device().malloc(size)
            },
            move |ptr, size| {
                f.1.fetch_add(1, SeqCst);
                // SAFETY: `ptr` is a segment `malloc` above made with `size` bytes, given back once
                // when no work uses it (the pool's promise).
                unsafe { a.device().free(ptr, size) }
            },
        );
        let before = a.memory_stats();
        let pool = MemPool::with_options(
            PoolOptions {
                allocator: Some(own),
                ..PoolOptions::default()
            },
            None,
        )
        .unwrap();
        assert!(pool.allocator().is_some());
        let x = {
            let _in = cuda::use_mem_pool(&pool).unwrap();
            cuda::caching_allocator_alloc(12 * MIB, None).unwrap()
        };
        assert_eq!(calls.0.load(SeqCst), 1);
        let s = a.memory_stats();
        assert_eq!(s.num_device_alloc, before.num_device_alloc + 1);
        assert_eq!(
            s.reserved_bytes.all.current,
            before.reserved_bytes.all.current + 12 * MIB as i64
        );
        cuda::caching_allocator_delete(x).unwrap();
        drop(pool);
        assert_eq!(
            calls.1.load(SeqCst),
            1,
            "the segment went back through free"
        );
        let s = a.memory_stats();
        assert_eq!(s.num_device_free, before.num_device_free + 1);
        assert_eq!(
            s.reserved_bytes.all.current,
            before.reserved_bytes.all.current
        );
    })
    .join()
    .expect("the test thread panicked");
}
