//! The shared-memory pool and the consumer's mapping cache, both ends in one process (connected
//! by socket pairs). Real processes and `kill -9` are in `pool_processes.rs`.

use std::os::unix::net::UnixStream;

use tensormem_shm::channel::{Channel, ChannelOptions, MAX_MESSAGE};
use tensormem_shm::mapping_cache::{CacheLimits, PoolReceiver, ReceiverOptions};
use tensormem_shm::pool::{PoolConfig, PoolSender, ShmPool};
use tensormem_shm::{Access, Error};

const MIB: u64 = 1 << 20;

fn connect(pool: &ShmPool, options: ReceiverOptions) -> (PoolSender, PoolReceiver) {
    let (producer, consumer) = UnixStream::pair().unwrap();
    let receiver = PoolReceiver::new(consumer, options).unwrap();
    let sender = PoolSender::new(pool, producer).unwrap();
    (sender, receiver)
}

fn small_pool() -> ShmPool {
    ShmPool::new(PoolConfig {
        threads: 2,
        idle_release: None,
        ..PoolConfig::default()
    })
}

#[test]
fn a_region_comes_back_only_when_every_holder_released_it() {
    let pool = small_pool();
    let (mut to_a, mut a) = connect(&pool, ReceiverOptions::default());
    let (mut to_b, mut b) = connect(&pool, ReceiverOptions::default());
    let mut buffer = pool.alloc(MIB).unwrap();
    buffer.fill(7).unwrap();
    let first_id = buffer.id();
    to_a.send(&buffer, b"a").unwrap();
    to_b.send(&buffer, b"b").unwrap();
    drop(buffer);
    let lease_a = a.recv().unwrap();
    let lease_b = b.recv().unwrap();
    assert_eq!(lease_a.read_volatile(0).unwrap(), 7);
    assert_eq!(lease_b.user_data(), b"b");

    // Both consumers still hold it: a new request gets another region.
    let other = pool.alloc(MIB).unwrap();
    assert_ne!(other.id(), first_id);
    drop(other);
    assert_eq!(pool.stats().regions.current, 2);

    drop(lease_a);
    assert_eq!(to_a.wait_release(None).unwrap(), 1);
    assert_eq!(to_a.outstanding(), 0);
    assert_eq!(pool.stats().in_use_bytes.current, MIB, "b still holds it");
    let again = pool.alloc(MIB).unwrap();
    assert_ne!(again.id(), first_id, "never lent while a consumer holds it");
    drop(again);

    drop(lease_b);
    assert_eq!(to_b.wait_release(None).unwrap(), 1);
    let stats = pool.stats();
    assert_eq!(stats.in_use_bytes.current, 0);
    assert_eq!(stats.cached_bytes.current, 2 * MIB);
    assert_eq!(stats.reserved_bytes.current, 2 * MIB);
    // LIFO: the region that came back last is lent first.
    assert_eq!(pool.alloc(MIB).unwrap().id(), first_id);
}

#[test]
fn a_known_region_travels_as_an_id_and_reuses_the_mapping() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    for step in 0..20u8 {
        let mut buffer = pool.alloc(MIB).unwrap();
        buffer.fill(step).unwrap();
        buffer.write_at(MIB as usize - 1, &[step ^ 0xFF]).unwrap();
        sender.send(&buffer, &[step]).unwrap();
        drop(buffer);
        let lease = receiver.recv().unwrap();
        assert_eq!(lease.user_data(), &[step]);
        assert_eq!(lease.len(), MIB as usize);
        assert_eq!(lease.read_volatile(0).unwrap(), step);
        assert_eq!(lease.read_volatile(MIB as usize - 1).unwrap(), step ^ 0xFF);
        drop(lease);
        assert_eq!(sender.wait_release(None).unwrap(), 1);
    }
    assert_eq!(sender.stats().sent_fd, 1);
    assert_eq!(sender.stats().sent_id, 19);
    assert_eq!(receiver.stats().mapped, 1);
    assert_eq!(receiver.stats().reused, 19);
    let stats = pool.stats();
    assert_eq!(stats.regions.allocated, 1);
    assert_eq!(stats.requests, 20);
    assert_eq!(stats.cache_hits, 19);
}

#[test]
fn a_smaller_request_of_the_same_class_reuses_the_region_and_bounds_the_lease() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let buffer = pool.alloc(MIB).unwrap();
    let id = buffer.id();
    drop(buffer);
    let mut smaller = pool.alloc(MIB - 100).unwrap();
    assert_eq!(smaller.id(), id);
    assert_eq!(smaller.len(), (MIB - 100) as usize);
    assert_eq!(smaller.capacity(), MIB as usize);
    assert!(matches!(
        smaller.write_at(smaller.len(), &[1]),
        Err(Error::OutOfBounds { .. })
    ));
    smaller.fill(3).unwrap();
    sender.send(&smaller, &[]).unwrap();
    let lease = receiver.recv().unwrap();
    assert_eq!(lease.len(), (MIB - 100) as usize);
    assert!(matches!(
        lease.read_volatile(lease.len()),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(lease.to_vec().unwrap().iter().all(|&b| b == 3));
}

#[test]
fn the_consumer_cache_is_bounded_and_mirrored_by_the_producer() {
    let pool = small_pool();
    let limits = CacheLimits {
        max_regions: 2,
        max_bytes: 64 * MIB,
    };
    let options = ReceiverOptions {
        limits,
        ..ReceiverOptions::default()
    };
    let (mut sender, mut receiver) = connect(&pool, options);
    // Three regions held at once by the producer, sent one after another.
    let buffers: Vec<_> = (0..3u8)
        .map(|i| {
            let mut b = pool.alloc(MIB).unwrap();
            b.fill(i).unwrap();
            b
        })
        .collect();
    for round in 0..3 {
        for (i, buffer) in buffers.iter().enumerate() {
            sender.send(buffer, &[]).unwrap();
            let lease = receiver.recv().unwrap();
            assert_eq!(lease.read_volatile(0).unwrap(), i as u8, "round {round}");
            drop(lease);
            sender.wait_release(None).unwrap();
            assert!(receiver.cached_regions() <= 2);
            assert_eq!(receiver.cached_regions(), sender.known_regions());
        }
    }
    // Round-robin over 3 regions with room for 2: every send evicts and maps again.
    assert_eq!(sender.stats().sent_fd, 9);
    assert_eq!(sender.stats().forgotten, 7);
    assert_eq!(receiver.stats().forgotten, 7);
}

#[test]
fn a_full_cache_of_leased_regions_sends_transient_regions() {
    let pool = small_pool();
    let options = ReceiverOptions {
        limits: CacheLimits {
            max_regions: 1,
            max_bytes: 64 * MIB,
        },
        ..ReceiverOptions::default()
    };
    let (mut sender, mut receiver) = connect(&pool, options);
    let a = pool.alloc(MIB).unwrap();
    let b = pool.alloc(MIB).unwrap();
    sender.send(&a, &[]).unwrap();
    let lease_a = receiver.recv().unwrap();
    sender.send(&b, &[]).unwrap(); // a is leased: cannot be evicted
    let lease_b = receiver.recv().unwrap();
    assert_eq!(sender.stats().sent_transient, 1);
    assert_eq!(receiver.cached_regions(), 1);
    drop((lease_a, lease_b));
    assert_eq!(
        sender.wait_release(None).unwrap() + sender.poll_releases().unwrap(),
        2
    );
    // b was not cached: sending it again carries its fd again, and now evicts a.
    sender.send(&b, &[]).unwrap();
    drop(receiver.recv().unwrap());
    assert_eq!(sender.stats().sent_fd, 3);
    assert_eq!(receiver.cached_regions(), 1);
}

#[test]
fn regions_the_pool_releases_are_forgotten_by_the_consumer() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let buffer = pool.alloc(MIB).unwrap();
    sender.send(&buffer, &[]).unwrap();
    drop(buffer);
    drop(receiver.recv().unwrap());
    sender.wait_release(None).unwrap();
    assert_eq!(receiver.cached_regions(), 1);
    assert_eq!(pool.trim(), MIB);
    assert_eq!(pool.stats().reserved_bytes.current, 0);
    assert_eq!(pool.stats().trimmed, 1);
    // The pool told the consumer at once, without the producer sending anything.
    assert_eq!(sender.known_regions(), 0);
    assert_eq!(sender.stats().forgotten, 1);
    assert_eq!(receiver.poll().unwrap(), 1);
    assert_eq!(receiver.cached_regions(), 0);
    assert_eq!(receiver.stats().forgotten, 1);
    assert_eq!(receiver.poll().unwrap(), 0);

    // A region message met by poll is kept for the next recv.
    let next = pool.alloc(2 * MIB).unwrap();
    sender.send(&next, &[]).unwrap();
    assert_eq!(receiver.poll().unwrap(), 0);
    let lease = receiver.recv().unwrap();
    assert_eq!(receiver.cached_regions(), 1);
    assert_eq!(lease.len(), 2 * MIB as usize);
    drop(lease);
    drop(next);
    sender.wait_release(None).unwrap();

    // Eviction by the cache limit is a release too.
    let small = ShmPool::new(PoolConfig {
        max_cached_bytes: 0,
        idle_release: None,
        threads: 1,
        ..PoolConfig::default()
    });
    let (mut sender, mut receiver) = connect(&small, ReceiverOptions::default());
    let buffer = small.alloc(MIB).unwrap();
    sender.send(&buffer, &[]).unwrap();
    drop(buffer);
    drop(receiver.recv().unwrap());
    sender.wait_release(None).unwrap();
    assert_eq!(small.stats().evictions, 1);
    assert_eq!(receiver.poll().unwrap(), 1);
    assert_eq!(receiver.cached_regions(), 0);
    sender.flush().unwrap();
}

#[test]
fn a_sender_dropped_with_open_leases_never_reuses_those_regions() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let mut buffer = pool.alloc(MIB).unwrap();
    buffer.fill(9).unwrap();
    let id = buffer.id();
    sender.send(&buffer, &[]).unwrap();
    drop(buffer);
    let lease = receiver.recv().unwrap();
    drop(sender);
    assert_eq!(pool.stats().abandoned, 1);
    let other = pool.alloc(MIB).unwrap();
    assert_ne!(other.id(), id);
    drop(other);
    // The consumer still reads its data; when it lets go, the region is released, not cached.
    assert_eq!(lease.read_volatile(0).unwrap(), 9);
    drop(lease);
    let stats = pool.stats();
    assert_eq!(stats.regions.current, 1, "only the second region is left");
    assert!(matches!(receiver.recv(), Err(Error::Disconnected)));
    assert_eq!(receiver.cached_regions(), 0);
}

#[test]
fn a_consumer_that_hangs_up_gives_back_its_leases() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let buffer = pool.alloc(MIB).unwrap();
    for _ in 0..3 {
        sender.send(&buffer, &[]).unwrap();
    }
    let leases: Vec<_> = (0..3).map(|_| receiver.recv().unwrap()).collect();
    drop(receiver);
    assert_eq!(
        sender.poll_releases().unwrap(),
        0,
        "leases keep the socket open"
    );
    assert!(sender.is_connected());
    drop(leases);
    drop(buffer);
    assert_eq!(sender.wait_release(None).unwrap(), 3);
    assert_eq!(sender.wait_release(None).unwrap(), 0);
    sender.poll_releases().unwrap();
    assert!(!sender.is_connected());
    assert!(matches!(
        sender.send(&pool.alloc(MIB).unwrap(), &[]),
        Err(Error::Disconnected)
    ));
    assert_eq!(pool.stats().in_use_bytes.current, 0);
}

#[test]
fn limits_evict_the_least_recently_used_and_stats_add_up() {
    let pool = ShmPool::new(PoolConfig {
        max_cached_bytes: 3 * MIB,
        idle_release: None,
        threads: 1,
        ..PoolConfig::default()
    });
    let buffers: Vec<_> = (0..4).map(|_| pool.alloc(MIB).unwrap()).collect();
    let ids: Vec<u64> = buffers.iter().map(|b| b.id()).collect();
    drop(buffers);
    let stats = pool.stats();
    assert_eq!(stats.evictions, 1);
    assert_eq!(stats.cached_bytes.current, 3 * MIB);
    assert_eq!(stats.reserved_bytes.current, 3 * MIB);
    assert_eq!(stats.reserved_bytes.peak, 4 * MIB);
    assert_eq!(stats.in_use_bytes.peak, 4 * MIB);
    assert_eq!(stats.in_use_bytes.allocated, 4 * MIB);
    assert_eq!(stats.in_use_bytes.freed, 4 * MIB);
    assert_eq!(stats.regions.current, 3);
    // The first one back was evicted; the last one back is reused first.
    assert_eq!(pool.alloc(MIB).unwrap().id(), ids[3]);
    // A region larger than the whole cache is never kept.
    drop(pool.alloc(4 * MIB).unwrap());
    assert_eq!(pool.stats().evictions, 2);
    assert_eq!(pool.trim_to(MIB), 2 * MIB);
    assert_eq!(pool.stats().cached_bytes.current, MIB);
    assert_eq!(pool.trim_idle(std::time::Duration::ZERO), MIB);
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes.current, 0);
    assert_eq!(
        stats.reserved_bytes.allocated - stats.reserved_bytes.freed,
        0
    );
    pool.reset_peak_stats();
    assert_eq!(pool.stats().reserved_bytes.peak, 0);
    let flat = pool.stats().to_flat();
    assert!(flat
        .iter()
        .any(|(k, v)| k == "reserved_bytes.all.allocated" && *v == 8 * MIB));
}

#[test]
fn idle_release_drops_regions_left_unused() {
    let pool = ShmPool::new(PoolConfig {
        idle_release: Some(std::time::Duration::ZERO),
        threads: 1,
        ..PoolConfig::default()
    });
    drop(pool.alloc(MIB).unwrap());
    // With a zero idle time a region is released as soon as it comes back.
    assert_eq!(pool.stats().cached_bytes.current, 0);
    assert_eq!(pool.stats().trimmed, 1);
}

#[test]
fn copies_and_zeroed_buffers_hold_the_right_bytes_cold_and_warm() {
    let pool = small_pool();
    let src: Vec<u8> = (0..(9 << 20) + 4321)
        .map(|i| (i * 31 % 253) as u8)
        .collect();
    let cold = pool.copy_from_bytes(&src).unwrap();
    assert_eq!(cold.to_vec().unwrap(), src);
    let id = cold.id();
    drop(cold);
    let reversed: Vec<u8> = src.iter().rev().copied().collect();
    let warm = pool.copy_from_bytes(&reversed).unwrap();
    assert_eq!(warm.id(), id, "warm copy reuses the region");
    assert_eq!(warm.to_vec().unwrap(), reversed);
    drop(warm);
    let zeroed = pool.alloc_zeroed(src.len() as u64).unwrap();
    assert_eq!(zeroed.id(), id);
    assert!(zeroed.to_vec().unwrap().iter().all(|&b| b == 0));
    assert!(matches!(pool.alloc(0), Err(Error::InvalidSize { .. })));
    assert!(matches!(
        pool.alloc(u64::MAX),
        Err(Error::InvalidSize { .. })
    ));
}

#[test]
fn regions_are_sealed_and_a_read_only_consumer_cannot_write() {
    let pool = small_pool();
    let options = ReceiverOptions {
        access: Access::ReadOnly,
        ..ReceiverOptions::default()
    };
    let (mut sender, mut receiver) = connect(&pool, options);
    let buffer = pool.alloc(MIB).unwrap();
    let fd = buffer.fd().unwrap();
    assert!(
        rustix::fs::ftruncate(fd, 4096).is_err(),
        "sealed against shrinking"
    );
    sender.send(&buffer, &[]).unwrap();
    let lease = receiver.recv().unwrap();
    assert!(matches!(lease.write_at(0, &[1]), Err(Error::ReadOnly)));
    assert!(!lease.mapping().is_truncatable());
}

#[test]
fn buffers_of_another_pool_and_oversized_user_data_are_refused() {
    let pool = small_pool();
    let other = small_pool();
    let (mut sender, _receiver) = connect(&pool, ReceiverOptions::default());
    let foreign = other.alloc(4096).unwrap();
    assert!(matches!(
        sender.send(&foreign, &[]),
        Err(Error::Protocol { .. })
    ));
    let mine = pool.alloc(4096).unwrap();
    let big = [0u8; tensormem_shm::pool::MAX_POOL_USER_DATA + 1];
    assert!(matches!(
        sender.send(&mine, &big),
        Err(Error::Protocol { .. })
    ));
    assert_eq!(sender.outstanding(), 0, "nothing lent when sending fails");
    drop(mine);
    assert_eq!(pool.stats().in_use_bytes.current, 0);
}

#[test]
fn the_idle_trimmer_releases_unused_regions_and_ends_with_the_pool() {
    let pool = ShmPool::new(PoolConfig {
        idle_release: Some(std::time::Duration::from_millis(20)),
        threads: 1,
        ..PoolConfig::default()
    });
    drop(pool.alloc(MIB).unwrap());
    assert_eq!(pool.stats().cached_bytes.current, MIB);
    let trimmer = pool
        .start_idle_trimmer()
        .unwrap()
        .expect("idle_release is set");
    // No timing asserted: wait (up to a generous bound) for the behaviour.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while pool.stats().reserved_bytes.current > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "idle region never released"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(pool.stats().trimmed, 1);
    drop(pool);
    trimmer.join().unwrap();
    let never = ShmPool::new(PoolConfig {
        idle_release: None,
        ..PoolConfig::default()
    });
    assert!(never.start_idle_trimmer().unwrap().is_none());
}

#[test]
fn trimming_from_another_thread_while_sending_keeps_both_ends_in_agreement() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let trims = std::sync::Arc::new(AtomicU64::new(0));
    let trimmer = {
        let (pool, stop, trims) = (pool.clone(), stop.clone(), trims.clone());
        std::thread::spawn(move || loop {
            pool.trim();
            trims.fetch_add(1, Ordering::Relaxed);
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::yield_now();
        })
    };
    while trims.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
    for step in 0..300u32 {
        let mut buffer = pool.alloc(64 << 10).unwrap();
        buffer.write_at(0, &step.to_le_bytes()).unwrap();
        sender.send(&buffer, &[]).unwrap();
        drop(buffer);
        // Never an unknown id, never a stale mapping: the bytes are this step's.
        let lease = receiver.recv().unwrap();
        let mut got = [0u8; 4];
        lease.read_at(0, &mut got).unwrap();
        assert_eq!(u32::from_le_bytes(got), step);
        drop(lease);
        sender.wait_release(None).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    trimmer.join().unwrap();
    pool.trim();
    sender.flush().unwrap();
    receiver.poll().unwrap();
    assert_eq!(receiver.cached_regions(), sender.known_regions());
    assert_eq!(receiver.cached_regions(), 0);
    assert_eq!(pool.stats().reserved_bytes.current, 0);
}

#[test]
fn a_consumer_releasing_what_it_does_not_hold_is_a_protocol_error_and_loses_nothing() {
    let pool = small_pool();
    let (producer, consumer) = UnixStream::pair().unwrap();
    // A hand-made consumer on a bare channel: hello, then a bogus release before a real one.
    let mut consumer = Channel::create(consumer, ChannelOptions::default()).unwrap();
    consumer.send(&record(1, 16, 1 << 30)).unwrap();
    let mut sender = PoolSender::new(&pool, producer).unwrap();
    let buffer = pool.alloc(4096).unwrap();
    sender.send(&buffer, &[]).unwrap();
    let id = buffer.id();
    drop(buffer);
    consumer.send(&record(2, id + 1000, 0)).unwrap();
    consumer.send(&record(2, id, 0)).unwrap();
    assert!(matches!(
        sender.wait_release(None),
        Err(Error::Protocol { .. })
    ));
    // The real release was applied all the same.
    assert_eq!(sender.outstanding(), 0);
    assert_eq!(pool.stats().in_use_bytes.current, 0);
}

/// A consumer-to-producer record (the layout of `pool::wire`).
fn record(kind: u32, a: u64, b: u64) -> Vec<u8> {
    let mut r = Vec::from(*b"TMRL");
    r.extend_from_slice(&kind.to_le_bytes());
    r.extend_from_slice(&a.to_le_bytes());
    r.extend_from_slice(&b.to_le_bytes());
    r
}

/// A hand-made producer: writes raw pool messages (the layout of `pool::wire`).
fn raw_message(kind: u8, id: u64, len: u64, map_len: u64) -> [u8; 256] {
    let mut m = [0u8; 256];
    m[0..4].copy_from_slice(b"TMPL");
    m[4..6].copy_from_slice(&1u16.to_le_bytes());
    m[6] = kind;
    m[8..16].copy_from_slice(&id.to_le_bytes());
    m[16..24].copy_from_slice(&len.to_le_bytes());
    m[24..32].copy_from_slice(&map_len.to_le_bytes());
    m
}

/// Accepts the channel a `PoolReceiver` set up and reads its hello.
fn hand_made_producer(socket: UnixStream) -> Channel {
    let mut producer = Channel::accept(socket, ChannelOptions::default()).unwrap();
    let mut hello = [0u8; MAX_MESSAGE];
    assert_eq!(producer.recv(&mut hello).unwrap(), 24);
    assert_eq!(&hello[0..4], b"TMRL");
    producer
}

#[test]
fn a_lying_producer_gets_protocol_errors_and_its_leases_back() {
    let (producer, consumer) = UnixStream::pair().unwrap();
    let mut receiver = PoolReceiver::new(consumer, ReceiverOptions::default()).unwrap();
    let mut producer = hand_made_producer(producer);
    let mut release = [0u8; MAX_MESSAGE];

    // An id this end never received.
    producer.send(&raw_message(2, 77, 4096, 4096)).unwrap();
    assert!(matches!(receiver.recv(), Err(Error::Protocol { .. })));
    assert_eq!(producer.recv(&mut release).unwrap(), 24);
    assert_eq!(u32::from_le_bytes(release[4..8].try_into().unwrap()), 2);
    assert_eq!(u64::from_le_bytes(release[8..16].try_into().unwrap()), 77);

    // A NEW message without its fd, garbage, and a message too short for a header.
    producer.send(&raw_message(1, 78, 4096, 4096)).unwrap();
    assert!(matches!(receiver.recv(), Err(Error::Protocol { .. })));
    assert_eq!(producer.recv(&mut release).unwrap(), 24);
    assert_eq!(u64::from_le_bytes(release[8..16].try_into().unwrap()), 78);
    producer.send(&[0xAB; 256]).unwrap();
    assert!(matches!(receiver.recv(), Err(Error::Protocol { .. })));
    producer.send(&[0xAB; 300]).unwrap();
    assert!(matches!(receiver.recv(), Err(Error::Protocol { .. })));
    producer.send(b"TMPL").unwrap();
    assert!(matches!(receiver.recv(), Err(Error::Protocol { .. })));
    assert_eq!(receiver.cached_regions(), 0);
}

#[test]
fn an_unsealed_region_from_a_producer_is_read_through_the_kernel() {
    use std::os::fd::AsFd;
    // A producer that sends a plain file it could truncate (not a pool region).
    let (producer, consumer) = UnixStream::pair().unwrap();
    let mut receiver = PoolReceiver::new(consumer, ReceiverOptions::default()).unwrap();
    let mut producer = hand_made_producer(producer);
    let file = tempfile::tempfile().unwrap();
    file.set_len(8192).unwrap();
    producer
        .send_with_fd(&raw_message(1, 5, 8192, 8192), file.as_fd())
        .unwrap();
    let lease = receiver.recv().unwrap();
    assert!(lease.mapping().is_truncatable());
    file.set_len(0).unwrap();
    assert!(matches!(
        lease.read_volatile(4096),
        Err(Error::Truncated { .. })
    ));
}

#[test]
fn a_request_the_cache_cannot_serve_takes_releases_no_sender_has_read_yet() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let buffer = pool.alloc(MIB).unwrap();
    let id = buffer.id();
    sender.send(&buffer, &[]).unwrap();
    drop(buffer);
    drop(receiver.recv().unwrap()); // the release record now waits in the channel
    assert_eq!(sender.outstanding(), 1, "nobody has read it yet");
    // The producer never polls: the pool reads the release itself on its cache miss.
    let again = pool.alloc(MIB).unwrap();
    assert_eq!(again.id(), id);
    assert_eq!(sender.outstanding(), 0);
    assert_eq!(sender.stats().released, 1);
    let stats = pool.stats();
    assert_eq!(stats.regions.allocated, 1);
    assert_eq!(stats.cache_hits, 1);
    assert_eq!(stats.requests, 2);
}

#[test]
fn the_handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<ShmPool>();
    send_sync::<tensormem_shm::PoolBuffer>();
    send::<PoolSender>();
    send::<PoolReceiver>();
    send_sync::<tensormem_shm::mapping_cache::Lease>();
}

#[test]
fn a_send_refused_for_oversized_user_data_leaves_the_consumer_cache_as_it_was() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let buffer = pool.alloc(MIB).unwrap();
    assert!(matches!(
        sender.send(&buffer, &[0; 217]),
        Err(Error::Protocol { .. })
    ));
    assert_eq!(sender.known_regions(), 0);
    assert_eq!(sender.outstanding(), 0);
    // The next send of the region carries its fd (the consumer never saw it).
    sender.send(&buffer, b"ok").unwrap();
    assert_eq!(sender.stats().sent_fd, 1);
    let lease = receiver.recv().unwrap();
    assert_eq!(lease.user_data(), b"ok");
}

#[test]
fn a_detached_region_is_never_reused_and_its_reused_tail_is_cleared() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let mut first = pool.alloc(3 * MIB).unwrap();
    first.fill(0xAB).unwrap();
    drop(first);
    // The same region, lent again for fewer bytes, then detached with a lease out.
    let mut second = pool.alloc(3 * MIB - 4096).unwrap();
    assert_eq!(pool.stats().cache_hits, 1);
    second.fill(0x11).unwrap();
    sender.send(&second, b"").unwrap();
    let lease = receiver.recv().unwrap();
    let region = second.detach();
    assert_eq!(pool.stats().detached, 1);
    let bytes = region.to_vec().unwrap();
    assert!(bytes[..3 * MIB as usize - 4096].iter().all(|&b| b == 0x11));
    assert!(bytes[3 * MIB as usize - 4096..].iter().all(|&b| b == 0));
    assert_eq!(lease.read_volatile(0).unwrap(), 0x11);
    drop(lease);
    sender.wait_release(None).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.regions.current, 0);
    assert_eq!(stats.cached_bytes.current, 0);
    // A new request of that size makes a new region.
    drop(pool.alloc(3 * MIB).unwrap());
    assert_eq!(pool.stats().regions.allocated, 2);
    drop(region);
}

#[test]
fn a_connection_carries_at_most_max_leases_open_and_every_release_fits_its_ring() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    let buffer = pool.alloc(4096).unwrap();
    for _ in 0..tensormem_shm::pool::MAX_LEASES {
        sender.send(&buffer, &[]).unwrap();
    }
    assert!(matches!(
        sender.send(&buffer, &[]),
        Err(Error::TooManyLeases { outstanding }) if outstanding == tensormem_shm::pool::MAX_LEASES
    ));
    // The consumer takes them all and drops every lease without the producer reading: the
    // releases all fit (no lease drop waits).
    let leases: Vec<_> = (0..tensormem_shm::pool::MAX_LEASES)
        .map(|_| receiver.recv().unwrap())
        .collect();
    drop(leases);
    let mut back = 0;
    while back < tensormem_shm::pool::MAX_LEASES {
        back += sender.wait_release(None).unwrap();
    }
    assert_eq!(sender.outstanding(), 0);
    sender.send(&buffer, b"again").unwrap();
    assert_eq!(receiver.recv().unwrap().user_data(), b"again");
}

#[test]
fn a_bounded_wait_for_releases_gives_up_with_nothing_or_returns_what_came_back() {
    let pool = small_pool();
    let (mut sender, mut receiver) = connect(&pool, ReceiverOptions::default());
    // Nothing lent: 0 at once.
    assert_eq!(
        sender
            .wait_release_timeout(std::time::Duration::from_secs(60))
            .unwrap(),
        0
    );
    let buffer = pool.alloc(MIB).unwrap();
    sender.send(&buffer, &[]).unwrap();
    drop(buffer);
    let lease = receiver.recv().unwrap();
    // The lease is held: the wait ends empty-handed and the lease stays out.
    assert_eq!(
        sender
            .wait_release_timeout(std::time::Duration::from_millis(20))
            .unwrap(),
        0
    );
    assert_eq!(sender.outstanding(), 1);
    drop(lease);
    assert_eq!(
        sender
            .wait_release_timeout(std::time::Duration::from_secs(60))
            .unwrap(),
        1
    );
    assert_eq!(sender.outstanding(), 0);
}
