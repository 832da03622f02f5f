//! Pooled storages in one process: regions recycled through the facade, detached when their
//! descriptor is handed out raw, the pooled send/receive path, and its bad input.
//!
//! Every test uses a pool of its own (the process-wide pool's test is `tests/default_pool.rs`,
//! alone in its binary, so other tests cannot disturb its statistics).

mod common;

use std::os::unix::net::UnixStream;

use common::pooled::{pattern, pool};
use tensormem_storage::{
    storage_copy, Error, PoolReceiver, PoolSender, ReceiverOptions, ShmPool, Storage, StorageKind,
};

const MIB: usize = 1 << 20;

fn connection(pool: &ShmPool) -> (PoolSender, PoolReceiver) {
    let (producer_end, consumer_end) = UnixStream::pair().unwrap();
    let receiver = PoolReceiver::new(consumer_end, ReceiverOptions::default()).unwrap();
    let sender = PoolSender::new(pool, producer_end).unwrap();
    (sender, receiver)
}

#[test]
fn a_dropped_pooled_storage_returns_its_region_and_the_next_share_reuses_it() {
    let pool = pool();
    let a = Storage::from_vec(pattern(MIB, 1));
    a.share_memory_in(&pool).unwrap();
    assert_eq!(a.kind(), StorageKind::CpuPooled);
    assert_eq!(a.to_vec().unwrap(), pattern(MIB, 1));
    let region = a.pooled_region_id().unwrap();

    // A clone keeps the region in use; a weak reference does not.
    let clone = a.clone();
    let weak = a.weak_ref();
    drop(a);
    assert_eq!(pool.stats().in_use_bytes.current, MIB as u64);
    assert_eq!(pool.stats().cached_bytes.current, 0);
    drop(clone);
    assert!(weak.expired());
    let stats = pool.stats();
    assert_eq!(stats.in_use_bytes.current, 0);
    assert_eq!(stats.cached_bytes.current, MIB as u64);

    // Same size class: the same region, no new one; the bytes are the new storage's.
    let b = Storage::from_vec(pattern(MIB - 100, 2));
    b.share_memory_in(&pool).unwrap();
    assert_eq!(b.pooled_region_id(), Some(region));
    assert_eq!(b.to_vec().unwrap(), pattern(MIB - 100, 2));
    let stats = pool.stats();
    assert_eq!(stats.regions.allocated, 1);
    assert_eq!(stats.cache_hits, 1);
    assert_eq!(stats.requests, 2);

    // Another size class gets another region.
    let c = Storage::from_vec(pattern(8 * MIB, 3));
    c.share_memory_in(&pool).unwrap();
    assert_ne!(c.pooled_region_id(), Some(region));
    assert_eq!(pool.stats().regions.allocated, 2);
}

#[test]
fn a_storage_whose_descriptor_was_handed_out_is_never_recycled() {
    let pool = pool();
    type Handout = fn(&Storage);
    let handouts: [(&str, Handout); 3] = [
        ("share_fd", |s| drop(s.share_fd().unwrap())),
        ("get_shared_fd", |s| drop(s.get_shared_fd().unwrap())),
        ("send_shared_fd", |s| {
            let (a, b) = UnixStream::pair().unwrap();
            s.send_shared_fd(&a).unwrap();
            drop(Storage::recv_shared_fd(&b).unwrap());
        }),
    ];
    for (round, (op, handout)) in handouts.into_iter().enumerate() {
        let s = Storage::from_vec(pattern(MIB, 4));
        s.share_memory_in(&pool).unwrap();
        let clone = s.clone();
        handout(&s);
        // Detached: same memory and bytes, fd-backed now, for every clone.
        assert!(
            matches!(clone.kind(), StorageKind::CpuFd { sealed: true }),
            "{op}"
        );
        assert_eq!(clone.pooled_region_id(), None, "{op}");
        assert_eq!(clone.to_vec().unwrap(), pattern(MIB, 4), "{op}");
        let stats = pool.stats();
        assert_eq!(stats.detached, round as u64 + 1, "{op}");
        assert_eq!(stats.regions.current, 0, "{op}: the pool forgot the region");
        drop((s, clone));
        let stats = pool.stats();
        assert_eq!(stats.cached_bytes.current, 0, "{op}: nothing came back");
        assert_eq!(stats.cache_hits, 0, "{op}");
    }
    // So the next share_memory_ makes a new region.
    let s = Storage::from_vec(pattern(MIB, 5));
    s.share_memory_in(&pool).unwrap();
    assert_eq!(pool.stats().regions.allocated, 4);
    assert_eq!(pool.stats().cache_hits, 0);
}

#[test]
fn a_detached_region_shows_nothing_of_its_earlier_use() {
    let pool = pool();
    let first = Storage::from_vec(vec![0xAB; 3 * MIB]);
    first.share_memory_in(&pool).unwrap();
    drop(first);
    // A smaller storage of the same size class reuses the region, whose tail held 0xAB.
    let second = Storage::from_vec(vec![0x11; 3 * MIB - 4096]);
    second.share_memory_in(&pool).unwrap();
    assert_eq!(pool.stats().cache_hits, 1);
    let fd = second.get_shared_fd().unwrap();
    let object_len = std::fs::File::from(fd.try_clone().unwrap())
        .metadata()
        .unwrap()
        .len();
    assert!(object_len >= 3 * MIB as u64);
    // Whoever holds the descriptor maps the whole object: the part past the storage is zeros.
    let whole = Storage::new_shared_fd(&fd, object_len).unwrap();
    let bytes = whole.to_vec().unwrap();
    assert!(bytes[..3 * MIB - 4096].iter().all(|&b| b == 0x11));
    assert!(bytes[3 * MIB - 4096..].iter().all(|&b| b == 0));
}

#[test]
fn detaching_while_a_lease_is_out_keeps_the_lease_valid_and_never_reuses_the_region() {
    let pool = pool();
    let (mut sender, mut receiver) = connection(&pool);
    let s = Storage::from_vec(pattern(MIB, 6));
    s.send_pooled(&mut sender, b"t").unwrap();
    let received = Storage::recv_pooled(&mut receiver).unwrap().storage;
    drop(s.share_fd().unwrap());
    assert!(matches!(s.kind(), StorageKind::CpuFd { .. }));
    // Producer and consumer still share the memory.
    s.write_at(0, &[0x5A]).unwrap();
    assert_eq!(received.to_vec().unwrap()[0], 0x5A);
    drop(received);
    sender.wait_release(None).unwrap();
    drop(s);
    let stats = pool.stats();
    assert_eq!(stats.detached, 1);
    assert_eq!(stats.regions.current, 0);
    assert_eq!(stats.cached_bytes.current, 0);
}

#[test]
fn pooled_send_and_receive_share_memory_and_recycle_regions() {
    let pool = pool();
    let (mut sender, mut receiver) = connection(&pool);
    let mut regions = Vec::new();
    for step in 0..5u8 {
        let batch = Storage::from_vec(pattern(2 * MIB, step));
        batch.send_pooled(&mut sender, &[step; 16]).unwrap();
        let got = Storage::recv_pooled(&mut receiver).unwrap();
        assert_eq!(got.metadata, [step; 16]);
        assert_eq!(got.storage.kind(), StorageKind::CpuPooledLease);
        assert!(got.storage.is_shared());
        assert_eq!(got.storage.nbytes(), 2 * MIB);
        assert_eq!(got.storage.to_vec().unwrap(), pattern(2 * MIB, step));
        // The same memory both ways.
        got.storage.write_at(7, &[0xC3]).unwrap();
        assert_eq!(batch.to_vec().unwrap()[7], 0xC3);
        batch.write_at(8, &[0x3C]).unwrap();
        assert_eq!(got.storage.to_vec().unwrap()[8], 0x3C);
        regions.push(got.storage.pooled_region_id().unwrap());
        assert_eq!(got.storage.pooled_region_id(), batch.pooled_region_id());

        // A clone of the received storage holds the lease; the last clone releases it.
        let clone = got.storage.clone();
        drop(got);
        drop(batch);
        assert_eq!(sender.poll_releases().unwrap(), 0);
        assert_eq!(pool.stats().in_use_bytes.current, 2 * MIB as u64);
        drop(clone);
        assert_eq!(sender.wait_release(None).unwrap(), 1);
        assert_eq!(pool.stats().in_use_bytes.current, 0);
    }
    assert!(regions.iter().all(|&id| id == regions[0]), "{regions:?}");
    assert_eq!(pool.stats().regions.allocated, 1);
    assert_eq!(pool.stats().cache_hits, 4);
    assert_eq!(sender.stats().sent_fd, 1);
    assert_eq!(sender.stats().sent_id, 4);
    assert_eq!(receiver.stats().mapped, 1);
    assert_eq!(receiver.stats().reused, 4);
}

#[test]
fn a_pooled_storage_is_sent_to_several_consumers_and_comes_back_after_all() {
    let pool = pool();
    let (mut s1, mut r1) = connection(&pool);
    let (mut s2, mut r2) = connection(&pool);
    let batch = Storage::new_pooled(&pool, 5000).unwrap();
    assert!(batch.to_vec().unwrap().iter().all(|&b| b == 0));
    batch.fill(9).unwrap();
    batch.send_pooled(&mut s1, b"").unwrap();
    batch.send_pooled(&mut s2, b"").unwrap();
    drop(batch);
    let a = Storage::recv_pooled(&mut r1).unwrap().storage;
    let b = Storage::recv_pooled(&mut r2).unwrap().storage;
    assert_eq!(a.to_vec().unwrap(), vec![9; 5000]);
    assert_eq!(b.to_vec().unwrap(), vec![9; 5000]);
    drop(a);
    s1.wait_release(None).unwrap();
    s2.poll_releases().unwrap();
    assert_eq!(pool.stats().cached_bytes.current, 0, "b still holds it");
    drop(b);
    s2.wait_release(None).unwrap();
    assert!(pool.stats().cached_bytes.current > 0);
}

#[test]
fn a_received_storage_shared_again_by_descriptor_moves_and_gives_the_lease_back() {
    let pool = pool();
    let (mut sender, mut receiver) = connection(&pool);
    let batch = Storage::from_vec(pattern(MIB, 7));
    batch.send_pooled(&mut sender, b"").unwrap();
    drop(batch);
    let got = Storage::recv_pooled(&mut receiver).unwrap().storage;
    // No raw descriptor of the producer's region leaves the consumer.
    assert!(matches!(got.get_shared_fd(), Err(Error::NotShared { .. })));
    let handle = got.share_fd().unwrap();
    assert!(matches!(got.kind(), StorageKind::CpuFd { sealed: true }));
    assert_eq!(handle.size(), MIB as u64);
    assert_eq!(got.to_vec().unwrap(), pattern(MIB, 7));
    sender.wait_release(None).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.in_use_bytes.current, 0);
    assert_eq!(stats.detached, 0, "the producer's region stays in its pool");
    assert_eq!(stats.cached_bytes.current, MIB as u64);
}

#[test]
fn bad_input_to_the_pooled_path_is_a_typed_error_and_lends_nothing() {
    let pool = pool();
    let (mut sender, mut receiver) = connection(&pool);

    // Metadata longer than a message holds.
    let s = Storage::from_vec(pattern(4096, 8));
    let err = s.send_pooled(&mut sender, &[0; 217]).unwrap_err();
    assert!(
        matches!(err, Error::Shm(tensormem_shm::Error::Protocol { .. })),
        "{err}"
    );
    assert_eq!(sender.outstanding(), 0);

    // Zero bytes.
    let empty = Storage::new(0);
    assert!(matches!(
        empty.send_pooled(&mut sender, b""),
        Err(Error::Empty { .. })
    ));
    assert!(matches!(
        Storage::new_pooled(&pool, 0),
        Err(Error::Empty { .. })
    ));

    // Memory outside the pool: fd-backed storages.
    let fd_backed = Storage::new_shared_fd_storage(4096).unwrap();
    let err = fd_backed.send_pooled(&mut sender, b"").unwrap_err();
    assert!(matches!(err, Error::NotShared { .. }), "{err}");
    assert!(err.to_string().contains("storage_copy"), "{err}");

    // A storage of another pool.
    let other = pool_other();
    let foreign = Storage::from_vec(pattern(4096, 9));
    foreign.share_memory_in(&other).unwrap();
    let err = foreign.send_pooled(&mut sender, b"").unwrap_err();
    assert!(matches!(err, Error::NotShared { .. }), "{err}");
    assert!(err.to_string().contains("another pool"), "{err}");
    assert_eq!(sender.outstanding(), 0);

    // A received lease cannot be lent on.
    s.send_pooled(&mut sender, b"").unwrap();
    let got = Storage::recv_pooled(&mut receiver).unwrap().storage;
    let (mut sender2, _receiver2) = connection(&pool);
    let err = got.send_pooled(&mut sender2, b"").unwrap_err();
    assert!(matches!(err, Error::NotShared { .. }), "{err}");
    assert_eq!(sender2.outstanding(), 0);

    // Copies between a lease and other storages work (the way to send it on).
    let copy = Storage::new(4096);
    storage_copy(&copy, &got, false).unwrap();
    assert_eq!(copy.to_vec().unwrap(), pattern(4096, 8));
    copy.send_pooled(&mut sender2, b"").unwrap();

    // Out-of-range access of a received storage.
    assert!(matches!(
        got.read_at(4090, &mut [0; 7]),
        Err(Error::OutOfBounds { .. })
    ));

    // A consumer that went away: Disconnected, nothing lent.
    drop((got, receiver));
    sender.wait_release(None).unwrap();
    let err = s.send_pooled(&mut sender, b"").unwrap_err();
    assert!(
        matches!(err, Error::Shm(tensormem_shm::Error::Disconnected)),
        "{err}"
    );
    assert_eq!(sender.outstanding(), 0);

    // A producer that went away: Disconnected on the consumer's side.
    let (sender3, mut receiver3) = connection(&pool);
    drop(sender3);
    assert!(matches!(
        Storage::recv_pooled(&mut receiver3),
        Err(Error::Shm(tensormem_shm::Error::Disconnected))
    ));
}

fn pool_other() -> ShmPool {
    pool()
}
