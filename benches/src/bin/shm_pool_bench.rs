//! `shm_pool_bench`: the shared-memory pool's steady state against the non-pooled path, in one
//! run, as CSV rows shaped like those of the anchor `torch_sharing_bench.py` (run it beside that
//! script in one call). Self-contained: the consumer is this binary re-executed.
//!
//! Sections (each starts with its own CSV header line):
//! 1. Round trips, `strategy,device,bytes,median_us_per_roundtrip`: `tensormem_pool`: a buffer
//!    from a warm pool (taken before the timer, as the anchor makes its tensor before the timer)
//!    is sent to a consumer that already caches the region's mapping (the message, on the
//!    connection's shared-memory channel, carries an id), the consumer reads the first and last
//!    byte and drops its lease, whose release (a channel message back) is the answer the
//!    producer waits for; both ends blocking in the kernel (`futex`) between messages.
//!    `tensormem_pool_spin`: the same, both ends spinning up to `--spin-us` first.
//!    `tensormem_fd`: today's non-pooled path in the same run (`send_region` of a region made
//!    before the timer; the consumer receives, maps, reads the two bytes, unmaps and answers one
//!    byte; blocking). `channel_pingpong` / `socket_pingpong` (bytes = message size): the bare
//!    transports, a 40-byte message and a 24-byte answer, blocking, on a
//!    `tensormem_shm::channel::Channel` and on a Unix stream socket.
//!    With `--same-cpu`, the pooled rows and the ping-pongs are measured again with both
//!    processes pinned to the CPU the producer runs on (rows suffixed `_1cpu`): each hand-off is
//!    then a direct switch on one CPU, without an inter-processor wake-up.
//! 2. `share_memory_` in a loop, `share_memory_*,cpu,BYTES,US  (GB/s)`, median per iteration:
//!    `share_memory_`: `SharedRegion::copy_from_bytes` (today's path: a new region every time,
//!    dropped after); `share_memory_pooled`: `ShmPool::copy_from_bytes`, the buffer sent to a
//!    consumer process which reads a byte and releases it (the copy, the send and the handling of
//!    releases are all inside the timer; a region the consumer has not released yet is not reused,
//!    so the pool holds two or three). `share_memory_pooled_first`: the first (cold) iteration.
//!
//! Usage: `shm_pool_bench [--rounds N] [--spin-us N] [--copies N] [--no-copy] [--same-cpu]`.

use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Instant;

use tensormem_benches::sharing_harness::{
    exit_code, median_us, print_copy, BenchResult, Consumer, Copies, OptionSet, Options,
    RoundTripTag, COPY_SIZES, ROUND_TRIP_SIZES, WARM_UP,
};
use tensormem_shm::channel::{Channel, ChannelOptions};
use tensormem_shm::copy::parallelism;
use tensormem_shm::mapping_cache::{PoolReceiver, ReceiverOptions};
use tensormem_shm::pool::{PoolConfig, PoolSender, ShmPool};
use tensormem_shm::transfer::{recv_exact, recv_region, send_region, RecvOptions, SendOptions};
use tensormem_shm::{Error, MapOptions, SharedRegion};

const OPTIONS: OptionSet = OptionSet {
    usage: "shm_pool_bench [--rounds N] [--spin-us N] [--copies N] [--no-copy] [--same-cpu]",
    copies: Some(Copies {
        default: 12,
        min: 2,
    }),
    same_cpu: true,
};
/// Bytes of a ping-pong message (a pool message's header) and of its answer (a release record).
const PING: usize = 40;
const PONG: usize = 24;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("--pool-consumer") => pool_consumer(&args[1..]),
        Some("--fd-consumer") => fd_consumer(&args[1..]),
        Some("--channel-consumer") => channel_consumer(&args[1..]),
        Some("--socket-consumer") => socket_consumer(&args[1..]),
        _ => Options::parse(&args, &OPTIONS).and_then(|args| producer(&args)),
    };
    exit_code("shm_pool_bench", result)
}

/// The consumer of the pooled rows: takes leases, checks the first and last byte against the
/// value sent with them, drops them (the release is the answer). The first message's user data
/// says how long to spin (µs, 4 bytes), byte 4 the expected value.
fn pool_consumer(args: &[String]) -> BenchResult<()> {
    let path = args.first().ok_or("--pool-consumer needs a socket path")?;
    pin_from_args(args)?;
    let socket = UnixStream::connect(path)?;
    let mut receiver = PoolReceiver::new(socket, ReceiverOptions::default())?;
    loop {
        let lease = match receiver.recv() {
            Ok(lease) => lease,
            Err(Error::Disconnected) => return Ok(()),
            Err(err) => return Err(err.into()),
        };
        let tag = RoundTripTag::from_bytes(lease.user_data())?;
        tag.check(
            lease.read_volatile(0)?,
            lease.read_volatile(lease.len() - 1)?,
        )?;
        drop(lease);
        receiver.set_recv(tag.next_recv());
    }
}

/// The consumer of the non-pooled rows: attach, read the two bytes, unmap, answer their sum.
fn fd_consumer(args: &[String]) -> BenchResult<()> {
    let path = args.first().ok_or("--fd-consumer needs a socket path")?;
    let socket = UnixStream::connect(path)?;
    while let Ok(received) = recv_region(&socket, &MapOptions::new()) {
        let region = &received.region;
        let answer = region
            .read_volatile(0)?
            .wrapping_add(region.read_volatile(region.len() - 1)?);
        drop(received);
        rustix::net::send(&socket, &[answer], rustix::net::SendFlags::NOSIGNAL)?;
    }
    Ok(())
}

/// The consumer of `channel_pingpong`: answers every message with [`PONG`] bytes.
fn channel_consumer(args: &[String]) -> BenchResult<()> {
    let path = args
        .first()
        .ok_or("--channel-consumer needs a socket path")?;
    pin_from_args(args)?;
    let mut channel = Channel::accept(UnixStream::connect(path)?, ChannelOptions::default())?;
    let mut buf = [0u8; PING];
    loop {
        match channel.recv(&mut buf) {
            Ok(_) => channel.send(&buf[..PONG])?,
            Err(Error::PeerGone) => return Ok(()),
            Err(err) => return Err(err.into()),
        }
    }
}

/// The consumer of `socket_pingpong`: answers every [`PING`] bytes with [`PONG`] bytes.
fn socket_consumer(args: &[String]) -> BenchResult<()> {
    let path = args
        .first()
        .ok_or("--socket-consumer needs a socket path")?;
    pin_from_args(args)?;
    let socket = UnixStream::connect(path)?;
    let mut buf = [0u8; PING];
    while recv_exact(&socket, &mut buf, RecvOptions::BLOCKING).is_ok() {
        rustix::net::send(&socket, &buf[..PONG], rustix::net::SendFlags::NOSIGNAL)?;
    }
    Ok(())
}

/// `--pin CPU` after the socket path: pins this process there.
fn pin_from_args(args: &[String]) -> BenchResult<()> {
    if let (Some(flag), Some(cpu)) = (args.get(1), args.get(2)) {
        if flag == "--pin" {
            pin_to(Some(cpu.parse()?))?;
        }
    }
    Ok(())
}

/// Pins the calling thread to `cpu` (`None`: every CPU it may run on at start, as saved by
/// [`allowed_cpus`]).
fn pin_to(cpu: Option<usize>) -> BenchResult<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside it (bounds-checked by
    // libc's macro against its size); sched_setaffinity reads `size_of` bytes of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        match cpu {
            Some(cpu) => libc::CPU_SET(cpu, &mut set),
            None => {
                for cpu in allowed_cpus() {
                    libc::CPU_SET(cpu, &mut set);
                }
            }
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(format!("sched_setaffinity: {}", std::io::Error::last_os_error()).into());
    }
    Ok(())
}

/// The CPUs this process may run on, read once at start.
fn allowed_cpus() -> Vec<usize> {
    static CPUS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    CPUS.get_or_init(|| {
        // SAFETY: sched_getaffinity writes at most `size_of` bytes into the zeroed set;
        // CPU_ISSET reads inside it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return (0..parallelism()).collect();
            }
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
                .collect()
        }
    })
    .clone()
}

/// The CPU this thread runs on now.
fn current_cpu() -> usize {
    // SAFETY: no arguments; returns -1 on failure.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).unwrap_or(0)
}

/// The consumer in `role`, pinned to `pin` if given.
fn spawn_consumer(role: &str, pin: Option<usize>) -> BenchResult<Consumer> {
    let extra = match pin {
        Some(cpu) => vec!["--pin".to_owned(), cpu.to_string()],
        None => Vec::new(),
    };
    Consumer::spawn_role("shm_pool_bench", role, &extra)
}

fn producer(args: &Options) -> BenchResult<()> {
    eprintln!(
        "shm_pool_bench: {} threads available for copies",
        parallelism()
    );
    println!("strategy,device,bytes,median_us_per_roundtrip");
    allowed_cpus();
    round_trips_pooled(args, None)?;
    pingpongs(args, None)?;
    if args.same_cpu {
        let cpu = current_cpu();
        eprintln!("shm_pool_bench: `_1cpu` rows: producer and consumer pinned to CPU {cpu}");
        pin_to(Some(cpu))?;
        let pinned = round_trips_pooled(args, Some(cpu)).and_then(|()| pingpongs(args, Some(cpu)));
        pin_to(None)?;
        pinned?;
    }
    round_trips_fd(args)?;
    if args.copy {
        println!("strategy,device,bytes,median_us_per_copy  (GB/s)");
        share_memory(args)?;
    }
    Ok(())
}

/// The pooled rows; with `pin`, both processes on that CPU (this thread is pinned already).
fn round_trips_pooled(args: &Options, pin: Option<usize>) -> BenchResult<()> {
    let suffix = if pin.is_some() { "_1cpu" } else { "" };
    let pool = ShmPool::new(PoolConfig::default());
    let peer = spawn_consumer("--pool-consumer", pin)?;
    let mut sender = PoolSender::new(&pool, peer.socket().try_clone()?)?;
    for len in ROUND_TRIP_SIZES {
        for (label, recv) in [
            ("tensormem_pool", RecvOptions::BLOCKING),
            ("tensormem_pool_spin", RecvOptions::spinning(args.spin)),
        ] {
            let mut times = Vec::with_capacity(args.rounds);
            for i in 0..WARM_UP + args.rounds {
                let value = (i % 251) as u8;
                let mut buffer = pool.alloc(len as u64)?;
                buffer.write_at(0, &[value])?;
                buffer.write_at(len - 1, &[value])?;
                let user = RoundTripTag::new(recv, value).to_bytes();
                let start = Instant::now();
                sender.send(&buffer, &user)?;
                drop(buffer);
                if sender.wait_release(Some(recv))? != 1 {
                    return Err("the consumer went away".into());
                }
                if i >= WARM_UP {
                    times.push(start.elapsed());
                }
            }
            println!("{label}{suffix},cpu,{len},{:.1}", median_us(&mut times));
        }
    }
    let stats = sender.stats();
    eprintln!(
        "shm_pool_bench: round trips sent {} fds and {} ids; pool made {} regions for {} requests",
        stats.sent_fd,
        stats.sent_id,
        pool.stats().regions.allocated,
        pool.stats().requests
    );
    drop(sender);
    peer.finish()
}

/// The bare transports: a [`PING`]-byte message and a [`PONG`]-byte answer, blocking, on a
/// shared-memory channel and on a Unix stream socket.
fn pingpongs(args: &Options, pin: Option<usize>) -> BenchResult<()> {
    let suffix = if pin.is_some() { "_1cpu" } else { "" };
    let ping = [7u8; PING];
    let mut pong = [0u8; PING];

    let peer = spawn_consumer("--channel-consumer", pin)?;
    let mut channel = Channel::create(peer.socket().try_clone()?, ChannelOptions::default())?;
    let mut times = Vec::with_capacity(args.rounds);
    for i in 0..WARM_UP + args.rounds {
        let start = Instant::now();
        channel.send(&ping)?;
        let n = channel.recv(&mut pong)?;
        let elapsed = start.elapsed();
        if n != PONG {
            return Err(format!("the channel consumer answered {n} bytes").into());
        }
        if i >= WARM_UP {
            times.push(elapsed);
        }
    }
    println!(
        "channel_pingpong{suffix},cpu,{PING},{:.1}",
        median_us(&mut times)
    );
    drop(channel);
    peer.finish()?;

    let peer = spawn_consumer("--socket-consumer", pin)?;
    let mut times = Vec::with_capacity(args.rounds);
    for i in 0..WARM_UP + args.rounds {
        let start = Instant::now();
        rustix::net::send(peer.socket(), &ping, rustix::net::SendFlags::NOSIGNAL)?;
        recv_exact(peer.socket(), &mut pong[..PONG], RecvOptions::BLOCKING)?;
        let elapsed = start.elapsed();
        if i >= WARM_UP {
            times.push(elapsed);
        }
    }
    println!(
        "socket_pingpong{suffix},cpu,{PING},{:.1}",
        median_us(&mut times)
    );
    peer.finish()
}

fn round_trips_fd(args: &Options) -> BenchResult<()> {
    let peer = spawn_consumer("--fd-consumer", None)?;
    for len in ROUND_TRIP_SIZES {
        let mut region = SharedRegion::create_anonymous(len as u64)?;
        region.fill(1)?;
        region.write_at(len - 1, &[2])?;
        let mut times = Vec::with_capacity(args.rounds);
        for i in 0..WARM_UP + args.rounds {
            let start = Instant::now();
            send_region(peer.socket(), &region, SendOptions::default())?;
            let mut answer = [0u8; 1];
            recv_exact(peer.socket(), &mut answer, RecvOptions::BLOCKING)?;
            let elapsed = start.elapsed();
            if answer[0] != 3 {
                return Err(format!("consumer answered {}", answer[0]).into());
            }
            if i >= WARM_UP {
                times.push(elapsed);
            }
        }
        println!("tensormem_fd,cpu,{len},{:.1}", median_us(&mut times));
    }
    peer.finish()
}

fn share_memory(args: &Options) -> BenchResult<()> {
    for len in COPY_SIZES {
        let src = vec![7u8; len];
        let runs = args.copy_runs(len);

        // Today's path: a new region per copy, dropped outside the timer.
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let start = Instant::now();
            let region = SharedRegion::copy_from_bytes(&src)?;
            times.push(start.elapsed());
            drop(region);
        }
        print_copy("share_memory_", len, &mut times);

        // The pool, a consumer releasing each buffer.
        let pool = ShmPool::new(PoolConfig::default());
        let peer = spawn_consumer("--pool-consumer", None)?;
        let mut sender = PoolSender::new(&pool, peer.socket().try_clone()?)?;
        let user = RoundTripTag {
            spin_us: 0,
            value: 7,
        }
        .to_bytes();
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs + 1 {
            let start = Instant::now();
            let buffer = pool.copy_from_bytes(&src)?;
            sender.send(&buffer, &user)?;
            drop(buffer);
            times.push(start.elapsed());
        }
        while sender.outstanding() > 0 {
            sender.wait_release(None)?;
        }
        let first = times.remove(0);
        print_copy("share_memory_pooled_first", len, &mut [first]);
        print_copy("share_memory_pooled", len, &mut times);
        eprintln!(
            "shm_pool_bench: {len} B pooled copies: {} regions made for {} requests",
            pool.stats().regions.allocated,
            pool.stats().requests
        );
        drop(sender);
        drop(pool);
        peer.finish()?;
    }
    Ok(())
}
