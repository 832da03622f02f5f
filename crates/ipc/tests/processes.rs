//! Producer and consumer in two real processes (the fake driver: ref counting, slot owners and file
//! cleanup need no GPU), including kill -9 of either side. Each test re-executes this binary, running
//! only itself, as the other process; an environment variable gives the child its role.

#[path = "common/child.rs"]
mod child;
mod common;

use std::io::BufReader;
use std::process::ChildStdout;
use std::sync::Arc;

use child::{expect, kill9, Peer};
use common::{hex, unhex};
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_ipc::driver::fake::FakeDriver;
use tensormem_ipc::{BatchHandle, IpcConsumer, IpcHandle, IpcProducer};

const ROLE: &str = "TENSORMEM_IPC_TEST_ROLE";
const HANDLE: &str = "TENSORMEM_IPC_TEST_HANDLE";
const S: StreamId = StreamId(0);

/// This test binary again, running only `test` in the role `role`.
fn spawn(test: &str, role: &str, handle: Option<&IpcHandle>) -> (Peer, BufReader<ChildStdout>) {
    let wire = handle.map(|h| hex(&h.encode()));
    let mut vars = vec![(ROLE, role)];
    if let Some(wire) = &wire {
        vars.push((HANDLE, wire.as_str()));
    }
    child::spawn(test, &vars)
}

fn received_handle() -> IpcHandle {
    IpcHandle::decode(&unhex(&std::env::var(HANDLE).unwrap())).unwrap()
}

fn setup() -> (
    Arc<CachingAllocator<SimDevice>>,
    IpcProducer<SimDevice, FakeDriver>,
) {
    let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
    (allocator, IpcProducer::new(Arc::new(FakeDriver::default())))
}

#[test]
fn a_consumer_process_releases_its_slot() {
    if let Ok(role) = std::env::var(ROLE) {
        assert_eq!(role, "consumer");
        let consumer = IpcConsumer::new(Arc::new(FakeDriver::default()));
        let received = consumer.open(&received_handle(), S).unwrap();
        println!("@@opened {}", received.size());
        drop(received);
        println!("@@released");
        return;
    }
    let (allocator, producer) = setup();
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(1 << 20, S).unwrap(), S)
        .unwrap();
    let (mut child, mut out) = spawn(
        "a_consumer_process_releases_its_slot",
        "consumer",
        Some(&handle),
    );
    assert_eq!(expect(&mut out, "opened"), (1 << 20).to_string());
    expect(&mut out, "released");
    assert!(child.wait().unwrap().success());
    drop(shared);
    assert_eq!(
        producer.stats().limbo,
        0,
        "released before the producer freed"
    );
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    producer.collect();
    assert!(!handle.ref_counter.as_ref().unwrap().path().exists());
}

#[test]
fn a_consumer_killed_holding_memory_does_not_pin_it() {
    if std::env::var(ROLE).is_ok() {
        let consumer = IpcConsumer::new(Arc::new(FakeDriver::default()));
        let received = consumer.open(&received_handle(), S).unwrap();
        println!("@@opened {}", received.size());
        std::thread::sleep(std::time::Duration::from_secs(600));
        return;
    }
    let (allocator, producer) = setup();
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    let (mut child, mut out) = spawn(
        "a_consumer_killed_holding_memory_does_not_pin_it",
        "consumer",
        Some(&handle),
    );
    expect(&mut out, "opened");
    drop(shared);
    assert_eq!(producer.stats().limbo, 1);
    assert!(
        !producer.collect(),
        "a live consumer's memory is not reclaimed"
    );
    kill9(&mut child);
    assert!(producer.collect(), "the dead consumer's slot is reclaimed");
    let stats = producer.stats();
    assert_eq!((stats.limbo, stats.slots_reclaimed), (0, 1));
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    assert!(
        !handle.ref_counter.as_ref().unwrap().path().exists(),
        "nothing left in /dev/shm"
    );
}

#[test]
fn a_producer_killed_while_shared_leaves_nothing_behind() {
    if std::env::var(ROLE).is_ok() {
        let (allocator, producer) = setup();
        let (_shared, handle) = producer
            .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
            .unwrap();
        println!("@@handle {}", hex(&handle.encode()));
        std::thread::sleep(std::time::Duration::from_secs(600));
        return;
    }
    let (mut child, mut out) = spawn(
        "a_producer_killed_while_shared_leaves_nothing_behind",
        "producer",
        None,
    );
    let handle = IpcHandle::decode(&unhex(&expect(&mut out, "handle"))).unwrap();
    let driver = Arc::new(FakeDriver::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let received = consumer.open(&handle, S).unwrap();
    kill9(&mut child);
    assert!(
        handle.ref_counter.as_ref().unwrap().path().exists(),
        "the dead producer's file is still there"
    );
    drop(received);
    drop(consumer);
    assert!(
        !handle.ref_counter.as_ref().unwrap().path().exists(),
        "the consumer removed the dead producer's file"
    );
    assert_eq!(driver.open_mappings(), 0);
}

/// A model of allocations of odd sizes in several segments, shared as one batch.
fn share_model_batch(
    allocator: &Arc<CachingAllocator<SimDevice>>,
    producer: &IpcProducer<SimDevice, FakeDriver>,
) -> (
    Vec<tensormem_ipc::SharedAllocation<SimDevice, FakeDriver>>,
    BatchHandle,
) {
    let mut model: Vec<_> = [1000, 3 << 20, 7, 25 << 20, 1 << 20]
        .into_iter()
        .map(|size| producer.adopt(allocator, allocator.allocate(size, S).unwrap()))
        .collect();
    let mut batch = producer.batch();
    for (i, allocation) in model.iter_mut().enumerate() {
        batch.whole(allocation, format!("layer{i}.weight")).unwrap();
    }
    let handle = batch.share(S).unwrap();
    (model, handle)
}

fn spawn_batch(test: &str, role: &str, batch: &BatchHandle) -> (Peer, BufReader<ChildStdout>) {
    child::spawn(test, &[(ROLE, role), (HANDLE, &hex(&batch.encode()))])
}

fn received_batch() -> BatchHandle {
    BatchHandle::decode(&unhex(&std::env::var(HANDLE).unwrap())).unwrap()
}

#[test]
fn a_consumer_process_releases_a_batch() {
    if std::env::var(ROLE).is_ok() {
        let consumer = IpcConsumer::new(Arc::new(FakeDriver::default()));
        let received = consumer.open_batch(&received_batch(), S).unwrap();
        println!("@@opened {}", received.len());
        drop(received);
        println!("@@released");
        return;
    }
    let (allocator, producer) = setup();
    let (model, handle) = share_model_batch(&allocator, &producer);
    let (mut child, mut out) =
        spawn_batch("a_consumer_process_releases_a_batch", "consumer", &handle);
    assert_eq!(expect(&mut out, "opened"), "5");
    expect(&mut out, "released");
    assert!(child.wait().unwrap().success());
    drop(model);
    assert_eq!(
        producer.stats().limbo,
        0,
        "released before the producer freed"
    );
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    producer.collect();
    assert!(!handle.ref_counter().path().exists());
}

#[test]
fn a_consumer_killed_holding_a_batch_does_not_pin_it() {
    if std::env::var(ROLE).is_ok() {
        let consumer = IpcConsumer::new(Arc::new(FakeDriver::default()));
        let received = consumer.open_batch(&received_batch(), S).unwrap();
        println!("@@opened {}", received.len());
        std::thread::sleep(std::time::Duration::from_secs(600));
        return;
    }
    let (allocator, producer) = setup();
    let (model, handle) = share_model_batch(&allocator, &producer);
    let (mut child, mut out) = spawn_batch(
        "a_consumer_killed_holding_a_batch_does_not_pin_it",
        "consumer",
        &handle,
    );
    expect(&mut out, "opened");
    drop(model);
    assert_eq!(
        producer.stats().limbo,
        5,
        "every allocation of the batch held"
    );
    assert!(
        !producer.collect(),
        "a live consumer's batch is not reclaimed"
    );
    assert!(allocator.memory_stats().active_bytes.all.current > 0);
    kill9(&mut child);
    assert!(producer.collect(), "the dead consumer's slot is reclaimed");
    let stats = producer.stats();
    assert_eq!(
        (stats.limbo, stats.slots_reclaimed, stats.events_in_use),
        (0, 1, 0),
        "one slot for the whole batch"
    );
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    assert!(
        !handle.ref_counter().path().exists(),
        "nothing left in /dev/shm"
    );
}
