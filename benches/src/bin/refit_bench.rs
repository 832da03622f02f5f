//! A model's weights into another process's own parameters on the same GPU, version after
//! version (`tensormem_ipc::weights`), timed like `torch_refit_bench.py` (the PyTorch anchor).
//!
//! Both processes allocate the same layout from tensormem's caching allocator on device 0 (the
//! consumer's parameters zeroed). One sync: the producer writes the last tensor (bytes of `r + 2`),
//! announces a version, and waits until the consumer installed it; the consumer waits for the
//! version, copies every tensor into its own parameter (one `cuMemcpyBatchAsync` of the plan's
//! merged copies, on its stream, ordered after the producer's writes by the producer's event),
//! synchronizes, reads one byte of its last parameter back and records the version installed. The
//! byte read is checked against `r + 2` after each sync. Timed on the producer: announce ->
//! installed.
//!
//! The first sync also makes the publication (one memory handle per segment), sends its message,
//! and has the consumer open it and build the plan (the consumer has started, initialised CUDA and
//! allocated its parameters before the timer, as the anchor's consumer has).
//!
//! Rows (`layout,method,tensors,bytes,first_ms,median_ms`, the anchor's CSV):
//! - `floor_batched`: one process, the same bytes copied parameter to parameter with one
//!   `cuMemcpyBatchAsync` (the anchor's `floor` row is `torch._foreach_copy_`);
//! - `floor_loop`: the same with one `cuMemcpyDtoDAsync` per tensor;
//! - `tm_sync`: the two-process sync above; `first_ms` is the first sync;
//! - `tm_open`: the consumer's open of the publication alone (`first_ms`) and its plan
//!   (`median_ms` column: the plan's build time).
//!
//! With `--consumer-device N` (N > 0, a machine with several GPUs) the consumer's parameters are
//! on device N: the install reads the producer's memory on device 0 through CUDA IPC and copies
//! it across (peer copies over NVLink or PCIe, peer access enabled). Two more rows give the floor
//! measured in the same run, one process:
//! - `floor_peer_batched`: the layout's tensors of device 0 copied to the same tensors on device N
//!   with one `cuMemcpyBatchAsync`;
//! - `floor_peer_bulk`: the layout's bytes as one buffer copied from device 0 to device N with one
//!   copy (the peer bandwidth: `tm_sync` at 90% of it or better is the goal).
//!
//! ```text
//! refit_bench [--layout gpt2|7b|moe|all] [--rounds N] [--verify] [--consumer-device N]
//!             [--consumer-wrap "PROGRAM ARGS..."]
//! ```
//!
//! `--consumer-wrap`: the consumer is started through `PROGRAM ARGS... <this binary>`, for example
//! in a pid namespace of its own and without ptrace rights, as a consumer in another container runs:
//! `--consumer-wrap "unshare --pid --fork --mount-proc setpriv --inh-caps=-all --bounding-set=-all"`
//! (as root; without `--mount-proc` the namespace sees its parent's `/proc` and CUDA's `cuInit`
//! fails with `CUDA_ERROR_OPERATING_SYSTEM`).
//!
//! `--verify`: after the last sync the consumer reads every parameter back and checks every byte
//! against the producer's (each tensor filled with its own byte), and the run fails otherwise.
//!
//! Without a CUDA driver or device it prints a `# skipped` line and exits successfully.
//! Re-executes itself as the consumer (`TENSORMEM_REFIT_BENCH_ROLE=consumer`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{check, CudaBackend};
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Device, StreamId};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::weights::{
    DType, PlacedTensor, PlanOptions, PublishedTensor, TensorMeta, WeightPublisher,
    WeightSubscriber, WeightsMessage,
};
use tensormem_ipc::{DeviceCopy, IpcConsumer, IpcDriver, IpcProducer};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ROLE: &str = "TENSORMEM_REFIT_BENCH_ROLE";
const LAYOUT: &str = "TENSORMEM_REFIT_BENCH_LAYOUT";
const ROUNDS: &str = "TENSORMEM_REFIT_BENCH_ROUNDS";
const VERIFY: &str = "TENSORMEM_REFIT_BENCH_VERIFY";
const DEVICE: &str = "TENSORMEM_REFIT_BENCH_DEVICE";
const WAIT: Option<Duration> = Some(Duration::from_secs(120));

/// The anchor's layouts: shapes and element type (`gpt2` in fp32, the others in bf16).
fn layout(name: &str) -> (Vec<Vec<u64>>, DType) {
    let (shapes, elem) = tensormem_benches::layouts::shapes(name).unwrap_or_default();
    (
        shapes,
        if elem == 4 {
            DType::Float32
        } else {
            DType::BFloat16
        },
    )
}

struct Model {
    metas: Vec<TensorMeta>,
    names: Vec<String>,
    allocations: Vec<Allocation>,
}

impl Model {
    /// The layout `name`, tensor `i` filled with bytes of `fill(i)`.
    fn new(
        name: &str,
        allocator: &CachingAllocator<CudaBackend>,
        fill: impl Fn(usize) -> u8,
    ) -> Result<Self, BoxError> {
        allocator.device().make_current()?;
        let (shapes, dtype) = layout(name);
        let metas: Vec<TensorMeta> = shapes
            .iter()
            .map(|s| TensorMeta::contiguous(dtype, s))
            .collect();
        let mut allocations = Vec::with_capacity(metas.len());
        for (i, m) in metas.iter().enumerate() {
            let a = allocator.allocate(m.nbytes() as usize, StreamId::DEFAULT)?;
            // SAFETY: the allocation is `nbytes` bytes of the allocator's device (current), owned here.
            check("cuMemsetD8", unsafe {
                sys::cuMemsetD8_v2(a.ptr().0, fill(i), m.nbytes() as usize)
            })?;
            allocations.push(a);
        }
        allocator.device().synchronize()?;
        let names = (0..metas.len()).map(|i| format!("p{i}")).collect();
        Ok(Self {
            metas,
            names,
            allocations,
        })
    }

    fn placed(&self) -> Vec<PlacedTensor<'_>> {
        self.names
            .iter()
            .zip(&self.metas)
            .zip(&self.allocations)
            .map(|((name, meta), a)| PlacedTensor {
                name,
                ptr: a.ptr(),
                meta,
            })
            .collect()
    }

    fn bytes(&self) -> u64 {
        self.metas.iter().map(TensorMeta::nbytes).sum()
    }

    fn free(self, allocator: &CachingAllocator<CudaBackend>) -> Result<(), BoxError> {
        for a in self.allocations {
            allocator.free(a)?;
        }
        allocator.empty_cache()?;
        Ok(())
    }
}

/// A non-blocking stream of the current device (batched copies refuse the legacy default stream).
fn new_stream() -> Result<StreamId, BoxError> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: `stream` is a valid out-parameter; a device's context is current.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(
            &mut stream,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    })?;
    Ok(StreamId(stream as u64))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn consumer() -> Result<(), BoxError> {
    let name = std::env::var(LAYOUT)?;
    let rounds: u64 = std::env::var(ROUNDS)?.parse()?;
    let device: u32 = std::env::var(DEVICE).map_or(Ok(0), |d| d.parse())?;
    let allocator = CachingAllocator::new(CudaBackend::new(device)?);
    if device != 0 {
        // The producer's memory is on device 0: this device reads it.
        allocator
            .device()
            .enable_peer_access(&CudaBackend::new(0)?)?;
    }
    allocator.device().make_current()?;
    let driver = Arc::new(CudaIpcDriver::new()?);
    let stream = new_stream()?;
    let params = Model::new(&name, &allocator, |_| 0)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "up")?;
    out.flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let wire = tensormem_test_support::unhex(line.trim());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let t = Instant::now();
    let mut sub = WeightSubscriber::open(&consumer, &WeightsMessage::decode(&wire)?, stream)?;
    let opened = t.elapsed();
    let t = Instant::now();
    let plan = sub.prepare(&params.placed(), PlanOptions::default())?;
    let planned = t.elapsed();
    let copies: Vec<DeviceCopy> = sub.plan(plan).copies().to_vec();
    writeln!(out, "ready {} {} {}", ms(opened), ms(planned), copies.len())?;
    out.flush()?;
    let last = params.allocations.last().ok_or("no tensors")?.ptr();
    let mut byte = 0u8;
    for _ in 0..rounds {
        let v = sub.begin(stream, WAIT)?;
        // SAFETY: the sources are the subscription's mapped views; the destinations are this
        // process's parameters, allocated until the end; nothing else runs on them.
        unsafe { driver.copy_batch(device, &copies, stream)? };
        driver.synchronize_stream(device, stream)?;
        sub.finish(v);
        // Read back once the sync is over (the producer's timer stops at `finish`): the last
        // parameter is this process's own memory, which the producer never writes.
        // SAFETY: `byte` is one writable host byte; `last` is a parameter of this device, and the
        // copies into it completed above.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2((&mut byte as *mut u8).cast(), last.0, 1)
        })?;
        writeln!(out, "v {v} {byte}")?;
        out.flush()?;
    }
    if std::env::var(VERIFY).is_ok_and(|v| v == "1") {
        let wrong = verify(&params, byte)?;
        writeln!(out, "verified {wrong}")?;
        out.flush()?;
    }
    drop(sub);
    params.free(&allocator)?;
    Ok(())
}

/// The byte tensor `i` of the producer is filled with (the last tensor is written again each sync).
fn pattern(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

/// Reads every parameter back (64 MiB at a time) and counts the tensors whose bytes are not all
/// [`pattern`] (the last: `last`).
fn verify(params: &Model, last: u8) -> Result<usize, BoxError> {
    let mut host = vec![0u8; 64 << 20];
    let mut wrong = 0;
    let count = params.allocations.len();
    for (i, (a, m)) in params.allocations.iter().zip(&params.metas).enumerate() {
        let expected = if i + 1 == count { last } else { pattern(i) };
        let total = m.nbytes() as usize;
        let mut done = 0;
        let mut bad = false;
        while done < total && !bad {
            let n = (total - done).min(host.len());
            // SAFETY: `host` has room for `n` bytes; the source is `n` bytes of the parameter.
            check("cuMemcpyDtoH", unsafe {
                sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), a.ptr().0 + done as u64, n)
            })?;
            bad = host[..n].iter().any(|&b| b != expected);
            done += n;
        }
        wrong += usize::from(bad);
    }
    Ok(wrong)
}

/// One copy per tensor of the layout, from `src`'s allocation to `dst`'s.
fn tensor_copies(src: &Model, dst: &Model) -> Vec<DeviceCopy> {
    src.allocations
        .iter()
        .zip(&dst.allocations)
        .zip(&src.metas)
        .map(|((s, d), m)| DeviceCopy {
            src: s.ptr(),
            dst: d.ptr(),
            len: m.nbytes(),
        })
        .collect()
}

/// Runs `round` once cold and `rounds` times warm: the cold time and the warm median, in ms.
fn time_rounds(
    rounds: usize,
    mut round: impl FnMut() -> Result<(), BoxError>,
) -> Result<(f64, f64), BoxError> {
    let mut times = Vec::new();
    for _ in 0..=rounds {
        let t = Instant::now();
        round()?;
        times.push(ms(t.elapsed()));
    }
    Ok((times[0], median(times[1..].to_vec())))
}

fn floor(
    name: &str,
    allocator: &CachingAllocator<CudaBackend>,
    driver: &CudaIpcDriver,
    rounds: usize,
) -> Result<(), BoxError> {
    let src = Model::new(name, allocator, |_| 1)?;
    let dst = Model::new(name, allocator, |_| 0)?;
    let stream = new_stream()?;
    let copies = tensor_copies(&src, &dst);
    for (method, single) in [("floor_batched", false), ("floor_loop", true)] {
        let (first, median) = time_rounds(rounds, || {
            if single {
                for c in &copies {
                    // SAFETY: both sides are live allocations of this process of `len` bytes.
                    unsafe { driver.copy_batch(0, std::slice::from_ref(c), stream)? };
                }
            } else {
                // SAFETY: as above.
                unsafe { driver.copy_batch(0, &copies, stream)? };
            }
            Ok(driver.synchronize_stream(0, stream)?)
        })?;
        let (count, bytes) = (copies.len(), src.bytes());
        println!("{name},{method},{count},{bytes},{first:.2},{median:.2}");
    }
    src.free(allocator)?;
    dst.free(allocator)?;
    Ok(())
}

/// The floor of an install across GPUs, in one process: the layout's tensors of device 0 copied to
/// the same tensors on `peer`'s device with one batched copy, and the same bytes as one buffer with
/// one copy (the peer bandwidth).
fn floor_peer(
    name: &str,
    allocator: &CachingAllocator<CudaBackend>,
    peer: &CachingAllocator<CudaBackend>,
    driver: &CudaIpcDriver,
    rounds: usize,
) -> Result<(), BoxError> {
    let device = peer.device().ordinal();
    let src = Model::new(name, allocator, |_| 1)?;
    let dst = Model::new(name, peer, |_| 0)?;
    let bytes = src.bytes() as usize;
    let whole_src = allocator.allocate(bytes, StreamId::DEFAULT)?;
    let whole_dst = peer.allocate(bytes, StreamId::DEFAULT)?;
    peer.device().make_current()?;
    let stream = new_stream()?;
    let tensors = tensor_copies(&src, &dst);
    let whole = [DeviceCopy {
        src: whole_src.ptr(),
        dst: whole_dst.ptr(),
        len: bytes as u64,
    }];
    for (method, copies) in [
        ("floor_peer_batched", tensors.as_slice()),
        ("floor_peer_bulk", whole.as_slice()),
    ] {
        let (first, median) = time_rounds(rounds, || {
            // SAFETY: both sides are live allocations of this process of `len` bytes, on device 0
            // and on `device` (whose context reads device 0's memory: peer access is enabled).
            unsafe { driver.copy_batch(device, copies, stream)? };
            Ok(driver.synchronize_stream(device, stream)?)
        })?;
        let count = copies.len();
        println!("{name},{method},{count},{bytes},{first:.2},{median:.2}");
    }
    allocator.free(whole_src)?;
    peer.free(whole_dst)?;
    src.free(allocator)?;
    dst.free(peer)?;
    allocator.device().make_current()?;
    Ok(())
}

fn sync(
    name: &str,
    allocator: &CachingAllocator<CudaBackend>,
    driver: &Arc<CudaIpcDriver>,
    rounds: usize,
    verify: bool,
    consumer_device: u32,
    wrap: &[String],
) -> Result<(), BoxError> {
    let weights = Model::new(name, allocator, pattern)?;
    let stream = new_stream()?;
    let exe = std::env::current_exe()?;
    let mut command = match wrap.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(&exe);
            command
        }
        None => Command::new(&exe),
    };
    let mut child = command
        .env(ROLE, "consumer")
        .env(DEVICE, consumer_device.to_string())
        .env(LAYOUT, name)
        .env(ROUNDS, (rounds + 1).to_string())
        .env(VERIFY, if verify { "1" } else { "0" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to = child.stdin.take().ok_or("no stdin")?;
    let mut from = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    let mut next = |line: &mut String| -> Result<String, BoxError> {
        line.clear();
        from.read_line(line)?;
        if line.is_empty() {
            return Err("the consumer exited".into());
        }
        Ok(line.trim().to_owned())
    };
    if next(&mut line)? != "up" {
        return Err(format!("the consumer did not start: {line}").into());
    }
    let producer = IpcProducer::<CudaBackend, _>::new(Arc::clone(driver));
    let last = weights.allocations.last().ok_or("no tensors")?.ptr();
    let last_len = weights.metas.last().map_or(0, TensorMeta::nbytes) as usize;
    let mut times = Vec::new();
    let mut publisher = None;
    let (mut opened, mut planned, mut copies) = (0.0, 0.0, 0usize);
    for r in 0..=rounds {
        let value = (r % 250) as u8 + 2;
        // SAFETY: `last` is the producer's last tensor, `last_len` bytes of device 0.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(last.0, value, last_len, stream.0 as _)
        })?;
        driver.synchronize_stream(0, stream)?;
        let t = Instant::now();
        if publisher.is_none() {
            let tensors: Vec<PublishedTensor> = weights
                .placed()
                .iter()
                .map(|p| PublishedTensor {
                    name: p.name.to_owned(),
                    ptr: p.ptr,
                    meta: p.meta.clone(),
                })
                .collect();
            // SAFETY: the tensors are live allocations of this process (cuMemAlloc segments of
            // the caching allocator), kept until the publication is released below.
            let made = unsafe { WeightPublisher::new(&producer, 0, &tensors)? };
            let wire = made.message()?.encode();
            writeln!(to, "{}", tensormem_test_support::hex(&wire))?;
            to.flush()?;
            let ready = next(&mut line)?;
            let mut words = ready.split_whitespace().skip(1);
            let mut word = || words.next().unwrap_or("0").to_owned();
            opened = word().parse()?;
            planned = word().parse()?;
            copies = word().parse()?;
            publisher = Some(made);
        }
        let publisher = publisher.as_ref().ok_or("no publisher")?;
        let v = publisher.publish(stream)?;
        publisher.wait_installed(v, WAIT)?;
        times.push(ms(t.elapsed()));
        let answer = next(&mut line)?;
        let expected = format!("v {v} {value}");
        if answer != expected {
            return Err(format!("the consumer answered {answer:?}, expected {expected:?}").into());
        }
    }
    if verify {
        let answer = next(&mut line)?;
        if answer != "verified 0" {
            return Err(format!(
                "the consumer's parameters differ from the producer's weights: {answer}"
            )
            .into());
        }
        println!(
            "# {name}: every byte of the {} tensors installed as published",
            weights.metas.len()
        );
    }
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the consumer failed: {status}").into());
    }
    if let Some(mut publisher) = publisher {
        publisher.wait_released(WAIT)?;
    }
    let tensors = weights.metas.len();
    let bytes = weights.bytes();
    println!(
        "{name},tm_sync,{tensors},{bytes},{:.2},{:.2}",
        times[0],
        median(times[1..].to_vec())
    );
    println!("{name},tm_open,{tensors},{bytes},{opened:.2},{planned:.2}");
    println!("# {name}: the plan merged {tensors} tensors into {copies} copies");
    weights.free(allocator)?;
    Ok(())
}

fn main() -> Result<(), BoxError> {
    if std::env::var(ROLE).is_ok() {
        return consumer();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let which = value("--layout").unwrap_or_else(|| "all".into());
    let rounds: usize = value("--rounds").map_or(Ok(10), |r| r.parse())?;
    let verify = args.iter().any(|a| a == "--verify");
    let consumer_device: u32 = value("--consumer-device").map_or(Ok(0), |d| d.parse())?;
    let wrap: Vec<String> = value("--consumer-wrap")
        .map(|w| w.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    let driver = match CudaIpcDriver::new() {
        Ok(d) if d.device_count().unwrap_or(0) > 0 => Arc::new(d),
        Ok(_) => {
            println!("# skipped: no CUDA device");
            return Ok(());
        }
        Err(e) => {
            println!("# skipped: no CUDA driver ({e})");
            return Ok(());
        }
    };
    let allocator = CachingAllocator::new(CudaBackend::new(0)?);
    let peer = match consumer_device {
        0 => None,
        n if n < driver.device_count().unwrap_or(0) => {
            let peer = CachingAllocator::new(CudaBackend::new(n)?);
            peer.device().enable_peer_access(allocator.device())?;
            Some(peer)
        }
        n => return Err(format!("--consumer-device {n}: no such device").into()),
    };
    allocator.device().make_current()?;
    println!("layout,method,tensors,bytes,first_ms,median_ms");
    let layouts: Vec<&str> = match which.as_str() {
        "all" => tensormem_benches::layouts::NAMES.to_vec(),
        one if tensormem_benches::layouts::NAMES.contains(&one) => vec![one],
        other => return Err(format!("unknown layout {other:?}: gpt2, 7b, moe or all").into()),
    };
    for name in layouts {
        match &peer {
            Some(peer) => floor_peer(name, &allocator, peer, &driver, rounds)?,
            None => floor(name, &allocator, &driver, rounds)?,
        }
        sync(
            name,
            &allocator,
            &driver,
            rounds,
            verify,
            consumer_device,
            &wrap,
        )?;
    }
    Ok(())
}
