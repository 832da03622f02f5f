//! Producer -> consumer round trip in two processes: the producer sends a region over a Unix
//! socket, the consumer (a long-lived child: this bench binary re-executed) attaches it, reads the
//! first and last byte, drops it and answers one byte. The region is made and filled before the
//! timer; the timer covers send, attach, the two reads, detach and the answer.
//!
//! Two series: `fd_scm_rights` blocks in the kernel on both ends (the default `recv_region`);
//! `fd_scm_rights_spin` has both ends poll for up to [`SPIN`] before blocking
//! (`RecvOptions::spinning`), which saves the two cross-process wake-ups at the price of a busy
//! core on each side while waiting.
//!
//! Compare with `torch_sharing_bench.py` (torch.multiprocessing, fd and file_system strategies).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use tensormem_benches::sharing_harness::Consumer;
use tensormem_shm::transfer::{
    recv_exact, recv_region_with, send_region, RecvOptions, SendOptions,
};
use tensormem_shm::{MapOptions, SharedRegion};

const CONSUMER_SOCKET: &str = "TENSORMEM_BENCH_CONSUMER_SOCKET";

/// How long the spinning series polls before blocking.
const SPIN: Duration = Duration::from_micros(200);

const SIZES: [(u64, &str); 3] = [(4 << 10, "4KiB"), (1 << 20, "1MiB"), (64 << 20, "64MiB")];

/// The consumer: attach, read first and last byte, answer their sum, until the producer hangs up.
/// The application data of each message (a byte: 1 = spin) says how to wait for the next.
fn consumer(path: &str) {
    let mut socket = UnixStream::connect(path).expect("connect to producer");
    let options = MapOptions::new();
    let mut recv = RecvOptions::BLOCKING;
    while let Ok(received) = recv_region_with(&socket, &options, recv) {
        recv = if received.user_data() == [1] {
            RecvOptions::spinning(SPIN)
        } else {
            RecvOptions::BLOCKING
        };
        // Copies of the two bytes, not a slice: the producer may write the region again.
        let region = &received.region;
        let first = region.read_volatile(0).unwrap_or(0);
        let last = region.read_volatile(region.len() - 1).unwrap_or(0);
        let answer = first.wrapping_add(last);
        drop(received);
        if socket.write_all(&[answer]).is_err() {
            break;
        }
    }
}

fn round_trip(c: &mut Criterion) {
    let consumer = Consumer::spawn("shm_round_trip", |command, path| {
        command.env(CONSUMER_SOCKET, path);
    })
    .expect("spawn the consumer");
    let socket = consumer.socket();

    let mut group = c.benchmark_group("shm_round_trip");
    for (len, label) in SIZES {
        let mut region = SharedRegion::create_anonymous(len).expect("create");
        region.fill(1).expect("fill");
        region.write_at(len as usize - 1, &[2]).expect("write");
        group.throughput(Throughput::Elements(1));
        for (series, recv, flag) in [
            ("fd_scm_rights", RecvOptions::BLOCKING, 0u8),
            ("fd_scm_rights_spin", RecvOptions::spinning(SPIN), 1u8),
        ] {
            let message = SendOptions {
                user: &[flag],
                read_only: false,
            };
            group.bench_function(BenchmarkId::new(series, label), |b| {
                b.iter(|| {
                    send_region(socket, &region, message).expect("send");
                    let mut answer = [0u8; 1];
                    recv_exact(socket, &mut answer, recv).expect("answer");
                    assert_eq!(answer[0], 3);
                });
            });
        }
    }
    group.finish();
    let _ = consumer.finish();
}

fn main() {
    if let Some(path) = std::env::var_os(CONSUMER_SOCKET) {
        consumer(path.to_str().expect("utf-8 socket path"));
        return;
    }
    let mut criterion = Criterion::default().configure_from_args();
    round_trip(&mut criterion);
    criterion.final_summary();
}
