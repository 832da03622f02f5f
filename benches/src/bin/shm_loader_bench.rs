//! `shm_loader_bench`: the data-loader pattern of the anchor `torch_loader_bench.py` on
//! tensormem, printing the same row shape (run both in one call and compare batches/s).
//!
//! One producer (this process) makes a fresh batch of BYTES bytes per step and fills it with the
//! step number (the anchor's `torch.empty` + `fill_`), then hands it to one of CONSUMERS consumer
//! processes (this binary re-executed), which read its first and last byte, check them, and drop
//! it. Each consumer has at most 2 batches in flight (the anchor's queue holds 8 for all 4). The
//! clock starts once every consumer is connected and stops when the last one has reported.
//!
//! Strategies:
//! - `tensormem_pool`: batches come from a [`ShmPool`] (warm regions, filled by the pool's
//!   threads) and go out through one [`PoolSender`] per consumer: after the first round a
//!   batch's region is one the consumer already maps, so the message carries an id; dropping the
//!   lease is the consumer's answer.
//! - `tensormem_fd`: the non-pooled path: a new sealed memfd per batch, filled by the same
//!   number of threads (first touch: a page allocation per 4 KiB), sent with its fd
//!   (`send_region`); the consumer maps, reads, unmaps and answers one byte.
//!
//! Usage: `shm_loader_bench [BYTES] [BATCHES] [CONSUMERS] [--only pool|fd]` (defaults
//! 67108864 200 4, both strategies).

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, ChildStdout, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tensormem_benches::sharing_harness::{exit_code, BenchResult};
use tensormem_shm::copy::parallelism;
use tensormem_shm::mapping_cache::{PoolReceiver, ReceiverOptions};
use tensormem_shm::pool::{PoolConfig, PoolSender, ShmPool};
use tensormem_shm::transfer::{recv_region, send_region, SendOptions};
use tensormem_shm::{Access, Error, MapOptions, SharedRegion};

/// Batches in flight per consumer.
const CREDIT: usize = 2;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("--consumer") {
        consumer(&args[1..])
    } else {
        run(&args)
    };
    exit_code("shm_loader_bench", result)
}

fn run(args: &[String]) -> BenchResult<()> {
    let mut positional = Vec::new();
    let mut only: Option<String> = None;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if arg == "--only" {
            only = iter.next().cloned();
        } else {
            positional.push(arg.parse::<usize>()?);
        }
    }
    let bytes = positional.first().copied().unwrap_or(64 << 20);
    let batches = positional.get(1).copied().unwrap_or(200);
    let consumers = positional.get(2).copied().unwrap_or(4).max(1);
    eprintln!(
        "shm_loader_bench: {} threads available for fills",
        parallelism()
    );
    println!("pattern,strategy,bytes,batches,consumers,rate,throughput");
    for strategy in ["pool", "fd"] {
        if only.as_deref().is_some_and(|o| o != strategy) {
            continue;
        }
        let seconds = run_one(strategy, bytes, batches, consumers)?;
        println!(
            "loader,tensormem_{strategy},{bytes},{batches},{consumers},{:.1} batches/s,{:.2} GB/s",
            batches as f64 / seconds,
            (batches * bytes) as f64 / seconds / 1e9
        );
    }
    Ok(())
}

struct Consumers {
    children: Vec<(Child, BufReader<ChildStdout>)>,
    sockets: Vec<UnixStream>,
    dir: std::path::PathBuf,
}

impl Consumers {
    fn spawn(strategy: &str, count: usize) -> BenchResult<Self> {
        let dir = std::env::temp_dir().join(format!(
            "tensormem-loader-bench-{}-{strategy}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        let mut children = Vec::new();
        for _ in 0..count {
            let mut child = Command::new(std::env::current_exe()?)
                .args(["--consumer", strategy])
                .arg(&path)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()?;
            let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
            children.push((child, stdout));
        }
        let sockets = (0..count)
            .map(|_| listener.accept().map(|(s, _)| s))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            children,
            sockets,
            dir,
        })
    }

    /// Waits for every consumer's count of batches; their sum.
    fn finish(self) -> BenchResult<usize> {
        let mut total = 0;
        for (mut child, mut stdout) in self.children {
            let mut line = String::new();
            stdout.read_line(&mut line)?;
            total += line
                .trim()
                .parse::<usize>()
                .map_err(|_| format!("a consumer said {line:?} instead of its count of batches"))?;
            child.wait()?;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(total)
    }
}

fn run_one(strategy: &str, bytes: usize, batches: usize, consumers: usize) -> BenchResult<f64> {
    let mut group = Consumers::spawn(strategy, consumers)?;
    let sockets = std::mem::take(&mut group.sockets);
    let start;
    if strategy == "pool" {
        let pool = ShmPool::new(PoolConfig::default());
        let mut senders = sockets
            .into_iter()
            .map(|s| PoolSender::new(&pool, s))
            .collect::<Result<Vec<_>, _>>()?;
        start = Instant::now();
        let mut next = 0;
        for i in 0..batches {
            let mut batch = pool.alloc(bytes as u64)?;
            batch.fill(i as u8)?;
            let c = pick(
                &mut senders,
                next,
                |s| {
                    s.poll_releases()?;
                    Ok(s.outstanding())
                },
                // Releases travel in shared memory: wait on the consumer whose turn it is (the
                // oldest batch in flight is its).
                |senders, next| {
                    let n = senders.len();
                    senders[next % n].wait_release_timeout(Duration::from_millis(100))?;
                    Ok(())
                },
            )?;
            senders[c].send(&batch, &[i as u8])?;
            next = c + 1;
        }
        for sender in &mut senders {
            while sender.outstanding() > 0 {
                sender.wait_release(None)?;
            }
        }
        eprintln!(
            "shm_loader_bench: pool made {} regions for {} batches",
            pool.stats().regions.allocated,
            pool.stats().requests
        );
    } else {
        let mut links: Vec<(UnixStream, usize)> = sockets.into_iter().map(|s| (s, 0)).collect();
        for (socket, _) in &links {
            socket.set_nonblocking(true)?;
        }
        start = Instant::now();
        let mut next = 0;
        let threads = PoolConfig::default().threads;
        for i in 0..batches {
            let mut region = SharedRegion::create_anonymous(bytes as u64)?;
            fill_parallel(&mut region, i as u8, threads);
            let c = pick(
                &mut links,
                next,
                |(socket, outstanding)| {
                    *outstanding -= read_acks(socket)?;
                    Ok(*outstanding)
                },
                |links, _| poll_readable(links),
            )?;
            let (socket, outstanding) = &mut links[c];
            socket.set_nonblocking(false)?;
            send_region(
                &*socket,
                &region,
                SendOptions {
                    user: &[i as u8],
                    read_only: true,
                },
            )?;
            socket.set_nonblocking(true)?;
            *outstanding += 1;
            next = c + 1;
        }
        for (socket, outstanding) in &mut links {
            socket.set_nonblocking(false)?;
            while *outstanding > 0 {
                *outstanding -= read_acks(socket)?;
            }
        }
    }
    let total = group.finish()?;
    let seconds = start.elapsed().as_secs_f64();
    if total != batches {
        return Err(format!("consumers took {total} batches of {batches}").into());
    }
    Ok(seconds)
}

/// The next consumer (round robin from `next`) with fewer than [`CREDIT`] batches in flight,
/// calling `wait` while every one is full.
fn pick<T>(
    links: &mut [T],
    next: usize,
    mut outstanding: impl FnMut(&mut T) -> BenchResult<usize>,
    mut wait: impl FnMut(&mut [T], usize) -> BenchResult<()>,
) -> BenchResult<usize> {
    let n = links.len();
    loop {
        for k in 0..n {
            let c = (next + k) % n;
            if outstanding(&mut links[c])? < CREDIT {
                return Ok(c);
            }
        }
        wait(links, next)?;
    }
}

/// Waits (`poll`) until one of the sockets has answers to read.
fn poll_readable(links: &mut [(UnixStream, usize)]) -> BenchResult<()> {
    let mut fds: Vec<libc::pollfd> = links
        .iter()
        .map(|(socket, _)| libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `fds` holds `fds.len()` valid pollfd entries.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
    Ok(())
}

/// Reads the one-byte answers that have arrived (blocking sockets wait for at least one).
fn read_acks(socket: &mut UnixStream) -> BenchResult<usize> {
    use std::io::Read;
    let mut buf = [0u8; 64];
    match socket.read(&mut buf) {
        Ok(0) => Err("a consumer hung up".into()),
        Ok(n) => Ok(n),
        Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
        Err(err) => Err(err.into()),
    }
}

/// Fills a new region with `threads` threads (each first-touching its own pages).
fn fill_parallel(region: &mut SharedRegion, value: u8, threads: usize) {
    let len = region.len();
    let piece = len.div_ceil(threads.max(1)).max(4 << 20);
    // SAFETY: the region was just made by this process and its fd has not been sent yet: no
    // other process reads, writes or truncates it while the slice lives.
    let all = unsafe { region.as_mut_slice() };
    std::thread::scope(|scope| {
        for chunk in all.chunks_mut(piece) {
            scope.spawn(move || chunk.fill(value));
        }
    });
}

fn consumer(args: &[String]) -> BenchResult<()> {
    let (Some(strategy), Some(path)) = (args.first(), args.get(1)) else {
        return Err("--consumer needs a strategy and a socket path".into());
    };
    let socket = UnixStream::connect(path)?;
    let mut count = 0usize;
    if strategy == "pool" {
        let options = ReceiverOptions {
            access: Access::ReadOnly,
            ..ReceiverOptions::default()
        };
        let mut receiver = PoolReceiver::new(socket, options)?;
        loop {
            let lease = match receiver.recv() {
                Ok(lease) => lease,
                Err(Error::Disconnected) => break,
                Err(err) => return Err(err.into()),
            };
            check(
                lease.user_data()[0],
                lease.read_volatile(0)?,
                lease.read_volatile(lease.len() - 1)?,
            )?;
            count += 1;
        }
    } else {
        let options = MapOptions::new().read_only();
        loop {
            let received = match recv_region(&socket, &options) {
                Ok(received) => received,
                Err(Error::Disconnected) => break,
                Err(err) => return Err(err.into()),
            };
            let region = &received.region;
            check(
                received.user_data()[0],
                region.read_volatile(0)?,
                region.read_volatile(region.len() - 1)?,
            )?;
            drop(received);
            rustix::net::send(&socket, &[1], rustix::net::SendFlags::NOSIGNAL)?;
            count += 1;
        }
    }
    println!("{count}");
    // Give the producer time to read the count before the pipe closes (it reads it at once).
    std::thread::sleep(Duration::from_millis(1));
    Ok(())
}

fn check(expected: u8, first: u8, last: u8) -> BenchResult<()> {
    if first != expected || last != expected {
        return Err(format!("batch {expected}: read {first} and {last}").into());
    }
    Ok(())
}
