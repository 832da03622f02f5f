//! A model's weights from one GPU into another GPU's own tensors through NCCL
//! (`tensormem_nccl::weights`), against NCCL's own broadcast bandwidth measured in the same run;
//! `torch_nccl_weights_bench.py` is the PyTorch anchor.
//!
//! Rank 0 (GPU 0) sends, rank 1 (GPU 1) receives: a thread each, communicators made from one unique
//! id (`ncclCommInitRank`, as separate processes make theirs). Both allocate the layout's tensors
//! from tensormem's caching allocator (rank 0 fills tensor `i` with the byte `i % 251 + 1`). Per
//! layout:
//! - the floor: broadcasts of a 1 GiB buffer from rank 0 to rank 1 (median of `--iters`; for a
//!   broadcast NCCL's bus bandwidth is its algorithm bandwidth, bytes / time), measured just before
//!   the layout's syncs;
//! - `connect_ms`: connecting (layout exchanged and matched, staging buffers allocated and
//!   registered); `first_ms`: the first sync; `median_ms`: the median of `--iters` later syncs, as
//!   the receiver times them (from its call until its tensors hold the values);
//! - `ratio`: `median_ms` over the floor's time for the layout's bytes (1.0: as fast as one large
//!   broadcast).
//!
//! After the first sync the receiver checks the first and last byte of every tensor; a wrong byte
//! fails the run. Prints CSV
//! `layout,tensors,bytes,buckets,direct,connect_ms,first_ms,median_ms,sync_gbps,nccl_gbps,ratio`.
//!
//! ```text
//! nccl_weights_bench [--quick] [--layout 7b|moe|gpt2|all] [--bucket-mib N] [--iters N]
//! ```
//!
//! `all` is `7b` and `moe`; `--quick` is `gpt2` with 3 iterations. NCCL's library on
//! `LD_LIBRARY_PATH` (the bundle's run.sh sets it); NVLink multicast stays off
//! (`NCCL_NVLS_ENABLE=0`).

use std::ffi::{c_int, c_void};
use std::time::Instant;

use cudarc::nccl::{result, sys};
use tensormem_benches::layouts;
use tensormem_cuda_alloc::backend::cuda::{self, BackendStream, CudaBackend};
use tensormem_cuda_alloc::{Allocation, CachingAllocator};
use tensormem_nccl::weights::{self, LocalTensor, SyncOptions, DEFAULT_BUCKET_BYTES};

const GIB: usize = 1 << 30;

struct Args {
    layouts: Vec<String>,
    bucket_bytes: usize,
    iters: usize,
}

fn args() -> Args {
    let mut out = Args {
        layouts: vec!["7b".into(), "moe".into()],
        bucket_bytes: DEFAULT_BUCKET_BYTES,
        iters: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{arg} needs a value")))
        };
        match arg.as_str() {
            "--quick" => {
                out.layouts = vec!["gpt2".into()];
                out.iters = 3;
            }
            "--layout" => {
                let name = value();
                out.layouts = match name.as_str() {
                    "all" => vec!["7b".into(), "moe".into()],
                    n if layouts::NAMES.contains(&n) => vec![name],
                    _ => usage(&format!("no layout {name}")),
                };
            }
            "--bucket-mib" => {
                let mib: usize = value().parse().unwrap_or_else(|_| usage("--bucket-mib N"));
                out.bucket_bytes = mib << 20;
            }
            "--iters" => {
                out.iters = value().parse().unwrap_or_else(|_| usage("--iters N"));
                out.iters = out.iters.max(1);
            }
            _ => usage(&format!("unknown argument {arg}")),
        }
    }
    out
}

fn usage(why: &str) -> ! {
    eprintln!("nccl_weights_bench: {why}");
    eprintln!(
        "usage: nccl_weights_bench [--quick] [--layout 7b|moe|gpt2|all] [--bucket-mib N] [--iters N]"
    );
    std::process::exit(2);
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One rank: its allocator, stream and communicator.
struct Rank {
    rank: usize,
    allocator: CachingAllocator<CudaBackend>,
    stream: BackendStream,
    comm: sys::ncclComm_t,
}

/// One layout's results, as the receiver saw them.
struct Row {
    layout: String,
    tensors: usize,
    bytes: u64,
    buckets: usize,
    direct: usize,
    connect_ms: f64,
    first_ms: f64,
    median_ms: f64,
    nccl_gbps: f64,
}

impl Rank {
    fn new(rank: usize, id: sys::ncclUniqueId) -> Self {
        let device = CudaBackend::new(rank as u32).expect("device");
        device.make_current().expect("context");
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-parameter; both ranks pass the same id, on their devices.
        unsafe { result::comm_init_rank(&mut comm, 2, id, rank as c_int) }
            .expect("ncclCommInitRank");
        Self {
            rank,
            allocator: CachingAllocator::new(CudaBackend::new(rank as u32).expect("device")),
            stream: device.create_stream().expect("stream"),
            comm,
        }
    }

    /// Median GB/s of broadcasts of 1 GiB from rank 0 (3 warm-ups, then `iters`).
    fn nccl_floor(&self, iters: usize) -> f64 {
        let buffer = self
            .allocator
            .allocate(GIB, self.stream.id())
            .expect("1 GiB");
        let mut rates = Vec::with_capacity(iters);
        for i in 0..3 + iters {
            let start = Instant::now();
            // SAFETY: `buffer` holds 1 GiB on the communicator's device; the stream is live.
            unsafe {
                result::broadcast(
                    buffer.ptr().0 as *const c_void,
                    buffer.ptr().0 as *mut c_void,
                    GIB,
                    sys::ncclDataType_t::ncclUint8,
                    0,
                    self.comm,
                    self.stream.as_raw() as sys::cudaStream_t,
                )
            }
            .expect("ncclBroadcast");
            self.stream.synchronize().expect("synchronize");
            if i >= 3 {
                rates.push(GIB as f64 / start.elapsed().as_secs_f64() / 1e9);
            }
        }
        self.allocator.free(buffer).expect("free");
        median(rates)
    }

    fn run(&self, layout: &str, args: &Args) -> Row {
        let (shapes, elem) = layouts::shapes(layout).expect("a known layout");
        let sizes = layouts::sizes(layout);
        let allocations: Vec<Allocation> = sizes
            .iter()
            .map(|&b| {
                self.allocator
                    .allocate(b, self.stream.id())
                    .expect("tensor")
            })
            .collect();
        let tensors: Vec<LocalTensor> = allocations
            .iter()
            .zip(shapes.iter().zip(&sizes))
            .enumerate()
            .map(|(i, (a, (shape, &bytes)))| LocalTensor {
                name: format!("{layout}.{i}"),
                ptr: a.ptr(),
                bytes: bytes as u64,
                meta: format!("{elem}B{shape:?}"),
            })
            .collect();
        if self.rank == 0 {
            for (i, t) in tensors.iter().enumerate() {
                // SAFETY: the tensor's allocation, used by nothing else.
                unsafe { self.stream.memset_d8(t.ptr, fill(i), t.bytes as usize) }.expect("fill");
            }
        }
        self.stream.synchronize().expect("synchronize");
        let nccl_gbps = self.nccl_floor(args.iters);

        let options = SyncOptions {
            bucket_bytes: args.bucket_bytes,
            ..SyncOptions::default()
        };
        let start = Instant::now();
        // SAFETY: `comm` lives on this device and is destroyed after the sync is dropped.
        let mut sync =
            unsafe { weights::cuda::connect(self.comm, self.stream.clone(), 0, &tensors, options) }
                .expect("connect");
        let connect_ms = start.elapsed().as_secs_f64() * 1e3;
        // SAFETY: the tensors are live allocations; no other stream uses them.
        let first = unsafe { sync.sync() }.expect("sync");
        if self.rank == 1 {
            self.verify(&tensors);
        }
        let times: Vec<f64> = (0..args.iters)
            // SAFETY: as above.
            .map(|_| unsafe { sync.sync() }.expect("sync").elapsed.as_secs_f64() * 1e3)
            .collect();
        drop(sync);
        for a in allocations {
            self.allocator.free(a).expect("free");
        }
        self.allocator.empty_cache().expect("empty_cache");
        Row {
            layout: layout.to_owned(),
            tensors: tensors.len(),
            bytes: first.bytes,
            buckets: first.buckets,
            direct: first.direct,
            connect_ms,
            first_ms: first.elapsed.as_secs_f64() * 1e3,
            median_ms: median(times),
            nccl_gbps,
        }
    }

    /// The first and last byte of every tensor hold the sender's fill.
    fn verify(&self, tensors: &[LocalTensor]) {
        for (i, t) in tensors.iter().enumerate() {
            for offset in [0, t.bytes as usize - 1] {
                let mut byte = [0u8];
                // SAFETY: a byte inside the tensor's allocation; the sync is done.
                unsafe { self.stream.copy_to_host(&mut byte, t.ptr.offset(offset)) }
                    .expect("read back");
                if byte[0] != fill(i) {
                    eprintln!(
                        "nccl_weights_bench: {} byte {offset} is {} instead of {}",
                        t.name,
                        byte[0],
                        fill(i)
                    );
                    std::process::exit(1);
                }
            }
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        // SAFETY: a live communicator; the syncs using it were dropped.
        if let Err(e) = unsafe { result::comm_destroy(self.comm) } {
            eprintln!("nccl_weights_bench: ncclCommDestroy: {e:?}");
        }
    }
}

/// The byte tensor `i` is filled with.
fn fill(i: usize) -> u8 {
    (i % 251 + 1) as u8
}

fn main() {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let args = args();
    match cuda::device_count() {
        Ok(n) if n >= 2 => {}
        other => {
            eprintln!("nccl_weights_bench: two GPUs needed ({other:?})");
            std::process::exit(2);
        }
    }
    let id = result::get_uniqueid().expect("ncclGetUniqueId");
    let args = &args;
    let rows: Vec<Vec<Row>> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let rank = Rank::new(r, id);
                    args.layouts.iter().map(|l| rank.run(l, args)).collect()
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("a rank failed"))
            .collect()
    });
    println!(
        "layout,tensors,bytes,buckets,direct,connect_ms,first_ms,median_ms,sync_gbps,nccl_gbps,ratio"
    );
    for row in &rows[1] {
        let floor_ms = row.bytes as f64 / (row.nccl_gbps * 1e9) * 1e3;
        println!(
            "{},{},{},{},{},{:.1},{:.2},{:.2},{:.1},{:.1},{:.3}",
            row.layout,
            row.tensors,
            row.bytes,
            row.buckets,
            row.direct,
            row.connect_ms,
            row.first_ms,
            row.median_ms,
            row.bytes as f64 / row.median_ms / 1e6,
            row.nccl_gbps,
            row.median_ms / floor_ms
        );
    }
}
