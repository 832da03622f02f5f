//! Kill schedules for CUDA memory shared between processes and for pools put to sleep: real
//! processes on a real GPU, each killed with `SIGKILL` at a random moment, then an account of what
//! they left behind (see `docs/reliability.md`).
//!
//! ```text
//! cuda_crash [--mode batch|expandable-pidfd|expandable-socket|pool-asleep|all]
//!            [--trials N] [--parallel W] [--seed S]
//! ```
//!
//! Modes:
//! - `batch`: this process (the producer) shares a model of several tensors as one batch
//!   (`tensormem_ipc::batch`); a consumer process opens it, reads a byte of every tensor, holds
//!   it, releases it. The consumer reports each phase before entering it, so each kill is counted
//!   against the phase it interrupted (starting, opening, holding, releasing, done).
//! - `expandable-pidfd`, `expandable-socket`: the same with three allocations of an expandable
//!   segment shared one by one (chunk descriptors taken with `pidfd_getfd`, or received over the
//!   producer's descriptor socket).
//! - `pool-asleep`: a child process fills a private pool on expandable segments and puts it to
//!   sleep and wakes it in a loop (contents kept in pinned host memory); it is killed while
//!   sleeping, asleep or waking.
//!
//! The kill lands at a uniform random delay after the child is ready (CUDA initialised), over the
//! span a child takes to finish when left alone (measured first, per mode). A child still running
//! 60 s after it was told to go counts as a hang. After each wave of `W` concurrent trials the
//! harness checks what is left:
//! - sharing modes: the producer frees its tensors, collects (`IpcProducer::collect`), and counts
//!   allocations still held in its limbo (memory pinned by a dead consumer, or by a share its
//!   consumer died before opening: given up after the producer's `expire_unopened_*` limit, 200 ms
//!   here), bytes still allocated, and, after `empty_cache`, bytes still reserved and chunk
//!   descriptors still open;
//! - `pool-asleep`: the device's free memory must come back to what it was before the wave
//!   (within 64 MiB, polled for 10 s while the driver tears dead contexts down);
//! - every mode: objects left in `/dev/shm` by a child, and, at the end, by the producer.
//!
//! Prints a Markdown table (mode, trials, kills by phase, left behind, hangs). Exits non-zero if
//! anything was left behind or hung. Without a CUDA driver or device it prints `# skipped` and
//! exits successfully. Re-executes itself as the child (`TENSORMEM_CUDA_CRASH_ROLE`).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tensormem_cuda_alloc::backend::cuda::{self, CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::{
    Allocation, CachingAllocator, Device, DeviceAddress, MempoolId, StreamId,
};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::{
    BatchHandle, ChunkFdRoutes, ConsumerConfig, IpcConsumer, IpcHandle, IpcProducer,
    ProducerConfig, SharedAllocation,
};
use tensormem_test_support::{hex, unhex};

const ROLE: &str = "TENSORMEM_CUDA_CRASH_ROLE";
const PAYLOAD: &str = "TENSORMEM_CUDA_CRASH_PAYLOAD";
const S: StreamId = StreamId::DEFAULT;
const FILL: u8 = 0x5a;
/// How long a child holds what it opened (or its pool asleep) before letting go.
const HOLD: Duration = Duration::from_millis(20);
/// A child not done this long after it was told to go hangs.
const HANG: Duration = Duration::from_secs(60);
/// How long the producer keeps a share unopened once it freed the memory.
const EXPIRY: Duration = Duration::from_millis(200);
/// The sizes of the model shared as one batch (odd sizes, several segments, both pools).
const BATCH_MODEL: [usize; 8] = [
    1000,
    3 << 20,
    7,
    25 << 20,
    1 << 20,
    40 << 20,
    512 << 10,
    100 << 20,
];
/// The sizes shared from an expandable segment: the middle one straddles a 20 MiB chunk boundary.
const EXPANDABLE_MODEL: [usize; 3] = [5 << 20, 30 << 20, 3 << 20];
/// Bytes of the pool that sleeps.
const POOL_BYTES: usize = 256 << 20;
const POOL: MempoolId = MempoolId(0, 1);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Batch,
    ExpandablePidfd,
    ExpandableSocket,
    PoolAsleep,
}

impl Mode {
    const ALL: [Mode; 4] = [
        Mode::Batch,
        Mode::ExpandablePidfd,
        Mode::ExpandableSocket,
        Mode::PoolAsleep,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::Batch => "batch",
            Mode::ExpandablePidfd => "expandable-pidfd",
            Mode::ExpandableSocket => "expandable-socket",
            Mode::PoolAsleep => "pool-asleep",
        }
    }

    fn parse(name: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The phases a child reports, in order, each a byte written before the phase begins.
    fn phases(self) -> &'static [(u8, &'static str)] {
        match self {
            Mode::PoolAsleep => &[
                (b'S', "starting"),
                (b'Z', "sleeping"),
                (b'A', "asleep"),
                (b'W', "waking"),
                (b'D', "done"),
            ],
            _ => &[
                (b'S', "starting"),
                (b'O', "opening"),
                (b'H', "holding"),
                (b'R', "releasing"),
                (b'D', "done"),
            ],
        }
    }
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        let code = match child(&role) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("cuda_crash child ({role}): {e}");
                2
            }
        };
        std::process::exit(code);
    }
    match harness() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("cuda_crash: {e}");
            std::process::exit(2);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The child.

/// Writes a phase byte to the harness (stdout, unbuffered).
fn phase(byte: u8) -> Result<(), BoxError> {
    let mut out = std::io::stdout().lock();
    out.write_all(&[byte])?;
    out.flush()?;
    Ok(())
}

/// Waits for the harness's go (a byte on stdin).
fn wait_for_go() -> Result<(), BoxError> {
    let mut go = [0u8; 1];
    std::io::stdin().read_exact(&mut go)?;
    Ok(())
}

fn read_byte(device: &CudaBackend, at: DeviceAddress) -> Result<u8, BoxError> {
    let mut byte = 0u8;
    // SAFETY: `at` is a byte of memory opened in this process on device 0 (current) and kept open
    // by the caller; the destination is one byte owned here.
    unsafe { device.copy_to_host(at, &mut byte, 1)? };
    Ok(byte)
}

fn child(role: &str) -> Result<(), BoxError> {
    let device = CudaBackend::new(0)?;
    device.make_current()?;
    match role {
        "batch" | "expandable-pidfd" | "expandable-socket" => consumer(role, &device),
        "pool-asleep" => sleeper(device),
        other => Err(format!("unknown role {other}").into()),
    }
}

fn consumer(role: &str, device: &CudaBackend) -> Result<(), BoxError> {
    let payload = unhex(&std::env::var(PAYLOAD)?);
    let chunk_fds = match role {
        "expandable-socket" => ChunkFdRoutes::SocketOnly,
        "expandable-pidfd" => ChunkFdRoutes::PidfdOnly,
        _ => ChunkFdRoutes::Auto,
    };
    let consumer = IpcConsumer::with_config(
        Arc::new(CudaIpcDriver::new()?),
        ConsumerConfig {
            chunk_fds,
            ..ConsumerConfig::default()
        },
    );
    phase(b'S')?;
    wait_for_go()?;
    phase(b'O')?;
    if role == "batch" {
        let received = consumer.open_batch(&BatchHandle::decode(&payload)?, S)?;
        phase(b'H')?;
        for view in received.views().iter().filter(|v| !v.is_empty()) {
            if read_byte(device, view.ptr())? != FILL {
                return Err(format!("wrong byte in {}", view.name()).into());
            }
        }
        std::thread::sleep(HOLD);
        phase(b'R')?;
        drop(received);
    } else {
        let handles = split_frames(&payload)?
            .iter()
            .map(|bytes| IpcHandle::decode(bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let mut received = Vec::new();
        for handle in &handles {
            received.push(consumer.open(handle, S)?);
        }
        phase(b'H')?;
        for memory in &received {
            if read_byte(device, memory.ptr())? != FILL {
                return Err("wrong byte in an expandable share".into());
            }
        }
        std::thread::sleep(HOLD);
        phase(b'R')?;
        drop(received);
    }
    phase(b'D')?;
    Ok(())
}

/// Fills a pool, then sleeps and wakes it (contents kept) until told to stop by a closed stdin or
/// three cycles, checking the contents after each wake.
fn sleeper(device: CudaBackend) -> Result<(), BoxError> {
    let source = CudaPinnedSource::host_alloc(&device);
    let host = Arc::new(HostCachingAllocator::new(CudaBackend::new(0)?, source));
    let allocator =
        CachingAllocator::with_config(device, AllocatorConfig::parse("expandable_segments:True")?);
    allocator.create_or_incref_pool(POOL)?;
    allocator.begin_allocate_to_pool(POOL, |_| true)?;
    let block = allocator.allocate(POOL_BYTES, S);
    allocator.end_allocate_to_pool(POOL)?;
    let block = block?;
    let pattern = vec![FILL; 1 << 20];
    for offset in (0..POOL_BYTES).step_by(pattern.len()) {
        // SAFETY: `[offset, offset + 1 MiB)` lies in the pool's block, allocated above; the source
        // is a host buffer of that length.
        unsafe {
            allocator.device().copy_from_host(
                pattern.as_ptr(),
                block.ptr().offset(offset),
                pattern.len(),
            )?;
        }
    }
    phase(b'S')?;
    wait_for_go()?;
    phase(b'Z')?;
    let backup: Box<dyn tensormem_cuda_alloc::HostBackup> = Box::new(Arc::clone(&host));
    allocator.sleep_pool(POOL, Some(backup))?;
    phase(b'A')?;
    std::thread::sleep(HOLD);
    phase(b'W')?;
    allocator.wake_pool(POOL)?;
    if read_byte(allocator.device(), block.ptr().offset(POOL_BYTES - 1))? != FILL {
        return Err("the pool woke with other contents".into());
    }
    phase(b'D')?;
    allocator.free(block)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The harness.

struct Options {
    modes: Vec<Mode>,
    trials: usize,
    parallel: usize,
    seed: u64,
}

fn options() -> Result<Options, BoxError> {
    let mut options = Options {
        modes: Mode::ALL.to_vec(),
        trials: 100,
        parallel: 8,
        seed: 20261207,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--mode" => {
                let v = value()?;
                options.modes = if v == "all" {
                    Mode::ALL.to_vec()
                } else {
                    vec![Mode::parse(&v).ok_or(format!("unknown mode {v}"))?]
                };
            }
            "--trials" => options.trials = value()?.parse()?,
            "--parallel" => options.parallel = value()?.parse::<usize>()?.max(1),
            "--seed" => options.seed = value()?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(options)
}

/// What one mode's trials came to.
#[derive(Default)]
struct Tally {
    trials: usize,
    /// Kills by the phase they interrupted (the last phase byte the child wrote).
    killed_in: BTreeMap<&'static str, usize>,
    /// Children that finished before their kill.
    finished: usize,
    /// Children that failed on their own (not killed), with their last error line.
    failed: Vec<String>,
    hangs: usize,
    /// Producer allocations still held in the limbo after collecting.
    limbo_left: usize,
    /// Bytes still allocated after the producer freed everything, and still reserved after
    /// `empty_cache`.
    allocated_left: u64,
    reserved_left: u64,
    /// Descriptors this process still had open beyond its start (exported chunks).
    fds_left: usize,
    /// Device memory not back after a wave of sleeping pools (bytes).
    device_left: u64,
    /// Objects a child left in `/dev/shm`.
    shm_left: usize,
}

impl Tally {
    fn left_behind(&self) -> bool {
        self.limbo_left > 0
            || self.allocated_left > 0
            || self.reserved_left > 0
            || self.fds_left > 0
            || self.device_left > 0
            || self.shm_left > 0
    }
}

fn harness() -> Result<bool, BoxError> {
    let options = options()?;
    match cuda::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            println!("# skipped: the driver reports no CUDA device");
            return Ok(true);
        }
        Err(e) => {
            println!("# skipped: no CUDA driver ({e})");
            return Ok(true);
        }
    }
    let device = CudaBackend::new(0)?;
    device.make_current()?;
    let driver = Arc::new(CudaIpcDriver::new()?);
    // Shares given up when unopened (a consumer killed before it opened them) after a short time
    // here, so that waves need not wait out the default minute; single shares too (every consumer
    // here is tensormem's).
    let producer = IpcProducer::with_config(
        driver,
        ProducerConfig {
            expire_unopened_batches: Some(EXPIRY),
            expire_unopened_shares: Some(EXPIRY),
            ..ProducerConfig::default()
        },
    );
    let plain = Arc::new(CachingAllocator::new(CudaBackend::new(0)?));
    let expandable = Arc::new(CachingAllocator::with_config(
        CudaBackend::new(0)?,
        AllocatorConfig::parse("expandable_segments:True")?,
    ));
    let mut rng = StdRng::seed_from_u64(options.seed);
    println!("| mode | trials | killed (by phase) | finished first | left behind | hangs | span |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut ok = true;
    for &mode in &options.modes {
        let allocator = if mode == Mode::Batch {
            &plain
        } else {
            &expandable
        };
        // How long a child takes from go to done when left alone: the span kills are drawn from.
        let span = {
            let (mut tally, waves) = (Tally::default(), 3);
            let mut longest = Duration::ZERO;
            for _ in 0..waves {
                let took = wave(mode, allocator, &producer, &device, &[None], &mut tally)?;
                longest = longest.max(took);
            }
            if tally.finished != waves || tally.left_behind() {
                return Err(format!(
                    "{}: a child left alone did not finish cleanly ({:?})",
                    mode.name(),
                    tally.failed
                )
                .into());
            }
            longest
        };
        // Counted after the calibration, which starts what stays open for the process's life
        // (the descriptor socket's listener, the driver's own descriptors).
        let fds_before = open_fds();
        let mut tally = Tally::default();
        let started = Instant::now();
        let mut done = 0;
        while done < options.trials {
            let n = options.parallel.min(options.trials - done);
            let kills: Vec<Option<Duration>> = (0..n)
                .map(|_| Some(span.mul_f64(rng.gen_range(0.0..1.1))))
                .collect();
            wave(mode, allocator, &producer, &device, &kills, &mut tally)?;
            done += n;
            eprintln!(
                "# {}: {done} trials, {:.0} s",
                mode.name(),
                started.elapsed().as_secs_f64()
            );
        }
        let fds_after = open_fds();
        tally.fds_left = fds_after.len().saturating_sub(fds_before.len());
        for (fd, target) in fds_after
            .iter()
            .filter(|(fd, _)| !fds_before.contains_key(*fd))
        {
            eprintln!(
                "{}: descriptor {fd} open since the trials began: {target}",
                mode.name()
            );
        }
        ok &= !tally.left_behind() && tally.hangs == 0 && tally.failed.is_empty();
        if !tally.failed.is_empty() {
            eprintln!("{}: children failed: {:?}", mode.name(), tally.failed);
        }
        print_row(&mode, &tally, &span, &started.elapsed());
    }
    // The producer lets go of its ref-counter files once nothing is out.
    producer.collect();
    drop(producer);
    let producer_left = shm_objects_of(std::process::id());
    ok &= producer_left == 0;

    println!("# ref-counter files of the producer left in /dev/shm: {producer_left}");
    println!(
        "# verdict: {}",
        if ok {
            "nothing left, no hang"
        } else {
            "FAILED"
        }
    );
    Ok(ok)
}

/// Prints the table row of one mode.
fn print_row(mode: &Mode, tally: &Tally, span: &Duration, took: &Duration) {
    let phases: Vec<String> = tally
        .killed_in
        .iter()
        .map(|(phase, n)| format!("{phase} {n}"))
        .collect();
    let left = if mode == &Mode::PoolAsleep {
        format!(
            "{} MiB of device memory, {} in /dev/shm",
            tally.device_left >> 20,
            tally.shm_left
        )
    } else {
        format!(
            "{} held in limbo, {} B allocated, {} B reserved, {} fds, {} in /dev/shm",
            tally.limbo_left,
            tally.allocated_left,
            tally.reserved_left,
            tally.fds_left,
            tally.shm_left
        )
    };
    println!(
        "| {} | {} | {} | {} | {} | {} | {:.0} ms ({:.0} s in all) |",
        mode.name(),
        tally.trials,
        phases.join(", "),
        tally.finished,
        left,
        tally.hangs,
        span.as_secs_f64() * 1e3,
        took.as_secs_f64()
    );
}

/// What a trial's thread reports: the phases the child wrote, whether it was killed, how it ended.
struct Outcome {
    phases: Vec<u8>,
    killed: bool,
    hung: bool,
    success: bool,
    stderr: String,
    pid: u32,
}

/// One wave: a child per entry of `kills` (each killed after its delay after go, or left alone
/// for `None`), run together; then the account of what is left. Returns the longest time from go
/// to a child's end.
fn wave(
    mode: Mode,
    allocator: &Arc<CachingAllocator<CudaBackend>>,
    producer: &IpcProducer<CudaBackend, CudaIpcDriver>,
    device: &CudaBackend,
    kills: &[Option<Duration>],
    tally: &mut Tally,
) -> Result<Duration, BoxError> {
    let free_before = device.mem_info()?.free;
    // The producer's side: a model per child, shared.
    let mut models: Vec<Vec<SharedAllocation<CudaBackend, CudaIpcDriver>>> = Vec::new();
    let mut payloads = Vec::new();
    for _ in kills {
        match mode {
            Mode::Batch => {
                let mut model = fill_model(allocator, producer, &BATCH_MODEL)?;
                let mut batch = producer.batch();
                for (i, allocation) in model.iter_mut().enumerate() {
                    batch.whole(allocation, format!("layer{i}.weight"))?;
                }
                payloads.push(hex(&batch.share(S)?.encode()));
                models.push(model);
            }
            Mode::ExpandablePidfd | Mode::ExpandableSocket => {
                let mut model = fill_model(allocator, producer, &EXPANDABLE_MODEL)?;
                let mut frames = Vec::new();
                for allocation in &mut model {
                    frames.push(allocation.share(S)?.encode());
                }
                payloads.push(hex(&join_frames(&frames)));
                models.push(model);
            }
            Mode::PoolAsleep => payloads.push(String::new()),
        }
    }
    device.synchronize()?;
    let mut pids = Vec::new();
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let threads: Vec<_> = kills
            .iter()
            .zip(&payloads)
            .map(|(&kill, payload)| scope.spawn(move || trial(mode, payload, kill)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a trial thread panicked"))
            .collect::<Result<Vec<_>, BoxError>>()
    })?;
    let mut longest = Duration::ZERO;
    for (outcome, kill) in outcomes.iter().zip(kills) {
        tally.trials += usize::from(kill.is_some());
        pids.push(outcome.pid);
        let last = outcome.phases.last().copied().unwrap_or(b'S');
        let name = mode
            .phases()
            .iter()
            .find(|(b, _)| *b == last)
            .map_or("unknown", |(_, n)| n);
        if outcome.hung {
            tally.hangs += 1;
        } else if outcome.killed && last != b'D' {
            *tally.killed_in.entry(name).or_default() += 1;
        } else if outcome.success || (outcome.killed && last == b'D') {
            tally.finished += 1;
        } else {
            tally
                .failed
                .push(outcome.stderr.lines().last().unwrap_or("").to_owned());
        }
        if let Some(took) = outcome_span(outcome) {
            longest = longest.max(took);
        }
    }
    // What is left: the producer frees its tensors and collects (what a killed consumer held, or
    // never opened, is given up once the share's time limit has passed).
    drop(models);
    let deadline = Instant::now() + EXPIRY + Duration::from_secs(10);
    while producer.stats().limbo > 0 && Instant::now() < deadline {
        producer.collect();
        std::thread::sleep(Duration::from_millis(5));
    }
    // Absolute figures, so that what one wave left is seen by every later one: the worst is kept.
    tally.limbo_left = tally.limbo_left.max(producer.stats().limbo);
    let stats = allocator.memory_stats();
    tally.allocated_left = tally
        .allocated_left
        .max(stats.allocated_bytes.all.current as u64);
    allocator.empty_cache()?;
    tally.reserved_left = tally
        .reserved_left
        .max(allocator.memory_stats().reserved_bytes.all.current as u64);
    if mode == Mode::PoolAsleep {
        // Dead children's contexts are torn down by the driver, not always at once.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut missing;
        loop {
            missing = free_before.saturating_sub(device.mem_info()?.free);
            if missing <= 64 << 20 || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if missing > 64 << 20 {
            tally.device_left += missing;
        }
    }
    tally.shm_left += pids.iter().map(|&pid| shm_objects_of(pid)).sum::<usize>();
    Ok(longest)
}

/// The time from go to the child's end, stored by `trial` in the outcome's stderr tail.
fn outcome_span(outcome: &Outcome) -> Option<Duration> {
    outcome
        .stderr
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("#span "))
        .and_then(|s| s.parse().ok())
        .map(Duration::from_nanos)
}

fn fill_model(
    allocator: &Arc<CachingAllocator<CudaBackend>>,
    producer: &IpcProducer<CudaBackend, CudaIpcDriver>,
    sizes: &[usize],
) -> Result<Vec<SharedAllocation<CudaBackend, CudaIpcDriver>>, BoxError> {
    let mut model = Vec::with_capacity(sizes.len());
    for &size in sizes {
        let allocation: Allocation = allocator.allocate(size, S)?;
        // SAFETY: the first byte of the allocation just made; the source is one byte.
        unsafe {
            allocator
                .device()
                .copy_from_host(&FILL, allocation.ptr(), 1)?;
        }
        model.push(producer.adopt(allocator, allocation));
    }
    Ok(model)
}

/// Runs one child: waits for it to be ready, tells it to go, kills it after `kill` (if given).
fn trial(mode: Mode, payload: &str, kill: Option<Duration>) -> Result<Outcome, BoxError> {
    let mut child: Child = Command::new(std::env::current_exe()?)
        .env(ROLE, mode.name())
        .env(PAYLOAD, payload)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let mut stdout = child.stdout.take().ok_or("no stdout")?;
    let mut phases = Vec::new();
    let mut byte = [0u8; 1];
    // Ready: CUDA initialised (and the pool filled).
    if stdout.read_exact(&mut byte).is_ok() {
        phases.push(byte[0]);
    }
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let go = Instant::now();
    let _ = stdin.write_all(b"g");
    // Phase bytes are read on a thread of their own, so that a kill lands on time.
    let reader = std::thread::spawn(move || {
        let mut rest = Vec::new();
        let _ = stdout.read_to_end(&mut rest);
        rest
    });
    let mut killed = false;
    if let Some(delay) = kill {
        std::thread::sleep(delay);
        if child.try_wait()?.is_none() {
            let _ = child.kill();
            killed = true;
        }
    }
    let mut hung = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if go.elapsed() > HANG {
            hung = true;
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let took = go.elapsed();
    phases.extend(reader.join().map_err(|_| "the reader panicked")?);
    let mut stderr = String::new();
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut stderr);
    }
    stderr.push_str(&format!("\n#span {}\n", took.as_nanos()));
    Ok(Outcome {
        phases,
        killed,
        hung,
        success: status.success(),
        stderr,
        pid,
    })
}

/// Descriptors this process has open, with what each names (`/proc/self/fd/N`'s link).
fn open_fds() -> std::collections::BTreeMap<String, String> {
    std::fs::read_dir("/proc/self/fd").map_or_else(
        |_| std::collections::BTreeMap::new(),
        |dir| {
            dir.flatten()
                .map(|e| {
                    let target = std::fs::read_link(e.path())
                        .map_or_else(|_| "?".to_owned(), |t| t.display().to_string());
                    (e.file_name().to_string_lossy().into_owned(), target)
                })
                .collect()
        },
    )
}

/// Objects in `/dev/shm` whose name carries `pid` the way tensormem's and PyTorch's names do
/// (`_<pid>_`).
fn shm_objects_of(pid: u32) -> usize {
    let needle = format!("_{pid}_");
    std::fs::read_dir("/dev/shm").map_or(0, |dir| {
        dir.flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(&needle))
            .count()
    })
}

/// Length-prefixed frames in one buffer.
fn join_frames(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for frame in frames {
        out.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        out.extend_from_slice(frame);
    }
    out
}

fn split_frames(mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, BoxError> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        if bytes.len() < 4 {
            return Err("a truncated frame".into());
        }
        let len = u32::from_le_bytes(bytes[..4].try_into()?) as usize;
        let frame = bytes.get(4..4 + len).ok_or("a truncated frame")?;
        frames.push(frame.to_vec());
        bytes = &bytes[4 + len..];
    }
    Ok(frames)
}
