//! The caching allocator's hot path on the simulated device (no device calls once warmed up).
//!
//! - `hot_pair/<size>`: one `allocate` + `free` of the same size on one stream, the cache warm: the
//!   allocator's own cost per pair (PyTorch's, measured on the GPU machine, is about 700 ns).
//! - `mixed_window`: a window of 256 live allocations of log-uniform sizes between 512 B and 32 MiB;
//!   each iteration frees the oldest and allocates the next size (a replay-like churn with splits
//!   and merges).
//! - `threads/<n>`: `n` threads, each on its own stream, doing 512 B pairs; throughput is the
//!   aggregate, so `threads/2` over `threads/1` is the scaling factor.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};

fn allocator() -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::new(1 << 40))
}

fn hot_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_pair");
    group.throughput(Throughput::Elements(1));
    for (size, label) in [(512usize, "512B"), (1 << 20, "1MiB"), (64 << 20, "64MiB")] {
        let alloc = allocator();
        let stream = StreamId(0);
        // Warm up: the first allocation makes the segment.
        let a = alloc.allocate(size, stream).expect("allocate");
        alloc.free(a).expect("free");
        group.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter(|| {
                let a = alloc
                    .allocate(std::hint::black_box(size), stream)
                    .expect("allocate");
                alloc.free(a).expect("free");
            });
        });
    }
    group.finish();
}

fn mixed_window(c: &mut Criterion) {
    const WINDOW: usize = 256;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let sizes: Vec<usize> = (0..4096)
        .map(|_| {
            let exp: f64 = rng.gen_range(9.0..25.0);
            2f64.powf(exp) as usize
        })
        .collect();
    let alloc = allocator();
    let stream = StreamId(0);
    let mut window: Vec<_> = (0..WINDOW)
        .map(|i| alloc.allocate(sizes[i], stream).expect("allocate"))
        .collect();
    // Warm up one full cycle of the size list so that segments exist.
    let mut next = WINDOW;
    for _ in 0..sizes.len() {
        let slot = next % WINDOW;
        let new = alloc
            .allocate(sizes[next % sizes.len()], stream)
            .expect("allocate");
        alloc
            .free(std::mem::replace(&mut window[slot], new))
            .expect("free");
        next += 1;
    }
    let mut group = c.benchmark_group("mixed_window");
    group.throughput(Throughput::Elements(1));
    group.bench_function("256_log_uniform_512B_32MiB", |b| {
        b.iter(|| {
            let slot = next % WINDOW;
            let new = alloc
                .allocate(sizes[next % sizes.len()], stream)
                .expect("allocate");
            alloc
                .free(std::mem::replace(&mut window[slot], new))
                .expect("free");
            next += 1;
        });
    });
    group.finish();
    for a in window {
        alloc.free(a).expect("free");
    }
}

/// `threads` threads each doing `pairs` 512 B pairs on their own stream; the wall time.
fn run_threads(alloc: &CachingAllocator<SimDevice>, threads: usize, pairs: u64) -> Duration {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let barrier = &barrier;
            scope.spawn(move || {
                let stream = StreamId(t as u64 + 1);
                barrier.wait();
                for _ in 0..pairs {
                    let a = alloc.allocate(512, stream).expect("allocate");
                    alloc.free(a).expect("free");
                }
                barrier.wait();
            });
        }
        barrier.wait();
        let start = Instant::now();
        barrier.wait();
        start.elapsed()
    })
}

fn threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("threads");
    for threads in [1usize, 2] {
        let alloc = allocator();
        run_threads(&alloc, threads, 1000);
        group.throughput(Throughput::Elements(threads as u64));
        group.bench_function(BenchmarkId::from_parameter(threads), |b| {
            b.iter_custom(|iters| run_threads(&alloc, threads, iters));
        });
    }
    group.finish();
}

criterion_group!(benches, hot_pair, mixed_window, threads);
criterion_main!(benches);
