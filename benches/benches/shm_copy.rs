//! Copying a private buffer into shared memory (`share_memory_`) against copying it into freshly
//! allocated private memory, in the same run.
//!
//! - `shared`: `SharedRegion::copy_from_bytes` (new sealed memfd, huge-page advice, one thread
//!   `pwrite`s pieces while the others pre-fault and copy theirs);
//! - `private_vec`: `src.to_vec()`, the plain way to copy into fresh private memory;
//! - `private_prefaulted`: a fresh zeroed `Vec` filled with `copy_prefaulted` (threads that
//!   pre-fault and copy pieces, as `shared` does minus the `pwrite`), to separate the technique
//!   from the kind of memory.
//!
//! Each result is dropped outside the timed part (freeing 1 GiB costs as much as a copy), as in
//! the anchor, which times `share_memory_()` alone.

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use tensormem_shm::{copy::parallelism, copy_prefaulted, SharedRegion};

const SIZES: [(usize, &str); 2] = [(64 << 20, "64MiB"), (1 << 30, "1GiB")];

fn copy_into_shared(c: &mut Criterion) {
    let mut group = c.benchmark_group("shm_copy");
    for (len, label) in SIZES {
        group.throughput(Throughput::Bytes(len as u64));
        group.sample_size(10);
        let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        group.bench_function(BenchmarkId::new("shared", label), |b| {
            b.iter_batched(
                || (),
                |()| SharedRegion::copy_from_bytes(&src).expect("copy"),
                BatchSize::PerIteration,
            );
        });
        group.bench_function(BenchmarkId::new("private_vec", label), |b| {
            b.iter_batched(|| (), |()| src.to_vec(), BatchSize::PerIteration);
        });
        group.bench_function(BenchmarkId::new("private_prefaulted", label), |b| {
            b.iter_batched(
                || (),
                |()| {
                    let mut dst = vec![0u8; len];
                    copy_prefaulted(&mut dst, &src, parallelism()).expect("copy");
                    dst
                },
                BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    copy_into_shared(&mut criterion);
    criterion.final_summary();
}
