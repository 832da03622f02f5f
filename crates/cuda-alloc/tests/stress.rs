//! Many threads at once, on their own streams and on shared ones, with cross-stream uses, cache
//! flushes and running out of memory; a shadow map checks that live blocks never overlap.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use common::*;
use rand::{Rng, SeedableRng};
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Error, StreamId};

/// Live ranges of every thread: start -> end.
struct Shadow(Mutex<BTreeMap<u64, u64>>);

impl Shadow {
    fn insert(&self, x: &Allocation) {
        let (start, end) = (x.ptr().0, x.ptr().0 + x.size() as u64);
        let mut map = self.0.lock().unwrap();
        if let Some((&s, &e)) = map.range(..end).next_back() {
            assert!(e <= start, "{start:#x}..{end:#x} overlaps {s:#x}..{e:#x}");
        }
        map.insert(start, end);
    }

    fn remove(&self, x: &Allocation) {
        self.0.lock().unwrap().remove(&x.ptr().0);
    }
}

fn hammer(alloc: &CachingAllocator<SimDevice>, threads: usize, streams: usize, seed: u64) {
    run_threads(alloc, threads, streams, seed);
    assert_all_returned(alloc);
}

/// After everything is freed: the state is consistent and `empty_cache` returns all memory.
fn assert_all_returned(alloc: &CachingAllocator<SimDevice>) {
    alloc.check_invariants().unwrap();
    alloc.device().complete_all_work();
    alloc.empty_cache().unwrap();
    let s = checked(alloc);
    assert_eq!(
        s.reserved_bytes.all.current,
        0,
        "segments left: {:#?}",
        alloc.snapshot().segments
    );
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.active.all.current, 0);
    assert_eq!(alloc.device().counters().used_bytes, 0);
}

fn run_threads(alloc: &CachingAllocator<SimDevice>, threads: usize, streams: usize, seed: u64) {
    let shadow = Shadow(Mutex::new(BTreeMap::new()));
    std::thread::scope(|scope| {
        for t in 0..threads {
            let shadow = &shadow;
            scope.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed + t as u64);
                let stream = StreamId(1 + (t % streams) as u64);
                let mut live: Vec<Allocation> = Vec::new();
                for step in 0..3000 {
                    match rng.gen_range(0..100) {
                        0..=49 => {
                            let bits = rng.gen_range(9..24);
                            let size = rng.gen_range(1usize << (bits - 1)..=1 << bits);
                            match alloc.allocate(size, stream) {
                                Ok(x) => {
                                    shadow.insert(&x);
                                    live.push(x);
                                }
                                Err(Error::OutOfMemory(_)) => {}
                                Err(e) => panic!("thread {t} step {step}: {e}"),
                            }
                        }
                        50..=89 if !live.is_empty() => {
                            let x = live.swap_remove(rng.gen_range(0..live.len()));
                            if rng.gen_bool(0.2) {
                                let other = StreamId(1 + rng.gen_range(0..8));
                                alloc.record_stream(&x, other).unwrap();
                            }
                            shadow.remove(&x);
                            alloc.free(x).unwrap();
                        }
                        90..=95 => alloc
                            .device()
                            .complete_stream_work(StreamId(1 + rng.gen_range(0..8))),
                        96 => alloc.empty_cache().unwrap(),
                        97 => {
                            let s = alloc.memory_stats();
                            assert!(s.allocated_bytes.all.peak >= s.allocated_bytes.all.current);
                        }
                        _ => {}
                    }
                }
                for x in live {
                    shadow.remove(&x);
                    alloc.free(x).unwrap();
                }
            });
        }
    });
}

#[test]
fn eight_threads_on_eight_streams() {
    hammer(&sim(512 * MIB), 8, 8, 1);
}

#[test]
fn eight_threads_sharing_two_streams() {
    hammer(&sim(512 * MIB), 8, 2, 100);
}

#[test]
fn eight_threads_with_expandable_segments() {
    hammer(&sim_with("expandable_segments:True", 512 * MIB), 8, 4, 200);
}

#[test]
fn eight_threads_with_split_limits_and_garbage_collection() {
    let a = sim_with(
        "max_split_size_mb:20,garbage_collection_threshold:0.6",
        512 * MIB,
    );
    a.set_memory_fraction(0.9).unwrap();
    hammer(&a, 8, 8, 300);
}

#[test]
fn eight_threads_while_captures_come_and_go() {
    let a = sim(512 * MIB);
    std::thread::scope(|scope| {
        let a = &a;
        scope.spawn(move || {
            for round in 0..200u64 {
                let pool = tensormem_cuda_alloc::MempoolId(round + 1, 0);
                a.begin_allocate_to_pool(pool, move |s| s.0 % 4 == round % 4)
                    .unwrap();
                std::thread::yield_now();
                a.end_allocate_to_pool(pool).unwrap();
                a.release_pool(pool).unwrap();
                if round % 10 == 0 {
                    a.empty_cache().unwrap();
                }
            }
        });
        run_threads(a, 7, 7, 400);
    });
    assert_all_returned(&a);
    assert!(a.private_pools().is_empty());
}
