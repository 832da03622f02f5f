//! Producer/consumer by file descriptor (PyTorch's `file_descriptor` strategy).
//!
//! Run `cargo run -p tensormem --example share_fd`: the producer listens on a Unix socket and
//! starts this program again as the consumer, which connects, receives the storage's
//! descriptor, checks the bytes, writes into them and answers; the producer then sees the write.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, ExitCode};

use tensormem::Storage;

const SIZE: usize = 16 << 20;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("share_fd: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, socket] = args.as_slice() {
        if role == "consumer" {
            return consumer(socket);
        }
    }
    producer()
}

fn producer() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("tensormem-share-fd-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket_path = dir.join("producer.sock");
    let listener = UnixListener::bind(&socket_path)?;

    // A private storage, e.g. a tensor's weights.
    let storage = Storage::from_vec((0..SIZE).map(|i| (i % 256) as u8).collect());
    let mut consumer = Command::new(std::env::current_exe()?)
        .arg("consumer")
        .arg(&socket_path)
        .spawn()?;
    let (mut socket, _) = listener.accept()?;

    // share_memory_ + _share_fd_cpu_ + send the descriptor (SCM_RIGHTS), in one call.
    storage.send_shared_fd(&socket)?;
    let mut answer = [0u8; 1];
    socket.read_exact(&mut answer)?;
    assert_eq!(answer, [1], "the consumer saw the bytes");
    let mut first = [0u8; 1];
    storage.read_at(0, &mut first)?;
    assert_eq!(first, [0xFF], "the consumer's write is visible here");
    println!(
        "producer: shared {SIZE} bytes by descriptor; the consumer wrote {:#x} into them",
        first[0]
    );

    assert!(consumer.wait()?.success());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn consumer(socket_path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut socket = UnixStream::connect(socket_path)?;
    // _new_shared_fd_cpu: the descriptor is checked (kind, owner, size) before it is mapped.
    let storage = Storage::recv_shared_fd(&socket)?;
    let mut last = [0u8; 1];
    storage.read_at(storage.nbytes() - 1, &mut last)?;
    let ok = storage.nbytes() == SIZE && last[0] == ((SIZE - 1) % 256) as u8;
    storage.write_at(0, &[0xFF])?;
    println!(
        "consumer: received {} bytes, last byte {}",
        storage.nbytes(),
        last[0]
    );
    socket.write_all(&[u8::from(ok)])?;
    Ok(())
}
