//! Create + attach latency of shared regions, fd mode and named mode.
//!
//! - fd mode: `SharedRegion::create_anonymous` (memfd, sealed) then a second mapping of its fd
//!   with `MapOptions::map_fd` (what a receiver does: fstat, seals, mmap).
//! - named mode: exclusive `shm_open` + ftruncate + mmap of a fresh name, a second mapping by
//!   name (`OpenExisting`).
//!
//! No page is touched: this is the fixed cost of making and attaching a region. Dropping (unmap,
//! close, unlink) happens outside the timed part.

use criterion::{BatchSize, BenchmarkId, Criterion};
use tensormem_shm::{CreateMode, MapOptions, NameGenerator, SharedRegion};

const SIZES: [(u64, &str); 4] = [
    (4 << 10, "4KiB"),
    (1 << 20, "1MiB"),
    (64 << 20, "64MiB"),
    (1 << 30, "1GiB"),
];

/// The named regions of one iteration; unlinks the name when criterion drops it (untimed).
struct Unlinked {
    created: SharedRegion,
    _attached: SharedRegion,
}

impl Drop for Unlinked {
    fn drop(&mut self) {
        self.created.unlink().expect("unlink");
    }
}

fn create_attach(c: &mut Criterion) {
    let names = NameGenerator::with_prefix("tmbench").expect("valid prefix");
    let mut group = c.benchmark_group("shm_create_attach");
    for (len, label) in SIZES {
        if len >= 1 << 30 {
            group.sample_size(10);
        }
        group.bench_function(BenchmarkId::new("fd", label), |b| {
            b.iter_batched(
                || (),
                |()| {
                    let region = SharedRegion::create_anonymous(len).expect("create");
                    let fd = region.fd().expect("anonymous regions keep their fd");
                    let attached = MapOptions::new().map_fd(fd).expect("attach");
                    (region, attached)
                },
                BatchSize::PerIteration,
            );
        });
        group.bench_function(BenchmarkId::new("named", label), |b| {
            b.iter_batched(
                || names.next_name(),
                |name| {
                    let region = MapOptions::new()
                        .create(CreateMode::CreateExclusive)
                        .len(len)
                        .map_shm(&name)
                        .expect("create");
                    let attached = MapOptions::new().map_shm(&name).expect("attach");
                    Unlinked {
                        created: region,
                        _attached: attached,
                    }
                },
                BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    create_attach(&mut criterion);
    criterion.final_summary();
}
