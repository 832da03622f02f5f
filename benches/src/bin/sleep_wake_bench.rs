//! `sleep_wake_bench`: a private pool on expandable segments put to sleep and woken, with and
//! without its contents, against the pinned-copy bandwidth measured in the same run, and the
//! memory it gives back as the device sees it (`cuMemGetInfo`). Prints CSV rows
//! (`pattern,bytes,value,unit`), then the goals met or missed:
//!
//! ```text
//! sleep_wake_bench                        # a 10 GiB pool
//! sleep_wake_bench --gib 4                # a smaller one (less device or host memory)
//! sleep_wake_bench --gib 22 --pinned      # every piece of the backup pinned (on the way)
//! sleep_wake_bench --gib 22 --register 8  # the backup pinned with malloc + cuMemHostRegister
//! ```
//!
//! Without a CUDA driver or device it prints a `# skipped` line and exits successfully.
//!
//! By default a sleep takes pinned memory the host allocator has cached and stages the rest through
//! a ring of pinned buffers into ordinary memory. `--pinned`: every piece in pinned memory
//! ([`AlwaysPinned`]), pinned on the way when not cached (the first sleep waits for the pinning,
//! the later ones find it cached).
//!
//! `--register N`: the backup's pinned host memory is made as under
//! `pinned_use_cuda_host_register:True,pinned_num_register_threads:N` (anonymous mappings with the
//! huge-page advice, their pages touched by N threads, then `cuMemHostRegister`) instead of
//! `cuMemHostAlloc`: run both in one call to compare their first cycles.
//!
//! | pattern | what |
//! | --- | --- |
//! | `pinned_d2h`, `pinned_h2d` | the copy limit: 256 MiB pieces between the pool's memory and pinned host memory, as sleeping copies, GB/s |
//! | `sleep_discard`, `wake_discard` | a sleep (wait + unmap + release) and a wake (create + map + access) without contents, median of 5, ms |
//! | `sleep_keep_first`, `wake_keep_first` | the first cycle with contents, the host cache emptied first: staged (with `--pinned`: pinned host memory made on the way, `cuMemHostAlloc` or as `--register` says), ms |
//! | `staged_first`, `woke_staged_first`, `staged_later` | bytes of the first backup that were staged, of them still staged at its wake (right after the sleep), and of a later backup staged, MiB |
//! | `sleep_keep_then_pinned`, `pinned_while_asleep`, `wake_keep_pinned` | the first cycle again (host cache emptied), the pool left asleep until its staged backup was moved into pinned memory in the background: the sleep, that wait, the wake, ms |
//! | `sleep_keep`, `wake_keep` | the later cycles with contents: median of 3, ms and GB/s |
//! | `reserve` | the pinned memory of a backup made ahead (`HostCachingAllocator::reserve`, after the cache was emptied), ms |
//! | `sleep_keep_reserved`, `wake_keep_reserved` | the first cycle after that reserve, ms |
//! | `returned` | device free memory gained by a sleep over the pool's mapped bytes, % |
//! | `rss_after_wake`, `rss_after_release` | the process's resident memory after the last wake (the pinned backup cached for the next sleep) and after the host cache was emptied, MiB |
//!
//! Goals: at least 95% of the pool's bytes returned, under 100 ms per 10 GiB without contents,
//! backup and restore at 90% of the pinned-copy bandwidth or more, a full cycle with contents
//! (sleep, then wake) within 2 s per 22 GiB the first time and within 1 s per 22 GiB after.

use std::process::ExitCode;
use std::time::Instant;

use tensormem_cuda_alloc::backend::cuda::{self, CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::host::{HostCachingAllocator, PinnedSource};
use tensormem_cuda_alloc::{
    AlwaysPinned, CachingAllocator, Device, DeviceAddress, HostBackup, MempoolId, StreamId,
};

const GIB: usize = 1 << 30;
const PIECE: usize = 256 << 20;
const POOL: MempoolId = MempoolId(0, 0x51ee_9bec);

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn ms(seconds: f64) -> f64 {
    seconds * 1e3
}

/// This process's resident memory (`VmRSS` of `/proc/self/status`), MiB; 0 where unknown.
fn rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib >> 10)
}

fn run(gib: usize, register: Option<usize>, pin_all: bool) -> Result<bool, String> {
    let err = |what: &str| {
        let what = what.to_string();
        move |e: tensormem_cuda_alloc::Error| format!("{what}: {e}")
    };
    let derr = |what: &str| {
        let what = what.to_string();
        move |e: tensormem_cuda_alloc::DeviceError| format!("{what}: {e}")
    };
    let config = AllocatorConfig::parse("expandable_segments:True").map_err(|e| e.to_string())?;
    let device = CudaBackend::new(0).map_err(derr("opening CUDA device 0"))?;
    let alloc = CachingAllocator::with_config(device, config);
    let host_device = CudaBackend::new(0).map_err(derr("opening CUDA device 0"))?;
    let source = match register {
        Some(threads) => CudaPinnedSource::host_register(&host_device, threads),
        None => CudaPinnedSource::host_alloc(&host_device),
    };
    let source_name = match register {
        Some(threads) => format!("{} ({threads} threads touching)", source.name()),
        None => source.name().to_owned(),
    };
    let host: &'static HostCachingAllocator<CudaBackend> =
        Box::leak(Box::new(HostCachingAllocator::new(host_device, source)));
    let device = alloc.device();
    let info = device.mem_info().map_err(derr("cuMemGetInfo"))?;
    if (info.free as usize) < gib * GIB + GIB {
        return Err(format!(
            "the device has {} MiB free, too little for a {gib} GiB pool (try --gib N)",
            info.free >> 20
        ));
    }

    alloc
        .create_or_incref_pool(POOL)
        .map_err(err("making the pool"))?;
    alloc
        .begin_allocate_to_pool(POOL, |_| true)
        .map_err(err("allocating to the pool"))?;
    let blocks = (0..gib)
        .map(|_| alloc.allocate(GIB, StreamId::DEFAULT))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err("allocating the pool's blocks"))?;
    alloc
        .end_allocate_to_pool(POOL)
        .map_err(err("ending the allocation to the pool"))?;
    let pool_bytes = alloc.memory_stats().reserved_bytes.all.current as u64;

    // The copy limit: what sleeping does, one 256 MiB piece at a time, into pinned memory.
    let mut pinned = host
        .allocate(PIECE)
        .map_err(err("allocating pinned memory"))?;
    pinned.as_mut_slice().fill(0x5a);
    let mut d2h = Vec::new();
    let mut h2d = Vec::new();
    let pieces = (gib * GIB / PIECE).min(8);
    for round in 0..4 {
        let started = Instant::now();
        for i in 0..pieces {
            let at = blocks[i * PIECE / GIB].ptr().offset(i * PIECE % GIB);
            // SAFETY: `at` lies in an allocated, mapped block of PIECE bytes or more; no work is
            // queued; the pinned buffer holds PIECE bytes.
            unsafe { device.copy_from_host(pinned.as_ptr(), at, PIECE) }
                .map_err(derr("copying to the device"))?;
        }
        let h2d_s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        for i in 0..pieces {
            let at = blocks[i * PIECE / GIB].ptr().offset(i * PIECE % GIB);
            let dst = pinned.as_mut_slice().as_mut_ptr();
            // SAFETY: as above.
            unsafe { device.copy_to_host(at, dst, PIECE) }.map_err(derr("copying to the host"))?;
        }
        let d2h_s = started.elapsed().as_secs_f64();
        if round > 0 {
            h2d.push((pieces * PIECE) as f64 / h2d_s / 1e9);
            d2h.push((pieces * PIECE) as f64 / d2h_s / 1e9);
        }
    }
    host.free(pinned).map_err(err("freeing pinned memory"))?;
    let (d2h, h2d) = (median(d2h), median(h2d));
    println!("# backup host memory: {source_name}");
    println!("pattern,bytes,value,unit");
    println!("pool,{pool_bytes},{},MiB", pool_bytes >> 20);
    println!("pinned_d2h,{},{d2h:.1},GB/s", pieces * PIECE);
    println!("pinned_h2d,{},{h2d:.1},GB/s", pieces * PIECE);

    // A mark at the start and end of every block, checked after each wake with contents.
    let marks: Vec<(DeviceAddress, Vec<u8>)> = blocks
        .iter()
        .enumerate()
        .flat_map(|(i, b)| {
            [
                (b.ptr(), vec![i as u8 ^ 0xa5; 4096]),
                (b.ptr().offset(GIB - 4096), vec![i as u8 ^ 0x3c; 4096]),
            ]
        })
        .collect();
    let mut returned = Vec::new();
    let staged = std::cell::Cell::new(0);
    let waited = std::cell::Cell::new(0.0);
    let woke_staged = std::cell::Cell::new(0);
    let mut cycle = |keep: bool, wait_pinned: bool| -> Result<(f64, f64), String> {
        if keep {
            // Written before each sleep that keeps contents: one that discards them (the cycles
            // before) leaves the memory's contents undefined.
            for (at, bytes) in &marks {
                // SAFETY: inside an allocated, mapped block; no work queued.
                unsafe { device.copy_from_host(bytes.as_ptr(), *at, bytes.len()) }
                    .map_err(derr("writing a mark"))?;
            }
        }
        device.synchronize().map_err(derr("synchronizing"))?;
        let free_before = device.mem_info().map_err(derr("cuMemGetInfo"))?.free;
        let started = Instant::now();
        let backup: Option<Box<dyn HostBackup>> = keep.then(|| -> Box<dyn HostBackup> {
            if pin_all {
                Box::new(AlwaysPinned(host))
            } else {
                Box::new(host)
            }
        });
        let slept = alloc.sleep_pool(POOL, backup).map_err(err("sleeping"))?;
        staged.set(slept.staged_bytes);
        let sleep_s = started.elapsed().as_secs_f64();
        let free_asleep = device.mem_info().map_err(derr("cuMemGetInfo"))?.free;
        returned.push(free_asleep.saturating_sub(free_before) as f64 / slept.released_bytes as f64);
        if wait_pinned {
            // As a pool asleep for a while: its staged pieces move into pinned memory meanwhile.
            let started = Instant::now();
            while alloc.asleep_staged_bytes(Some(POOL)) > 0 {
                if started.elapsed().as_secs() > 60 {
                    return Err("the staged backup was not pinned within 60 s".into());
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            waited.set(started.elapsed().as_secs_f64());
        }
        let started = Instant::now();
        let woke = alloc.wake_pool(POOL).map_err(err("waking"))?;
        let wake_s = started.elapsed().as_secs_f64();
        woke_staged.set(woke.staged_bytes);
        if keep {
            for (at, bytes) in &marks {
                let mut back = vec![0u8; bytes.len()];
                // SAFETY: inside an allocated block mapped again by the wake; no work queued.
                unsafe { device.copy_to_host(*at, back.as_mut_ptr(), back.len()) }
                    .map_err(derr("reading a mark"))?;
                if back != *bytes {
                    return Err(format!("the contents at {at} did not survive the sleep"));
                }
            }
        }
        Ok((sleep_s, wake_s))
    };

    let mut sleeps = Vec::new();
    let mut wakes = Vec::new();
    for _ in 0..5 {
        let (s, w) = cycle(false, false)?;
        sleeps.push(s);
        wakes.push(w);
    }
    let (sleep_discard, wake_discard) = (median(sleeps), median(wakes));
    // Nothing pinned ready: the first sleep stages its backup (or, with --pinned, pins it).
    host.empty_cache().map_err(err("emptying the host cache"))?;
    let (first_keep, first_wake) = cycle(true, false)?;
    let (staged_first, woke_staged_first) = (staged.get(), woke_staged.get());
    // Again, the pool asleep until its backup is pinned (as between two training steps).
    host.empty_cache().map_err(err("emptying the host cache"))?;
    let (asleep_keep, asleep_wake) = cycle(true, true)?;
    let pinning_s = waited.get();
    let mut sleeps = Vec::new();
    let mut wakes = Vec::new();
    for _ in 0..3 {
        let (s, w) = cycle(true, false)?;
        sleeps.push(s);
        wakes.push(w);
    }
    let (sleep_keep, wake_keep) = (median(sleeps), median(wakes));
    let staged_later = staged.get();
    // The first cycle again, its host memory pinned ahead instead.
    host.empty_cache().map_err(err("emptying the host cache"))?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let started = Instant::now();
    host.reserve(
        pool_bytes as usize,
        tensormem_cuda_alloc::BACKUP_PIECE_BYTES,
        threads,
    )
    .map_err(err("reserving pinned memory"))?;
    let reserve_s = started.elapsed().as_secs_f64();
    let (reserved_keep, reserved_wake) = cycle(true, false)?;
    // What the process keeps after a wake (the pinned backup cached for the next sleep), and
    // after giving it back (`host_empty_cache`, `release_host_memory=True` in Python).
    let rss_kept = rss_mib();
    host.empty_cache().map_err(err("emptying the host cache"))?;
    let rss_released = rss_mib();
    let bytes = pool_bytes as f64;
    let per_10 = 10.0 * GIB as f64 / bytes;
    let per_22 = 22.0 * GIB as f64 / bytes;
    println!("sleep_discard,{pool_bytes},{:.2},ms", ms(sleep_discard));
    println!("wake_discard,{pool_bytes},{:.2},ms", ms(wake_discard));
    println!("sleep_keep_first,{pool_bytes},{:.1},ms", ms(first_keep));
    println!("wake_keep_first,{pool_bytes},{:.1},ms", ms(first_wake));
    println!("staged_first,{pool_bytes},{},MiB", staged_first >> 20);
    println!(
        "woke_staged_first,{pool_bytes},{},MiB",
        woke_staged_first >> 20
    );
    println!(
        "sleep_keep_then_pinned,{pool_bytes},{:.1},ms",
        ms(asleep_keep)
    );
    println!("pinned_while_asleep,{pool_bytes},{:.1},ms", ms(pinning_s));
    println!("wake_keep_pinned,{pool_bytes},{:.1},ms", ms(asleep_wake));
    println!("sleep_keep,{pool_bytes},{:.1},ms", ms(sleep_keep));
    println!("wake_keep,{pool_bytes},{:.1},ms", ms(wake_keep));
    println!("staged_later,{pool_bytes},{},MiB", staged_later >> 20);
    println!("rss_after_wake,{pool_bytes},{rss_kept},MiB");
    println!("rss_after_release,{pool_bytes},{rss_released},MiB");
    println!("reserve,{pool_bytes},{:.1},ms", ms(reserve_s));
    println!(
        "sleep_keep_reserved,{pool_bytes},{:.1},ms",
        ms(reserved_keep)
    );
    println!(
        "wake_keep_reserved,{pool_bytes},{:.1},ms",
        ms(reserved_wake)
    );
    let backup_bw = bytes / sleep_keep / 1e9;
    let restore_bw = bytes / wake_keep / 1e9;
    println!("sleep_keep_bandwidth,{pool_bytes},{backup_bw:.1},GB/s");
    println!("wake_keep_bandwidth,{pool_bytes},{restore_bw:.1},GB/s");
    let returned = returned.iter().copied().fold(f64::INFINITY, f64::min) * 100.0;
    println!("returned,{pool_bytes},{returned:.1},%");

    let goals = [
        (
            "returned >= 95% of the pool's bytes",
            returned >= 95.0,
            format!("{returned:.1}%"),
        ),
        (
            "sleep without contents < 100 ms per 10 GiB",
            ms(sleep_discard) * per_10 < 100.0,
            format!("{:.1} ms per 10 GiB", ms(sleep_discard) * per_10),
        ),
        (
            "wake without contents < 100 ms per 10 GiB",
            ms(wake_discard) * per_10 < 100.0,
            format!("{:.1} ms per 10 GiB", ms(wake_discard) * per_10),
        ),
        (
            "backup >= 90% of pinned d2h",
            backup_bw >= 0.9 * d2h,
            format!(
                "{:.0}% ({backup_bw:.1} of {d2h:.1} GB/s)",
                100.0 * backup_bw / d2h
            ),
        ),
        (
            "restore >= 90% of pinned h2d",
            restore_bw >= 0.9 * h2d,
            format!(
                "{:.0}% ({restore_bw:.1} of {h2d:.1} GB/s)",
                100.0 * restore_bw / h2d
            ),
        ),
        (
            "first cycle with contents <= 2 s per 22 GiB",
            (first_keep + first_wake) * per_22 <= 2.0,
            format!("{:.2} s per 22 GiB", (first_keep + first_wake) * per_22),
        ),
        (
            "cycle with contents <= 1 s per 22 GiB",
            (sleep_keep + wake_keep) * per_22 <= 1.0,
            format!("{:.2} s per 22 GiB", (sleep_keep + wake_keep) * per_22),
        ),
    ];
    let mut all = true;
    for (goal, met, figure) in goals {
        println!(
            "goal,{},{figure},{goal}",
            if met { "met" } else { "MISSED" }
        );
        all &= met;
    }

    for b in blocks {
        alloc.free(b).map_err(err("freeing"))?;
    }
    alloc
        .release_pool(POOL)
        .map_err(err("releasing the pool"))?;
    alloc
        .release_pool(POOL)
        .map_err(err("releasing the pool"))?;
    alloc.empty_cache().map_err(err("emptying the cache"))?;
    host.empty_cache().map_err(err("emptying the host cache"))?;
    Ok(all)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut gib, mut register, mut pin_all) = (10, None, false);
    while let Some(flag) = args.next() {
        if flag == "--pinned" {
            pin_all = true;
            continue;
        }
        let value = args
            .next()
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0);
        match (flag.as_str(), value) {
            ("--gib", Some(n)) => gib = n,
            ("--register", Some(n)) => register = Some(n),
            _ => {
                eprintln!(
                    "usage: sleep_wake_bench [--gib N] [--register THREADS] [--pinned] (N, THREADS > 0)"
                );
                return ExitCode::from(2);
            }
        }
    }
    match cuda::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            println!("# skipped: the driver reports no CUDA device");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            println!("# skipped: no CUDA driver ({e})");
            return ExitCode::SUCCESS;
        }
    }
    match run(gib, register, pin_all) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("sleep_wake_bench: a goal was missed (see the goal rows)");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("sleep_wake_bench: {message}");
            ExitCode::FAILURE
        }
    }
}
