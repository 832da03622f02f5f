//! CUDA IPC round trip between two processes, timed like `torch_sharing_bench.py`'s `cuda_ipc` rows:
//! the producer's buffer is allocated (from the cache) and filled before the timer; timed are the
//! share, the message to the consumer, the consumer's open, its read of one byte (`.item()`), its
//! release (stream synchronize + slot decrement) and its one-byte answer. The producer frees after
//! the timer, as the anchor's `del t` does.
//!
//! ```text
//! ipc_roundtrip [--iters N]
//! ```
//!
//! Prints `strategy,device,bytes,median_us_per_roundtrip` rows (the anchor's header):
//! `tensormem_ipc_warm` (the consumer keeps opened handles: a repeat share opens nothing),
//! `tensormem_ipc_cold` (handles closed after each use, as PyTorch does: every round trip opens and
//! closes), and `tensormem_ipc_first_open` (the warm consumer's first round trip, which opens).
//! Re-executes itself as the consumer (`TENSORMEM_IPC_BENCH_ROLE=consumer`).

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::CudaDevice;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::{ConsumerConfig, IpcConsumer, IpcHandle, IpcProducer};

const ROLE: &str = "TENSORMEM_IPC_BENCH_ROLE";
const IDLE: &str = "TENSORMEM_IPC_BENCH_IDLE";
const S: StreamId = StreamId::DEFAULT;

type BoxError = Box<dyn std::error::Error>;

fn check(call: &str, result: sys::CUresult) -> Result<(), BoxError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {result:?}").into())
    }
}

fn consumer() -> Result<(), BoxError> {
    let idle = std::env::var(IDLE)?.parse()?;
    let driver = Arc::new(CudaIpcDriver::new()?);
    let consumer = IpcConsumer::with_config(
        driver,
        ConsumerConfig {
            idle_mem_handles: idle,
            ..ConsumerConfig::default()
        },
    );
    CudaDevice::new(0)?.make_current()?;
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    let mut len = [0u8; 4];
    let mut buf = Vec::new();
    while input.read_exact(&mut len).is_ok() {
        buf.resize(u32::from_le_bytes(len) as usize, 0);
        input.read_exact(&mut buf)?;
        let handle = IpcHandle::decode(&buf)?;
        let received = consumer.open(&handle, S)?;
        let mut first = 0u8;
        // SAFETY: one byte of received device memory into a local byte; device 0's context is current.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2((&mut first as *mut u8).cast(), received.ptr().0, 1)
        })?;
        drop(received);
        output.write_all(&[first])?;
        output.flush()?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Round trips of `size` bytes against a consumer keeping `idle` handles; (first, median) in µs.
fn run(size: usize, idle: usize, iters: usize) -> Result<(f64, f64), BoxError> {
    let device = CudaDevice::new(0)?;
    let allocator = Arc::new(CachingAllocator::new(device));
    let producer = IpcProducer::new(Arc::new(CudaIpcDriver::new()?));
    let mut child = Command::new(std::env::current_exe()?)
        .env(ROLE, "consumer")
        .env(IDLE, idle.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to = child.stdin.take().ok_or("no stdin")?;
    let mut from = child.stdout.take().ok_or("no stdout")?;
    let mut times = Vec::with_capacity(iters);
    let mut first = 0.0;
    for i in 0..iters + 10 {
        let allocation = allocator.allocate(size, S)?;
        let value = (i % 251) as u8;
        allocator.device().make_current()?;
        // SAFETY: the allocation is `size` bytes of device 0, owned here; synchronous memset.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(allocation.ptr().0, value, size)
        })?;
        let t0 = Instant::now();
        let (shared, handle) = producer.share(&allocator, allocation, S)?;
        let bytes = handle.encode();
        to.write_all(&(bytes.len() as u32).to_le_bytes())?;
        to.write_all(&bytes)?;
        to.flush()?;
        let mut answer = [0u8];
        from.read_exact(&mut answer)?;
        let dt = t0.elapsed().as_secs_f64() * 1e6;
        if answer[0] != value {
            return Err(format!("consumer read {} instead of {value}", answer[0]).into());
        }
        drop(shared);
        if i == 0 {
            first = dt;
        }
        if i >= 10 {
            times.push(dt);
        }
    }
    drop(to);
    child.wait()?;
    Ok((first, median(times)))
}

fn main() -> Result<(), BoxError> {
    if std::env::var(ROLE).is_ok() {
        return consumer();
    }
    let args: Vec<String> = std::env::args().collect();
    let iters = args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(200), |n| n.parse())?;
    println!("strategy,device,bytes,median_us_per_roundtrip");
    for size in [4096usize, 1 << 20, 64 << 20] {
        let (first, warm) = run(size, 16, iters)?;
        println!("tensormem_ipc_warm,cuda,{size},{warm:.1}");
        println!("tensormem_ipc_first_open,cuda,{size},{first:.1}");
        let (_, cold) = run(size, 0, iters)?;
        println!("tensormem_ipc_cold,cuda,{size},{cold:.1}");
    }
    Ok(())
}
