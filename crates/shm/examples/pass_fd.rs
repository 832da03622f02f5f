//! Two processes share one region by file descriptor (PyTorch's `file_descriptor` strategy).
//!
//! Run `cargo run -p tensormem-shm --example pass_fd`. The producer copies a buffer into a sealed
//! anonymous region, listens on a Unix socket and starts this program again as the consumer. The
//! consumer connects, receives the region's descriptor (`SCM_RIGHTS`), checks the bytes, writes into
//! the same memory and answers; the producer then reads the consumer's write. No copy crosses the
//! socket: both processes map the same pages.
//!
//! Needs only `tensormem-shm = { path = ... }` (no features: the manager is not needed).

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, ExitCode};

use tensormem_shm::transfer::{recv_region, send_region, SendOptions};
use tensormem_shm::{MapOptions, SharedRegion};

const SIZE: usize = 16 << 20;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("pass_fd: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    match args.as_slice() {
        [_, role, socket] if role == "consumer" => consumer(socket),
        _ => producer(),
    }
}

fn producer() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("tensormem-shm-fd-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket_path = dir.join("producer.sock");
    let listener = UnixListener::bind(&socket_path)?;

    // A buffer (a tensor's bytes, say) moved into shared memory: a sealed memfd, pre-faulted.
    let tensor: Vec<u8> = (0..SIZE).map(|i| (i % 251) as u8).collect();
    let shared = SharedRegion::copy_from_bytes(&tensor)?;

    let mut consumer = Command::new(std::env::current_exe()?)
        .arg("consumer")
        .arg(&socket_path)
        .spawn()?;
    let (mut socket, _) = listener.accept()?;

    // The descriptor, its length and a few bytes of our own travel in one message.
    send_region(
        &socket,
        &shared,
        SendOptions {
            user: b"weights",
            ..Default::default()
        },
    )?;
    let mut answer = [0u8; 1];
    socket.read_exact(&mut answer)?;
    assert_eq!(answer, [1], "the consumer saw the bytes");

    let mut first = [0u8; 1];
    shared.read_at(0, &mut first)?;
    assert_eq!(first, [0xFF], "the consumer's write is visible here");
    println!(
        "producer: shared {SIZE} bytes by descriptor; the consumer wrote {:#x} into them",
        first[0]
    );

    assert!(consumer.wait()?.success(), "the consumer failed");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn consumer(socket_path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut socket = UnixStream::connect(socket_path)?;
    // The descriptor is checked (kind, owner, size) before it is mapped.
    let mut received = recv_region(&socket, &MapOptions::new())?;
    let user = String::from_utf8_lossy(received.user_data()).into_owned();
    let region = &mut received.region;
    let mut last = [0u8; 1];
    region.read_at(region.len() - 1, &mut last)?;
    let ok = user == "weights" && region.len() == SIZE && last[0] == ((SIZE - 1) % 251) as u8;
    region.write_at(0, &[0xFF])?;
    println!(
        "consumer: received {} bytes ({user:?}), last byte {}",
        region.len(),
        last[0]
    );
    socket.write_all(&[u8::from(ok)])?;
    Ok(())
}
