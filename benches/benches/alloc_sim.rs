//! The caching allocator's hot path on the simulated device (no device calls once warmed up).
//!
//! - `hot_pair/<size>`: one `allocate` + `free` of the same size on one stream, the cache warm: the
//!   allocator's own cost per pair (PyTorch's, measured on the GPU machine, is about 700 ns).
//! - `mixed_window`: a window of 256 live allocations of log-uniform sizes between 512 B and 32 MiB;
//!   each iteration frees a random one and allocates a new size in its place (the anchors' `mixed`
//!   pattern: churn with splits and merges). An iteration is two operations (throughput counts
//!   operations).
//! - `threads/<n>` (1, 2, 4, 8): `n` threads, each on its own stream, doing 512 B pairs; throughput
//!   is the aggregate, so `threads/n` over `threads/1` is the scaling factor (meaningful only with
//!   `n` free cores).

use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
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
    const STEPS: usize = 1 << 16;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    // Precomputed (slot, size) steps, so that the timed loop does no random-number work.
    let steps: Vec<(usize, usize)> = (0..STEPS)
        .map(|_| {
            let exp: f64 = rng.gen_range(9.0..25.0);
            (rng.gen_range(0..WINDOW), 2f64.powf(exp) as usize)
        })
        .collect();
    let alloc = allocator();
    let stream = StreamId(0);
    let mut window: Vec<_> = steps[..WINDOW]
        .iter()
        .map(|&(_, size)| alloc.allocate(size, stream).expect("allocate"))
        .collect();
    let mut next = 0;
    let mut step = |window: &mut Vec<_>| {
        let (slot, size) = steps[next % STEPS];
        next += 1;
        let old = std::mem::replace(
            &mut window[slot],
            alloc.allocate(size, stream).expect("allocate"),
        );
        alloc.free(old).expect("free");
    };
    // Warm up one pass over the steps so that segments exist.
    for _ in 0..STEPS {
        step(&mut window);
    }
    let mut group = c.benchmark_group("mixed_window");
    group.throughput(Throughput::Elements(2));
    group.bench_function("256_log_uniform_512B_32MiB", |b| {
        b.iter(|| step(&mut window));
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
    for threads in [1usize, 2, 4, 8] {
        let alloc = allocator();
        run_threads(&alloc, threads, 1000);
        group.throughput(Throughput::Elements(threads as u64));
        group.bench_function(BenchmarkId::from_parameter(threads), |b| {
            b.iter_custom(|iters| run_threads(&alloc, threads, iters));
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    hot_pair(&mut criterion);
    mixed_window(&mut criterion);
    threads(&mut criterion);
    criterion.final_summary();
}
