//! `storage_pool_bench`: the storage facade's pooled paths against the bare `tensormem-shm` pool,
//! in one run, so the facade's cost is measured on the same machine at the same moment (the facade
//! should stay within 10% of the bare pool). Self-contained: each consumer is this binary
//! re-executed.
//!
//! Sections (each starts with its own CSV header line):
//! 1. Round trips, `strategy,device,bytes,median_us_per_roundtrip`, blocking (both ends asleep in
//!    the kernel between messages) and spinning (`--spin-us`): a warm pooled buffer, taken before
//!    the timer, is sent to a consumer that already caches the region's mapping; the consumer
//!    reads the first and last byte and lets go, which is the answer the producer waits for.
//!    Both prepare the buffer alike (zeroed, then the two bytes written) before the timer.
//!    `bare_pool*`: `ShmPool::alloc_zeroed` + `PoolSender::send` / `PoolReceiver::recv` + `Lease`.
//!    `storage_pool*`: `Storage::new_pooled` + `Storage::send_pooled` / `Storage::recv_pooled`,
//!    reading through `Storage::read_at`.
//! 2. Steady-state `share_memory_`, `strategy,device,bytes,median_us_per_copy  (GB/s)`: a fresh
//!    private buffer (made before the timer) is moved into shared memory and sent to a consumer
//!    process that reads a byte and releases it; the copy, freeing the private buffer, the send
//!    and the handling of releases are inside the timer. `bare_share_memory`:
//!    `ShmPool::copy_from_bytes(&fresh)`, `drop(fresh)`, `PoolSender::send`.
//!    `storage_share_memory`: `Storage::from_vec(fresh)` (before the timer), then
//!    `Storage::share_memory_()` on the process-wide pool and `Storage::send_pooled`.
//!
//! The two series of each row are measured interleaved (alternating which goes first), each
//! against its own consumer process, so machine drift hits both alike. After each pair a
//! `ratio,...,facade/bare` line. Usage:
//! `storage_pool_bench [--rounds N] [--spin-us N] [--copies N] [--no-copy]`.

use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensormem_benches::sharing_harness::{
    exit_code, median_us, print_copy, BenchResult, Consumer, Copies, OptionSet, Options,
    RoundTripTag, COPY_SIZES, ROUND_TRIP_SIZES, WARM_UP,
};
use tensormem_shm::mapping_cache::{PoolReceiver, ReceiverOptions};
use tensormem_shm::pool::{PoolConfig, PoolSender, ShmPool};
use tensormem_shm::transfer::RecvOptions;
use tensormem_storage::{default_pool, set_default_pool, Storage};

const OPTIONS: OptionSet = OptionSet {
    usage: "storage_pool_bench [--rounds N] [--spin-us N] [--copies N] [--no-copy]",
    copies: Some(Copies {
        default: 10,
        min: 1,
    }),
    same_cpu: false,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("--bare-consumer") => consumer(&args[1..], false),
        Some("--storage-consumer") => consumer(&args[1..], true),
        _ => Options::parse(&args, &OPTIONS).and_then(|args| producer(&args)),
    };
    exit_code("storage_pool_bench", result)
}

/// A consumer: receives, checks the first and last byte against byte 4 of the user data, lets
/// go (the release is the answer). Bytes 0..4 of the user data: how long to spin next (µs).
fn consumer(args: &[String], facade: bool) -> BenchResult<()> {
    let path = args.first().ok_or("the consumer needs a socket path")?;
    let socket = UnixStream::connect(path)?;
    let mut receiver = PoolReceiver::new(socket, ReceiverOptions::default())?;
    loop {
        let (first, last, tag) = if facade {
            let received = match Storage::recv_pooled(&mut receiver) {
                Ok(received) => received,
                Err(tensormem_storage::Error::Shm(tensormem_shm::Error::Disconnected)) => {
                    return Ok(())
                }
                Err(err) => return Err(err.into()),
            };
            let storage = &received.storage;
            let (mut first, mut last) = ([0u8], [0u8]);
            storage.read_at(0, &mut first)?;
            storage.read_at(storage.nbytes() - 1, &mut last)?;
            let tag = RoundTripTag::from_bytes(&received.metadata)?;
            drop(received);
            (first[0], last[0], tag)
        } else {
            let lease = match receiver.recv() {
                Ok(lease) => lease,
                Err(tensormem_shm::Error::Disconnected) => return Ok(()),
                Err(err) => return Err(err.into()),
            };
            let first = lease.read_volatile(0)?;
            let last = lease.read_volatile(lease.len() - 1)?;
            let tag = RoundTripTag::from_bytes(lease.user_data())?;
            drop(lease);
            (first, last, tag)
        };
        tag.check(first, last)?;
        receiver.set_recv(tag.next_recv());
    }
}

/// One connection: a pool, a consumer process and the sender to it.
struct Connection {
    pool: ShmPool,
    sender: PoolSender,
    peer: Consumer,
}

impl Connection {
    fn open(pool: ShmPool, facade: bool) -> BenchResult<Self> {
        let role = if facade {
            "--storage-consumer"
        } else {
            "--bare-consumer"
        };
        let peer = Consumer::spawn_role("storage_pool_bench", role, &[])?;
        let sender = PoolSender::new(&pool, peer.socket().try_clone()?)?;
        Ok(Self { pool, sender, peer })
    }

    fn close(mut self) -> BenchResult<()> {
        while self.sender.outstanding() > 0 {
            self.sender.wait_release(None)?;
        }
        drop(self.sender);
        self.peer.finish()
    }

    fn wait_answer(&mut self, recv: RecvOptions) -> BenchResult<()> {
        if self.sender.wait_release(Some(recv))? != 1 {
            return Err("the consumer went away".into());
        }
        Ok(())
    }
}

fn producer(args: &Options) -> BenchResult<()> {
    // The facade's share_memory_ uses the process-wide pool: give it the bare rows' config.
    set_default_pool(ShmPool::new(PoolConfig::default()))?;
    println!("strategy,device,bytes,median_us_per_roundtrip");
    let mut bare = Connection::open(ShmPool::new(PoolConfig::default()), false)?;
    let mut facade = Connection::open(ShmPool::new(PoolConfig::default()), true)?;
    for len in ROUND_TRIP_SIZES {
        for (suffix, recv) in [
            ("", RecvOptions::BLOCKING),
            ("_spin", RecvOptions::spinning(args.spin)),
        ] {
            // Interleaved round by round, in alternating order, so machine drift hits both.
            let (mut bare_times, mut facade_times) = (Vec::new(), Vec::new());
            for i in 0..WARM_UP + args.rounds {
                let value = (i % 251) as u8;
                let facade_first = i % 2 == 0;
                for facade_turn in [facade_first, !facade_first] {
                    let elapsed = if facade_turn {
                        round_trip_facade(&mut facade, len, recv, value)?
                    } else {
                        round_trip_bare(&mut bare, len, recv, value)?
                    };
                    if i >= WARM_UP {
                        if facade_turn {
                            facade_times.push(elapsed);
                        } else {
                            bare_times.push(elapsed);
                        }
                    }
                }
            }
            let bare_us = median_us(&mut bare_times);
            let facade_us = median_us(&mut facade_times);
            println!("bare_pool{suffix},cpu,{len},{bare_us:.1}");
            println!("storage_pool{suffix},cpu,{len},{facade_us:.1}");
            println!(
                "ratio,storage_pool{suffix}/bare_pool{suffix},{len},{:.3}",
                facade_us / bare_us
            );
        }
    }
    for (label, c) in [("bare", &bare), ("storage", &facade)] {
        let stats = c.sender.stats();
        eprintln!(
            "storage_pool_bench: {label} round trips sent {} fds and {} ids; pool made {} regions \
             for {} requests",
            stats.sent_fd,
            stats.sent_id,
            c.pool.stats().regions.allocated,
            c.pool.stats().requests
        );
    }
    bare.close()?;
    facade.close()?;
    if args.copy {
        println!("strategy,device,bytes,median_us_per_copy  (GB/s)");
        share_memory(args)?;
    }
    Ok(())
}

fn round_trip_bare(
    c: &mut Connection,
    len: usize,
    recv: RecvOptions,
    value: u8,
) -> BenchResult<Duration> {
    let mut buffer = c.pool.alloc_zeroed(len as u64)?;
    buffer.write_at(0, &[value])?;
    buffer.write_at(len - 1, &[value])?;
    let user = RoundTripTag::new(recv, value).to_bytes();
    let start = Instant::now();
    c.sender.send(&buffer, &user)?;
    drop(buffer);
    c.wait_answer(recv)?;
    Ok(start.elapsed())
}

fn round_trip_facade(
    c: &mut Connection,
    len: usize,
    recv: RecvOptions,
    value: u8,
) -> BenchResult<Duration> {
    let storage = Storage::new_pooled(&c.pool, len)?;
    storage.write_at(0, &[value])?;
    storage.write_at(len - 1, &[value])?;
    let user = RoundTripTag::new(recv, value).to_bytes();
    let start = Instant::now();
    storage.send_pooled(&mut c.sender, &user)?;
    drop(storage);
    c.wait_answer(recv)?;
    Ok(start.elapsed())
}

fn share_memory(args: &Options) -> BenchResult<()> {
    for len in COPY_SIZES {
        let src = vec![7u8; len];
        let runs = args.copy_runs(len);
        let user = RoundTripTag {
            spin_us: 0,
            value: 7,
        }
        .to_bytes();

        let mut bare = Connection::open(ShmPool::new(PoolConfig::default()), false)?;
        let mut facade = Connection::open(default_pool().clone(), true)?;
        let (mut bare_times, mut facade_times) = (Vec::new(), Vec::new());
        // Interleaved, in alternating order, so both see the same machine state; the first
        // (cold) round of each is dropped.
        for round in 0..2 * (runs + 1) {
            let facade_turn = (round % 2 == 0) == (round / 2 % 2 == 0);
            let elapsed = if facade_turn {
                let storage = Storage::from_vec(src.clone());
                let start = Instant::now();
                storage.share_memory_()?;
                storage.send_pooled(&mut facade.sender, &user)?;
                drop(storage);
                start.elapsed()
            } else {
                let fresh = src.clone();
                let start = Instant::now();
                let buffer = bare.pool.copy_from_bytes(&fresh)?;
                drop(fresh);
                bare.sender.send(&buffer, &user)?;
                drop(buffer);
                start.elapsed()
            };
            if round >= 2 {
                if facade_turn {
                    facade_times.push(elapsed);
                } else {
                    bare_times.push(elapsed);
                }
            }
        }
        let bare_us = print_copy("bare_share_memory", len, &mut bare_times);
        let facade_us = print_copy("storage_share_memory", len, &mut facade_times);
        println!(
            "ratio,storage_share_memory/bare_share_memory,{len},{:.3}",
            facade_us / bare_us
        );
        eprintln!(
            "storage_pool_bench: {len} B copies: bare pool made {} regions for {} requests, \
             the process-wide pool {} for {}",
            bare.pool.stats().regions.allocated,
            bare.pool.stats().requests,
            facade.pool.stats().regions.allocated,
            facade.pool.stats().requests
        );
        bare.close()?;
        facade.close()?;
        default_pool().trim();
    }
    Ok(())
}
