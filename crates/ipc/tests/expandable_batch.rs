//! Batches that carry memory of expandable segments beside device allocations (simulated device,
//! fake driver): the views alias the producer's chunks at the right offsets, touching blocks of
//! one segment travel as one range, malformed ranges are refused, and a consumer that lets go, or
//! dies, leaves nothing pinned: the allocations are freed and the chunks can be released.

use std::io::BufReader;
use std::process::ChildStdout;
use std::sync::Arc;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, StreamId};
use tensormem_ipc::driver::fake::{FakeDriver, FAKE_MAPPING_OFFSET};
use tensormem_ipc::{
    BatchHandle, ChunkFdRoutes, ConsumerConfig, Error, IpcConsumer, IpcProducer, ReceivedBatch,
    SegmentMemory, SharedAllocation, BATCH_ENCODING_VERSION,
};
use tensormem_test_support::child::{self, expect, Peer};
use tensormem_test_support::{hex, unhex};

mod common;
use common::{chunks_under, expandable_allocator};

const ROLE: &str = "TENSORMEM_IPC_EXPANDABLE_BATCH_ROLE";
const HANDLE: &str = "TENSORMEM_IPC_EXPANDABLE_BATCH_HANDLE";
const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;

type Shared = SharedAllocation<SimDevice, FakeDriver>;

/// Both kinds of memory, one producer.
struct Setup {
    driver: Arc<FakeDriver>,
    expandable: Arc<CachingAllocator<SimDevice>>,
    plain: Arc<CachingAllocator<SimDevice>>,
    producer: IpcProducer<SimDevice, FakeDriver>,
}

fn setup() -> Setup {
    let driver = Arc::new(FakeDriver::default());
    Setup {
        expandable: expandable_allocator(),
        plain: Arc::new(CachingAllocator::new(SimDevice::new(1 << 30))),
        producer: IpcProducer::new(Arc::clone(&driver)),
        driver,
    }
}

/// A model in both kinds of memory: `x` (25 MiB + 7) over chunks 0 and 1 of a large-pool
/// expandable segment, `y` (12 MiB) right after it in chunk 1, `z` (1000 bytes) in a small-pool
/// expandable segment, `o` (4096 bytes) in a device allocation.
fn model(s: &Setup) -> Vec<Shared> {
    let (e, p) = (&s.expandable, &s.plain);
    [(e, 25 * MIB + 7), (e, 12 * MIB), (e, 1000), (p, 4096)]
        .into_iter()
        .map(|(allocator, size)| {
            s.producer
                .adopt(allocator, allocator.allocate(size, S).unwrap())
        })
        .collect()
}

const NAMES: [&str; 4] = ["x", "y", "z", "o"];

/// The model as one batch: `x` as its first 25 MiB and its last 7 bytes (`x.tail`), the others
/// whole.
fn share(producer: &IpcProducer<SimDevice, FakeDriver>, model: &mut [Shared]) -> BatchHandle {
    let mut batch = producer.batch();
    let (x, rest) = model.split_first_mut().unwrap();
    let x = batch.allocation(x).unwrap();
    batch.view(x, "x", 0, 25 * MIB as u64).unwrap();
    batch.view(x, "x.tail", 25 * MIB as u64, 7).unwrap();
    for (allocation, name) in rest.iter_mut().zip(&NAMES[1..]) {
        batch.whole(allocation, *name).unwrap();
    }
    batch.share(S).unwrap()
}

fn chunks_of(handle: &BatchHandle, segment: usize) -> &tensormem_ipc::ChunkHandle {
    match &handle.segments()[segment].memory {
        SegmentMemory::Chunks(chunks) => chunks,
        other => panic!("segment {segment} is a range of chunks, not {other:?}"),
    }
}

#[test]
fn a_batch_carries_expandable_ranges_beside_allocations_and_its_views_alias_the_chunks() {
    let s = setup();
    let mut model = model(&s);
    let handle = share(&s.producer, &mut model);
    assert_eq!(handle.encoding_version(), BATCH_ENCODING_VERSION);
    let handle = BatchHandle::decode(&handle.encode()).unwrap();

    // x and y touch chunk 1: one range of chunks 0 and 1. z's small chunk, o's allocation.
    let segments = handle.segments();
    assert_eq!(segments.len(), 3, "{segments:?}");
    let x_chunks = chunks_under(&s.expandable, model[0].ptr());
    let y_chunks = chunks_under(&s.expandable, model[1].ptr());
    let z_chunks = chunks_under(&s.expandable, model[2].ptr());
    let range = chunks_of(&handle, 0);
    assert_eq!((range.chunk_size, range.fds.len()), (20 * MIB as u64, 2));
    assert_eq!(segments[0].size, 40 * MIB as u64);
    assert_eq!(y_chunks.base.0, x_chunks.base.0 + 20 * MIB as u64);
    assert_eq!(chunks_of(&handle, 1).chunk_size, 2 * MIB as u64);
    assert!(matches!(segments[2].memory, SegmentMemory::Allocation(_)));
    // Offsets count from the range's first chunk, as the producer lays the blocks out.
    let offset = |name: &str| handle.view(name).unwrap().offset;
    assert_eq!(offset("x"), model[0].ptr().0 - x_chunks.base.0);
    assert_eq!(offset("y"), model[1].ptr().0 - x_chunks.base.0);
    assert_eq!(
        offset("y") - offset("x"),
        model[1].ptr().0 - model[0].ptr().0
    );
    assert_eq!(offset("x.tail"), offset("x") + 25 * MIB as u64);
    assert_eq!(handle.view("x.tail").unwrap().len, 7);

    let consumer = IpcConsumer::new(Arc::clone(&s.driver));
    let received = consumer.open_batch(&handle, S).unwrap();
    assert_eq!(received.segments(), 3);
    // The consumer maps each range once, contiguously; its views keep the producer's distances.
    let ptr = |name: &str| received.get(name).unwrap().ptr();
    assert_eq!(ptr("y").0 - ptr("x").0, model[1].ptr().0 - model[0].ptr().0);
    assert_eq!(ptr("x.tail").0, ptr("x").0 + 25 * MIB as u64);
    assert_eq!(received.get("x").unwrap().len(), 25 * MIB as u64);
    assert_eq!(received.get("z").unwrap().len(), 1000);
    // The same physical chunks, at the same offsets in them, as in the producer.
    for (name, chunks, allocation) in [
        ("x", &x_chunks, &model[0]),
        ("y", &y_chunks, &model[1]),
        ("z", &z_chunks, &model[2]),
    ] {
        let into = allocation.ptr().0 - chunks.base.0;
        let (chunk, at) = s.driver.chunk_at(0, ptr(name)).unwrap();
        assert_eq!(chunk, chunks.ids()[0], "{name}: the producer's chunk");
        assert_eq!(
            at,
            into % chunks.chunk_size as u64,
            "{name}: the same offset in it"
        );
    }
    // x's last bytes lie in its second chunk.
    let (chunk, _) = s
        .driver
        .chunk_at(0, DeviceAddress(ptr("x").0 + 25 * MIB as u64))
        .unwrap();
    assert_eq!(chunk, x_chunks.ids()[1]);
    assert_eq!(
        ptr("o").0,
        model[3].ptr().0 + FAKE_MAPPING_OFFSET,
        "the device allocation as before"
    );
    assert_eq!(
        s.driver
            .counts
            .chunk_imports
            .load(std::sync::atomic::Ordering::Relaxed),
        3,
        "each chunk imported once"
    );

    // Dropped: the slot goes back and the ranges are unmapped at once; the allocation stays open
    // for the next batch.
    drop(received);
    assert_eq!(s.driver.open_mappings(), 1);
    drop(model);
    assert_eq!(s.producer.stats().limbo, 0, "nothing held: freed at once");
    assert_eq!(s.expandable.memory_stats().active_bytes.all.current, 0);
    s.expandable.empty_cache().unwrap();
    assert_eq!(s.expandable.memory_stats().reserved_bytes.all.current, 0);
    consumer.trim();
    assert_eq!(s.driver.open_mappings(), 0);
}

#[test]
fn malformed_ranges_of_chunks_are_refused_with_the_batch_error() {
    let s = setup();
    let mut model = model(&s);
    let wire = share(&s.producer, &mut model).encode();
    assert!(BatchHandle::decode(&wire).is_ok());
    let refused = |bytes: &[u8]| match BatchHandle::decode(bytes) {
        Err(Error::MalformedBatch { problem }) => problem,
        other => panic!("expected MalformedBatch, got {other:?}"),
    };
    for len in 0..wire.len() {
        refused(&wire[..len]);
    }
    // The first segment (the range of chunks) starts after the 102-byte header and the name:
    // kind (1), pid (4), chunk size (8), count (4), descriptors (4 each).
    let name_len = u16::from_le_bytes([wire[100], wire[101]]) as usize;
    let at = 102 + name_len;
    let with = |offset: usize, value: &[u8]| {
        let mut bytes = wire.clone();
        bytes[at + offset..at + offset + value.len()].copy_from_slice(value);
        refused(&bytes)
    };
    assert!(with(0, &[2]).contains("unknown kind 2"));
    assert!(with(13, &0u32.to_le_bytes()).contains("0 chunks"));
    assert!(with(13, &u32::MAX.to_le_bytes()).contains("chunks (1 to"));
    assert!(with(5, &(1u64 << 20).to_le_bytes()).contains("multiple of 2 MiB"));
    assert!(with(17, &(-3i32).to_le_bytes()).contains("negative"));
    let second_fd = i32::from_le_bytes(wire[at + 21..at + 25].try_into().unwrap());
    assert!(with(17, &second_fd.to_le_bytes()).contains("named twice"));
    // A build that reads version 1 only says so; this one names the versions it reads.
    let mut newer = wire.clone();
    newer[4..6].copy_from_slice(&3u16.to_le_bytes());
    assert!(refused(&newer).contains("versions 1 to 2"));
}

/// A consumer in another process: opens the batch, reports the lengths of its views, then holds
/// it until its stdin closes (or it is killed).
fn consumer_role() {
    let driver = Arc::new(FakeDriver::default());
    let consumer = IpcConsumer::with_config(
        Arc::clone(&driver),
        ConsumerConfig {
            chunk_fds: ChunkFdRoutes::SocketOnly,
            ..ConsumerConfig::default()
        },
    );
    let handle = BatchHandle::decode(&unhex(&std::env::var(HANDLE).unwrap())).unwrap();
    let received: ReceivedBatch<FakeDriver> = consumer.open_batch(&handle, S).unwrap();
    let lens: Vec<String> = NAMES
        .iter()
        .map(|n| received.get(n).unwrap().len().to_string())
        .collect();
    child::report(&format!("opened {}", lens.join(" ")));
    child::hold();
    drop(received);
    assert_eq!(
        consumer.open_mem_handles(),
        1,
        "only the allocation is kept"
    );
    child::report("released");
}

fn spawn(test: &str, handle: &BatchHandle) -> (Peer, BufReader<ChildStdout>) {
    child::spawn(
        child::this_test(test)
            .env(ROLE, "consumer")
            .env(HANDLE, hex(&handle.encode()))
            .stdin(std::process::Stdio::piped()),
    )
}

#[test]
fn a_consumer_process_releasing_a_batch_lets_the_producer_free_and_release_the_chunks() {
    const TEST: &str =
        "a_consumer_process_releasing_a_batch_lets_the_producer_free_and_release_the_chunks";
    if child::role(ROLE).is_some() {
        consumer_role();
        return;
    }
    let s = setup();
    let mut model = model(&s);
    let handle = share(&s.producer, &mut model);
    let (mut peer, mut out) = spawn(TEST, &handle);
    assert_eq!(
        expect(&mut out, "opened"),
        format!("{} {} 1000 4096", 25 * MIB, 12 * MIB)
    );
    drop(model);
    assert_eq!(s.producer.stats().limbo, 4, "held by the consumer");
    assert!(!s.producer.collect());
    drop(peer.stdin.take());
    expect(&mut out, "released");
    assert!(peer.wait().unwrap().success());
    assert!(s.producer.collect(), "released: freed");
    assert_eq!(s.producer.stats().limbo, 0);
    s.expandable.empty_cache().unwrap();
    assert_eq!(s.expandable.memory_stats().reserved_bytes.all.current, 0);
}

#[test]
fn a_consumer_killed_holding_a_batch_of_chunks_pins_nothing() {
    const TEST: &str = "a_consumer_killed_holding_a_batch_of_chunks_pins_nothing";
    if child::role(ROLE).is_some() {
        consumer_role();
        return;
    }
    let s = setup();
    let mut model = model(&s);
    let handle = share(&s.producer, &mut model);
    let (mut peer, mut out) = spawn(TEST, &handle);
    expect(&mut out, "opened");
    drop(model);
    assert_eq!(s.producer.stats().limbo, 4);
    assert!(
        !s.producer.collect(),
        "a live consumer's batch is not reclaimed"
    );
    peer.kill9();
    assert!(
        s.producer.collect(),
        "the dead consumer's slot is reclaimed"
    );
    assert_eq!(s.producer.stats().limbo, 0);
    assert_eq!(s.expandable.memory_stats().active_bytes.all.current, 0);
    s.expandable.empty_cache().unwrap();
    assert_eq!(s.expandable.memory_stats().reserved_bytes.all.current, 0);
}
