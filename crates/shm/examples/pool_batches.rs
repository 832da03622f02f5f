//! A producer lends batch after batch to a consumer process through the shared-memory pool.
//!
//! Run `cargo run -p tensormem-shm --example pool_batches`. The producer starts this program again as the
//! consumer, which connects and makes a [`PoolReceiver`]; the producer wraps its end in a
//! [`PoolSender`] and sends batches from a [`ShmPool`]. The first batch of a size makes a region and
//! sends its descriptor; every later one reuses a region the consumer has already mapped and travels
//! as an id on a shared-memory ring: no new object, no `mmap`, no page faults on either side. The
//! consumer's lease, once dropped, gives the region back.
//!
//! The socket belongs to the pool connection once it is wrapped: the application's own messages
//! go elsewhere (here, each batch carries a few bytes of its own as user data).
//!
//! Needs only `tensormem-shm = { path = ... }` (no features: the manager is not needed).

use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, ExitCode};

use tensormem_shm::{Error, PoolConfig, PoolReceiver, PoolSender, ReceiverOptions, ShmPool};

const BATCH: usize = 8 << 20;
const STEPS: u8 = 10;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("pool_batches: error: {error}");
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
    let dir = std::env::temp_dir().join(format!("tensormem-shm-pool-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket_path = dir.join("producer.sock");
    let listener = UnixListener::bind(&socket_path)?;
    let mut consumer = Command::new(std::env::current_exe()?)
        .arg("consumer")
        .arg(&socket_path)
        .spawn()?;
    let (socket, _) = listener.accept()?;

    let pool = ShmPool::new(PoolConfig::default());
    // Waits for the consumer's PoolReceiver to announce itself.
    let mut sender = PoolSender::new(&pool, socket)?;
    for step in 0..STEPS {
        let mut batch = pool.alloc(BATCH as u64)?;
        batch.fill(step)?; // the producer writes the batch in place
        sender.send(&batch, &[step])?; // the descriptor the first time, an id afterwards
        drop(batch); // the producer's share; the consumer's lease keeps the region lent
        sender.wait_release(None)?; // the consumer is done: the region is back in the pool
    }
    drop(sender); // the consumer sees the connection end

    let stats = pool.stats();
    println!(
        "producer: {STEPS} batches of {} MiB from {} region(s); {} cache hits",
        BATCH >> 20,
        stats.regions.allocated,
        stats.cache_hits
    );
    assert_eq!(stats.regions.allocated, 1, "one region served every batch");
    assert!(consumer.wait()?.success(), "the consumer failed");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn consumer(socket_path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let socket = UnixStream::connect(socket_path)?;
    let mut receiver = PoolReceiver::new(socket, ReceiverOptions::default())?;
    let mut steps = 0u8;
    loop {
        let lease = match receiver.recv() {
            Ok(lease) => lease,
            Err(Error::Disconnected) => break, // the producer is done
            Err(e) => return Err(e.into()),
        };
        let step = lease.user_data()[0];
        assert_eq!(lease.len(), BATCH);
        assert_eq!(
            lease.read_volatile(BATCH - 1)?,
            step,
            "batch {step}'s bytes"
        );
        steps += 1;
        drop(lease); // tells the producer
    }
    let stats = receiver.stats();
    println!(
        "consumer: {steps} batches, {} mapped, {} reached through the mapping cache",
        stats.mapped, stats.reused
    );
    assert_eq!((steps, stats.mapped), (STEPS, 1));
    Ok(())
}
