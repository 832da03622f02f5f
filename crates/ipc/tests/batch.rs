//! Batches (many views in one message) on the simulated device and the fake driver: round trips
//! with views in several segments at odd sizes and offsets, one slot and one event per message,
//! segments opened once and kept warm across messages, the limbo and collect, refusals on both
//! sides, and release without opening.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_ipc::driver::fake::{FakeDriver, FAKE_MAPPING_OFFSET};
use tensormem_ipc::{
    BatchHandle, ConsumerConfig, Error, IpcConsumer, IpcProducer, ProducerConfig, SharedAllocation,
};

type Producer = IpcProducer<SimDevice, FakeDriver>;
type Shared = SharedAllocation<SimDevice, FakeDriver>;

const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;

fn setup() -> (Arc<FakeDriver>, Arc<CachingAllocator<SimDevice>>, Producer) {
    let driver = Arc::new(FakeDriver::default());
    let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 34)));
    let producer = IpcProducer::new(Arc::clone(&driver));
    (driver, allocator, producer)
}

fn active(allocator: &CachingAllocator<SimDevice>) -> i64 {
    allocator.memory_stats().active_bytes.all.current
}

/// Odd sizes: small-pool allocations sharing 2 MiB segments, large ones sharing 20 MiB segments,
/// and ones large enough for a segment each.
const SIZES: &[usize] = &[
    1,
    1000,
    3,
    513,
    MIB + 3,
    7 * MIB + 1,
    3 * MIB - 1,
    25 * MIB + 7,
    4096,
    65 * MIB,
];

/// A "model": one allocation per size, adopted by `producer`.
fn model(allocator: &Arc<CachingAllocator<SimDevice>>, producer: &Producer) -> Vec<Shared> {
    SIZES
        .iter()
        .map(|&size| producer.adopt(allocator, allocator.allocate(size, S).unwrap()))
        .collect()
}

/// Views per batch of [`share_model`].
const VIEWS: usize = SIZES.len() - 1 + 3;

/// A batch of every allocation but the last whole, named `p{i}`, plus three views into the last
/// one at odd offsets (a fused weight).
fn share_model(producer: &Producer, model: &mut [Shared]) -> BatchHandle {
    let mut batch = producer.batch();
    let (fused, whole) = model.split_last_mut().unwrap();
    for (i, allocation) in whole.iter_mut().enumerate() {
        batch.whole(allocation, format!("p{i}")).unwrap();
    }
    let fused = batch.allocation(fused).unwrap();
    batch.view(fused, "fused.q", 1, 4095).unwrap();
    batch.view(fused, "fused.k", 4096, 1000).unwrap();
    batch
        .view(fused, "fused.v", 65 * MIB as u64 - 3, 3)
        .unwrap();
    batch.share(S).unwrap()
}

#[test]
fn a_batch_round_trips_views_in_several_segments_exactly() {
    let (driver, allocator, producer) = setup();
    let mut model = model(&allocator, &producer);
    let handle = share_model(&producer, &mut model);
    let handle = BatchHandle::decode(&handle.encode()).unwrap();

    let bases: std::collections::HashSet<u64> = model
        .iter()
        .map(|a| allocator.base_allocation(a.ptr()).unwrap().0 .0)
        .collect();
    assert!(
        bases.len() >= 4 && bases.len() < SIZES.len(),
        "several segments, some shared by several allocations ({} for {})",
        bases.len(),
        SIZES.len()
    );
    assert_eq!(
        handle.segments().len(),
        bases.len(),
        "one handle per segment"
    );
    assert_eq!(handle.views().len(), VIEWS);
    let stats = producer.stats();
    assert_eq!(
        (stats.shares, stats.events_in_use),
        (1, 1),
        "one slot, one event"
    );
    assert_eq!(
        driver.counts.handles_exported.load(Ordering::Relaxed),
        bases.len()
    );

    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let received = consumer.open_batch(&handle, S).unwrap();
    assert_eq!(received.segments(), bases.len());
    assert_eq!(
        driver.counts.opens.load(Ordering::Relaxed),
        bases.len(),
        "each segment opened once"
    );
    assert_eq!(driver.counts.event_waits.load(Ordering::Relaxed), 1);
    for (i, (allocation, &size)) in model.iter().zip(&SIZES[..SIZES.len() - 1]).enumerate() {
        let view = received.get(&format!("p{i}")).unwrap();
        assert_eq!(view.len(), size as u64, "exact size of p{i}");
        assert_eq!(view.ptr().0, allocation.ptr().0 + FAKE_MAPPING_OFFSET);
    }
    let fused = model.last().unwrap().ptr().0 + FAKE_MAPPING_OFFSET;
    for (name, offset, len) in [
        ("fused.q", 1, 4095),
        ("fused.k", 4096, 1000),
        ("fused.v", 65 * MIB as u64 - 3, 3),
    ] {
        let view = received.get(name).unwrap();
        assert_eq!((view.ptr().0, view.len()), (fused + offset, len), "{name}");
    }
    assert_eq!(
        received.get("p1").unwrap().view::<u8>().unwrap().len(),
        1000
    );
    assert!(matches!(
        received.get("p0").unwrap().view::<f32>(),
        Err(Error::BadView { bytes: 1, .. })
    ));
    assert!(received.get("nope").is_none());
    // The views keep the producer's order.
    assert_eq!(received.views()[2].name(), "p2");

    drop(received);
    assert_eq!(producer.stats().events_in_use, 1, "held until pruned");
    drop(model);
    assert_eq!(
        producer.stats().limbo,
        0,
        "released before the producer freed"
    );
    assert_eq!(producer.stats().events_in_use, 0);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn a_warm_second_handoff_opens_nothing() {
    let (driver, allocator, producer) = setup();
    let mut model = model(&allocator, &producer);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let first = share_model(&producer, &mut model);
    drop(consumer.open_batch(&first, S).unwrap());
    let opens = driver.counts.opens.load(Ordering::Relaxed);
    let exported = driver.counts.handles_exported.load(Ordering::Relaxed);
    let events = driver.counts.events_opened.load(Ordering::Relaxed);
    assert!(opens > 0);
    assert_eq!(driver.open_mappings(), first.segments().len(), "kept open");
    for _ in 0..3 {
        let again = share_model(&producer, &mut model);
        assert_ne!(again.slot(), first.slot(), "a new slot per message");
        let received = consumer.open_batch(&again, S).unwrap();
        assert_eq!(received.len(), VIEWS);
        drop(received);
    }
    assert_eq!(
        driver.counts.opens.load(Ordering::Relaxed),
        opens,
        "no open"
    );
    assert_eq!(
        driver.counts.handles_exported.load(Ordering::Relaxed),
        exported,
        "the producer's handles are cached too"
    );
    assert_eq!(
        driver.counts.events_opened.load(Ordering::Relaxed),
        events,
        "the producer's pooled event stays open here"
    );
    // trim() closes what was kept.
    consumer.trim();
    assert_eq!(driver.open_mappings(), 0);
    drop(model);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn kept_segments_are_bounded_and_can_be_turned_off() {
    let (driver, allocator, producer) = setup();
    let mut model = model(&allocator, &producer);
    let segments = share_model(&producer, &mut model).segments().len();
    let off = IpcConsumer::with_config(
        Arc::clone(&driver),
        ConsumerConfig {
            batch_segments: 0,
            ..ConsumerConfig::default()
        },
    );
    drop(
        off.open_batch(&share_model(&producer, &mut model), S)
            .unwrap(),
    );
    assert_eq!(driver.open_mappings(), 0, "closed with the batch");
    let two = IpcConsumer::with_config(
        Arc::clone(&driver),
        ConsumerConfig {
            batch_segments: 2,
            ..ConsumerConfig::default()
        },
    );
    let held = two
        .open_batch(&share_model(&producer, &mut model), S)
        .unwrap();
    assert_eq!(
        driver.open_mappings(),
        segments,
        "all open while the batch lives"
    );
    drop(held);
    assert_eq!(driver.open_mappings(), 2, "two kept");
    drop(two);
    assert_eq!(driver.open_mappings(), 0);
}

#[test]
fn the_batch_holds_every_allocation_until_the_consumer_releases_it() {
    let (driver, allocator, producer) = setup();
    let mut model = model(&allocator, &producer);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let handle = share_model(&producer, &mut model);
    let mut received = consumer.open_batch(&handle, S).unwrap();
    received.use_on(StreamId(7));
    drop(model); // the producer frees the whole model while the consumer holds it
    assert_eq!(producer.stats().limbo, SIZES.len());
    assert!(active(&allocator) > 0);
    assert!(!producer.collect(), "nothing freed while the slot is held");
    let syncs = driver.counts.stream_syncs.load(Ordering::Relaxed);
    drop(received);
    assert_eq!(
        driver.counts.stream_syncs.load(Ordering::Relaxed),
        syncs + 2,
        "both streams synchronized before the release"
    );
    assert!(producer.collect());
    let stats = producer.stats();
    assert_eq!((stats.limbo, stats.events_in_use), (0, 0));
    assert_eq!(active(&allocator), 0);
    producer.collect();
    assert!(
        !handle.ref_counter().path().exists(),
        "the file went with its last slot"
    );
}

#[test]
fn single_shares_and_batches_of_one_allocation_are_counted_apart() {
    let (driver, allocator, producer) = setup();
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut shared = producer.adopt(&allocator, allocator.allocate(MIB, S).unwrap());
    let single = shared.share(S).unwrap();
    let mut batch = producer.batch();
    batch.whole(&mut shared, "w").unwrap();
    let batch = batch.share(S).unwrap();
    let one = consumer.open(&single, S).unwrap();
    let many = consumer.open_batch(&batch, S).unwrap();
    assert_eq!(
        driver.counts.opens.load(Ordering::Relaxed),
        1,
        "one mapping"
    );
    assert_eq!(one.ptr(), many.get("w").unwrap().ptr());
    assert_eq!(shared.outstanding(), 2);
    drop(one);
    assert_eq!(shared.outstanding(), 1, "the batch still holds it");
    drop(shared);
    assert_eq!(producer.stats().limbo, 1);
    drop(many);
    assert!(producer.collect());
    assert_eq!(active(&allocator), 0);
}

#[test]
fn releasing_a_batch_without_opening_touches_only_its_slot() {
    let (driver, allocator, producer) = setup();
    let mut model = model(&allocator, &producer);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let handle = share_model(&producer, &mut model);
    consumer.release_batch(&handle).unwrap();
    assert_eq!(driver.counts.opens.load(Ordering::Relaxed), 0);
    assert_eq!(driver.counts.event_waits.load(Ordering::Relaxed), 0);
    assert_eq!(driver.counts.stream_syncs.load(Ordering::Relaxed), 0);
    assert!(matches!(
        consumer.release_batch(&handle),
        Err(Error::SlotNotHeld { .. })
    ));
    assert!(matches!(
        consumer.open_batch(&handle, S),
        Err(Error::SlotNotHeld { .. })
    ));
    drop(model);
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(active(&allocator), 0);
}

#[test]
fn bad_batches_are_refused_by_the_consumer_leaving_the_slot_usable() {
    let (driver, allocator, producer) = setup();
    let mut model = model(&allocator, &producer);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let handle = share_model(&producer, &mut model);
    let bytes = handle.encode();

    // A segment claiming more bytes than its handle opens (views still inside the claim).
    let name_len = handle.ref_counter().as_str().len();
    let size_at = 102 + name_len + 64;
    let mut bigger = bytes.clone();
    let real = handle.segments()[0].size;
    bigger[size_at..size_at + 8].copy_from_slice(&(real + 4096).to_le_bytes());
    let forged = BatchHandle::decode(&bigger).unwrap();
    assert!(matches!(
        consumer.open_batch(&forged, S),
        Err(Error::OutOfBounds { size, base_size, .. }) if size == real + 4096 && base_size == real
    ));
    // A device this process does not have.
    let mut device = bytes.clone();
    device[8..12].copy_from_slice(&5u32.to_le_bytes());
    assert!(matches!(
        consumer.open_batch(&BatchHandle::decode(&device).unwrap(), S),
        Err(Error::InvalidDevice {
            device: 5,
            count: 1
        })
    ));
    // A slot past the file.
    let mut slot = bytes.clone();
    slot[28..36].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        consumer.open_batch(&BatchHandle::decode(&slot).unwrap(), S),
        Err(Error::SlotOutOfRange { .. })
    ));
    assert_eq!(driver.open_mappings(), 0, "nothing left open");
    // Nothing was claimed or changed: the real batch opens once, and only once at a time.
    let received = consumer.open_batch(&handle, S).unwrap();
    let other = IpcConsumer::new(Arc::clone(&driver));
    assert!(matches!(
        other.open_batch(&handle, S),
        Err(Error::SlotClaimed { .. }) | Err(Error::SlotNotHeld { .. })
    ));
    drop(received);
    assert!(matches!(
        consumer.open_batch(&handle, S),
        Err(Error::SlotNotHeld { .. })
    ));
    drop(model);
    assert_eq!(active(&allocator), 0);
}

/// The problem of an `InvalidBatch` error.
fn invalid<T: std::fmt::Debug>(result: Result<T, Error>) -> String {
    match result {
        Err(Error::InvalidBatch { problem }) => problem,
        other => panic!("expected InvalidBatch, got {other:?}"),
    }
}

#[test]
fn bad_batches_are_refused_by_the_producer_before_a_slot_is_taken() {
    let (driver, allocator, producer) = setup();
    let mut a = producer.adopt(&allocator, allocator.allocate(4096, S).unwrap());
    let mut b = producer.adopt(&allocator, allocator.allocate(4096, S).unwrap());
    assert!(invalid(producer.batch().share(S)).contains("nothing was added"));
    let mut batch = producer.batch();
    let i = batch.whole(&mut a, "x").unwrap();
    assert!(invalid(batch.view(i, "past", 4000, 97)).contains("4096"));
    assert!(invalid(batch.view(i, "overflow", u64::MAX, 2)).contains("offset"));
    assert!(invalid(batch.view(9, "nowhere", 0, 1)).contains("allocation 9"));
    batch.whole(&mut b, "x").unwrap();
    assert!(invalid(batch.share(S)).contains("same name"));
    let mut batch = producer.batch();
    let i = batch.allocation(&mut a).unwrap();
    batch.view(i, "lo", 0, 100).unwrap();
    batch.view(i, "mid", 50, 100).unwrap();
    assert!(invalid(batch.share(S)).contains("overlap"));
    // An allocation of another producer.
    let other = IpcProducer::with_config(Arc::clone(&driver), ProducerConfig::default());
    let mut foreign = other.adopt(&allocator, allocator.allocate(512, S).unwrap());
    assert!(invalid(producer.batch().allocation(&mut foreign)).contains("another IpcProducer"));
    // Only empty allocations: nothing to send.
    let mut empty = producer.adopt(&allocator, allocator.allocate(0, S).unwrap());
    let mut batch = producer.batch();
    batch.whole(&mut empty, "e").unwrap();
    assert!(invalid(batch.share(S)).contains("zero-byte"));
    let stats = producer.stats();
    assert_eq!((stats.shares, stats.files_created), (0, 0), "no slot taken");
    // An empty allocation beside others: a view of no memory.
    let mut batch = producer.batch();
    batch.whole(&mut empty, "e").unwrap();
    batch.whole(&mut a, "a").unwrap();
    let handle = batch.share(S).unwrap();
    let received = IpcConsumer::new(Arc::clone(&driver))
        .open_batch(&handle, S)
        .unwrap();
    let e = received.get("e").unwrap();
    assert!(e.is_empty() && e.ptr().0 == 0);
}

#[test]
fn truncated_or_flipped_bytes_of_a_real_batch_never_reach_the_driver() {
    let (driver, allocator, producer) = setup();
    let mut model = model(&allocator, &producer);
    let bytes = share_model(&producer, &mut model).encode();
    for at in 0..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0xff;
        let _ = BatchHandle::decode(&b);
        let mut cut = bytes.clone();
        cut.truncate(at);
        assert!(matches!(
            BatchHandle::decode(&cut),
            Err(Error::MalformedBatch { .. })
        ));
    }
    assert_eq!(driver.counts.opens.load(Ordering::Relaxed), 0);
}
