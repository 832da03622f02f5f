//! Weights publications on the fake driver: versions, waits and mismatches in one process, and a
//! consumer in a real second process (killed, or closing), so that the channel and the slot are
//! exercised across processes; memory of expandable segments published beside device
//! allocations. The GPU path (bytes really copied) is in `gpu/weights.rs`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, StreamId};
use tensormem_ipc::driver::fake::FakeDriver;
use tensormem_ipc::weights::{
    DType, DeviceCopy, PlacedTensor, PlanOptions, PublishedTensor, TensorMeta, WeightPublisher,
    WeightSubscriber, WeightsMessage,
};
use tensormem_ipc::{Error, IpcConsumer, IpcProducer, SegmentMemory};
use tensormem_test_support::child::{self, expect};
use tensormem_test_support::{hex, unhex};

mod common;
use common::{chunks_under, expandable_allocator};

const S: StreamId = StreamId(0);
const ROLE: &str = "TENSORMEM_IPC_WEIGHTS_ROLE";
const MESSAGE: &str = "TENSORMEM_IPC_WEIGHTS_MESSAGE";
const SECOND: Option<Duration> = Some(Duration::from_secs(10));

/// A producer on the fake driver with `n` bf16 tensors of 64x64 (8 KiB) back to back in one
/// allocation at 0x100000.
fn published(
    n: u64,
) -> (
    Arc<FakeDriver>,
    WeightPublisher<SimDevice, FakeDriver>,
    TensorMeta,
) {
    let driver = Arc::new(FakeDriver::default());
    driver.add_allocation(0, DeviceAddress(0x10_0000), (n * 8192) as usize);
    let meta = TensorMeta::contiguous(DType::BFloat16, &[64, 64]);
    let tensors: Vec<PublishedTensor> = (0..n)
        .map(|i| PublishedTensor {
            name: format!("layer{i}.weight"),
            ptr: DeviceAddress(0x10_0000 + i * 8192),
            meta: meta.clone(),
        })
        .collect();
    let producer = IpcProducer::new(Arc::clone(&driver));
    // SAFETY: the fake driver has no memory behind the addresses; nothing reads them.
    let publisher = unsafe { WeightPublisher::new(&producer, 0, &tensors) }.unwrap();
    (driver, publisher, meta)
}

fn names(n: u64) -> Vec<String> {
    (0..n).map(|i| format!("layer{i}.weight")).collect()
}

/// The consumer's destinations: `n` tensors, every other one 8 KiB apart (so runs merge pairwise).
fn destinations<'a>(names: &'a [String], meta: &'a TensorMeta) -> Vec<PlacedTensor<'a>> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| PlacedTensor {
            name,
            ptr: DeviceAddress(0x90_0000 + (i as u64) * 8192 + (i as u64 / 2) * 4096),
            meta,
        })
        .collect()
}

#[test]
fn versions_install_in_order_and_the_producer_waits_for_them() {
    let (driver, publisher, meta) = published(6);
    let message = WeightsMessage::decode(&publisher.message().unwrap().encode()).unwrap();
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut sub = WeightSubscriber::open(&consumer, &message, S).unwrap();
    assert_eq!(sub.tensors().len(), 6);
    // The consumer's parameters: one allocation of 1 MiB.
    driver.add_allocation(0, DeviceAddress(0x90_0000), 1 << 20);
    let names = names(6);
    let dst = destinations(&names, &meta);
    let plan = sub.prepare(&dst, PlanOptions::default()).unwrap();
    assert_eq!(sub.prepare(&dst, PlanOptions::default()).unwrap(), plan);
    // Plans by number, as a C caller keeps them.
    assert_eq!(sub.plan_id(plan.index()), Some(plan));
    assert_eq!((sub.plan_count(), sub.plan_id(1)), (1, None));
    assert_eq!(sub.plan(plan).copies().len(), 3, "pairs merge");
    assert_eq!(sub.plan(plan).bytes(), 6 * 8192);

    // No version yet: a consumer's wait times out, having changed nothing.
    let err = sub.begin(S, Some(Duration::from_millis(30))).unwrap_err();
    assert!(matches!(err, Error::WeightsTimedOut { .. }), "{err}");

    let consumer_thread = thread::spawn(move || {
        let mut got = Vec::new();
        for _ in 0..3 {
            // SAFETY: the fake driver moves no bytes.
            got.push(unsafe { sub.install(plan, S, SECOND) }.unwrap());
        }
        (got, sub)
    });
    for expected in 1..=3 {
        let v = publisher.publish(S).unwrap();
        assert_eq!(v, expected);
        publisher.wait_installed(v, SECOND).unwrap();
    }
    let (got, sub) = consumer_thread.join().unwrap();
    assert_eq!(got, vec![1, 2, 3]);
    assert_eq!(sub.installed(), 3);
    assert_eq!(driver.copies().len(), 9);
    assert_eq!(publisher.holders(), 1);
    drop(sub);
    assert_eq!(publisher.holders(), 0);
}

/// A consumer whose parameters are on another GPU than the publication: the install runs on its
/// stream's device, which is first given peer access to the publication's device.
#[test]
fn an_install_on_another_device_copies_there_with_peer_access() {
    let driver = Arc::new(FakeDriver::new(2));
    driver.add_allocation(0, DeviceAddress(0x10_0000), 2 * 8192);
    let meta = TensorMeta::contiguous(DType::BFloat16, &[64, 64]);
    let names = names(2);
    let tensors: Vec<PublishedTensor> = names
        .iter()
        .enumerate()
        .map(|(i, name)| PublishedTensor {
            name: name.clone(),
            ptr: DeviceAddress(0x10_0000 + i as u64 * 8192),
            meta: meta.clone(),
        })
        .collect();
    let producer = IpcProducer::<SimDevice, _>::new(Arc::clone(&driver));
    // SAFETY: the fake driver has no memory behind the addresses; nothing reads them.
    let publisher = unsafe { WeightPublisher::new(&producer, 0, &tensors) }.unwrap();
    let message = WeightsMessage::decode(&publisher.message().unwrap().encode()).unwrap();
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let other_gpu = StreamId(0x51);
    driver.set_stream_device(other_gpu, 1);
    let mut sub = WeightSubscriber::open(&consumer, &message, other_gpu).unwrap();
    driver.add_allocation(1, DeviceAddress(0x90_0000), 1 << 20);
    let plan = sub
        .prepare(&destinations(&names, &meta), PlanOptions::default())
        .unwrap();
    let v = publisher.publish(S).unwrap();
    // SAFETY: the fake driver moves no bytes.
    assert_eq!(unsafe { sub.install(plan, other_gpu, SECOND) }.unwrap(), v);
    assert_eq!(driver.copy_devices(), vec![1]);
    assert_eq!(driver.peer_accesses(), vec![(1, 0)]);
    // A stream of the publication's device needs no peer access.
    let v = publisher.publish(S).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { sub.install(plan, S, SECOND) }.unwrap(), v);
    assert_eq!(driver.copy_devices(), vec![1, 0]);
    assert_eq!(driver.peer_accesses(), vec![(1, 0)]);
}

#[test]
fn the_producer_does_not_pass_a_consumer_that_reads_a_version() {
    let (driver, publisher, _meta) = published(2);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut sub = WeightSubscriber::open(&consumer, &publisher.message().unwrap(), S).unwrap();
    let v = publisher.publish(S).unwrap();
    assert_eq!(sub.begin(S, SECOND).unwrap(), v);
    // Reading: the producer may not write the next version yet.
    let err = publisher
        .wait_installed(v, Some(Duration::from_millis(30)))
        .unwrap_err();
    assert!(matches!(err, Error::WeightsTimedOut { .. }), "{err}");
    sub.finish(v);
    publisher.wait_installed(v, SECOND).unwrap();
}

#[test]
fn mismatches_are_refused_before_any_copy() {
    let (driver, publisher, meta) = published(3);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut sub = WeightSubscriber::open(&consumer, &publisher.message().unwrap(), S).unwrap();
    let names = names(3);
    let other = TensorMeta::contiguous(DType::BFloat16, &[64, 32]);
    let mut dst = destinations(&names, &meta);
    dst[1].meta = &other;
    let err = sub.prepare(&dst, PlanOptions::default()).unwrap_err();
    assert!(
        matches!(&err, Error::WeightsMismatch { problem } if problem.contains("layer1.weight")),
        "{err}"
    );
    let renamed = ["layer0.weight", "layer1.weight", "layer9.weight"];
    let dst: Vec<PlacedTensor<'_>> = renamed
        .iter()
        .enumerate()
        .map(|(i, name)| PlacedTensor {
            name,
            ptr: DeviceAddress(0x90_0000 + i as u64 * 8192),
            meta: &meta,
        })
        .collect();
    let err = sub.prepare(&dst, PlanOptions::default()).unwrap_err();
    assert!(err.to_string().contains("layer9.weight"), "{err}");
    assert!(driver.copies().is_empty());
}

#[test]
fn closing_ends_the_consumers_wait_and_refuses_new_messages() {
    let (driver, mut publisher, _meta) = published(1);
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let unopened = publisher.message().unwrap();
    let mut sub = WeightSubscriber::open(&consumer, &publisher.message().unwrap(), S).unwrap();
    let waiter = thread::spawn(move || {
        let err = sub.begin(S, SECOND).unwrap_err();
        (err, sub)
    });
    thread::sleep(Duration::from_millis(20));
    publisher.close();
    let (err, sub) = waiter.join().unwrap();
    assert!(matches!(err, Error::PublicationClosed { .. }), "{err}");
    assert!(matches!(
        publisher.message().unwrap_err(),
        Error::PublicationClosed { .. }
    ));
    // The message never opened was given up at close: it no longer holds anything.
    assert_eq!(publisher.holders(), 1);
    let err = WeightSubscriber::open(&consumer, &unopened, S).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ShareExpired { .. } | Error::WeightsChannel { .. }
        ),
        "{err}"
    );
    let start = Instant::now();
    let releaser = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        drop(sub);
    });
    publisher.wait_released(SECOND).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(25));
    releaser.join().unwrap();
}

#[test]
fn malformed_messages_are_refused_at_every_length() {
    let (_driver, publisher, _meta) = published(3);
    let wire = publisher.message().unwrap().encode();
    assert!(WeightsMessage::decode(&wire).is_ok());
    for len in 0..wire.len() {
        let err = WeightsMessage::decode(&wire[..len]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::MalformedWeights { .. } | Error::MalformedBatch { .. }
            ),
            "{len}: {err}"
        );
    }
    let mut longer = wire.clone();
    longer.push(0);
    assert!(WeightsMessage::decode(&longer).is_err());
    // A shape that would run past its view.
    let mut bigger = wire.clone();
    let at = bigger.len() - 3 * (2 + 32) + 2; // first tensor's first size
    bigger[at..at + 8].copy_from_slice(&1_000_000u64.to_le_bytes());
    let err = WeightsMessage::decode(&bigger).unwrap_err();
    assert!(err.to_string().contains("past its view"), "{err}");
    let mut unknown = wire;
    let at = unknown.len() - 3 * (2 + 32);
    unknown[at] = 99;
    assert!(WeightsMessage::decode(&unknown)
        .unwrap_err()
        .to_string()
        .contains("unknown element type"));
}

#[test]
fn a_consumer_killed_while_subscribed_holds_nothing_back() {
    if let Some(role) = child::role(ROLE) {
        assert_eq!(role, "consumer");
        let driver = Arc::new(FakeDriver::default());
        let consumer = IpcConsumer::new(driver);
        let wire = unhex(&std::env::var(MESSAGE).unwrap());
        let mut sub =
            WeightSubscriber::open(&consumer, &WeightsMessage::decode(&wire).unwrap(), S).unwrap();
        let v = sub.begin(S, SECOND).unwrap();
        child::report(&format!("reading {v}"));
        child::hold();
        return;
    }
    let (_driver, mut publisher, _meta) = published(4);
    let wire = hex(&publisher.message().unwrap().encode());
    let (mut peer, mut out) = child::spawn(
        child::this_test("a_consumer_killed_while_subscribed_holds_nothing_back")
            .env(ROLE, "consumer")
            .env(MESSAGE, &wire)
            .stdin(std::process::Stdio::piped()),
    );
    let v = publisher.publish(S).unwrap();
    assert_eq!(expect(&mut out, "reading"), v.to_string());
    assert_eq!(publisher.holders(), 1);
    let err = publisher
        .wait_installed(v, Some(Duration::from_millis(30)))
        .unwrap_err();
    assert!(matches!(err, Error::WeightsTimedOut { .. }), "{err}");
    peer.kill9();
    // Killed mid-install: the producer goes on, and nothing stays held.
    publisher.wait_installed(v, SECOND).unwrap();
    assert_eq!(publisher.holders(), 0);
    publisher.wait_released(SECOND).unwrap();
}

#[test]
fn a_producer_that_exits_without_closing_leaves_no_file() {
    if let Some(role) = child::role(ROLE) {
        assert_eq!(role, "exiting producer");
        let driver = Arc::new(FakeDriver::default());
        driver.add_allocation(0, DeviceAddress(0x10_0000), 8192);
        let producer = IpcProducer::<SimDevice, _>::new(driver);
        // The process-wide producer's habit: its ref-counter files go at exit too.
        producer.register_exit_hook();
        let tensors = [PublishedTensor {
            name: "w".into(),
            ptr: DeviceAddress(0x10_0000),
            meta: TensorMeta::contiguous(DType::UInt8, &[8192]),
        }];
        // SAFETY: the fake driver has no memory behind the address; nothing reads it.
        let publisher = unsafe { WeightPublisher::new(&producer, 0, &tensors) }.unwrap();
        let message = publisher.message().unwrap();
        child::report(&format!(
            "files {} {}",
            message.channel(),
            message.batch().ref_counter()
        ));
        // As a process-wide table would: never dropped, then a normal exit.
        std::mem::forget(publisher);
        std::process::exit(0);
    }
    let (mut peer, mut out) = child::spawn(
        child::this_test("a_producer_that_exits_without_closing_leaves_no_file")
            .env(ROLE, "exiting producer"),
    );
    let files = expect(&mut out, "files");
    let names: Vec<&str> = files.split_whitespace().collect();
    assert_eq!(names.len(), 2, "{files}");
    assert!(peer.wait().unwrap().success());
    for name in names {
        let file = tensormem_shm::ShmName::new(name).unwrap().path();
        assert!(!file.exists(), "{} was left behind", file.display());
    }
}

/// A publication of memory of expandable segments beside a device allocation: tensors over two
/// 20 MiB chunks of one segment (one of them across the chunks' boundary), one in a small-pool
/// chunk, one in a device allocation. The consumer maps each range of chunks once, in one piece,
/// and the plan merges copies inside a range, across its chunks, but never from one segment into
/// the next, even where the consumer happens to map them side by side.
#[test]
fn expandable_memory_installs_through_one_mapping_per_range() {
    const MIB: usize = 1 << 20;
    let driver = Arc::new(FakeDriver::default());
    let expandable = expandable_allocator();
    let plain = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
    let x = expandable.allocate(40 * MIB, S).unwrap(); // chunks 0 and 1 of the large pool
    let y = expandable.allocate(MIB, S).unwrap(); // a 2 MiB chunk of the small pool
    let z = plain.allocate(4096, S).unwrap();
    // What the CUDA driver knows of this process's memory by itself.
    let (x_chunks, y_chunks) = (
        chunks_under(&expandable, x.ptr()),
        chunks_under(&expandable, y.ptr()),
    );
    for chunks in [&x_chunks, &y_chunks] {
        driver
            .add_chunks(0, chunks.base, chunks.chunk_size, &chunks.borrowed())
            .unwrap();
    }
    let (z_base, z_size) = plain.base_allocation(z.ptr()).unwrap();
    driver.add_allocation(0, z_base, z_size);
    let layout = [
        ("a", x.ptr(), 12 * MIB),
        ("b", x.ptr().offset(12 * MIB), 12 * MIB), // crosses into chunk 1
        ("e", x.ptr().offset(24 * MIB), 16 * MIB),
        ("c", y.ptr(), MIB),
        ("d", z.ptr(), 4096),
    ];
    let metas: Vec<TensorMeta> = layout
        .iter()
        .map(|&(_, _, len)| TensorMeta::contiguous(DType::UInt8, &[len as u64]))
        .collect();
    let tensors: Vec<PublishedTensor> = layout
        .iter()
        .zip(&metas)
        .map(|(&(name, ptr, _), meta)| PublishedTensor {
            name: name.into(),
            ptr,
            meta: meta.clone(),
        })
        .collect();
    let producer = IpcProducer::<SimDevice, _>::new(Arc::clone(&driver));
    // SAFETY: the allocations live until the publication is released, below.
    let mut publisher = unsafe { WeightPublisher::new(&producer, 0, &tensors) }.unwrap();
    assert_eq!(
        driver.counts.mappings_exported.load(Ordering::Relaxed),
        3,
        "each chunk exported once, however many tensors lie in it"
    );
    let message = WeightsMessage::decode(&publisher.message().unwrap().encode()).unwrap();
    let kinds: Vec<Option<usize>> = message
        .batch()
        .segments()
        .iter()
        .map(|s| match &s.memory {
            SegmentMemory::Chunks(chunks) => Some(chunks.fds.len()),
            SegmentMemory::Allocation(_) => None,
        })
        .collect();
    assert_eq!(kinds, [Some(2), Some(1), None]);

    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let mut sub = WeightSubscriber::open(&consumer, &message, S).unwrap();
    let src = |name: &str| sub.ptr(name).unwrap();
    // Each range in one piece; the fake maps the two ranges side by side.
    assert_eq!(src("b"), src("a").offset(12 * MIB));
    assert_eq!(src("c"), src("a").offset(40 * MIB));
    // The producer's chunks, at the producer's offsets in them.
    let (x_ids, y_ids) = (x_chunks.ids(), y_chunks.ids());
    assert_eq!(driver.chunk_at(0, src("a")), Some((x_ids[0], 0)));
    assert_eq!(
        driver.chunk_at(0, src("b").offset(8 * MIB)),
        Some((x_ids[1], 0))
    );
    assert_eq!(
        driver.chunk_at(0, src("e")),
        Some((x_ids[1], 4 * MIB as u64))
    );
    assert_eq!(driver.chunk_at(0, src("c")), Some((y_ids[0], 0)));

    // The engine's parameters: one allocation, the tensors back to back.
    let params = DeviceAddress(0x100_0000);
    driver.add_allocation(0, params, 64 * MIB);
    let mut at = 0;
    let destinations: Vec<PlacedTensor<'_>> = layout
        .iter()
        .zip(&metas)
        .map(|(&(name, _, len), meta)| {
            let placed = PlacedTensor {
                name,
                ptr: params.offset(at),
                meta,
            };
            at += len;
            placed
        })
        .collect();
    let copy = |src: DeviceAddress, dst: usize, len: usize| DeviceCopy {
        src,
        dst: params.offset(dst),
        len: len as u64,
    };
    let expected = [
        copy(src("a"), 0, 40 * MIB),
        copy(src("c"), 40 * MIB, MIB),
        copy(src("d"), 41 * MIB, 4096),
    ];
    let plan = sub.prepare(&destinations, PlanOptions::default()).unwrap();
    assert_eq!(sub.plan(plan).copies(), expected);

    let version = publisher.publish(S).unwrap();
    // SAFETY: the fake driver moves no bytes.
    assert_eq!(unsafe { sub.install(plan, S, SECOND) }.unwrap(), version);
    publisher.wait_installed(version, SECOND).unwrap();
    assert_eq!(driver.copies(), expected);
    assert_eq!(driver.counts.copy_batches.load(Ordering::Relaxed), 1);

    // The consumer lets go: nothing is held, the ranges are unmapped, the memory can be freed.
    drop(sub);
    assert_eq!(publisher.holders(), 0);
    publisher.wait_released(SECOND).unwrap();
    drop(publisher);
    consumer.trim();
    assert_eq!(driver.open_mappings(), 0);
    expandable.free(x).unwrap();
    expandable.free(y).unwrap();
    expandable.empty_cache().unwrap();
    assert_eq!(expandable.memory_stats().reserved_bytes.all.current, 0);
    plain.free(z).unwrap();
}
