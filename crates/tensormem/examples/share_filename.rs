//! Producer/consumer by name (PyTorch's `file_system` strategy).
//!
//! Run `cargo run -p tensormem --features manager --example share_filename`: the producer moves a
//! storage into a named, refcounted shm object registered with tensormem's shm manager daemon, adds
//! a reference for the name in transit, and starts this program again as the consumer with the name
//! on its command line. The consumer opens the name, takes over the in-transit reference, checks and
//! writes the bytes. The producer drops its storage first; the name stays while the consumer holds
//! it, and the consumer's close, the last, removes it.
//!
//! No daemon binary is needed: the first shared name starts the daemon from this program's own
//! image, through the start-up hook the `manager` feature links (docs/shm-manager.md, "Starting
//! without a binary"). `TENSORMEM_SHM_MANAGER` names a `tensormem-shm-manager` binary to use
//! instead.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};

use tensormem::storage::{FilenameHandle, ShmName, Storage};

const SIZE: usize = 1 << 20;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("share_filename: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, name, size] = args.as_slice() {
        if role == "consumer" {
            return consumer(name, size.parse()?);
        }
    }
    producer()
}

fn producer() -> Result<(), Box<dyn std::error::Error>> {
    let storage = Storage::from_vec((0..SIZE).map(|i| (i % 256) as u8).collect());
    let handle = storage.share_filename()?; // _share_filename_cpu_
    storage.shared_incref()?; // the reference of the message in transit
    println!(
        "producer: shared {} bytes as {} (refcount {:?})",
        handle.size,
        handle.name,
        storage.shared_refcount()
    );
    let mut consumer = Command::new(std::env::current_exe()?)
        .args(["consumer", handle.name.as_str(), &handle.size.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(consumer.stdout.take().ok_or("no stdout")?).lines();
    let opened = lines.next().ok_or("the consumer exited early")??;
    println!("{opened}");

    let mut first = [0u8; 1];
    storage.read_at(0, &mut first)?;
    assert_eq!(first, [0xFF], "the consumer's write is visible here");
    drop(storage); // the producer lets go first; the consumer still holds the name
    assert!(handle.name.path().exists());

    consumer
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(b"done\n")?;
    for line in lines {
        println!("{}", line?);
    }
    assert!(consumer.wait()?.success());
    assert!(
        !handle.name.path().exists(),
        "the last user removed the name"
    );
    println!("producer: the name is gone");
    Ok(())
}

fn consumer(name: &str, size: u64) -> Result<(), Box<dyn std::error::Error>> {
    let handle = FilenameHandle {
        manager_handle: Vec::new(),
        name: ShmName::new(name)?,
        size,
    };
    let storage = Storage::new_shared_filename(&handle)?; // _new_shared_filename_cpu
    storage.shared_decref()?; // took over the sender's reference
    let mut last = [0u8; 1];
    storage.read_at(storage.nbytes() - 1, &mut last)?;
    assert_eq!(last[0], ((SIZE - 1) % 256) as u8);
    storage.write_at(0, &[0xFF])?;
    println!("consumer: opened {name}, last byte {}", last[0]);
    std::io::stdout().flush()?;
    // Wait for the producer to let go, then close: ours is the last reference.
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    println!(
        "consumer: closing with refcount {:?} (the last user unlinks the name)",
        storage.shared_refcount()
    );
    Ok(())
}
