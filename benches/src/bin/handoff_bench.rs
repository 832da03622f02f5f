//! A whole model's weights handed from one process to another as one batch
//! (`tensormem_ipc::batch`), timed like `torch_handoff_bench.py` (the PyTorch anchor, which puts
//! the state dict on a `torch.multiprocessing` Queue: one CUDA IPC handle per tensor).
//!
//! The producer allocates every tensor of a state dict from the caching allocator on device 0 and
//! fills it (bytes of 1, as the anchor's `torch.ones`), synchronizes, and keeps the tensors alive.
//! Per round it shares them all as one batch (one slot, one memory handle per segment; no event,
//! the stream being idle as after the anchor's `torch.cuda.synchronize()`), sends the encoded batch
//! to the consumer process and waits for its answer. The consumer decodes the batch, opens it
//! (segments kept open between rounds: a warm round opens nothing), touches one element of each
//! tensor on its stream (a 1-byte `cuMemcpyDtoHAsync` per tensor into pinned memory, then one
//! `cuStreamSynchronize`: the anchor adds one element of each tensor on the GPU and synchronizes),
//! drops the batch (its stream synchronized, the slot released) and acknowledges with the sum of
//! the bytes it read, which the producer checks. Timed: share -> acknowledgement.
//!
//! ```text
//! handoff_bench [--quick] [--layout gpt2|7b|both] [--rounds N] [--events] [--sim]
//! ```
//!
//! Prints the anchor's CSV (`layout,tensors,bytes,first_round_ms,median_ms_per_handoff`) with
//! layouts `tensormem_gpt2` and `tensormem_7b`: the first round (the consumer's first opens of every
//! segment; the consumer has started and initialised CUDA before the timer) and the median of the
//! warm rounds after it. Comment lines (`#`) give the consumer's start-up (spawn to ready, CUDA
//! initialised: the anchor's first round includes it), segments per batch, message bytes, and the
//! warm rounds' phase medians (share, open, touch, release, rest).
//!
//! - `--quick`: the GPT-2 layout only, 3 warm rounds (a smoke test);
//! - `--rounds N`: warm rounds (default 20);
//! - `--events`: record an interprocess event although the stream is idle (as PyTorch always does);
//! - `--sim`: the simulated device and the fake driver (no GPU, nothing touched): the crate's own
//!   work and the transport, on any machine.
//!
//! Without a CUDA driver or device it prints a `# skipped` line and exits successfully.
//! Re-executes itself as the consumer (`TENSORMEM_HANDOFF_BENCH_ROLE=consumer`).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{check, CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Device, StreamId};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::driver::fake::FakeDriver;
use tensormem_ipc::{
    BatchHandle, IpcConsumer, IpcDriver, IpcProducer, ProducerConfig, ReceivedBatch,
    SharedAllocation,
};

const ROLE: &str = "TENSORMEM_HANDOFF_BENCH_ROLE";
const SIM: &str = "TENSORMEM_HANDOFF_BENCH_SIM";
const S: StreamId = StreamId::DEFAULT;
/// The consumer's first message: CUDA initialised, ready for the first batch.
const READY: &[u8] = b"ready";
/// The byte every tensor is filled with (the anchor's `torch.ones`; any nonzero byte checks reads).
const FILL: u8 = 1;

type BoxError = Box<dyn std::error::Error>;

/// The tensor sizes in bytes of a state dict, as `torch_handoff_bench.py`'s `layout()`: GPT-2
/// small in fp32 (`gpt2`), else Llama-7B-shaped in bf16.
fn layout(name: &str) -> Vec<usize> {
    tensormem_benches::layouts::sizes(if name == "gpt2" { "gpt2" } else { "7b" })
}

/// Length-prefixed frames over a pair of byte streams.
struct Link {
    from: File,
    to: File,
}

impl Link {
    fn send(&mut self, bytes: &[u8]) -> Result<(), BoxError> {
        let mut frame = Vec::with_capacity(4 + bytes.len());
        frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        frame.extend_from_slice(bytes);
        self.to.write_all(&frame)?;
        Ok(())
    }

    /// The next frame, or `false` when the other side closed its end.
    fn recv(&mut self, into: &mut Vec<u8>) -> Result<bool, BoxError> {
        let mut len = [0u8; 4];
        match self.from.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        into.resize(u32::from_le_bytes(len) as usize, 0);
        self.from.read_exact(into)?;
        Ok(true)
    }
}

/// The consumer's answer: views seen, the sum of the bytes read, its phase times (ns).
struct Answer {
    views: u32,
    sum: u64,
    open: u64,
    touch: u64,
    release: u64,
}

impl Answer {
    const LEN: usize = 36;

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::LEN);
        out.extend_from_slice(&self.views.to_le_bytes());
        for word in [self.sum, self.open, self.touch, self.release] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Self, BoxError> {
        if bytes.len() != Self::LEN {
            return Err(
                format!("an answer of {} bytes, expected {}", bytes.len(), Self::LEN).into(),
            );
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Ok(Self {
            views: u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            sum: word(4),
            open: word(12),
            touch: word(20),
            release: word(28),
        })
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The consumer loop: open each batch, `touch` it (returns the sum of the bytes read), drop it,
/// answer.
fn consume<B: IpcDriver>(
    consumer: &IpcConsumer<B>,
    link: &mut Link,
    mut touch: impl FnMut(&ReceivedBatch<B>) -> Result<u64, BoxError>,
) -> Result<(), BoxError> {
    link.send(READY)?;
    let mut message = Vec::new();
    while link.recv(&mut message)? {
        let t0 = Instant::now();
        let batch = BatchHandle::decode(&message)?;
        let received = consumer.open_batch(&batch, S)?;
        let t1 = Instant::now();
        let sum = touch(&received)?;
        let t2 = Instant::now();
        let views = received.len() as u32;
        drop(received);
        let t3 = Instant::now();
        let answer = Answer {
            views,
            sum,
            open: nanos(t1 - t0),
            touch: nanos(t2 - t1),
            release: nanos(t3 - t2),
        };
        link.send(&answer.encode())?;
    }
    Ok(())
}

/// Reads the first byte of every view: one async copy each into pinned memory, one synchronize.
fn touch_all(
    received: &ReceivedBatch<CudaIpcDriver>,
    host: &HostCachingAllocator<CudaBackend>,
) -> Result<u64, BoxError> {
    let views = received.views();
    let mut bytes = host.allocate(views.len().max(1))?;
    let base = bytes.as_mut_slice().as_mut_ptr();
    for (i, view) in views.iter().enumerate() {
        if view.is_empty() {
            continue;
        }
        // SAFETY: the destination is byte `i` of a pinned block of `views.len()` bytes owned here
        // until it is freed below, after the synchronize that completes every copy; the source is
        // the first byte of a nonempty view of the batch, open on device 0 (whose context is
        // current) while `received` lives; the copies run on the stream the batch was opened on.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(base.add(i).cast(), view.ptr().0, 1, S.0 as sys::CUstream)
        })?;
    }
    // SAFETY: the stream the copies were queued on, of the current context.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(S.0 as sys::CUstream)
    })?;
    let sum = bytes.as_slice()[..views.len()]
        .iter()
        .map(|&b| u64::from(b))
        .sum();
    host.free(bytes)?;
    Ok(sum)
}

fn consumer() -> Result<(), BoxError> {
    let mut link = Link {
        from: File::from(std::io::stdin().as_fd().try_clone_to_owned()?),
        // Unbuffered: one write per frame.
        to: File::from(std::io::stdout().as_fd().try_clone_to_owned()?),
    };
    if std::env::var(SIM).is_ok() {
        let consumer = IpcConsumer::new(Arc::new(FakeDriver::default()));
        return consume(&consumer, &mut link, |_| Ok(0));
    }
    let consumer = IpcConsumer::new(Arc::new(CudaIpcDriver::new()?));
    let device = CudaBackend::new(0)?;
    device.make_current()?;
    let source = CudaPinnedSource::host_alloc(&device);
    let host = HostCachingAllocator::new(device, source);
    // The pinned block is made before the first round (a process's first cuMemHostAlloc takes
    // milliseconds) and cached from then on.
    host.free(host.allocate(4096)?)?;
    consume(&consumer, &mut link, |received| touch_all(received, &host))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One run's settings.
#[derive(Clone, Copy)]
struct Config<'a> {
    layout: &'a str,
    rounds: usize,
    events: bool,
    sim: bool,
}

/// Hands the state dict of `config.layout` (allocated from `allocator`, each tensor filled by
/// `fill`) to a consumer process, round after round, and prints the rows.
fn run_on<D: Device, B: IpcDriver>(
    config: Config<'_>,
    allocator: &Arc<CachingAllocator<D>>,
    driver: Arc<B>,
    fill: impl Fn(&Allocation) -> Result<(), BoxError>,
    synchronize: impl Fn() -> Result<(), BoxError>,
) -> Result<(), BoxError> {
    let sizes = layout(config.layout);
    let total: usize = sizes.iter().sum();
    let producer = IpcProducer::with_config(
        driver,
        ProducerConfig {
            skip_event_when_idle: !config.events,
            ..ProducerConfig::default()
        },
    );
    let mut model: Vec<SharedAllocation<D, B>> = Vec::with_capacity(sizes.len());
    for &size in &sizes {
        let allocation = allocator.allocate(size, S)?;
        fill(&allocation)?;
        model.push(producer.adopt(allocator, allocation));
    }
    synchronize()?;
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("p{i}")).collect();

    let started = Instant::now();
    let mut command = Command::new(std::env::current_exe()?);
    command
        .env(ROLE, "consumer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if config.sim {
        command.env(SIM, "1");
    }
    let mut child = command.spawn()?;
    let mut link = Link {
        from: File::from(std::os::fd::OwnedFd::from(
            child.stdout.take().ok_or("no stdout")?,
        )),
        to: File::from(std::os::fd::OwnedFd::from(
            child.stdin.take().ok_or("no stdin")?,
        )),
    };
    let mut answer = Vec::new();
    if !link.recv(&mut answer)? || answer != READY {
        return Err("the consumer did not start".into());
    }
    let start_up = started.elapsed();

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (mut first, mut segments, mut message_len) = (0.0, 0, 0);
    let mut rounds = Vec::new();
    let (mut share, mut open, mut touch, mut release, mut rest) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..=config.rounds {
        let t0 = Instant::now();
        let mut batch = producer.batch();
        for (allocation, name) in model.iter_mut().zip(&names) {
            batch.whole(allocation, name.as_str())?;
        }
        let handle = batch.share(S)?;
        let bytes = handle.encode();
        let shared = t0.elapsed();
        link.send(&bytes)?;
        if !link.recv(&mut answer)? {
            return Err("the consumer ended early".into());
        }
        let dt = t0.elapsed();
        let answer = Answer::decode(&answer)?;
        if answer.views as usize != sizes.len() {
            return Err(
                format!("the consumer saw {} views of {}", answer.views, sizes.len()).into(),
            );
        }
        if !config.sim && answer.sum != sizes.len() as u64 * u64::from(FILL) {
            return Err(format!(
                "the consumer read a byte sum of {} instead of {}",
                answer.sum,
                sizes.len() as u64 * u64::from(FILL)
            )
            .into());
        }
        if round == 0 {
            first = ms(dt);
            segments = handle.segments().len();
            message_len = bytes.len();
            continue;
        }
        let ns = |n: u64| n as f64 / 1e6;
        rounds.push(ms(dt));
        share.push(ms(shared));
        open.push(ns(answer.open));
        touch.push(ns(answer.touch));
        release.push(ns(answer.release));
        rest.push(ms(dt) - ms(shared) - ns(answer.open) - ns(answer.touch) - ns(answer.release));
    }
    drop(link);
    child.wait()?;
    drop(model);
    if producer.stats().limbo != 0 {
        return Err("memory left in the limbo after the consumer released every batch".into());
    }
    let name = format!("tensormem_{}", config.layout);
    println!(
        "{name},{},{total},{first:.2},{:.3}",
        sizes.len(),
        median(rounds)
    );
    println!(
        "# {name}: {segments} segments, {message_len}-byte message; consumer start-up (spawn to \
         ready, CUDA initialised) {:.1} ms, first round with it {:.1} ms",
        ms(start_up),
        ms(start_up) + first
    );
    println!(
        "# {name} warm phases, median ms: share {:.3}, open {:.3}, touch {:.3}, release {:.3}, \
         rest (messages, wake-ups) {:.3}",
        median(share),
        median(open),
        median(touch),
        median(release),
        median(rest)
    );
    Ok(())
}

/// On the first GPU.
fn run_cuda(config: Config<'_>) -> Result<(), BoxError> {
    let allocator = Arc::new(CachingAllocator::new(CudaBackend::new(0)?));
    let driver = Arc::new(CudaIpcDriver::new()?);
    allocator.device().make_current()?;
    let device = Arc::clone(&allocator);
    run_on(
        config,
        &allocator,
        driver,
        |allocation| {
            // SAFETY: the allocation is at least `requested_size` bytes of device 0 (current),
            // owned here.
            check("cuMemsetD8", unsafe {
                sys::cuMemsetD8_v2(allocation.ptr().0, FILL, allocation.requested_size())
            })?;
            Ok(())
        },
        || Ok(device.device().synchronize()?),
    )
}

/// On the simulated device and the fake driver.
fn run_sim(config: Config<'_>) -> Result<(), BoxError> {
    let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 36)));
    let driver = Arc::new(FakeDriver::default());
    driver.set_streams_idle(!config.events);
    run_on(config, &allocator, driver, |_| Ok(()), || Ok(()))
}

/// Whether a CUDA driver and a device are there; says why not otherwise.
fn gpu_available() -> Result<(), String> {
    let driver = CudaIpcDriver::new().map_err(|e| format!("no CUDA driver ({e})"))?;
    match driver.device_count() {
        Ok(0) => Err("no CUDA device".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("no CUDA device ({e})")),
    }
}

fn main() -> Result<(), BoxError> {
    if std::env::var(ROLE).is_ok() {
        return consumer();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .map(|i| {
                args.get(i + 1)
                    .cloned()
                    .ok_or(format!("{name} needs a value"))
            })
            .transpose()
    };
    let quick = flag("--quick");
    let sim = flag("--sim");
    let events = flag("--events");
    let rounds: usize = match value("--rounds")? {
        Some(text) => text.parse().map_err(|e| format!("--rounds {text}: {e}"))?,
        None if quick => 3,
        None => 20,
    };
    if rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let which = value("--layout")?.unwrap_or_else(|| if quick { "gpt2" } else { "both" }.into());
    let layouts: &[&str] = match which.as_str() {
        "gpt2" => &["gpt2"],
        "7b" => &["7b"],
        "both" => &["gpt2", "7b"],
        other => return Err(format!("--layout {other}: expected gpt2, 7b or both").into()),
    };
    if !sim {
        if let Err(why) = gpu_available() {
            println!("# handoff_bench skipped: {why} (--sim runs it on the fake driver)");
            return Ok(());
        }
    }
    println!(
        "# device: {}; warm rounds: {rounds}; events: {}",
        if sim { "sim (fake driver)" } else { "cuda:0" },
        if events {
            "always"
        } else {
            "when the stream is busy"
        }
    );
    println!("layout,tensors,bytes,first_round_ms,median_ms_per_handoff");
    for &layout in layouts {
        let config = Config {
            layout,
            rounds,
            events,
            sim,
        };
        if sim {
            run_sim(config)?;
        } else {
            run_cuda(config)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_the_anchors_tensor_counts_and_sizes() {
        let gpt2 = layout("gpt2");
        assert_eq!(gpt2.len(), 148);
        let bytes: usize = gpt2.iter().sum();
        assert!((490_000_000..510_000_000).contains(&bytes), "{bytes}");
        let llama = layout("7b");
        assert_eq!(llama.len(), 291);
        let bytes: usize = llama.iter().sum();
        assert!((13_000_000_000..14_000_000_000).contains(&bytes), "{bytes}");
    }

    #[test]
    fn answers_round_trip_and_bad_lengths_are_refused() {
        let answer = Answer {
            views: 291,
            sum: 291,
            open: 1,
            touch: 2,
            release: u64::MAX,
        };
        let back = Answer::decode(&answer.encode()).unwrap();
        assert_eq!(
            (back.views, back.sum, back.open, back.touch, back.release),
            (291, 291, 1, 2, u64::MAX)
        );
        assert!(Answer::decode(&[0; 3]).is_err());
    }
}
