//! CUDA IPC round trip between two processes, timed like `torch_sharing_bench.py`'s `cuda_ipc` rows:
//! the producer's buffer is allocated (from the cache) and filled before the timer; timed are the
//! share, the message to the consumer, the consumer's open, its read of one byte (`.item()`), its
//! release (stream synchronize + slot decrement) and its answer. The producer frees after the
//! timer, as the anchor's `del t` does. As in the anchor (`torch.cuda.synchronize()` before the
//! timer), the producer's stream is idle at share time, so by default no event is sent.
//!
//! # How the byte is read
//!
//! As PyTorch's `.item()` reads a CUDA scalar (`_local_scalar_dense_cuda`: a pinned host buffer from
//! its caching host allocator, `cudaMemcpyAsync` on the current stream, then a synchronize of that
//! stream): a 1-byte block from tensormem's pinned host caching allocator
//! (`HostCachingAllocator` on `cuMemHostAlloc`, cached after the first trip), `cuMemcpyDtoHAsync`
//! on the consumer's stream (the one the memory was opened on), `cuStreamSynchronize` of that stream,
//! then the byte is read on the host and the block freed back to the cache. `--read pageable` reads
//! it with a synchronous `cuMemcpyDtoH` into a stack byte instead (what this bench did before; the
//! driver stages a pageable copy through its own buffer, ~8 µs on an H100).
//!
//! # The transport
//!
//! By default the handle and the answer travel over a `tensormem_shm::channel` (two rings in a
//! shared memfd with futex doorbells: no system call while the receiver is awake, one `futex` wake
//! when it sleeps; the consumer gets its end of a Unix socket pair as its standard input).
//! `--transport pipe` uses two pipes instead (one `write` per message). Either way both sides block
//! in the kernel while they wait, unless `--spin-us` says otherwise (the `_spin` rows).
//!
//! ```text
//! ipc_roundtrip [--iters N] [--spin-us N] [--read pinned|pageable] [--transport chan|pipe]
//!               [--same-cpu [--cpu N]] [--only warm,same_cpu,spin,event,cold] [--sim]
//! ```
//!
//! Prints `strategy,device,bytes,median_us_per_roundtrip` rows (the anchor's header), 200 round
//! trips after 10 warm-ups by default:
//! `tensormem_ipc_warm` (the consumer keeps opened handles: a repeat share opens nothing; both sides
//! block while they wait), `tensormem_ipc_first_open` (the warm consumer's first round trip, which
//! opens: the process's first `cuIpcOpenMemHandle`; the consumer says it is ready, CUDA initialised
//! and its pinned block made, before the timer starts; `tensormem_ipc_first_open.open` is the open
//! alone), `tensormem_ipc_share_only` (the producer's `share` call alone, warm),
//! `tensormem_ipc_warm_spin` (warm, both sides polling their end of the transport for up to
//! `--spin-us`, default 200, before blocking, which takes the two cross-process wake-ups off the
//! round trip), `tensormem_ipc_warm_event` (warm, with an interprocess event recorded although the
//! stream is idle, as PyTorch always does: `skip_event_when_idle` off) and `tensormem_ipc_cold`
//! (handles closed after each use, as PyTorch does: every round trip opens and closes).
//!
//! With `--same-cpu`, also `tensormem_ipc_warm_same_cpu`: the warm, blocking round trip with the
//! producer's thread and the whole consumer process pinned to one CPU (`--cpu N`, default the CPU
//! the producer starts on), where a wake-up needs no inter-processor interrupt. These rows come in
//! addition to the default placement's, never instead of them. `--only` runs some configurations
//! (`warm` always runs: it gives the first-open and share-only rows).
//!
//! Each configuration also prints its per-phase medians as rows named `CONFIG.PHASE`: `share` (the
//! producer's `share` call), `open` (decoding the handle and `IpcConsumer::open`), `read` (the byte, as
//! above), `release` (dropping the received memory: stream synchronize, slot decrement) and
//! `transport` (the rest of each round trip: encoding, both messages and the two process wake-ups;
//! the consumer sends its phase times back in its answer). Medians of the phases do not add up
//! exactly to the round trip's median.
//!
//! `--sim` runs the same round trips on the simulated device and the fake driver (no GPU, nothing to
//! read; device `sim` in the rows): the crate's own work and the transport, on any machine.
//!
//! Re-executes itself as the consumer (`TENSORMEM_IPC_BENCH_ROLE=consumer`).

mod link;

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::thread::{sched_getaffinity, sched_getcpu, sched_setaffinity, CpuSet};

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{check, CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Device, StreamId};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::driver::fake::FakeDriver;
use tensormem_ipc::{
    ConsumerConfig, IpcConsumer, IpcDriver, IpcHandle, IpcProducer, ProducerConfig, ReceivedMemory,
};

use link::{ChanLink, Link, PipeLink, Transport};

const ROLE: &str = "TENSORMEM_IPC_BENCH_ROLE";
const IDLE: &str = "TENSORMEM_IPC_BENCH_IDLE";
const SPIN: &str = "TENSORMEM_IPC_BENCH_SPIN_US";
const READ: &str = "TENSORMEM_IPC_BENCH_READ";
const SIM: &str = "TENSORMEM_IPC_BENCH_SIM";
const TRANSPORT: &str = "TENSORMEM_IPC_BENCH_TRANSPORT";
const S: StreamId = StreamId::DEFAULT;
/// The consumer's first message: set up, ready for the first handle.
const READY: &[u8] = b"ready";

type BoxError = Box<dyn std::error::Error>;

/// How the consumer reads the byte (see the crate docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadMode {
    Pinned,
    Pageable,
}

impl ReadMode {
    fn parse(text: &str) -> Result<Self, BoxError> {
        match text {
            "pinned" => Ok(Self::Pinned),
            "pageable" => Ok(Self::Pageable),
            other => Err(format!("--read {other}: expected `pinned` or `pageable`").into()),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Pinned => "pinned",
            Self::Pageable => "pageable",
        }
    }
}

/// The consumer's answer: the byte it read and how long its phases took.
struct Answer {
    value: u8,
    /// Decoding the handle and opening it, ns.
    open: u32,
    /// Reading the byte, ns.
    read: u32,
    /// Dropping the received memory, ns.
    release: u32,
}

impl Answer {
    const LEN: usize = 13;

    fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        out[0] = self.value;
        out[1..5].copy_from_slice(&self.open.to_le_bytes());
        out[5..9].copy_from_slice(&self.read.to_le_bytes());
        out[9..13].copy_from_slice(&self.release.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, BoxError> {
        if bytes.len() != Self::LEN {
            return Err(
                format!("an answer of {} bytes, expected {}", bytes.len(), Self::LEN).into(),
            );
        }
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        Ok(Self {
            value: bytes[0],
            open: word(1),
            read: word(5),
            release: word(9),
        })
    }
}

fn nanos(d: Duration) -> u32 {
    u32::try_from(d.as_nanos()).unwrap_or(u32::MAX)
}

/// The consumer process: opens what it is sent, reads a byte of it with `read`, releases it and
/// answers, until the producer closes its end.
fn consume<B: IpcDriver>(
    consumer: &IpcConsumer<B>,
    link: &mut dyn Link,
    mut read: impl FnMut(&ReceivedMemory<B>) -> Result<u8, BoxError>,
) -> Result<(), BoxError> {
    // Set up: the producer's timer starts after this (the first trip times the first open, not the
    // consumer's start or its CUDA initialisation).
    link.send(READY)?;
    let mut message = Vec::new();
    while link.recv(&mut message)? {
        let t0 = Instant::now();
        let handle = IpcHandle::decode(&message)?;
        let received = consumer.open(&handle, S)?;
        let t1 = Instant::now();
        let value = read(&received)?;
        let t2 = Instant::now();
        drop(received);
        let t3 = Instant::now();
        let answer = Answer {
            value,
            open: nanos(t1 - t0),
            read: nanos(t2 - t1),
            release: nanos(t3 - t2),
        };
        link.send(&answer.encode())?;
    }
    Ok(())
}

/// Reads the first byte of `received` as the crate docs say.
fn read_byte(
    received: &ReceivedMemory<CudaIpcDriver>,
    mode: ReadMode,
    host: &HostCachingAllocator<CudaBackend>,
) -> Result<u8, BoxError> {
    match mode {
        ReadMode::Pinned => {
            let mut byte = host.allocate(1)?;
            // SAFETY: `byte` is one byte of pinned host memory owned here until it is freed below,
            // after the synchronize that completes the copy; the source is the first byte of the
            // received memory (never empty: `share` refuses empty allocations), open on device 0,
            // whose context is current; the copy runs on the stream the memory was opened on.
            check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    byte.as_mut_slice().as_mut_ptr().cast(),
                    received.ptr().0,
                    1,
                    S.0 as sys::CUstream,
                )
            })?;
            // SAFETY: the stream the copy was queued on, of the current context.
            check("cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(S.0 as sys::CUstream)
            })?;
            let value = byte.as_slice()[0];
            host.free(byte)?;
            Ok(value)
        }
        ReadMode::Pageable => {
            let mut value = 0u8;
            // SAFETY: one byte of received device memory (never empty) into a local byte; device 0's
            // context is current.
            check("cuMemcpyDtoH", unsafe {
                sys::cuMemcpyDtoH_v2((&mut value as *mut u8).cast(), received.ptr().0, 1)
            })?;
            Ok(value)
        }
    }
}

fn consumer() -> Result<(), BoxError> {
    let idle = std::env::var(IDLE)?.parse()?;
    let spin = Duration::from_micros(std::env::var(SPIN)?.parse()?);
    let read_mode = ReadMode::parse(&std::env::var(READ)?)?;
    let config = ConsumerConfig {
        idle_mem_handles: idle,
        ..ConsumerConfig::default()
    };
    let stdin = std::io::stdin().as_fd().try_clone_to_owned()?;
    let mut link: Box<dyn Link> = match Transport::parse(&std::env::var(TRANSPORT)?)? {
        // The producer hands over one end of a socket pair as the standard input.
        Transport::Chan => Box::new(ChanLink::accept(stdin, spin)?),
        // Unbuffered ends: the standard output's line buffering would split an answer holding a
        // newline byte into two writes.
        Transport::Pipe => {
            let output = File::from(std::io::stdout().as_fd().try_clone_to_owned()?);
            Box::new(PipeLink::new(File::from(stdin), output, spin)?)
        }
    };
    if std::env::var(SIM).is_ok() {
        let consumer = IpcConsumer::with_config(Arc::new(FakeDriver::default()), config);
        // Nothing is behind a fake mapping: the trip is the crate's work and the transport.
        return consume(&consumer, &mut *link, |_| Ok(0));
    }
    let consumer = IpcConsumer::with_config(Arc::new(CudaIpcDriver::new()?), config);
    let device = CudaBackend::new(0)?;
    device.make_current()?;
    let source = CudaPinnedSource::host_alloc(&device);
    let host = HostCachingAllocator::new(device, source);
    // The pinned block is made once, before the first trip (a process's first `cuMemHostAlloc`
    // takes milliseconds), and cached from then on.
    host.free(host.allocate(1)?)?;
    consume(&consumer, &mut *link, |received| {
        read_byte(received, read_mode, &host)
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The per-trip times of one configuration, µs.
#[derive(Default)]
struct Trips {
    round_trip: Vec<f64>,
    share: Vec<f64>,
    open: Vec<f64>,
    read: Vec<f64>,
    release: Vec<f64>,
    transport: Vec<f64>,
}

/// Medians of one configuration, µs.
struct Figures {
    /// The first round trip (opens).
    first: f64,
    /// The consumer's open in the first round trip.
    first_open: f64,
    /// The median round trip.
    round_trip: f64,
    /// Phase name and median, in the order of the trip.
    phases: [(&'static str, f64); 5],
}

impl Figures {
    fn print(&self, name: &str, device: &str, size: usize) {
        println!("{name},{device},{size},{:.1}", self.round_trip);
        for (phase, us) in self.phases {
            println!("{name}.{phase},{device},{size},{us:.2}");
        }
    }

    fn share(&self) -> f64 {
        self.phases[0].1
    }
}

/// One configuration of [`run`].
#[derive(Clone, Copy)]
struct Config {
    size: usize,
    /// Idle memory handles the consumer keeps (0: cold).
    idle: usize,
    /// How long both sides poll before blocking.
    spin: Duration,
    /// Record an event although the stream is idle.
    events: bool,
    /// Pin the producer's thread and the consumer to this CPU.
    cpu: Option<usize>,
    read: ReadMode,
    iters: usize,
    /// On the simulated device and the fake driver.
    sim: bool,
    transport: Transport,
}

/// Restores the calling thread's CPU affinity when dropped.
struct AffinityGuard(Option<CpuSet>);

impl AffinityGuard {
    /// Pins the calling thread (and the processes it spawns from now on) to `cpu`.
    fn pin(cpu: Option<usize>) -> Result<Self, BoxError> {
        let Some(cpu) = cpu else {
            return Ok(Self(None));
        };
        let before = sched_getaffinity(None)?;
        let mut one = CpuSet::new();
        one.set(cpu);
        sched_setaffinity(None, &one).map_err(|e| format!("pinning to CPU {cpu}: {e}"))?;
        Ok(Self(Some(before)))
    }
}

impl Drop for AffinityGuard {
    fn drop(&mut self) {
        if let Some(before) = &self.0 {
            if let Err(e) = sched_setaffinity(None, before) {
                eprintln!("# could not restore the CPU affinity: {e}");
            }
        }
    }
}

/// Round trips as `config` says, on the first GPU.
fn run(config: Config) -> Result<Figures, BoxError> {
    let allocator = Arc::new(CachingAllocator::new(CudaBackend::new(0)?));
    let driver = Arc::new(CudaIpcDriver::new()?);
    run_on(config, &allocator, driver, |allocation, value| {
        allocator.device().make_current()?;
        // SAFETY: the allocation is `size` bytes of device 0, owned here.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(allocation.ptr().0, value, allocation.size())
        })?;
        // The anchor calls torch.cuda.synchronize() before its timer (cuMemsetD8 may return before
        // the fill is done).
        allocator.device().synchronize()?;
        Ok(())
    })
}

/// Round trips as `config` says on the simulated device and the fake driver (`--sim`): no GPU, no
/// byte to read; what is left is the crate's own work and the transport.
fn run_sim(config: Config) -> Result<Figures, BoxError> {
    let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 34)));
    let driver = Arc::new(FakeDriver::default());
    driver.set_streams_idle(!config.events);
    run_on(config, &allocator, driver, |_, _| Ok(()))
}

/// Round trips of allocations of `allocator` (each filled by `fill` with a value before the timer)
/// to a consumer process.
fn run_on<D: Device, B: IpcDriver>(
    config: Config,
    allocator: &Arc<CachingAllocator<D>>,
    driver: Arc<B>,
    fill: impl Fn(&Allocation, u8) -> Result<(), BoxError>,
) -> Result<Figures, BoxError> {
    let Config {
        size,
        idle,
        spin,
        events,
        cpu,
        read,
        iters,
        sim,
        transport,
    } = config;
    let producer_config = ProducerConfig {
        skip_event_when_idle: !events,
        ..ProducerConfig::default()
    };
    let producer = IpcProducer::with_config(driver, producer_config);
    let pinned = AffinityGuard::pin(cpu)?;
    let mut command = Command::new(std::env::current_exe()?);
    command
        .env(ROLE, "consumer")
        .env(IDLE, idle.to_string())
        .env(SPIN, spin.as_micros().to_string())
        .env(READ, read.name())
        .env(TRANSPORT, transport.name());
    if sim {
        command.env(SIM, "1");
    }
    let (mut child, mut link): (_, Box<dyn Link>) = match transport {
        Transport::Chan => {
            let (mine, theirs) = UnixStream::pair()?;
            command.stdin(Stdio::from(OwnedFd::from(theirs)));
            let child = command.spawn()?;
            // The child's end must not stay open here too, or the child's death shows no hang-up.
            drop(command);
            (child, Box::new(ChanLink::create(mine, spin)?))
        }
        Transport::Pipe => {
            let mut child = command
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            let to = child.stdin.take().ok_or("no stdin")?;
            let from = child.stdout.take().ok_or("no stdout")?;
            (child, Box::new(PipeLink::new(from, to, spin)?))
        }
    };
    let mut trips = Trips::default();
    let (mut first, mut first_open) = (0.0, 0.0);
    let mut answer = Vec::new();
    if !link.recv(&mut answer)? || answer != READY {
        return Err("the consumer did not start".into());
    }
    for i in 0..iters + 10 {
        let allocation = allocator.allocate(size, S)?;
        let value = (i % 251) as u8;
        fill(&allocation, value)?;
        let t0 = Instant::now();
        let (shared, handle) = producer.share(allocator, allocation, S)?;
        let share = t0.elapsed();
        link.send(&handle.encode())?;
        if !link.recv(&mut answer)? {
            return Err("the consumer ended early".into());
        }
        let dt = t0.elapsed();
        let answer = Answer::decode(&answer)?;
        if !sim && answer.value != value {
            return Err(format!("consumer read {} instead of {value}", answer.value).into());
        }
        drop(shared);
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let ns = |n: u32| f64::from(n) / 1e3;
        if i == 0 {
            first = us(dt);
            first_open = ns(answer.open);
        }
        if i >= 10 {
            trips.round_trip.push(us(dt));
            trips.share.push(us(share));
            trips.open.push(ns(answer.open));
            trips.read.push(ns(answer.read));
            trips.release.push(ns(answer.release));
            let consumer = ns(answer.open) + ns(answer.read) + ns(answer.release);
            trips.transport.push(us(dt) - us(share) - consumer);
        }
    }
    drop(link);
    child.wait()?;
    drop(pinned);
    if producer.stats().limbo != 0 {
        return Err("memory left in the limbo after every consumer released it".into());
    }
    Ok(Figures {
        first,
        first_open,
        round_trip: median(trips.round_trip),
        phases: [
            ("share", median(trips.share)),
            ("open", median(trips.open)),
            ("read", median(trips.read)),
            ("release", median(trips.release)),
            ("transport", median(trips.transport)),
        ],
    })
}

/// The value after `flag`, parsed, or `default` when the flag is absent.
fn option<T: std::str::FromStr>(args: &[String], flag: &str, default: T) -> Result<T, BoxError>
where
    T::Err: std::fmt::Display,
{
    match args.iter().position(|a| a == flag) {
        None => Ok(default),
        Some(i) => {
            let text = args.get(i + 1).ok_or(format!("{flag} needs a value"))?;
            text.parse()
                .map_err(|e| format!("{flag} {text}: {e}").into())
        }
    }
}

fn main() -> Result<(), BoxError> {
    if std::env::var(ROLE).is_ok() {
        return consumer();
    }
    let args: Vec<String> = std::env::args().collect();
    let iters = option(&args, "--iters", 200usize)?;
    let spin_us = option(&args, "--spin-us", 200u64)?;
    let read = ReadMode::parse(&option(&args, "--read", "pinned".to_string())?)?;
    let same_cpu = args.iter().any(|a| a == "--same-cpu");
    let cpu = option(&args, "--cpu", sched_getcpu())?;
    let sim = args.iter().any(|a| a == "--sim");
    let transport = Transport::parse(&option(&args, "--transport", "chan".to_string())?)?;
    let only = option(&args, "--only", String::new())?;
    let wants = |config: &str| only.is_empty() || only.split(',').any(|c| c == config);
    let (block, spin) = (Duration::ZERO, Duration::from_micros(spin_us));
    let run = if sim { run_sim } else { run };
    let device = if sim { "sim" } else { "cuda" };
    println!(
        "# transport: {}; read: {}; iters: {iters}; device: {device}",
        transport.name(),
        if sim {
            "none (fake driver)"
        } else {
            read.name()
        }
    );
    println!("strategy,device,bytes,median_us_per_roundtrip");
    for size in [4096usize, 1 << 20, 64 << 20] {
        let base = Config {
            size,
            idle: 16,
            spin: block,
            events: false,
            cpu: None,
            read,
            iters,
            sim,
            transport,
        };
        let warm = run(base)?;
        warm.print("tensormem_ipc_warm", device, size);
        println!("tensormem_ipc_first_open,{device},{size},{:.1}", warm.first);
        println!(
            "tensormem_ipc_first_open.open,{device},{size},{:.1}",
            warm.first_open
        );
        println!(
            "tensormem_ipc_share_only,{device},{size},{:.1}",
            warm.share()
        );
        if same_cpu && wants("same_cpu") {
            run(Config {
                cpu: Some(cpu),
                ..base
            })?
            .print("tensormem_ipc_warm_same_cpu", device, size);
        }
        if wants("spin") {
            run(Config { spin, ..base })?.print("tensormem_ipc_warm_spin", device, size);
        }
        if wants("event") {
            run(Config {
                events: true,
                ..base
            })?
            .print("tensormem_ipc_warm_event", device, size);
        }
        if wants("cold") {
            run(Config { idle: 0, ..base })?.print("tensormem_ipc_cold", device, size);
        }
    }
    if same_cpu {
        println!("# same_cpu rows: producer thread and consumer process pinned to CPU {cpu}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip_and_bad_lengths_are_refused() {
        let answer = Answer {
            value: 9,
            open: 1,
            read: 2,
            release: u32::MAX,
        };
        let back = Answer::decode(&answer.encode()).unwrap();
        assert_eq!(
            (back.value, back.open, back.read, back.release),
            (9, 1, 2, u32::MAX)
        );
        assert!(Answer::decode(&[0; 3]).is_err());
        assert!(ReadMode::parse("pinned").is_ok());
        assert!(ReadMode::parse("mapped").is_err());
        assert!(matches!(Transport::parse("chan"), Ok(Transport::Chan)));
        assert!(Transport::parse("socket").is_err());
    }
}
