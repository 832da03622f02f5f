//! `shm_bench`: tensormem-shm's sharing costs as CSV rows shaped like those of the anchor
//! `torch_sharing_bench.py`, to be run side by side with it on one machine. Self-contained: the
//! consumer process is this binary re-executed (`shm_bench --consumer SOCKET`), so it runs where
//! there is no Rust toolchain. Takes a few seconds.
//!
//! Rows:
//! - `tensormem_fd,cpu,BYTES,MEDIAN_US`: one round trip producer -> consumer (send a region over a
//!   Unix socket with `SCM_RIGHTS`, consumer attaches, reads the first and last byte, detaches,
//!   answers one byte); region made and filled before timing, as in the anchor;
//! - `tensormem_make_region,cpu,BYTES,MEDIAN_US`: making that region (`create_anonymous`), not part
//!   of the round trip;
//! - `share_memory_,cpu,BYTES,US  (GB/s)`: `SharedRegion::copy_from_bytes` of a private buffer
//!   (median of several runs); `share_memory_1_thread`: the same with one thread;
//!   `private_vec_copy`: the same bytes copied into a fresh private `Vec` (`to_vec`), for reference.
//!
//! Usage: `shm_bench [--rounds N]` (default 1000 round trips per size after 50 warm-up ones).

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tensormem_shm::copy::parallelism;
use tensormem_shm::transfer::{recv_region, send_region, SendOptions};
use tensormem_shm::{MapOptions, SharedRegion};

const ROUND_TRIP_SIZES: [u64; 3] = [4 << 10, 1 << 20, 64 << 20];
const COPY_SIZES: [(usize, usize); 2] = [(64 << 20, 9), (1 << 30, 5)];
const WARM_UP: usize = 50;

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("--consumer") => match args.get(1) {
            Some(path) => consumer(path),
            None => Err("--consumer needs a socket path".into()),
        },
        Some("--rounds") => match args.get(1).and_then(|n| n.parse().ok()) {
            Some(rounds) => producer(rounds),
            None => Err("--rounds needs a number".into()),
        },
        None => producer(1000),
        Some(other) => {
            Err(format!("unknown argument {other}; usage: shm_bench [--rounds N]").into())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("shm_bench: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Attach, read first and last byte, answer their sum; until the producer hangs up.
fn consumer(path: &str) -> BenchResult<()> {
    let mut socket = UnixStream::connect(path)?;
    let options = MapOptions::new();
    while let Ok(received) = recv_region(&socket, &options) {
        let bytes = received.region.as_slice();
        let answer = bytes[0].wrapping_add(bytes[bytes.len() - 1]);
        drop(received);
        socket.write_all(&[answer])?;
    }
    Ok(())
}

fn producer(rounds: usize) -> BenchResult<()> {
    let dir = std::env::temp_dir().join(format!("tensormem-shm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let outcome = run(&dir, rounds);
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

fn run(dir: &std::path::Path, rounds: usize) -> BenchResult<()> {
    let path = dir.join("rt.sock");
    let listener = UnixListener::bind(&path)?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--consumer")
        .arg(&path)
        .stdin(Stdio::null())
        .spawn()?;
    let (mut socket, _) = listener.accept()?;

    eprintln!(
        "shm_bench: copies use up to {} threads (available_parallelism)",
        parallelism()
    );
    println!("strategy,device,bytes,median_us_per_roundtrip");
    for len in ROUND_TRIP_SIZES {
        let mut make = Vec::with_capacity(20);
        for _ in 0..20 {
            let start = Instant::now();
            let region = SharedRegion::create_anonymous(len)?;
            make.push(start.elapsed());
            drop(region);
        }
        let mut region = SharedRegion::create_anonymous(len)?;
        region.as_mut_slice().fill(1);
        region.write_at(len as usize - 1, &[2])?;
        let mut times = Vec::with_capacity(rounds);
        for i in 0..WARM_UP + rounds {
            let start = Instant::now();
            send_region(&socket, &region, SendOptions::default())?;
            let mut answer = [0u8; 1];
            socket.read_exact(&mut answer)?;
            let elapsed = start.elapsed();
            if answer[0] != 3 {
                return Err(format!("consumer answered {} instead of 3", answer[0]).into());
            }
            if i >= WARM_UP {
                times.push(elapsed);
            }
        }
        println!("tensormem_fd,cpu,{len},{:.1}", median_us(&mut times));
        println!(
            "tensormem_make_region,cpu,{len},{:.1}",
            median_us(&mut make)
        );
    }
    drop(socket);
    child.wait()?;

    for (len, runs) in COPY_SIZES {
        let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut shared = Vec::with_capacity(runs);
        let mut one_thread = Vec::with_capacity(runs);
        let mut private = Vec::with_capacity(runs);
        for _ in 0..runs {
            let start = Instant::now();
            let region = SharedRegion::copy_from_bytes(&src)?;
            shared.push(start.elapsed());
            drop(region);
            let start = Instant::now();
            let region = SharedRegion::copy_from_bytes_with_threads(&src, 1)?;
            one_thread.push(start.elapsed());
            drop(region);
            let start = Instant::now();
            let copy = std::hint::black_box(src.to_vec());
            private.push(start.elapsed());
            drop(copy);
        }
        let rows = [
            ("share_memory_", &mut shared),
            ("share_memory_1_thread", &mut one_thread),
            ("private_vec_copy", &mut private),
        ];
        for (label, times) in rows {
            let us = median_us(times);
            let gbs = len as f64 / (us * 1e-6) / 1e9;
            println!("{label},cpu,{len},{us:.1}  ({gbs:.2} GB/s)");
        }
    }
    Ok(())
}

fn median_us(times: &mut [Duration]) -> f64 {
    times.sort_unstable();
    times[times.len() / 2].as_secs_f64() * 1e6
}
