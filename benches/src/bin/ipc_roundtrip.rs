//! CUDA IPC round trip between two processes, timed like `torch_sharing_bench.py`'s `cuda_ipc` rows:
//! the producer's buffer is allocated (from the cache) and filled before the timer; timed are the
//! share, the message to the consumer, the consumer's open, its read of one byte (`.item()`), its
//! release (stream synchronize + slot decrement) and its one-byte answer. The producer frees after
//! the timer, as the anchor's `del t` does. As in the anchor (`torch.cuda.synchronize()` before the
//! timer), the producer's stream is idle at share time, so by default no event is sent.
//!
//! ```text
//! ipc_roundtrip [--iters N] [--spin-us N]
//! ```
//!
//! Prints `strategy,device,bytes,median_us_per_roundtrip` rows (the anchor's header):
//! `tensormem_ipc_warm` (the consumer keeps opened handles: a repeat share opens nothing),
//! `tensormem_ipc_cold` (handles closed after each use, as PyTorch does: every round trip opens and
//! closes), `tensormem_ipc_first_open` (the warm consumer's first round trip, which opens),
//! `tensormem_ipc_share_only` (the producer's `share` call alone, warm),
//! `tensormem_ipc_warm_event` (warm, with an interprocess event recorded although the stream is
//! idle, as PyTorch always does: `skip_event_when_idle` off), and
//! `tensormem_ipc_warm_spin`: warm, both sides polling their pipe for up to `--spin-us` (default
//! 200) before blocking, which takes the two cross-process wake-ups off the round trip.
//! Re-executes itself as the consumer (`TENSORMEM_IPC_BENCH_ROLE=consumer`).

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{fcntl_getfl, fcntl_setfl, OFlags};

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::{CachingAllocator, Device, StreamId};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::{ConsumerConfig, IpcConsumer, IpcHandle, IpcProducer, ProducerConfig};

const ROLE: &str = "TENSORMEM_IPC_BENCH_ROLE";
const IDLE: &str = "TENSORMEM_IPC_BENCH_IDLE";
const SPIN: &str = "TENSORMEM_IPC_BENCH_SPIN_US";
const S: StreamId = StreamId::DEFAULT;

type BoxError = Box<dyn std::error::Error>;

fn check(call: &str, result: sys::CUresult) -> Result<(), BoxError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {result:?}").into())
    }
}

/// Reads exactly `buf.len()` bytes; with a non-zero `spin`, polls the (non-blocking) pipe for up to
/// that long before falling back to a blocking read. `Ok(false)` at end of input.
fn read_exact_spin<R: Read + AsFd>(
    input: &mut R,
    buf: &mut [u8],
    spin: Duration,
) -> std::io::Result<bool> {
    if spin.is_zero() {
        return match input.read_exact(buf) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(false),
            Err(e) => Err(e),
        };
    }
    // Blocking flags (an earlier call leaves the pipe non-blocking).
    let flags = fcntl_getfl(input.as_fd())? & !OFlags::NONBLOCK;
    let mut filled = 0;
    let mut started = Instant::now();
    fcntl_setfl(input.as_fd(), flags | OFlags::NONBLOCK)?;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                filled += n;
                started = Instant::now();
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if started.elapsed() < spin {
                    std::hint::spin_loop();
                    continue;
                }
                fcntl_setfl(input.as_fd(), flags)?;
                let blocking = input.read(&mut buf[filled..]);
                fcntl_setfl(input.as_fd(), flags | OFlags::NONBLOCK)?;
                match blocking {
                    Ok(0) => return Ok(false),
                    Ok(n) => filled += n,
                    Err(e) => return Err(e),
                }
                started = Instant::now();
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn consumer() -> Result<(), BoxError> {
    let idle = std::env::var(IDLE)?.parse()?;
    let spin = Duration::from_micros(std::env::var(SPIN)?.parse()?);
    let driver = Arc::new(CudaIpcDriver::new()?);
    let consumer = IpcConsumer::with_config(
        driver,
        ConsumerConfig {
            idle_mem_handles: idle,
            ..ConsumerConfig::default()
        },
    );
    CudaBackend::new(0)?.make_current()?;
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    let mut len = [0u8; 4];
    let mut buf = Vec::new();
    let mut phases: [Vec<f64>; 3] = Default::default();
    while read_exact_spin(&mut input, &mut len, spin)? {
        buf.resize(u32::from_le_bytes(len) as usize, 0);
        read_exact_spin(&mut input, &mut buf, spin)?;
        let t0 = Instant::now();
        let handle = IpcHandle::decode(&buf)?;
        let received = consumer.open(&handle, S)?;
        let t1 = Instant::now();
        let mut first = 0u8;
        // SAFETY: one byte of received device memory into a local byte; device 0's context is current.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2((&mut first as *mut u8).cast(), received.ptr().0, 1)
        })?;
        let t2 = Instant::now();
        drop(received);
        let t3 = Instant::now();
        output.write_all(&[first])?;
        output.flush()?;
        for (phase, (a, b)) in phases.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3)]) {
            phase.push((b - a).as_secs_f64() * 1e6);
        }
    }
    if !phases[0].is_empty() {
        let [open, read, release] = phases.map(median);
        eprintln!(
            "# consumer medians, us: open {open:.1}, read 1 byte {read:.1}, release {release:.1}"
        );
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Medians of one configuration, µs.
struct Figures {
    /// The first round trip (opens).
    first: f64,
    /// The median round trip.
    round_trip: f64,
    /// The median of the producer's `share` alone.
    share: f64,
}

/// Round trips of `size` bytes against a consumer keeping `idle` handles, both sides spinning for
/// `spin` before blocking; with `events`, an event is sent even though the stream is idle.
fn run(
    size: usize,
    idle: usize,
    spin: Duration,
    events: bool,
    iters: usize,
) -> Result<Figures, BoxError> {
    let device = CudaBackend::new(0)?;
    let allocator = Arc::new(CachingAllocator::new(device));
    let config = ProducerConfig {
        skip_event_when_idle: !events,
        ..ProducerConfig::default()
    };
    let producer = IpcProducer::with_config(Arc::new(CudaIpcDriver::new()?), config);
    let mut child = Command::new(std::env::current_exe()?)
        .env(ROLE, "consumer")
        .env(IDLE, idle.to_string())
        .env(SPIN, spin.as_micros().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to = child.stdin.take().ok_or("no stdin")?;
    let mut from = child.stdout.take().ok_or("no stdout")?;
    let mut times = Vec::with_capacity(iters);
    let mut shares = Vec::with_capacity(iters);
    let mut first = 0.0;
    for i in 0..iters + 10 {
        let allocation = allocator.allocate(size, S)?;
        let value = (i % 251) as u8;
        allocator.device().make_current()?;
        // SAFETY: the allocation is `size` bytes of device 0, owned here.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(allocation.ptr().0, value, size)
        })?;
        // The anchor calls torch.cuda.synchronize() before its timer (cuMemsetD8 may return before
        // the fill is done).
        allocator.device().synchronize()?;
        let t0 = Instant::now();
        let (shared, handle) = producer.share(&allocator, allocation, S)?;
        let share = t0.elapsed().as_secs_f64() * 1e6;
        let bytes = handle.encode();
        to.write_all(&(bytes.len() as u32).to_le_bytes())?;
        to.write_all(&bytes)?;
        to.flush()?;
        let mut answer = [0u8];
        if !read_exact_spin(&mut from, &mut answer, spin)? {
            return Err("the consumer ended early".into());
        }
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
            shares.push(share);
        }
    }
    drop(to);
    child.wait()?;
    Ok(Figures {
        first,
        round_trip: median(times),
        share: median(shares),
    })
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
    let spin_us: u64 = args
        .iter()
        .position(|a| a == "--spin-us")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(200), |n| n.parse())?;
    let (block, spin) = (Duration::ZERO, Duration::from_micros(spin_us));
    println!("strategy,device,bytes,median_us_per_roundtrip");
    for size in [4096usize, 1 << 20, 64 << 20] {
        let warm = run(size, 16, block, false, iters)?;
        println!("tensormem_ipc_warm,cuda,{size},{:.1}", warm.round_trip);
        println!("tensormem_ipc_first_open,cuda,{size},{:.1}", warm.first);
        println!("tensormem_ipc_share_only,cuda,{size},{:.1}", warm.share);
        let warm_spin = run(size, 16, spin, false, iters)?;
        println!(
            "tensormem_ipc_warm_spin,cuda,{size},{:.1}",
            warm_spin.round_trip
        );
        let event = run(size, 16, block, true, iters)?;
        println!(
            "tensormem_ipc_warm_event,cuda,{size},{:.1}",
            event.round_trip
        );
        let cold = run(size, 0, block, false, iters)?;
        println!("tensormem_ipc_cold,cuda,{size},{:.1}", cold.round_trip);
    }
    Ok(())
}
