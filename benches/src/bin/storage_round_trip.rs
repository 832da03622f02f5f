//! The storage facade against the bare shm layer: `share_memory_` + send + open + read the first
//! and last byte, producer -> consumer in two processes, for 4 KiB, 1 MiB and 64 MiB.
//!
//! - `bare shm`: a private buffer (made before the timer) is copied by
//!   `SharedRegion::copy_from_bytes` (memfd, pre-faulted copy) and freed, and the region is sent
//!   with `send_region`; the consumer `recv_region`s, reads bytes 0 and len-1 with `read_volatile`, drops the region and
//!   answers one byte.
//! - `storage`: a private `Storage` (made before the timer) is moved into shared memory by
//!   `share_memory_` (which also frees its private buffer, as PyTorch's does; the bytes go into a
//!   region of the process-wide pool) and sent with `send_shared_fd` (which detaches the region
//!   from the pool: a raw descriptor's users cannot be accounted for, so every round trip is the
//!   cold path, a new region each time); the consumer `Storage::recv_shared_fd`s, reads the two bytes with
//!   `read_at`, drops it and answers.
//!
//! The two are measured interleaved (bare, storage, storage, bare, ...), each round trip timed on
//! its own, so that load from other processes on the machine hits both alike; the figures are
//! medians and the ratio is storage / bare. The producer's shared object is dropped after the
//! timer in both. One consumer process (this binary re-executed) serves both series, told by a
//! mode byte sent before the timer starts which API to open the next region with.
//!
//! `cargo run --release -p tensormem-benches --bin storage_round_trip [-- ROUNDS]`

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use tensormem_benches::sharing_harness::Consumer;
use tensormem_shm::transfer::{recv_exact, recv_region, send_region, RecvOptions, SendOptions};
use tensormem_shm::{MapOptions, SharedRegion};
use tensormem_storage::Storage;

const CONSUMER_SOCKET: &str = "TENSORMEM_BENCH_STORAGE_SOCKET";

const SIZES: [(usize, &str, usize); 3] = [
    (4 << 10, "4 KiB", 4000),
    (1 << 20, "1 MiB", 1000),
    (64 << 20, "64 MiB", 60),
];

/// The consumer: for each round trip, a mode byte (1 = storage facade, 0 = bare), then open the
/// region, read its first and last byte, drop it and answer their sum; until the producer hangs
/// up.
fn consumer(path: &str) {
    let mut socket = UnixStream::connect(path).expect("connect to producer");
    loop {
        let mut mode = [0u8; 1];
        if recv_exact(&socket, &mut mode, RecvOptions::BLOCKING).is_err() {
            break;
        }
        let answer = if mode[0] == 1 {
            let Ok(storage) = Storage::recv_shared_fd(&socket) else {
                break;
            };
            let (mut first, mut last) = ([0u8], [0u8]);
            let ok = storage.read_at(0, &mut first).is_ok()
                && storage.read_at(storage.nbytes() - 1, &mut last).is_ok();
            if ok {
                first[0].wrapping_add(last[0])
            } else {
                0
            }
        } else {
            let Ok(received) = recv_region(&socket, &MapOptions::new()) else {
                break;
            };
            let region = &received.region;
            let first = region.read_volatile(0).unwrap_or(0);
            let last = region.read_volatile(region.len() - 1).unwrap_or(0);
            first.wrapping_add(last)
        };
        if socket.write_all(&[answer]).is_err() {
            break;
        }
    }
}

fn answer(socket: &UnixStream) {
    let mut answer = [0u8; 1];
    recv_exact(socket, &mut answer, RecvOptions::BLOCKING).expect("answer");
    assert_eq!(answer[0], 3, "the consumer read the first and last byte");
}

fn bare(mut socket: &UnixStream, data: &[u8]) -> Duration {
    socket.write_all(&[0]).expect("mode");
    let private = data.to_vec();
    let start = Instant::now();
    let region = SharedRegion::copy_from_bytes(&private).expect("copy");
    drop(private); // what share_memory_ does with the storage's old buffer
    send_region(socket, &region, SendOptions::default()).expect("send");
    answer(socket);
    let took = start.elapsed();
    drop(region);
    took
}

fn facade(mut socket: &UnixStream, data: &[u8]) -> Duration {
    socket.write_all(&[1]).expect("mode");
    let storage = Storage::from_vec(data.to_vec());
    let start = Instant::now();
    storage.share_memory_().expect("share_memory_");
    storage.send_shared_fd(socket).expect("send");
    answer(socket);
    let took = start.elapsed();
    drop(storage);
    took
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    if let Some(path) = std::env::var_os(CONSUMER_SOCKET) {
        consumer(path.to_str().expect("utf-8 socket path"));
        return;
    }
    let scale: f64 = std::env::args()
        .nth(1)
        .map_or(1.0, |s| s.parse().expect("a number: the rounds factor"));
    let consumer = Consumer::spawn("storage_round_trip", |command, path| {
        command.env(CONSUMER_SOCKET, path);
    })
    .expect("spawn the consumer");
    let socket = consumer.socket();

    println!("| size | bare shm (median) | storage facade (median) | storage / bare | rounds |");
    println!("| --- | --- | --- | --- | --- |");
    for (len, label, rounds) in SIZES {
        let rounds = ((rounds as f64 * scale) as usize).max(5);
        let mut data = vec![1u8; len];
        data[len - 1] = 2;
        for _ in 0..(rounds / 10).max(2) {
            bare(socket, &data);
            facade(socket, &data);
        }
        let (mut b, mut f) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
        for round in 0..rounds {
            if round % 2 == 0 {
                b.push(bare(socket, &data));
                f.push(facade(socket, &data));
            } else {
                f.push(facade(socket, &data));
                b.push(bare(socket, &data));
            }
        }
        let (mb, mf) = (median(b), median(f));
        println!(
            "| {label} | {:.1} µs | {:.1} µs | {:.3} | {rounds} |",
            mb.as_secs_f64() * 1e6,
            mf.as_secs_f64() * 1e6,
            mf.as_secs_f64() / mb.as_secs_f64()
        );
    }
    let _ = consumer.finish();
}
