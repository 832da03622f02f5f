//! The pooled path between real processes: a consumer process receives storages sent with
//! `send_pooled`, writes back, releases; a consumer killed with `kill -9` while holding storages
//! gets its leases reclaimed and the regions reused.
//!
//! Children are this test binary run again on one test (tests/common/child.rs); each test first
//! asks whether it is a child and if so plays its role.

mod common;

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::ChildStdout;

use common::child::{role, spawn};
use common::pooled::{pattern, pool};
use tensormem_storage::{PoolReceiver, PoolSender, ReceiverOptions, ShmPool, Storage, StorageKind};
use tensormem_test_support::child::{hold, next_report, report, Peer};

const MIB: usize = 1 << 20;
const BATCHES: u8 = 4;

/// The consumer: receives `BATCHES` storages; in mode "release" checks and answers each, then
/// drops it; in mode "hold" keeps them all and waits to be killed.
fn consumer(arg: &str) {
    let (mode, socket) = arg.split_once(':').unwrap();
    let stream = UnixStream::connect(socket).unwrap();
    let mut receiver = PoolReceiver::new(stream, ReceiverOptions::default()).unwrap();
    let mut held = Vec::new();
    for step in 0..BATCHES {
        let got = Storage::recv_pooled(&mut receiver).unwrap();
        assert_eq!(got.storage.kind(), StorageKind::CpuPooledLease);
        assert_eq!(got.metadata, format!("batch {step}").as_bytes());
        assert_eq!(got.storage.to_vec().unwrap(), pattern(MIB, step));
        if mode == "hold" {
            held.push(got.storage);
            continue;
        }
        got.storage.write_at(0, &[0xF0 | step]).unwrap();
        report(&format!("read {step}"));
        drop(got);
    }
    let stats = receiver.stats();
    report(&format!(
        "mapped {} reused {} held {}",
        stats.mapped,
        stats.reused,
        held.len()
    ));
    hold();
}

/// A consumer child in `mode`, connected to a sender of `pool`.
fn connect(
    pool: &ShmPool,
    test: &str,
    mode: &str,
) -> (Peer, BufReader<ChildStdout>, PoolSender, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (child, out) = spawn(
        test,
        "consumer",
        &format!("{mode}:{}", path.to_str().unwrap()),
    );
    let (stream, _) = listener.accept().unwrap();
    (child, out, PoolSender::new(pool, stream).unwrap(), dir)
}

#[test]
fn pooled_storages_travel_between_processes_and_their_regions_are_recycled() {
    if let Some((_, arg)) = role() {
        return consumer(&arg);
    }
    let pool = pool();
    let (mut child, mut out, mut sender, _dir) = connect(
        &pool,
        "pooled_storages_travel_between_processes_and_their_regions_are_recycled",
        "release",
    );
    for step in 0..BATCHES {
        let batch = Storage::from_vec(pattern(MIB, step));
        batch
            .send_pooled(&mut sender, format!("batch {step}").as_bytes())
            .unwrap();
        assert_eq!(next_report(&mut out), format!("read {step}"));
        assert_eq!(
            batch.to_vec().unwrap()[0],
            0xF0 | step,
            "the consumer's write"
        );
        drop(batch);
        sender.wait_release(None).unwrap();
    }
    assert_eq!(
        next_report(&mut out),
        format!("mapped 1 reused {} held 0", BATCHES - 1)
    );
    let stats = pool.stats();
    assert_eq!(stats.regions.allocated, 1);
    assert_eq!(stats.cache_hits, u64::from(BATCHES) - 1);
    assert_eq!(sender.stats().sent_fd, 1);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_consumer_killed_while_holding_pooled_storages_gives_them_back() {
    if let Some((_, arg)) = role() {
        return consumer(&arg);
    }
    let pool = pool();
    let (mut child, mut out, mut sender, _dir) = connect(
        &pool,
        "a_consumer_killed_while_holding_pooled_storages_gives_them_back",
        "hold",
    );
    let mut regions = Vec::new();
    for step in 0..BATCHES {
        let batch = Storage::from_vec(pattern(MIB, step));
        batch
            .send_pooled(&mut sender, format!("batch {step}").as_bytes())
            .unwrap();
        regions.push(batch.pooled_region_id().unwrap());
        drop(batch); // the producer's share; the consumer's leases keep the regions
    }
    assert_eq!(
        next_report(&mut out),
        format!("mapped {BATCHES} reused 0 held {BATCHES}")
    );
    assert_eq!(
        pool.stats().in_use_bytes.current,
        u64::from(BATCHES) * MIB as u64
    );
    assert_eq!(sender.outstanding(), usize::from(BATCHES));

    child.kill9(); // SIGKILL
    while sender.is_connected() {
        sender.wait_release(None).unwrap();
    }
    assert_eq!(sender.stats().reclaimed, u64::from(BATCHES));
    assert_eq!(sender.outstanding(), 0);
    let stats = pool.stats();
    assert_eq!(stats.in_use_bytes.current, 0);
    assert_eq!(stats.cached_bytes.current, u64::from(BATCHES) * MIB as u64);

    // The reclaimed regions serve the next share_memory_ (no new region).
    let next = Storage::from_vec(pattern(MIB, 9));
    next.share_memory_in(&pool).unwrap();
    assert!(regions.contains(&next.pooled_region_id().unwrap()));
    assert_eq!(pool.stats().regions.allocated, u64::from(BATCHES));
    assert_eq!(next.to_vec().unwrap(), pattern(MIB, 9));
}
