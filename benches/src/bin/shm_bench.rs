//! `shm_bench`: tensormem-shm's sharing costs as CSV rows shaped like those of the anchor
//! `torch_sharing_bench.py`, to be run side by side with it on one machine. Self-contained: the
//! consumer process is this binary re-executed (`shm_bench --consumer SOCKET`), so it runs where
//! there is no Rust toolchain. Takes under 90 s on a 16-core machine.
//!
//! Sections (each starts with its own CSV header line):
//! 1. `system`: the kernel's huge-page settings (`transparent_hugepage/{enabled,shmem_enabled}`,
//!    per-size shmem mTHP settings, `/dev/shm` mount options, hugetlb pages) and probes: whether
//!    `MADV_HUGEPAGE` really gives a memfd / a `/dev/shm` object huge pages (`ShmemHugePages`
//!    grows) and whether `memfd_create(MFD_HUGETLB)` can be mapped and populated.
//! 2. Round trips: `tensormem_fd,cpu,BYTES,MEDIAN_US`: producer -> consumer, blocking receives
//!    (send a region over a Unix socket with `SCM_RIGHTS`, consumer attaches, reads the first and
//!    last byte, detaches, answers one byte); `tensormem_fd_spin`: the same with both ends
//!    spinning up to `--spin-us` before blocking (`RecvOptions::spinning`);
//!    `tensormem_fd_spin_answer_then_unmap`: spinning, and the consumer answers as soon as it has
//!    read the bytes and unmaps afterwards (a consumer keeps using the data it received; its unmap
//!    then overlaps the producer's next step instead of delaying the answer);
//!    `tensormem_make_region`: making the region (`create_anonymous`), not part of the round trip.
//! 3. `share_memory_,cpu,BYTES,US  (GB/s)`: `SharedRegion::copy_from_bytes` (the default plan),
//!    median, in the anchor's row format.
//! 4. Copy variants, for 64 MiB and 1 GiB: every `CopyPlan` worth comparing (method x threads
//!    1/4/8/16 capped by `available_parallelism` x huge-page advice x memfd / `/dev/shm`), plus
//!    `torch_like` (what PyTorch's `share_memory_` does: a fresh unlinked `/dev/shm` object, no
//!    advice, threads `memcpy` contiguous pieces taking a fault per page), `private_vec` (`to_vec`)
//!    and `private_prefaulted` (zeroed `Vec` + `copy_prefaulted`). Each variant runs several times
//!    in a row; the first run is reported apart from the median of the others, so first-touch
//!    effects (a VM's host faulting guest memory in) show. Results are freed outside the timer.
//!
//! Usage: `shm_bench [--rounds N] [--spin-us N] [--no-copy]` (default 1000 round trips per size
//! after 50 warm-up ones, spin 200 µs).

use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensormem_benches::sharing_harness::{
    exit_code, median_us, BenchResult, Consumer, OptionSet, Options, ROUND_TRIP_SIZES, WARM_UP,
};
use tensormem_shm::copy::{parallelism, CopyMethod, CopyPlan};
use tensormem_shm::transfer::{
    recv_exact, recv_region_with, send_region, RecvOptions, SendOptions,
};
use tensormem_shm::{copy_prefaulted, AnonymousKind, MapOptions, SharedRegion};

/// (bytes, runs per variant: the first plus the ones the median is taken over).
const COPY_SIZES: [(usize, usize); 2] = [(64 << 20, 7), (1 << 30, 4)];
const OPTIONS: OptionSet = OptionSet {
    usage: "shm_bench [--rounds N] [--spin-us N] [--no-copy]",
    copies: None,
    same_cpu: false,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("--consumer") {
        match args.get(1) {
            Some(path) => consumer(path),
            None => Err("--consumer needs a socket path".into()),
        }
    } else {
        Options::parse(&args, &OPTIONS).and_then(|args| producer(&args))
    };
    exit_code("shm_bench", result)
}

/// Attach, read first and last byte, answer their sum; until the producer hangs up. Each message
/// says (4 bytes of application data, µs) how long to spin while waiting for the next one.
fn consumer(path: &str) -> BenchResult<()> {
    let socket = UnixStream::connect(path)?;
    let options = MapOptions::new();
    let mut recv = RecvOptions::BLOCKING;
    while let Ok(received) = recv_region_with(&socket, &options, recv) {
        let mut spin_us = [0u8; 4];
        spin_us.copy_from_slice(&received.user_data()[..4]);
        recv = RecvOptions::spinning(Duration::from_micros(u32::from_le_bytes(spin_us).into()));
        let detach_first = received.user_data().get(4) == Some(&1);
        // Copies of the two bytes, not a slice: the producer may write the region again.
        let region = &received.region;
        let first = region.read_volatile(0).unwrap_or(0);
        let last = region.read_volatile(region.len() - 1).unwrap_or(0);
        let answer = first.wrapping_add(last);
        if detach_first {
            // The anchor's order: unmap, then answer.
            drop(received);
            rustix::net::send(&socket, &[answer], rustix::net::SendFlags::NOSIGNAL)?;
        } else {
            // A consumer that keeps using the data answers first; the unmap then overlaps the
            // producer's next step instead of delaying the answer.
            rustix::net::send(&socket, &[answer], rustix::net::SendFlags::NOSIGNAL)?;
            drop(received);
        }
    }
    Ok(())
}

fn producer(args: &Options) -> BenchResult<()> {
    eprintln!(
        "shm_bench: copies use up to {} threads (available_parallelism)",
        parallelism()
    );
    system::report();
    round_trips(args)?;
    if args.copy {
        copies()?;
    }
    Ok(())
}

fn round_trips(args: &Options) -> BenchResult<()> {
    let consumer = Consumer::spawn_role("shm_bench", "--consumer", &[])?;
    let socket = consumer.socket();

    println!("strategy,device,bytes,median_us_per_roundtrip");
    let spinning = RecvOptions::spinning(args.spin);
    for len in ROUND_TRIP_SIZES {
        let mut make = Vec::with_capacity(20);
        for _ in 0..20 {
            let start = Instant::now();
            let region = SharedRegion::create_anonymous(len as u64)?;
            make.push(start.elapsed());
            drop(region);
        }
        let mut region = SharedRegion::create_anonymous(len as u64)?;
        region.fill(1)?;
        region.write_at(len - 1, &[2])?;
        for (label, recv, detach_first) in [
            ("tensormem_fd", RecvOptions::BLOCKING, true),
            ("tensormem_fd_spin", spinning, true),
            ("tensormem_fd_spin_answer_then_unmap", spinning, false),
        ] {
            let spin_us = u32::try_from(recv.spin.as_micros()).unwrap_or(u32::MAX);
            let mut user = [0u8; 5];
            user[..4].copy_from_slice(&spin_us.to_le_bytes());
            user[4] = u8::from(detach_first);
            let message = SendOptions {
                user: &user,
                read_only: false,
            };
            let mut times = Vec::with_capacity(args.rounds);
            for i in 0..WARM_UP + args.rounds {
                let start = Instant::now();
                send_region(socket, &region, message)?;
                let mut answer = [0u8; 1];
                recv_exact(socket, &mut answer, recv)?;
                let elapsed = start.elapsed();
                if answer[0] != 3 {
                    return Err(format!("consumer answered {} instead of 3", answer[0]).into());
                }
                if i >= WARM_UP {
                    times.push(elapsed);
                }
            }
            println!("{label},cpu,{len},{:.1}", median_us(&mut times));
        }
        println!(
            "tensormem_make_region,cpu,{len},{:.1}",
            median_us(&mut make)
        );
    }
    consumer.finish()
}

/// One way of copying a buffer into fresh memory; returns what must be freed after the timer.
enum Variant {
    Plan(CopyPlan),
    TorchLike(usize),
    PrivateVec,
    PrivatePrefaulted(usize),
}

impl Variant {
    fn label(&self) -> String {
        match self {
            Self::Plan(plan) => format!(
                "{:?},{},{},{}",
                plan.method,
                plan.threads,
                if plan.huge_pages { "huge" } else { "nohuge" },
                match plan.object {
                    AnonymousKind::Memfd => "memfd",
                    AnonymousKind::UnlinkedShm => "dev_shm",
                }
            ),
            Self::TorchLike(threads) => format!("torch_like,{threads},nohuge,dev_shm"),
            Self::PrivateVec => "private_vec,1,-,private".to_owned(),
            Self::PrivatePrefaulted(threads) => {
                format!("private_prefaulted,{threads},-,private")
            }
        }
    }

    /// Copies `src`; the result is returned so that freeing it happens outside the timer.
    fn run(&self, src: &[u8]) -> BenchResult<Box<dyn std::any::Any>> {
        Ok(match self {
            Self::Plan(plan) => Box::new(SharedRegion::copy_from_bytes_with(src, plan)?),
            Self::TorchLike(threads) => Box::new(torch_like(src, *threads)?),
            Self::PrivateVec => Box::new(std::hint::black_box(src.to_vec())),
            Self::PrivatePrefaulted(threads) => {
                let mut dst = vec![0u8; src.len()];
                copy_prefaulted(&mut dst, src, *threads)?;
                Box::new(dst)
            }
        })
    }
}

/// PyTorch's `share_memory_`: a new unlinked `/dev/shm` object mapped without advice, filled by
/// `threads` threads copying contiguous pieces, each page faulted in by the first store.
fn torch_like(src: &[u8], threads: usize) -> BenchResult<SharedRegion> {
    let mut region =
        SharedRegion::create_anonymous_as(src.len() as u64, AnonymousKind::UnlinkedShm)?;
    // SAFETY: the region was created just above and its fd has not been shared: no other
    // process can reach, write or truncate the object while `dst` lives.
    let dst = unsafe { region.as_mut_slice() };
    let piece = src.len().div_ceil(threads.max(1));
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
    Ok(region)
}

fn variants() -> Vec<Variant> {
    let max = parallelism();
    let mut counts: Vec<usize> = [1, 4, 8, 16].iter().map(|&n| n.min(max)).collect();
    counts.push(max.min(16));
    counts.sort_unstable();
    counts.dedup();
    let plan = |method, threads, huge_pages, object| {
        Variant::Plan(CopyPlan {
            method,
            threads,
            huge_pages,
            object,
        })
    };
    let top = *counts.last().unwrap_or(&1);
    let mut list = vec![Variant::Plan(CopyPlan::new())];
    for &threads in &counts {
        for huge in [true, false] {
            list.push(plan(
                CopyMethod::PrefaultSplit,
                threads,
                huge,
                AnonymousKind::Memfd,
            ));
        }
    }
    for huge in [true, false] {
        list.push(plan(CopyMethod::Pwrite, 1, huge, AnonymousKind::Memfd));
    }
    list.push(plan(
        CopyMethod::PwriteAndMap,
        top,
        true,
        AnonymousKind::Memfd,
    ));
    list.push(plan(
        CopyMethod::FallocateSplit,
        top,
        true,
        AnonymousKind::Memfd,
    ));
    for (method, threads) in [(CopyMethod::PrefaultSplit, top), (CopyMethod::Pwrite, 1)] {
        list.push(plan(method, threads, true, AnonymousKind::UnlinkedShm));
    }
    list.push(Variant::TorchLike(top));
    list.push(Variant::PrivateVec);
    list.push(Variant::PrivatePrefaulted(top));
    list
}

fn copies() -> BenchResult<()> {
    let variants = variants();
    let mut default_rows = Vec::new();
    println!(
        "copy_variant,bytes,method,threads,huge_pages,object,first_GBps,median_GBps,median_us"
    );
    for (len, runs) in COPY_SIZES {
        let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        for (index, variant) in variants.iter().enumerate() {
            let mut times = Vec::with_capacity(runs);
            for _ in 0..runs {
                let start = Instant::now();
                let result = variant.run(&src)?;
                times.push(start.elapsed());
                drop(result);
            }
            let first = times[0];
            let median = median_us(&mut times[1..]);
            let gbs = |us: f64| len as f64 / (us * 1e-6) / 1e9;
            let first_us = first.as_secs_f64() * 1e6;
            println!(
                "copy_variant,{len},{},{:.2},{:.2},{median:.1}",
                variant.label(),
                gbs(first_us),
                gbs(median)
            );
            if index == 0 {
                default_rows.push(format!(
                    "share_memory_,cpu,{len},{median:.1}  ({:.2} GB/s)",
                    gbs(median)
                ));
            }
        }
    }
    println!("strategy,device,bytes,median_us  (GB/s)  [copy_from_bytes, default plan]");
    for row in default_rows {
        println!("{row}");
    }
    Ok(())
}

/// The kernel's huge-page settings and what really works.
mod system {
    use tensormem_shm::copy::{CopyMethod, CopyPlan};
    use tensormem_shm::{AnonymousKind, SharedRegion};

    const THP: &str = "/sys/kernel/mm/transparent_hugepage";

    pub(super) fn report() {
        println!("system,key,value");
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|e| format!("unreadable ({e})"))
        };
        println!("system,thp_enabled,{}", read(&format!("{THP}/enabled")));
        println!(
            "system,thp_shmem_enabled,{}",
            read(&format!("{THP}/shmem_enabled"))
        );
        println!("system,thp_defrag,{}", read(&format!("{THP}/defrag")));
        let mut sizes: Vec<_> = std::fs::read_dir(THP)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("shmem_enabled").exists())
            .collect();
        sizes.sort();
        for dir in sizes {
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
            let value = read(&dir.join("shmem_enabled").to_string_lossy());
            if !value.contains("[never]") {
                println!("system,mthp_shmem_{},{value}", name.unwrap_or_default());
            }
        }
        let mounts = read("/proc/mounts");
        let dev_shm = mounts
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some("/dev/shm"))
            .unwrap_or("not mounted");
        println!("system,dev_shm_mount,{}", dev_shm.replace(',', ";"));
        println!(
            "system,hugetlb_pages_total,{}",
            meminfo("HugePages_Total").map_or("unknown".into(), |v| v.to_string())
        );
        for (label, object) in [
            ("madv_hugepage_memfd", AnonymousKind::Memfd),
            ("madv_hugepage_dev_shm", AnonymousKind::UnlinkedShm),
        ] {
            println!("system,{label},{}", huge_pages_effective(object));
        }
        println!("system,mfd_hugetlb,{}", hugetlb_memfd());
    }

    /// A `/proc/meminfo` figure (kB, or a count).
    fn meminfo(key: &str) -> Option<u64> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
    }

    /// Copies 8 MiB with `MADV_HUGEPAGE` and says whether `ShmemHugePages` grew meanwhile.
    fn huge_pages_effective(object: AnonymousKind) -> String {
        let before = meminfo("ShmemHugePages");
        let src = vec![1u8; 8 << 20];
        let plan = CopyPlan {
            method: CopyMethod::PrefaultSplit,
            threads: 1,
            huge_pages: true,
            object,
        };
        match SharedRegion::copy_from_bytes_with(&src, &plan) {
            Ok(region) => {
                let after = meminfo("ShmemHugePages");
                drop(region);
                match (before, after) {
                    (Some(b), Some(a)) if a > b => format!("yes (+{} kB ShmemHugePages)", a - b),
                    (Some(_), Some(_)) => "no (ShmemHugePages unchanged)".to_owned(),
                    _ => "unknown (no ShmemHugePages in /proc/meminfo)".to_owned(),
                }
            }
            Err(err) => format!("copy failed: {err}"),
        }
    }

    /// Whether a 2 MiB `memfd_create(MFD_HUGETLB)` object can be mapped and populated.
    fn hugetlb_memfd() -> String {
        use rustix::fs::MemfdFlags;
        use rustix::mm::{Advice, MapFlags, ProtFlags};
        const LEN: usize = 2 << 20;
        let fd = match rustix::fs::memfd_create(
            "tensormem-probe",
            MemfdFlags::CLOEXEC | MemfdFlags::HUGETLB,
        ) {
            Ok(fd) => fd,
            Err(e) => return format!("no (memfd_create: {e})"),
        };
        if let Err(e) = rustix::fs::ftruncate(&fd, LEN as u64) {
            return format!("no (ftruncate: {e})");
        }
        // SAFETY: a fresh mapping at a kernel-chosen address, unmapped below before returning.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                LEN,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        };
        let ptr = match ptr {
            Ok(ptr) => ptr,
            Err(e) => return format!("no (mmap: {e}; reserve pages in /proc/sys/vm/nr_hugepages)"),
        };
        // SAFETY: the range is the mapping made above; populating only faults pages in.
        let populated = unsafe { rustix::mm::madvise(ptr, LEN, Advice::LinuxPopulateWrite) };
        // SAFETY: unmaps exactly the mapping made above; nothing refers to it any more.
        let _ = unsafe { rustix::mm::munmap(ptr, LEN) };
        match populated {
            Ok(()) => "yes".to_owned(),
            Err(e) => format!("no (populate: {e})"),
        }
    }
}
