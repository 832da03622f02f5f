//! `alloc_patterns`: the allocator patterns of `benches/anchors/torch_alloc_bench.cpp`, run on
//! tensormem's caching allocator, printed as the same CSV rows so that `compare_alloc.sh` can set them
//! beside PyTorch's, measured in the same run on the same machine.
//!
//! ```text
//! alloc_patterns            # device 0, the CUDA backend (what compare_alloc.sh runs)
//! alloc_patterns --sim      # the simulated device: profile the allocator's own code without a GPU
//! alloc_patterns --history all   # the cost of memory history with call stacks (off/state/alloc/all)
//! alloc_patterns --only mixed   # one pattern's rows only (e.g. under `perf stat` for its cache misses)
//! alloc_patterns --only mixed --repeat 5   # the rows five times over in one process (per-process
//!                                          # states, such as memory placement, against the host's)
//! ```
//!
//! Each pattern is timed exactly as the C++ harness times it: the same warm-up, iteration counts, random
//! sizes (the same `std::mt19937_64` stream and `uniform_real_distribution`, so the same size sequence),
//! and the same arithmetic for the printed figure, including the per-thread truncation to whole
//! nanoseconds of the multi-threaded pattern.
//!
//! | pattern | key | timed |
//! | --- | --- | --- |
//! | `hot_pair` | 512, 65536, 1048576, 8388608, 67108864 | 100 warm-up pairs, then 200000 alloc+free pairs; ns per pair |
//! | `mixed` | 256 | 256 live blocks of 2^U(9,25) bytes, 200000 steps of free-random-then-alloc; ns per single op |
//! | `mt_hot_pair_1MiB` | `1 threads` .. `8 threads` | each thread on its own non-blocking stream runs `hot_pair` of 1 MiB 100000 times; mean of the threads' ns per pair |

use std::process::ExitCode;
use std::time::Instant;

use tensormem_cuda_alloc::backend::cuda::{BackendStream, CudaBackend};
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{
    Allocation, CachingAllocator, Device, DeviceAddress, RecordContext, StreamId,
};

/// `std::mt19937_64`, the engine of the C++ harness (same seed, same outputs).
struct Mt19937_64 {
    state: [u64; 312],
    index: usize,
}

impl Mt19937_64 {
    const N: usize = 312;
    const M: usize = 156;
    const MATRIX_A: u64 = 0xB502_6F5A_A966_19E9;
    const UPPER: u64 = 0xFFFF_FFFF_8000_0000;
    const LOWER: u64 = 0x7FFF_FFFF;

    fn new(seed: u64) -> Self {
        let mut state = [0u64; Self::N];
        state[0] = seed;
        for i in 1..Self::N {
            let prev = state[i - 1];
            state[i] = 6_364_136_223_846_793_005u64
                .wrapping_mul(prev ^ (prev >> 62))
                .wrapping_add(i as u64);
        }
        Self {
            state,
            index: Self::N,
        }
    }

    /// The next 312 outputs' state, as libstdc++ generates it: in three runs without index
    /// wrapping, and with the twist's odd case selected by a mask (as libstdc++'s
    /// `(y & 1) ? a : 0` compiles), not by a branch on the data, which mispredicts every other time.
    #[cold]
    #[inline(never)]
    fn twist(&mut self) {
        let (n, m) = (Self::N, Self::M);
        let s = &mut self.state;
        let mix = |y: u64| (y >> 1) ^ ((y & 1).wrapping_neg() & Self::MATRIX_A);
        for i in 0..n - m {
            let y = (s[i] & Self::UPPER) | (s[i + 1] & Self::LOWER);
            s[i] = s[i + m] ^ mix(y);
        }
        for i in n - m..n - 1 {
            let y = (s[i] & Self::UPPER) | (s[i + 1] & Self::LOWER);
            s[i] = s[i + m - n] ^ mix(y);
        }
        let y = (s[n - 1] & Self::UPPER) | (s[0] & Self::LOWER);
        s[n - 1] = s[m - 1] ^ mix(y);
        self.index = 0;
    }

    #[inline]
    fn next_u64(&mut self) -> u64 {
        if self.index >= Self::N {
            self.twist();
        }
        let mut x = self.state[self.index];
        self.index += 1;
        x ^= (x >> 29) & 0x5555_5555_5555_5555;
        x ^= (x << 17) & 0x71D6_7FFF_EDA6_0000;
        x ^= (x << 37) & 0xFFF7_EEE0_0000_0000;
        x ^ (x >> 43)
    }

    /// `std::uniform_real_distribution<double>(a, b)(engine)` as libstdc++ computes it
    /// (`generate_canonical<double, 53>` draws once from a 64-bit engine).
    fn uniform(&mut self, a: f64, b: f64) -> f64 {
        let range = 18_446_744_073_709_551_616.0_f64; // 2^64 = max - min + 1
        let mut canonical = self.next_u64() as f64 / range;
        if canonical >= 1.0 {
            canonical = 1.0 - f64::EPSILON / 2.0; // nextafter(1.0, 0.0)
        }
        a + (b - a) * canonical
    }
}

/// The sizes of `hot_pair`.
const HOT_SIZES: [usize; 5] = [512, 65_536, 1 << 20, 8 << 20, 64 << 20];
/// Warm-up pairs before each timed `hot_pair` loop.
const HOT_WARMUP: usize = 100;
/// Timed pairs of `hot_pair`.
const HOT_ITERS: usize = 200_000;
/// Timed steps of `mixed`.
const MIXED_OPS: usize = 200_000;
/// Live blocks of `mixed`.
const MIXED_WINDOW: usize = 256;
/// The seed of `mixed`.
const MIXED_SEED: u64 = 42;
/// Thread counts of `mt_hot_pair_1MiB`.
const MT_THREADS: [usize; 4] = [1, 2, 4, 8];
/// Timed pairs per thread of `mt_hot_pair_1MiB`.
const MT_ITERS: usize = 100_000;
/// The simulated device's capacity: an 80 GiB GPU.
const SIM_CAPACITY: u64 = 80 << 30;

/// The CSV header of the harness.
const HEADER: &str = "pattern,backend,size_or_window,ns_per_op";

/// An error that ends the run, with what was being done.
type RunResult<T> = Result<T, String>;

/// How blocks are taken and given back: the allocator's handle API, or the pointer API that mirrors
/// PyTorch's `raw_alloc_with_stream` / `raw_delete` (a pointer lookup on every free).
trait Api<D: Device>: Send + Sync + 'static {
    /// What an allocation returns.
    type Block: Send;
    fn alloc(a: &CachingAllocator<D>, size: usize, stream: StreamId) -> RunResult<Self::Block>;
    fn free(a: &CachingAllocator<D>, block: Self::Block) -> RunResult<()>;
}

/// The message of a failed call, out of the timed loops' line (the loops branch over it).
#[cold]
#[inline(never)]
fn failed(what: std::fmt::Arguments<'_>) -> String {
    what.to_string()
}

/// [`CachingAllocator::allocate`] / [`CachingAllocator::free`].
struct HandleApi;
/// [`CachingAllocator::raw_alloc`] / [`CachingAllocator::raw_free`].
struct RawApi;

impl<D: Device> Api<D> for HandleApi {
    type Block = Allocation;
    #[inline]
    fn alloc(a: &CachingAllocator<D>, size: usize, stream: StreamId) -> RunResult<Allocation> {
        a.allocate(size, stream)
            .map_err(|e| failed(format_args!("allocating {size} bytes: {e}")))
    }
    #[inline]
    fn free(a: &CachingAllocator<D>, block: Allocation) -> RunResult<()> {
        a.free(block)
            .map_err(|e| failed(format_args!("freeing: {e}")))
    }
}

impl<D: Device> Api<D> for RawApi {
    type Block = DeviceAddress;
    #[inline]
    fn alloc(a: &CachingAllocator<D>, size: usize, stream: StreamId) -> RunResult<DeviceAddress> {
        a.raw_alloc(size, stream)
            .map_err(|e| failed(format_args!("allocating {size} bytes: {e}")))
    }
    #[inline]
    fn free(a: &CachingAllocator<D>, ptr: DeviceAddress) -> RunResult<()> {
        a.raw_free(ptr)
            .map_err(|e| failed(format_args!("freeing {ptr}: {e}")))
    }
}

/// Pattern 1 of the harness: alloc then free the same size, `iters` times after 100 warm-up pairs; ns per
/// pair.
fn hot_pair_ns<D: Device, A: Api<D>>(
    a: &CachingAllocator<D>,
    size: usize,
    iters: usize,
    stream: StreamId,
) -> RunResult<f64> {
    for _ in 0..HOT_WARMUP {
        A::free(a, A::alloc(a, size, stream)?)?;
    }
    let start = Instant::now();
    for _ in 0..iters {
        A::free(a, A::alloc(a, size, stream)?)?;
    }
    Ok(start.elapsed().as_nanos() as f64 / iters as f64)
}

/// Pattern 2: a window of live blocks of log-uniform sizes 2^9..2^25 bytes; each step frees a random one
/// and allocates a new one; ns per single operation. The random stream is the harness's, draw for draw.
fn mixed_op_ns<D: Device, A: Api<D>>(a: &CachingAllocator<D>, stream: StreamId) -> RunResult<f64> {
    let mut rng = Mt19937_64::new(MIXED_SEED);
    let mut live = Vec::with_capacity(MIXED_WINDOW);
    for _ in 0..MIXED_WINDOW {
        live.push(Some(A::alloc(
            a,
            rng.uniform(9.0, 25.0).exp2() as usize,
            stream,
        )?));
    }
    let start = Instant::now();
    for _ in 0..MIXED_OPS {
        let k = (rng.next_u64() % MIXED_WINDOW as u64) as usize;
        if let Some(block) = live[k].take() {
            A::free(a, block)?;
        }
        live[k] = Some(A::alloc(a, rng.uniform(9.0, 25.0).exp2() as usize, stream)?);
    }
    let ns = start.elapsed().as_nanos() as f64 / (2.0 * MIXED_OPS as f64);
    for block in live.into_iter().flatten() {
        A::free(a, block)?;
    }
    Ok(ns)
}

/// A stream for one thread of the benchmark, kept alive for as long as the thread uses it.
trait StreamSource: Sync {
    fn stream(&self, thread: usize) -> RunResult<(StreamId, Option<BackendStream>)>;
}

/// Non-blocking streams of a real device.
struct CudaStreams<'a>(&'a CudaBackend);
/// Made-up stream ids for the simulated device.
struct SimStreams;

impl StreamSource for CudaStreams<'_> {
    fn stream(&self, _thread: usize) -> RunResult<(StreamId, Option<BackendStream>)> {
        let stream = self
            .0
            .create_stream()
            .map_err(|e| format!("creating a stream: {e}"))?;
        Ok((stream.id(), Some(stream)))
    }
}

impl StreamSource for SimStreams {
    fn stream(&self, thread: usize) -> RunResult<(StreamId, Option<BackendStream>)> {
        Ok((StreamId(0x5000 + thread as u64), None))
    }
}

/// The patterns, by the name their rows carry.
const PATTERNS: [&str; 3] = ["hot_pair", "mixed", "mt_hot_pair_1MiB"];

/// Prints every row for one allocator, in the harness's order (only those of pattern `only`, if
/// given).
fn run_patterns<D: Device, A: Api<D>>(
    a: &CachingAllocator<D>,
    backend: &str,
    streams: &dyn StreamSource,
    only: Option<&str>,
) -> RunResult<()> {
    let wanted = |pattern: &str| only.is_none_or(|o| o == pattern);
    let (stream, _keep) = streams.stream(usize::MAX)?;
    for size in HOT_SIZES.into_iter().filter(|_| wanted("hot_pair")) {
        emit(format_args!(
            "hot_pair,{backend},{size},{:.1}",
            hot_pair_ns::<D, A>(a, size, HOT_ITERS, stream)?
        ))?;
    }
    if wanted("mixed") {
        emit(format_args!(
            "mixed,{backend},{MIXED_WINDOW},{:.1}",
            mixed_op_ns::<D, A>(a, stream)?
        ))?;
    }
    for threads in MT_THREADS
        .into_iter()
        .filter(|_| wanted("mt_hot_pair_1MiB"))
    {
        let per_thread: Vec<RunResult<f64>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        let (stream, _keep) = streams.stream(t)?;
                        hot_pair_ns::<D, A>(a, 1 << 20, MT_ITERS, stream)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a benchmark thread panicked".to_owned()))
                })
                .collect()
        });
        // As the harness: each thread's figure truncated to whole nanoseconds, summed, divided.
        let mut total: i64 = 0;
        for ns in per_thread {
            total += ns? as i64;
        }
        emit(format_args!(
            "mt_hot_pair_1MiB,{backend},{threads} threads,{:.1}",
            total as f64 / threads as f64
        ))?;
    }
    Ok(())
}

/// Why a run stopped early without failing: whoever read the rows closed the output (`| head`).
const OUTPUT_CLOSED: &str = "the output was closed";

/// Writes one row (or the header) to standard output; a closed output ends the run with
/// [`OUTPUT_CLOSED`] rather than a panic.
fn emit(row: std::fmt::Arguments<'_>) -> RunResult<()> {
    use std::io::Write;
    match writeln!(std::io::stdout().lock(), "{row}") {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(OUTPUT_CLOSED.to_owned()),
        Err(e) => Err(format!("writing the results: {e}")),
    }
}

/// The header, then the patterns `--repeat` times over on `a`, by handle or by pointer as `--raw`
/// says.
fn run_repeated<D: Device>(
    a: &CachingAllocator<D>,
    backend: &str,
    streams: &dyn StreamSource,
    options: &Options,
) -> RunResult<()> {
    let only = options.only.as_deref();
    emit(format_args!("{HEADER}"))?;
    for _ in 0..options.repeat {
        if options.raw {
            run_patterns::<D, RawApi>(a, backend, streams, only)?;
        } else {
            run_patterns::<D, HandleApi>(a, backend, streams, only)?;
        }
    }
    Ok(())
}

/// The command line.
struct Options {
    sim: bool,
    raw: bool,
    device: u32,
    /// Memory history while the patterns run: `None` off, else the context level.
    history: Option<RecordContext>,
    /// The history ring buffer's size.
    history_entries: usize,
    /// Run only this pattern.
    only: Option<String>,
    /// How many times the selected patterns run, one after the other, in this process.
    repeat: usize,
}

/// The ring buffer size `--history` uses unless `--history-entries` says otherwise.
const DEFAULT_HISTORY_ENTRIES: usize = 100_000;

const USAGE: &str = "usage: alloc_patterns [--sim] [--raw] [--device N] [--history LEVEL] [--history-entries N] [--only P]
  --sim       run on the simulated device (no GPU needed; for profiling the allocator's own code)
  --raw       use the pointer API (raw_alloc/raw_free, like PyTorch's raw_alloc_with_stream/raw_delete)
              instead of Allocation handles
  --device N  the CUDA device to run on (default 0)
  --history LEVEL  record memory history while timing: off (default), none (the trace without
              stacks), state, alloc or all (call stacks, PyTorch's context levels); the backend
              column gets the suffix _history_LEVEL
  --history-entries N  the history ring buffer's size (default 100000)
  --only P    run only pattern P (hot_pair, mixed or mt_hot_pair_1MiB), e.g. to count the mixed
              pattern's cache misses alone: perf stat -e cache-misses,cache-references alloc_patterns --only mixed
  --repeat N  run the patterns N times over on the same allocator, printing every row each time
              (default 1: the harness's single pass)
Prints CSV rows pattern,backend,size_or_window,ns_per_op (see benches/anchors/README.md).";

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        sim: false,
        raw: false,
        device: 0,
        history: None,
        history_entries: DEFAULT_HISTORY_ENTRIES,
        only: None,
        repeat: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--sim" => options.sim = true,
            "--raw" => options.raw = true,
            "--device" => {
                let value = args.next().ok_or("--device needs a device ordinal")?;
                options.device = value
                    .parse()
                    .map_err(|_| format!("--device {value}: not a device ordinal"))?;
            }
            "--history" => {
                let value = args.next().ok_or("--history needs a level")?;
                options.history = match value.as_str() {
                    "off" => None,
                    "none" => Some(RecordContext::Never),
                    "state" => Some(RecordContext::State),
                    "alloc" => Some(RecordContext::Alloc),
                    "all" => Some(RecordContext::All),
                    other => {
                        return Err(format!(
                            "--history {other}: expected off, none, state, alloc or all"
                        ))
                    }
                };
            }
            "--history-entries" => {
                let value = args.next().ok_or("--history-entries needs a count")?;
                options.history_entries =
                    value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                        format!("--history-entries {value}: not a positive count")
                    })?;
            }
            "--only" => {
                let value = args.next().ok_or("--only needs a pattern name")?;
                if !PATTERNS.contains(&value.as_str()) {
                    return Err(format!(
                        "--only {value}: not a pattern (one of {})",
                        PATTERNS.join(", ")
                    ));
                }
                options.only = Some(value);
            }
            "--repeat" => {
                let value = args.next().ok_or("--repeat needs a count")?;
                options.repeat = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("--repeat {value}: not a positive count"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

/// Turns memory history on as `--history` asks.
fn start_history<D: Device>(a: &CachingAllocator<D>, options: &Options) {
    if let Some(level) = options.history {
        a.record_history_with_context(true, options.history_entries, level);
    }
}

fn run(options: &Options) -> RunResult<()> {
    let base = match (options.sim, options.raw) {
        (false, false) => "tensormem",
        (false, true) => "tensormem_raw",
        (true, false) => "tensormem_sim",
        (true, true) => "tensormem_sim_raw",
    };
    let backend = match options.history {
        None => base.to_owned(),
        Some(level) => format!("{base}_history_{}", level.name().unwrap_or("none")),
    };
    let backend = backend.as_str();
    // Settings from the environment (TENSORMEM_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF), as PyTorch's harness.
    let config =
        AllocatorConfig::from_env().map_err(|e| format!("allocator configuration: {e}"))?;
    if options.sim {
        let a = CachingAllocator::with_config(SimDevice::new(SIM_CAPACITY), config);
        start_history(&a, options);
        run_repeated(&a, backend, &SimStreams, options)
    } else {
        let device = CudaBackend::new(options.device)
            .map_err(|e| format!("opening CUDA device {}: {e}", options.device))?;
        let a = CachingAllocator::with_config(device, config);
        start_history(&a, options);
        let streams = CudaStreams(a.device());
        run_repeated(&a, backend, &streams, options)
    }
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("alloc_patterns: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) if message == OUTPUT_CLOSED => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("alloc_patterns: {message}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Mt19937_64;

    #[test]
    fn the_engine_matches_the_cpp_standard() {
        // [rand.predef]: the 10000th output of a default-constructed std::mt19937_64 (seed 5489).
        let mut rng = Mt19937_64::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = rng.next_u64();
        }
        assert_eq!(last, 9_981_545_732_273_789_042);
    }

    #[test]
    fn uniform_draws_stay_in_range() {
        let mut rng = Mt19937_64::new(42);
        for _ in 0..10_000 {
            let x = rng.uniform(9.0, 25.0);
            assert!((9.0..25.0).contains(&x), "{x}");
        }
    }
}
