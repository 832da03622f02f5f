//! The pool between real processes: consumers and producers killed with `SIGKILL` while they
//! hold leases. This test binary re-executes itself as the other process (role in an environment
//! variable), hence its own `main`.
//!
//! Run with `cargo test -p tensormem-shm --test pool_processes [-- FILTER]`.

use std::io::{BufRead, BufReader};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{ChildStdout, Stdio};
use std::time::Duration;

use tensormem_shm::mapping_cache::{PoolReceiver, ReceiverOptions};
use tensormem_shm::pool::{PoolConfig, PoolSender, ShmPool};
use tensormem_shm::Error;
use tensormem_test_support::child::{self, Peer};
use tensormem_test_support::harness::{self, RoleResult, Test};

const ROLE: &str = "TENSORMEM_POOL_TEST_ROLE";
const SOCKET: &str = "TENSORMEM_POOL_TEST_SOCKET";
const COUNT: &str = "TENSORMEM_POOL_TEST_COUNT";
const MIB: u64 = 1 << 20;

const TESTS: &[Test] = &[
    (
        "consumer_killed_with_open_leases_gives_them_back",
        consumer_killed_with_open_leases_gives_them_back,
    ),
    (
        "consumers_killed_again_and_again_leave_nothing_stuck",
        consumers_killed_again_and_again_leave_nothing_stuck,
    ),
    (
        "producer_killed_leaves_readable_leases_and_no_objects",
        producer_killed_leaves_readable_leases_and_no_objects,
    ),
    (
        "a_region_sent_again_is_mapped_once_by_another_process",
        a_region_sent_again_is_mapped_once_by_another_process,
    ),
];

fn main() {
    harness::main(ROLE, run_role, TESTS, None);
}

// ---------------------------------------------------------------------------------------------
// Parent side

/// A child process of this binary; killed (SIGKILL) if the test ends before it exits.
struct ChildProc {
    child: Peer,
    stdout: BufReader<ChildStdout>,
}

impl ChildProc {
    fn spawn(role: &str, socket: &PathBuf, count: u32) -> Self {
        let (child, stdout) = child::spawn(
            child::this_binary()
                .env(ROLE, role)
                .env(SOCKET, socket)
                .env(COUNT, count.to_string())
                .stdin(Stdio::null()),
        );
        Self { child, stdout }
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    fn kill_9(&mut self) {
        self.child.kill9();
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

struct Listener {
    path: PathBuf,
    listener: UnixListener,
}

impl Listener {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "tensormem-pool-test-{}-{n}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        Self { path, listener }
    }

    fn accept(&self) -> UnixStream {
        self.listener.accept().unwrap().0
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `/dev/shm` entries whose name mentions `pid` (what a leak by that process would look like).
fn shm_entries_of(pid: u32) -> Vec<String> {
    let needle = format!("_{pid}_");
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.contains(&needle))
                .collect()
        })
        .unwrap_or_default()
}

fn pool() -> ShmPool {
    ShmPool::new(PoolConfig {
        idle_release: None,
        threads: 2,
        ..PoolConfig::default()
    })
}

fn consumer_killed_with_open_leases_gives_them_back() {
    let pool = pool();
    let listener = Listener::new();
    let mut child = ChildProc::spawn("hold_leases", &listener.path, 3);
    let mut sender = PoolSender::new(&pool, listener.accept()).unwrap();
    let mut ids = Vec::new();
    for i in 0..3u8 {
        let mut buffer = pool.alloc(MIB).unwrap();
        buffer.fill(10 + i).unwrap();
        ids.push(buffer.id());
        sender.send(&buffer, &[]).unwrap();
    }
    // The child read every region (10 + 11 + 12) and now holds the three leases.
    assert_eq!(child.line(), "held 33");
    sender.poll_releases().unwrap();
    assert_eq!(sender.outstanding(), 3);
    assert_eq!(pool.stats().in_use_bytes.current, 3 * MIB);
    // Meanwhile nothing it holds is lent again.
    let fresh = pool.alloc(MIB).unwrap();
    assert!(!ids.contains(&fresh.id()));
    drop(fresh);

    let pid = child.pid();
    child.kill_9();
    // The kernel closed the dead consumer's socket: every open lease comes back.
    assert_eq!(sender.wait_release(None).unwrap(), 3);
    assert!(!sender.is_connected());
    assert_eq!(sender.stats().reclaimed, 3);
    let stats = pool.stats();
    assert_eq!(stats.in_use_bytes.current, 0);
    assert_eq!(stats.cached_bytes.current, 4 * MIB);
    // Reclaimed regions went back last, so they are lent first.
    let reused = pool.alloc(MIB).unwrap();
    assert!(ids.contains(&reused.id()));
    assert!(shm_entries_of(pid).is_empty());
    assert!(shm_entries_of(std::process::id()).is_empty());
}

fn consumers_killed_again_and_again_leave_nothing_stuck() {
    let pool = pool();
    let listener = Listener::new();
    for round in 0..8 {
        let mut child = ChildProc::spawn("hold_leases", &listener.path, 2);
        let mut sender = PoolSender::new(&pool, listener.accept()).unwrap();
        let buffers: Vec<_> = (0..2).map(|_| pool.alloc(4 * MIB).unwrap()).collect();
        for buffer in &buffers {
            sender.send(buffer, &[]).unwrap();
        }
        drop(buffers);
        assert_eq!(child.line(), "held 0", "round {round}");
        child.kill_9();
        assert_eq!(sender.wait_release(None).unwrap(), 2, "round {round}");
        assert_eq!(pool.stats().in_use_bytes.current, 0, "round {round}");
    }
    let stats = pool.stats();
    // Two regions, made once, lent in every round.
    assert_eq!(stats.regions.allocated, 2);
    assert_eq!(stats.cache_hits, 14);
    assert_eq!(stats.abandoned, 0);
}

fn producer_killed_leaves_readable_leases_and_no_objects() {
    let listener = Listener::new();
    let mut child = ChildProc::spawn("produce_and_hang", &listener.path, 2);
    let mut receiver = PoolReceiver::new(listener.accept(), ReceiverOptions::default()).unwrap();
    let first = receiver.recv().unwrap();
    let second = receiver.recv().unwrap();
    assert_eq!(child.line(), "sent");
    assert_eq!(receiver.cached_regions(), 2);
    let pid = child.pid();
    child.kill_9();
    assert!(matches!(receiver.recv(), Err(Error::Disconnected)));
    assert_eq!(
        receiver.cached_regions(),
        0,
        "mappings of a dead producer are dropped"
    );
    // What the consumer holds stays readable: the memory lives while mapped.
    assert!(first.to_vec().unwrap().iter().all(|&b| b == 5));
    assert!(second.to_vec().unwrap().iter().all(|&b| b == 6));
    assert!(first.release().is_err(), "nobody to give it back to");
    drop(second);
    assert!(shm_entries_of(pid).is_empty());
}

fn a_region_sent_again_is_mapped_once_by_another_process() {
    let pool = pool();
    let listener = Listener::new();
    let mut child = ChildProc::spawn("read_and_release", &listener.path, 0);
    let mut sender = PoolSender::new(&pool, listener.accept()).unwrap();
    for step in 0..50u8 {
        let mut buffer = pool.alloc(MIB).unwrap();
        buffer.fill(step).unwrap();
        sender.send(&buffer, &[step]).unwrap();
        drop(buffer);
        assert_eq!(sender.wait_release(None).unwrap(), 1);
    }
    drop(sender);
    assert_eq!(child.line(), "ok mapped 1 reused 49");
    assert_eq!(pool.stats().regions.allocated, 1);
}

// ---------------------------------------------------------------------------------------------
// Child side

fn run_role(role: &str) -> RoleResult {
    let path = std::env::var(SOCKET)?;
    let count: u32 = std::env::var(COUNT)?.parse()?;
    let socket = UnixStream::connect(path)?;
    match role {
        "hold_leases" => {
            let mut receiver = PoolReceiver::new(socket, ReceiverOptions::default())?;
            let mut leases = Vec::new();
            let mut sum = 0u32;
            for _ in 0..count {
                let lease = receiver.recv()?;
                sum += u32::from(lease.read_volatile(lease.len() - 1)?);
                leases.push(lease);
            }
            println!("held {sum}");
            std::thread::sleep(Duration::from_secs(120));
            Err("not killed".into())
        }
        "produce_and_hang" => {
            let pool = pool();
            let mut sender = PoolSender::new(&pool, socket)?;
            let mut buffers = Vec::new();
            for i in 0..count {
                let mut buffer = pool.alloc(MIB)?;
                buffer.fill(5 + i as u8)?;
                sender.send(&buffer, &[])?;
                buffers.push(buffer);
            }
            println!("sent");
            std::thread::sleep(Duration::from_secs(120));
            Err("not killed".into())
        }
        "read_and_release" => {
            let mut receiver = PoolReceiver::new(socket, ReceiverOptions::default())?;
            loop {
                match receiver.recv() {
                    Ok(lease) => {
                        let step = lease.user_data()[0];
                        if lease.read_volatile(0)? != step
                            || lease.read_volatile(lease.len() - 1)? != step
                        {
                            return Err(format!("step {step}: wrong bytes").into());
                        }
                    }
                    Err(Error::Disconnected) => break,
                    Err(err) => return Err(err.into()),
                }
            }
            let stats = receiver.stats();
            println!("ok mapped {} reused {}", stats.mapped, stats.reused);
            Ok(())
        }
        other => Err(format!("unknown role {other}").into()),
    }
}
