//! Producer/consumer with recycled shared memory (the pooled path; no PyTorch equivalent).
//!
//! Run `cargo run -p tensormem --example share_pooled`: the producer listens on a Unix socket and
//! starts this program again as the consumer. It makes a fresh private batch per step, sends it
//! with `Storage::send_pooled` (moved into the producer's pool first) and drops it; the consumer
//! receives each as a storage over the producer's region, checks it, writes a byte back and drops
//! it, which gives the region back. One region serves every step, and after the first step only
//! its id travels: the consumer maps it once.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, ExitCode, Stdio};

use tensormem::storage::{PoolReceiver, PoolSender, ReceiverOptions, ShmPool, Storage};

const SIZE: usize = 8 << 20;
const STEPS: u8 = 16;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("share_pooled: error: {error}");
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

fn batch(step: u8) -> Vec<u8> {
    (0..SIZE).map(|i| (i % 251) as u8 ^ step).collect()
}

fn producer() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("tensormem-share-pooled-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket_path = dir.join("producer.sock");
    let listener = UnixListener::bind(&socket_path)?;
    let mut consumer = Command::new(std::env::current_exe()?)
        .arg("consumer")
        .arg(&socket_path)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(consumer.stdout.take().ok_or("no consumer stdout")?).lines();
    let (socket, _) = listener.accept()?;

    let pool = ShmPool::default();
    let mut sender = PoolSender::new(&pool, socket)?; // reads the consumer's hello
    for step in 0..STEPS {
        let storage = Storage::from_vec(batch(step)); // a fresh private batch
        storage.send_pooled(&mut sender, format!("batch {step}").as_bytes())?;
        let answer = lines.next().ok_or("the consumer went away")??;
        assert_eq!(answer, format!("checked {step}"));
        let mut first = [0u8; 1];
        storage.read_at(0, &mut first)?;
        assert_eq!(
            first,
            [0xF0 | (step & 0xF)],
            "the consumer's write is visible here"
        );
        drop(storage); // the producer's share; the region is back once the consumer's lease is
    }
    drop(sender); // the consumer reads end-of-file and exits
    let stats = pool.stats();
    println!(
        "producer: {STEPS} batches of {SIZE} bytes from {} region(s) ({} of {} requests served \
         from the cache)",
        stats.regions.allocated, stats.cache_hits, stats.requests
    );
    for line in lines {
        println!("{}", line?);
    }
    assert!(consumer.wait()?.success());
    assert_eq!(stats.regions.allocated, 1, "one region serves every batch");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn consumer(socket_path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let socket = UnixStream::connect(socket_path)?;
    let mut receiver = PoolReceiver::new(socket, ReceiverOptions::default())?; // sends the hello
    let mut out = std::io::stdout().lock();
    for step in 0..STEPS {
        let received = Storage::recv_pooled(&mut receiver)?;
        assert_eq!(received.metadata, format!("batch {step}").as_bytes());
        assert_eq!(received.storage.to_vec()?, batch(step));
        received.storage.write_at(0, &[0xF0 | (step & 0xF)])?;
        drop(received); // gives the lease back
        writeln!(out, "checked {step}")?;
        out.flush()?;
    }
    let stats = receiver.stats();
    writeln!(
        out,
        "consumer: mapped {} region(s), reached {} batches through the cached mapping",
        stats.mapped, stats.reused
    )?;
    Ok(())
}
