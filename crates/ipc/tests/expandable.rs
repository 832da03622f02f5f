//! Memory of expandable segments between two real processes (simulated device, fake driver): the
//! consumer takes the producer's chunk descriptors with `pidfd_getfd` or over the producer's socket,
//! maps only the shared chunks, releases its slot, and neither side's death pins or leaks anything.
//! Each test re-executes this binary, running only itself, as the other process.

use std::io::BufReader;
use std::process::ChildStdout;
use std::sync::Arc;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_ipc::driver::fake::FakeDriver;
use tensormem_ipc::{
    ChunkFdRoutes, ConsumerConfig, Error, IpcConsumer, IpcHandle, IpcProducer, SegmentMemory,
};
use tensormem_test_support::child::{self, expect, Peer};
use tensormem_test_support::{hex, unhex};

const ROLE: &str = "TENSORMEM_IPC_EXPANDABLE_ROLE";
const HANDLE: &str = "TENSORMEM_IPC_EXPANDABLE_HANDLE";
const ROUTES: &str = "TENSORMEM_IPC_EXPANDABLE_ROUTES";
const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;

fn spawn(
    test: &str,
    role: &str,
    handle: Option<&IpcHandle>,
    routes: &str,
) -> (Peer, BufReader<ChildStdout>) {
    let wire = handle.map(|h| hex(&h.encode()));
    let mut vars = vec![(ROLE, role), (ROUTES, routes)];
    if let Some(wire) = &wire {
        vars.push((HANDLE, wire.as_str()));
    }
    child::spawn(child::this_test(test).envs(vars))
}

fn setup() -> (
    Arc<CachingAllocator<SimDevice>>,
    IpcProducer<SimDevice, FakeDriver>,
) {
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let allocator = Arc::new(CachingAllocator::with_config(
        SimDevice::new(8 << 30),
        config,
    ));
    (allocator, IpcProducer::new(Arc::new(FakeDriver::default())))
}

fn consumer(driver: &Arc<FakeDriver>) -> IpcConsumer<FakeDriver> {
    let chunk_fds = match std::env::var(ROUTES).as_deref() {
        Ok("socket") => ChunkFdRoutes::SocketOnly,
        _ => ChunkFdRoutes::Auto,
    };
    IpcConsumer::with_config(
        Arc::clone(driver),
        ConsumerConfig {
            chunk_fds,
            // Kept idle if it were allowed: chunks are closed at once all the same.
            idle_mem_handles: 8,
            ..ConsumerConfig::default()
        },
    )
}

#[test]
fn a_consumer_process_maps_the_shared_chunks_and_releases_them() {
    const TEST: &str = "a_consumer_process_maps_the_shared_chunks_and_releases_them";
    if std::env::var(ROLE).is_ok() {
        let driver = Arc::new(FakeDriver::default());
        let consumer = consumer(&driver);
        let handle = IpcHandle::decode(&unhex(&std::env::var(HANDLE).unwrap())).unwrap();
        let received = consumer.open(&handle, S).unwrap();
        println!(
            "@@opened {} {:?} {}",
            received.size(),
            received.fd_route(),
            driver
                .counts
                .chunk_imports
                .load(std::sync::atomic::Ordering::Relaxed)
        );
        drop(received);
        assert_eq!(consumer.open_mem_handles(), 0, "chunks are not kept idle");
        assert_eq!(driver.open_mappings(), 0);
        println!("@@released");
        return;
    }
    for (routes, route) in [("socket", "Some(Socket)"), ("auto", "")] {
        let (allocator, producer) = setup();
        // 4 MiB first, then 25 MiB + 7 bytes: the shared block spans chunks 0 and 1 of 20 MiB.
        let first = allocator.allocate(4 * MIB, S).unwrap();
        let allocation = allocator.allocate(25 * MIB + 7, S).unwrap();
        let (shared, handle) = producer.share(&allocator, allocation, S).unwrap();
        let SegmentMemory::Chunks(chunks) = &handle.memory else {
            panic!("an expandable block is shared as chunks: {handle:?}");
        };
        assert_eq!((chunks.fds.len(), chunks.pid), (2, std::process::id()));
        assert_eq!(
            (handle.size, handle.offset),
            (25 * MIB as u64 + 7, 4 * MIB as u64)
        );
        let (mut child, mut out) = spawn(TEST, "consumer", Some(&handle), routes);
        let opened = expect(&mut out, "opened");
        let fields: Vec<&str> = opened.split_whitespace().collect();
        assert_eq!(fields[0], (25 * MIB + 7).to_string());
        assert!(fields[1].starts_with("Some("), "{opened}");
        if !route.is_empty() {
            assert_eq!(fields[1], route);
        }
        assert_eq!(fields[2], "2", "only the two shared chunks are imported");
        expect(&mut out, "released");
        assert!(child.0.wait().unwrap().success());
        drop(shared);
        assert_eq!(
            producer.stats().limbo,
            0,
            "released before the producer freed"
        );
        allocator.free(first).unwrap();
        assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
        producer.collect();
    }
}

#[test]
fn a_consumer_killed_holding_chunks_does_not_pin_them() {
    const TEST: &str = "a_consumer_killed_holding_chunks_does_not_pin_them";
    if std::env::var(ROLE).is_ok() {
        let driver = Arc::new(FakeDriver::default());
        let consumer = consumer(&driver);
        let handle = IpcHandle::decode(&unhex(&std::env::var(HANDLE).unwrap())).unwrap();
        let received = consumer.open(&handle, S).unwrap();
        println!("@@opened {}", received.size());
        std::thread::sleep(std::time::Duration::from_secs(600));
        return;
    }
    let (allocator, producer) = setup();
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(1000, S).unwrap(), S)
        .unwrap();
    let (mut child, mut out) = spawn(TEST, "consumer", Some(&handle), "auto");
    expect(&mut out, "opened");
    drop(shared);
    assert_eq!(producer.stats().limbo, 1);
    assert!(
        !producer.collect(),
        "a live consumer's memory is not reclaimed"
    );
    child.kill9();
    assert!(producer.collect(), "the dead consumer's slot is reclaimed");
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    // With nothing allocated, emptying the cache unmaps the chunk and closes its descriptor.
    allocator.empty_cache().unwrap();
    assert_eq!(allocator.memory_stats().reserved_bytes.all.current, 0);
}

#[test]
fn a_producer_killed_while_shared_leaves_nothing_behind() {
    const TEST: &str = "a_producer_killed_while_shared_leaves_nothing_behind";
    if std::env::var(ROLE).is_ok() {
        let (allocator, producer) = setup();
        let (_shared, handle) = producer
            .share(&allocator, allocator.allocate(3 * MIB, S).unwrap(), S)
            .unwrap();
        println!("@@handle {}", hex(&handle.encode()));
        std::thread::sleep(std::time::Duration::from_secs(600));
        return;
    }
    let (mut child, mut out) = spawn(TEST, "producer", None, "auto");
    let handle = IpcHandle::decode(&unhex(&expect(&mut out, "handle"))).unwrap();
    let driver = Arc::new(FakeDriver::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let received = consumer.open(&handle, S).unwrap();
    child.kill9();
    // The mapping stays usable (the imported chunks live on here) until the consumer lets go.
    assert_eq!(received.size(), 3 * MIB as u64);
    drop(received);
    drop(consumer);
    assert_eq!(driver.open_mappings(), 0);
    assert!(
        !handle.ref_counter.as_ref().unwrap().path().exists(),
        "the consumer removed the dead producer's file"
    );
    // A handle of the dead producer cannot be opened any more, and the error says why.
    let late = IpcConsumer::new(Arc::new(FakeDriver::default()));
    match late.open(&handle, S) {
        Err(Error::RefCounterFile { .. } | Error::ChunkDescriptors { .. }) => {}
        other => panic!("expected the producer's absence to be named, got {other:?}"),
    }
}

#[test]
fn a_forged_descriptor_is_refused_by_both_ways() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let (allocator, producer) = setup();
    let (shared, mut handle) = producer
        .share(&allocator, allocator.allocate(1000, S).unwrap(), S)
        .unwrap();
    // stdin: open in the producer, never exported for a share.
    if let SegmentMemory::Chunks(chunks) = &mut handle.memory {
        chunks.fds = vec![0];
    }
    let driver = Arc::new(FakeDriver::default());
    for routes in [ChunkFdRoutes::SocketOnly, ChunkFdRoutes::Auto] {
        let consumer = IpcConsumer::with_config(
            Arc::clone(&driver),
            ConsumerConfig {
                chunk_fds: routes,
                ..ConsumerConfig::default()
            },
        );
        let err = consumer.open(&handle, S).unwrap_err();
        match routes {
            // The socket hands out only what was exported.
            ChunkFdRoutes::SocketOnly => assert!(
                matches!(&err, Error::ChunkDescriptors { problem, .. } if problem.contains("not exported")),
                "{err}"
            ),
            // pidfd_getfd copies any descriptor (as for PyTorch); the import then refuses it.
            _ => assert!(matches!(err, Error::Driver(_)), "{err}"),
        }
    }
    assert_eq!(
        driver.open_mappings(),
        0,
        "nothing is left mapped by a refused open"
    );
    drop(shared);
    producer.collect();
}
