//! Producer and consumer in one process, on the simulated device and the fake driver: limbo and
//! collect, the free-memory callback, rotation, 10 000+ shares, the event budget, many threads, every
//! bad-handle class, the opened-handle cache, shutdown. (Re-sharing received memory: `received.rs`'s
//! unit tests.)

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_ipc::driver::fake::FakeDriver;
use tensormem_ipc::{
    ConsumerConfig, Error, IpcConsumer, IpcHandle, IpcProducer, MemHandle, ProducerConfig,
    SegmentMemory, REF_COUNTER_FILE_SIZE,
};
use tensormem_shm::{NameGenerator, RefcountedRegion, ShmName};

type Producer = IpcProducer<SimDevice, FakeDriver>;

const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;

fn setup(config: ProducerConfig) -> (Arc<FakeDriver>, Arc<CachingAllocator<SimDevice>>, Producer) {
    let driver = Arc::new(FakeDriver::default());
    let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
    let producer = IpcProducer::with_config(Arc::clone(&driver), config);
    (driver, allocator, producer)
}

fn active(allocator: &CachingAllocator<SimDevice>) -> i64 {
    allocator.memory_stats().active_bytes.all.current
}

#[test]
fn limbo_holds_memory_until_the_consumer_releases_it() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(MIB, S).unwrap(), S)
        .unwrap();
    assert!(
        handle.event.is_some(),
        "an event is recorded while the budget lasts"
    );
    let received = consumer.open(&handle, S).unwrap();
    assert_eq!(received.size(), MIB as u64);

    drop(shared);
    assert_eq!(producer.stats().limbo, 1);
    assert_eq!(
        active(&allocator),
        MIB as i64,
        "still allocated while the consumer holds it"
    );
    assert!(
        !producer.collect(),
        "nothing to free while the slot is held"
    );

    let syncs = driver.counts.stream_syncs.load(Ordering::Relaxed);
    drop(received);
    assert_eq!(
        driver.counts.stream_syncs.load(Ordering::Relaxed),
        syncs + 1,
        "the consumer synchronized its stream before releasing"
    );
    assert_eq!(driver.open_mappings(), 0, "the last user closed the handle");
    assert!(producer.collect());
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(active(&allocator), 0);
    assert_eq!(producer.stats().events_in_use, 0);
    assert_eq!(
        driver.counts.events_alive.load(Ordering::Relaxed),
        1,
        "pooled for the next share"
    );
    drop(producer);
    assert_eq!(
        driver.counts.events_alive.load(Ordering::Relaxed),
        0,
        "destroyed with the producer"
    );
}

#[test]
fn every_stream_the_memory_was_used_on_is_synchronized_once_before_release() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    let mut received = consumer.open(&handle, S).unwrap();
    received.use_on(StreamId(5));
    received.use_on(StreamId(5));
    received.use_on(S);
    received.use_on(StreamId(6));
    let syncs = driver.counts.stream_syncs.load(Ordering::Relaxed);
    drop(received);
    assert_eq!(
        driver.counts.stream_syncs.load(Ordering::Relaxed),
        syncs + 3,
        "streams 0, 5 and 6, each once"
    );
    drop(shared);
    assert_eq!(producer.stats().limbo, 0);
}

#[test]
fn memory_released_before_the_producer_frees_goes_back_at_once() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    drop(consumer.open(&handle, S).unwrap());
    drop(shared);
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn the_allocator_collects_the_limbo_before_running_out() {
    let driver = Arc::new(FakeDriver::default());
    let allocator = Arc::new(CachingAllocator::new(SimDevice::new(64 * MIB as u64)));
    let producer: Producer = IpcProducer::new(Arc::clone(&driver));
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let big = 40 * MIB;

    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(big, S).unwrap(), S)
        .unwrap();
    let received = consumer.open(&handle, S).unwrap();
    drop(shared);
    // Held by the consumer: the callback frees nothing, the device is out of room.
    let err = allocator.allocate(big, S).unwrap_err();
    assert!(err.to_string().contains("CUDA out of memory"), "{err}");
    assert_eq!(producer.stats().limbo, 1);

    drop(received);
    // Released but not collected yet: the allocator's free-memory callback collects it and retries.
    assert_eq!(producer.stats().limbo, 1);
    let again = allocator.allocate(big, S).unwrap();
    assert_eq!(producer.stats().limbo, 0);
    allocator.free(again).unwrap();
}

#[test]
fn slots_rotate_across_files_and_files_go_when_their_slots_return() {
    let (driver, allocator, producer) = setup(ProducerConfig {
        slots_per_file: 3,
        ..ProducerConfig::default()
    });
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut shared = producer.adopt(&allocator, allocator.allocate(4096, S).unwrap());
    let mut handles = Vec::new();
    for _ in 0..7 {
        handles.push(shared.share(S).unwrap());
    }
    let places: Vec<(String, u64)> = handles
        .iter()
        .map(|h| (h.ref_counter.as_ref().unwrap().to_string(), h.slot))
        .collect();
    assert_eq!(
        places.iter().map(|p| p.1).collect::<Vec<_>>(),
        [0, 1, 2, 0, 1, 2, 0]
    );
    let files: Vec<&String> = places.iter().map(|p| &p.0).collect();
    assert!(
        files[0] == files[2]
            && files[2] != files[3]
            && files[3] == files[5]
            && files[5] != files[6]
    );
    assert_eq!(producer.stats().files_created, 3);
    let first_file = ShmName::new(files[0].clone()).unwrap();
    assert!(first_file.path().exists());

    let received: Vec<_> = handles
        .iter()
        .map(|h| consumer.open(h, S).unwrap())
        .collect();
    drop(received);
    consumer.trim();
    assert_eq!(shared.outstanding(), 0);
    assert!(
        !first_file.path().exists(),
        "a used-up file goes when its last slot returns"
    );
    drop(shared);
    assert_eq!(active(&allocator), 0);
    assert_eq!(producer.stats().limbo, 0);
    assert!(
        files[6].starts_with('/') && ShmName::new(files[6].clone()).unwrap().path().exists(),
        "the current file stays for the next share"
    );
    producer.collect(); // and goes when collected with no slot out (CudaIPCCollect)
    for (name, _) in &places {
        assert!(
            !ShmName::new(name.clone()).unwrap().path().exists(),
            "{name} left behind"
        );
    }
}

#[test]
fn ten_thousand_and_more_shares_rotate_through_full_size_files() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::with_config(
        Arc::clone(&driver),
        ConsumerConfig {
            idle_mem_handles: 1,
            ..ConsumerConfig::default()
        },
    );
    let mut shared = producer.adopt(&allocator, allocator.allocate(4096, S).unwrap());
    let total = REF_COUNTER_FILE_SIZE + 50;
    let mut names = HashSet::new();
    for i in 0..total {
        let handle = shared.share(S).unwrap();
        assert_eq!(handle.slot as usize, i % REF_COUNTER_FILE_SIZE);
        names.insert(handle.ref_counter.as_ref().unwrap().to_string());
        drop(consumer.open(&handle, S).unwrap());
    }
    assert_eq!(names.len(), 2);
    assert_eq!(producer.stats().files_created, 2);
    assert_eq!(producer.stats().shares, total);
    assert_eq!(
        driver.counts.opens.load(Ordering::Relaxed),
        1,
        "the idle handle stays open"
    );
    assert_eq!(
        driver.counts.handles_exported.load(Ordering::Relaxed),
        1,
        "cached per base allocation"
    );
    assert_eq!(shared.outstanding(), 0);
    drop(shared);
    consumer.trim();
    assert_eq!(driver.open_mappings(), 0);
    producer.collect();
    for name in names {
        assert!(
            !ShmName::new(name.clone()).unwrap().path().exists(),
            "{name} left behind"
        );
    }
}

#[test]
fn past_the_event_budget_shares_synchronize_instead() {
    let (driver, allocator, producer) = setup(ProducerConfig {
        max_events: 5,
        ..ProducerConfig::default()
    });
    let mut shared = producer.adopt(&allocator, allocator.allocate(4096, S).unwrap());
    let handles: Vec<IpcHandle> = (0..8).map(|_| shared.share(S).unwrap()).collect();
    let with_event = handles.iter().filter(|h| h.event.is_some()).count();
    assert_eq!(with_event, 5);
    assert!(handles[5..].iter().all(|h| h.event.is_none()));
    let stats = producer.stats();
    assert_eq!((stats.events_in_use, stats.synchronized_shares), (5, 3));
    assert_eq!(driver.counts.stream_syncs.load(Ordering::Relaxed), 3);
    // Consumers release the first share: its event is reused by the next share.
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    drop(consumer.open(&handles[0], S).unwrap());
    let next = shared.share(S).unwrap();
    assert_eq!(
        next.event, handles[0].event,
        "the released share's event, recorded again"
    );
    assert_eq!(producer.stats().events_in_use, 5);
    assert_eq!(driver.counts.events_created.load(Ordering::Relaxed), 5);
    drop(consumer.open(&next, S).unwrap());
    assert_eq!(
        driver.counts.events_opened.load(Ordering::Relaxed),
        1,
        "the consumer kept the producer's event open"
    );
    assert_eq!(driver.counts.event_waits.load(Ordering::Relaxed), 2);
    for h in &handles[1..] {
        drop(consumer.open(h, S).unwrap());
    }
}

#[test]
fn an_idle_stream_is_shared_without_an_event() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    driver.set_streams_idle(true);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    assert_eq!(handle.event, None);
    assert!(!handle.to_torch().event_sync_required);
    drop(consumer.open(&handle, S).unwrap());
    assert_eq!(driver.counts.events_created.load(Ordering::Relaxed), 0);
    assert_eq!(driver.counts.event_waits.load(Ordering::Relaxed), 0);
    assert_eq!(producer.stats().idle_stream_shares, 1);
    drop(shared);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn the_default_budget_is_pytorchs() {
    let (_driver, allocator, producer) = setup(ProducerConfig::default());
    let mut shared = producer.adopt(&allocator, allocator.allocate(512, S).unwrap());
    for _ in 0..1002 {
        shared.share(S).unwrap();
    }
    let stats = producer.stats();
    assert_eq!((stats.events_in_use, stats.synchronized_shares), (1000, 2));
}

#[test]
fn many_threads_share_and_open_at_once() {
    let (driver, allocator, producer) = setup(ProducerConfig {
        slots_per_file: 97,
        ..ProducerConfig::default()
    });
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let places: Vec<(String, u64)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..8)
            .map(|t| {
                let (allocator, producer, consumer) = (&allocator, &producer, &consumer);
                s.spawn(move || {
                    let stream = StreamId(t + 1);
                    let mut places = Vec::new();
                    for i in 0..200 {
                        let size = 512 * (1 + (i % 7));
                        let (shared, handle) = producer
                            .share(allocator, allocator.allocate(size, stream).unwrap(), stream)
                            .unwrap();
                        let received = consumer.open(&handle, stream).unwrap();
                        assert_eq!(received.size(), shared.size() as u64);
                        places.push((
                            handle.ref_counter.as_ref().unwrap().to_string(),
                            handle.slot,
                        ));
                        if i % 2 == 0 {
                            drop(shared);
                            drop(received);
                        } else {
                            drop(received);
                            drop(shared);
                        }
                    }
                    places
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    let unique: HashSet<_> = places.iter().collect();
    assert_eq!(unique.len(), places.len(), "no slot handed out twice");
    producer.collect();
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(active(&allocator), 0);
    assert_eq!(driver.open_mappings(), 0);
    assert_eq!(producer.stats().events_in_use, 0);
}

#[test]
fn every_bad_handle_is_refused_before_anything_is_opened_or_written() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (shared, good) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    let base_size = allocator.base_allocation(shared.ptr()).unwrap().1 as u64;
    let check = |bad: IpcHandle, what: fn(&Error) -> bool| {
        let err = consumer.open(&bad, S).unwrap_err();
        assert!(what(&err), "unexpected error: {err}");
        assert_eq!(driver.open_mappings(), 0, "nothing left open after: {err}");
    };
    check(
        IpcHandle {
            device: 1,
            ..good.clone()
        },
        |e| {
            matches!(
                e,
                Error::InvalidDevice {
                    device: 1,
                    count: 1
                }
            )
        },
    );
    check(
        IpcHandle {
            slot: REF_COUNTER_FILE_SIZE as u64,
            ..good.clone()
        },
        |e| {
            matches!(
                e,
                Error::SlotOutOfRange {
                    slots: REF_COUNTER_FILE_SIZE,
                    ..
                }
            )
        },
    );
    check(
        IpcHandle {
            slot: 1,
            ..good.clone()
        },
        |e| {
            matches!(
                e,
                Error::SlotNotHeld {
                    slot: 1,
                    value: 0,
                    ..
                }
            )
        },
    );
    check(
        IpcHandle {
            size: base_size - good.offset + 1,
            ..good.clone()
        },
        |e| matches!(e, Error::OutOfBounds { .. }),
    );
    check(
        IpcHandle {
            offset: u64::MAX,
            ..good.clone()
        },
        |e| matches!(e, Error::OutOfBounds { .. }),
    );
    check(
        IpcHandle {
            memory: SegmentMemory::Allocation(MemHandle([3; 64])),
            ..good.clone()
        },
        |e| matches!(e, Error::Driver(_)),
    );
    check(
        IpcHandle {
            ref_counter: Some(ShmName::new("/tensormem_0_0_missing").unwrap()),
            ..good.clone()
        },
        |e| matches!(e, Error::RefCounterFile { .. }),
    );
    // The slot was never written by any of these.
    let received = consumer.open(&good, S).unwrap();
    // Each share is for one consumer: a second open of the same handle is refused.
    let err = consumer.open(&good, S).unwrap_err();
    assert!(
        matches!(err, Error::SlotClaimed { pid, .. } if pid == std::process::id()),
        "{err}"
    );
    drop(received);
    let err = consumer.open(&good, S).unwrap_err();
    assert!(matches!(err, Error::SlotNotHeld { value: 0, .. }), "{err}");
    drop(shared);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn a_handle_naming_another_shared_memory_object_leaves_it_untouched() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (shared, good) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    // An application's refcounted region of the same user, of a size a counter file could have
    // (PyTorch's, and a small multiple of 8), with a positive word where the handle points.
    for data_len in [8 * REF_COUNTER_FILE_SIZE, 128] {
        let name = NameGenerator::default().next_name();
        let mut victim = RefcountedRegion::create(&name, data_len as u64).unwrap();
        victim.write_at(8, &1003i64.to_le_bytes()).unwrap();
        let forged = IpcHandle {
            ref_counter: Some(name.clone()),
            slot: 1,
            ..good.clone()
        };
        for _ in 0..3 {
            match consumer.open(&forged, S) {
                Err(Error::NotRefCounterFile { name: n, .. }) => assert_eq!(n, name.to_string()),
                Err(err) => panic!("unexpected error: {err}"),
                Ok(received) => drop(received),
            }
        }
        let mut word = [0u8; 8];
        victim.read_at(8, &mut word).unwrap();
        assert_eq!(i64::from_le_bytes(word), 1003, "the victim's word changed");
        assert_eq!(driver.open_mappings(), 0);
    }
    drop(shared);
}

#[test]
fn a_ref_counter_file_truncated_while_open_is_an_error_not_a_crash() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    let received = consumer.open(&handle, S).unwrap();
    // A process of the same user shrinks the file under both mappings. The producer then cannot
    // tell whether the counter file is still in use and keeps it: the test removes it at the end.
    let counter = handle.ref_counter.clone().unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(handle.ref_counter.as_ref().unwrap().path())
        .unwrap()
        .set_len(0)
        .unwrap();
    // Releasing touches the counter, the owner record and the trailer: no SIGBUS.
    drop(received);
    assert_eq!(driver.open_mappings(), 0);
    // The release could not be recorded, so the producer keeps the memory held, never reused.
    drop(shared);
    assert!(!producer.collect());
    assert_eq!(producer.stats().limbo, 1);
    // Sharing from the truncated file is refused the same way.
    let err = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::RefCounterFile {
                source: tensormem_shm::Error::Truncated { .. },
                ..
            }
        ),
        "{err}"
    );
    drop(producer);
    tensormem_shm::unlink_shm(&counter).unwrap();
}

#[test]
fn one_open_per_base_allocation_and_idle_handles_stay_warm() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    // Two small allocations share one 2 MiB segment: one base allocation.
    let (a, ha) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    let (b, hb) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    assert_eq!(ha.memory, hb.memory);
    assert_ne!(ha.offset, hb.offset);
    let cold = IpcConsumer::new(Arc::clone(&driver));
    let (ra, rb) = (cold.open(&ha, S).unwrap(), cold.open(&hb, S).unwrap());
    assert_eq!(driver.counts.opens.load(Ordering::Relaxed), 1);
    assert_eq!(rb.ptr().0 - ra.ptr().0, hb.offset - ha.offset);
    drop(ra);
    assert_eq!(driver.open_mappings(), 1);
    drop(rb);
    assert_eq!(driver.counts.closes.load(Ordering::Relaxed), 1);

    let warm = IpcConsumer::with_config(
        Arc::clone(&driver),
        ConsumerConfig {
            idle_mem_handles: 4,
            ..ConsumerConfig::default()
        },
    );
    let mut a = a;
    drop(warm.open(&a.share(S).unwrap(), S).unwrap());
    drop(warm.open(&a.share(S).unwrap(), S).unwrap());
    assert_eq!(
        driver.counts.opens.load(Ordering::Relaxed),
        2,
        "opened once, then warm"
    );
    assert_eq!(driver.open_mappings(), 1);
    drop(warm);
    assert_eq!(
        driver.open_mappings(),
        0,
        "dropping the consumer closes its idle handles"
    );
    drop((a, b));
}

#[test]
fn the_torch_tuple_opens_like_the_handle() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(8192, S).unwrap(), S)
        .unwrap();
    let tuple = handle.to_torch();
    assert_eq!(tuple.ref_counter_offset, handle.slot);
    let line = tuple.to_line();
    let back =
        IpcHandle::from_torch(&tensormem_ipc::TorchShareTuple::from_line(&line).unwrap()).unwrap();
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let received = consumer.open(&back, S).unwrap();
    assert_eq!(received.view::<u64>().unwrap().len(), 1024);
    assert_eq!(consumer.open_mem_handles(), 1);
    drop(received);
    // A view must fit the memory: 1001 bytes are not u32s.
    let odd = producer.adopt(&allocator, allocator.allocate(4096, S).unwrap());
    let mut odd = odd;
    let h = IpcHandle {
        size: 1001,
        ..odd.share(S).unwrap()
    };
    let received = consumer.open(&h, S).unwrap();
    assert_eq!(received.view::<u8>().unwrap().len(), 1001);
    assert!(matches!(
        received.view::<u32>(),
        Err(Error::BadView {
            bytes: 1001,
            elem_size: 4,
            ..
        })
    ));
    drop(received);
    drop(odd);
    drop(shared);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn limbo_and_shutdown_warn_once() {
    let (driver, allocator, producer) = setup(ProducerConfig {
        warn_after_blocks_in_limbo: 2,
        ..ProducerConfig::default()
    });
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut held = Vec::new();
    for _ in 0..3 {
        let (shared, handle) = producer
            .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
            .unwrap();
        held.push(consumer.open(&handle, S).unwrap());
        drop(shared);
    }
    let stats = producer.stats();
    assert_eq!(stats.limbo, 3);
    assert!(stats.limbo_warned);
    assert_eq!(producer.shutdown(), 3);
    assert!(producer.stats().shutdown_warned);
    drop(held);
    assert_eq!(producer.shutdown(), 0);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn threads_opening_one_base_allocation_at_once_open_it_once() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut shared = producer.adopt(&allocator, allocator.allocate(4096, S).unwrap());
    let handles: Vec<IpcHandle> = (0..16).map(|_| shared.share(S).unwrap()).collect();
    let barrier = std::sync::Barrier::new(handles.len());
    let received: Vec<_> = std::thread::scope(|s| {
        let workers: Vec<_> = handles
            .iter()
            .map(|h| {
                let (consumer, barrier) = (&consumer, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    consumer.open(h, S).unwrap()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    assert_eq!(driver.counts.opens.load(Ordering::Relaxed), 1);
    assert!(received.windows(2).all(|w| w[0].ptr() == w[1].ptr()));
    drop(received);
    assert_eq!(driver.counts.closes.load(Ordering::Relaxed), 1);
    assert_eq!(shared.outstanding(), 0);
}

/// Allocates `sizes` in turn on `stream` and keeps them, so that the next allocation of the size
/// class lands inside a segment, past its start.
fn occupy(
    allocator: &CachingAllocator<SimDevice>,
    sizes: &[usize],
) -> Vec<tensormem_cuda_alloc::Allocation> {
    sizes
        .iter()
        .map(|&n| allocator.allocate(n, S).unwrap())
        .collect()
}

#[test]
fn odd_sizes_and_offsets_inside_a_segment_round_trip_exactly() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    // Small pool (2 MiB segments) and large pool (2^20 + 3 bytes: a 20 MiB segment, 3 MiB in).
    let before = occupy(&allocator, &[512, 3 * MIB, 700]);
    for size in [1usize, 1000, MIB + 3] {
        let allocation = allocator.allocate(size, S).unwrap();
        assert!(allocation.size() > size, "the block is rounded up");
        let (base, _) = allocator.base_allocation(allocation.ptr()).unwrap();
        let offset = allocation.ptr().0 - base.0;
        assert!(offset > 0, "size {size} lies inside its segment");
        let (shared, handle) = producer.share(&allocator, allocation, S).unwrap();
        assert_eq!(shared.nbytes(), size);
        assert_eq!(
            handle.size, size as u64,
            "the storage's bytes, not the block's"
        );
        assert_eq!(handle.offset, offset);
        // Both wire formats carry the size and offset unchanged.
        let decoded = IpcHandle::decode(&handle.encode()).unwrap();
        assert_eq!((decoded.size, decoded.offset), (size as u64, offset));
        let tuple = handle.to_torch();
        assert_eq!((tuple.size, tuple.offset), (size as u64, offset));
        let from_line = tensormem_ipc::TorchShareTuple::from_line(&tuple.to_line()).unwrap();
        let from_torch = IpcHandle::from_torch(&from_line).unwrap();
        assert_eq!((from_torch.size, from_torch.offset), (size as u64, offset));
        // The consumer sees exactly `size` bytes at the producer's address (plus the fake mapping's
        // offset).
        let received = consumer.open(&from_torch, S).unwrap();
        assert_eq!(received.size(), size as u64);
        assert_eq!(
            received.ptr().0,
            shared.ptr().0 + tensormem_ipc::driver::fake::FAKE_MAPPING_OFFSET
        );
        assert_eq!(received.view::<u8>().unwrap().len(), size);
        drop(received);
        drop(shared);
    }
    for allocation in before {
        allocator.free(allocation).unwrap();
    }
    assert!(producer.collect() || producer.stats().limbo == 0);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn a_pytorch_tuple_of_odd_size_at_an_offset_opens_with_that_size() {
    // What PyTorch sends for a 1000-byte storage that lies 512 bytes into its segment:
    // `storage.nbytes()` and `data - base`.
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let first = allocator.allocate(512, S).unwrap();
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(1000, S).unwrap(), S)
        .unwrap();
    let mut tuple = handle.to_torch();
    tuple.handle = [&[2u8, b'c'][..], &handle.memory.to_torch()[..]].concat();
    assert_eq!((tuple.size, tuple.offset), (1000, 512));
    let received = consumer
        .open(&IpcHandle::from_torch(&tuple).unwrap(), S)
        .unwrap();
    assert_eq!(received.size(), 1000);
    assert_eq!(received.view::<f32>().unwrap().len(), 250);
    drop(received);
    drop(shared);
    allocator.free(first).unwrap();
}

#[test]
fn empty_allocations_are_shared_as_pytorch_shares_empty_storages() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (mut shared, handle) = producer
        .share(&allocator, allocator.allocate(0, S).unwrap(), S)
        .unwrap();
    assert!(handle.is_empty());
    assert_eq!(handle, IpcHandle::empty(0));
    assert_eq!(shared.nbytes(), 0);
    assert_eq!(shared.outstanding(), 0, "no slot is taken");
    let stats = producer.stats();
    assert_eq!((stats.files_created, stats.events_in_use), (0, 0));
    assert_eq!(driver.counts.handles_exported.load(Ordering::Relaxed), 0);
    // PyTorch's `(device, None, 0, 0, None, 0, None, None)`, both ways.
    let tuple = handle.to_torch();
    assert!(tuple.is_empty());
    assert_eq!(IpcHandle::from_torch(&tuple).unwrap(), handle);
    assert_eq!(IpcHandle::decode(&handle.encode()).unwrap(), handle);
    // Nothing to open, nothing to release.
    assert!(matches!(
        consumer.open(&handle, S),
        Err(Error::EmptyHandle { device: 0 })
    ));
    consumer.release(&handle).unwrap();
    assert_eq!(driver.counts.opens.load(Ordering::Relaxed), 0);
    drop(shared);
    assert_eq!(producer.stats().limbo, 0);
}

#[test]
fn releasing_a_counter_touches_only_the_counter_file() {
    let (driver, allocator, producer) = setup(ProducerConfig::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let (mut shared, handle) = producer
        .share(&allocator, allocator.allocate(1000, S).unwrap(), S)
        .unwrap();
    assert!(
        handle.event.is_some(),
        "the stream is busy: an event is sent"
    );
    let counts = &driver.counts;
    let before = |c: &tensormem_ipc::driver::fake::FakeCounts| {
        [
            c.opens.load(Ordering::Relaxed),
            c.events_opened.load(Ordering::Relaxed),
            c.event_waits.load(Ordering::Relaxed),
            c.stream_syncs.load(Ordering::Relaxed),
        ]
    };
    let calls = before(counts);
    consumer.release(&handle).unwrap();
    assert_eq!(
        before(counts),
        calls,
        "no memory opened, no event opened or waited on, no stream synchronized"
    );
    assert_eq!(shared.outstanding(), 0, "the slot is back to 0");
    // Released once: a second release and an open are refused, and change nothing.
    assert!(matches!(
        consumer.release(&handle),
        Err(Error::SlotNotHeld { value: 0, .. })
    ));
    assert!(matches!(
        consumer.open(&handle, S),
        Err(Error::SlotNotHeld { .. })
    ));
    // A handle a consumer opened is that consumer's to release.
    let second = shared.share(S).unwrap();
    let received = consumer.open(&second, S).unwrap();
    assert!(matches!(
        consumer.release(&second),
        Err(Error::SlotClaimed { .. })
    ));
    assert_eq!(shared.outstanding(), 1);
    drop(received);
    assert_eq!(shared.outstanding(), 0);
    // The producer frees at once: nothing is held.
    drop(shared);
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(active(&allocator), 0);
    // A handle whose file is gone (the producer ended): an error, as PyTorch's ignored exception.
    let gone = IpcHandle {
        ref_counter: Some(ShmName::new("/tensormem_0_0_gone").unwrap()),
        ..second
    };
    assert!(matches!(
        consumer.release(&gone),
        Err(Error::RefCounterFile { .. })
    ));
}
