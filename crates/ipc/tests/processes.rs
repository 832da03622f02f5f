//! Producer and consumer in two real processes (the fake driver: ref counting, slot owners and file
//! cleanup need no GPU), including kill -9 of either side. Each test re-executes this binary, running
//! only itself, as the other process; an environment variable gives the child its role.

use std::io::{BufReader, Read, Write};
use std::process::{ChildStdout, Stdio};
use std::sync::{Arc, OnceLock};

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_ipc::driver::fake::FakeDriver;
use tensormem_ipc::{
    BatchHandle, IpcConsumer, IpcHandle, IpcProducer, PRODUCER_TERMINATED_WARNING,
};
use tensormem_test_support::child::{self, expect, Peer};
use tensormem_test_support::{hex, unhex};

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
    child::spawn(child::this_test(test).envs(vars))
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
    child.kill9();
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
    child.kill9();
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
    child::spawn(
        child::this_test(test)
            .env(ROLE, role)
            .env(HANDLE, hex(&batch.encode())),
    )
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
    child.kill9();
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

/// Writes the message of every warning (and error) to stderr: the child's only subscriber.
struct WarningsToStderr;

impl tracing::Subscriber for WarningsToStderr {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        let _ = writeln!(
            std::io::stderr(),
            "{} {}: {}",
            event.metadata().level(),
            event.metadata().target(),
            message.0
        );
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// The child's process-wide state, in a static as the process runtime keeps it: never dropped.
type Process = (
    Arc<CachingAllocator<SimDevice>>,
    IpcProducer<SimDevice, FakeDriver>,
);
static PROCESS: OnceLock<Process> = OnceLock::new();

#[test]
fn a_producer_exiting_normally_leaves_no_file_and_warns() {
    const TEST: &str = "a_producer_exiting_normally_leaves_no_file_and_warns";
    if std::env::var(ROLE).is_ok() {
        tracing::subscriber::set_global_default(WarningsToStderr).unwrap();
        let (allocator, producer) = PROCESS.get_or_init(|| {
            let producer = IpcProducer::new(Arc::new(FakeDriver::default()));
            producer.register_exit_hook();
            (
                Arc::new(CachingAllocator::new(SimDevice::new(1 << 30))),
                producer,
            )
        });
        let (held, handle) = producer
            .share(allocator, allocator.allocate(4096, S).unwrap(), S)
            .unwrap();
        // A share alive until the process ends, as a model's weights are.
        let (kept, _) = producer
            .share(allocator, allocator.allocate(8192, S).unwrap(), S)
            .unwrap();
        std::mem::forget(kept);
        println!("@@handle {}", hex(&handle.encode()));
        let mut go = String::new();
        std::io::stdin().read_line(&mut go).unwrap();
        drop(held); // the parent holds it: into the limbo
        return; // a normal exit, without ipc_collect
    }
    let mut child = Peer(
        child::this_test(TEST)
            .env(ROLE, "producer")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let handle = IpcHandle::decode(&unhex(&expect(&mut out, "handle"))).unwrap();
    let driver = Arc::new(FakeDriver::default());
    let consumer = IpcConsumer::new(Arc::clone(&driver));
    let received = consumer.open(&handle, S).unwrap();
    assert!(handle.ref_counter.as_ref().unwrap().path().exists());
    let mut stderr = child.stderr.take().unwrap();
    writeln!(child.stdin.take().unwrap(), "exit").unwrap();
    let status = child.wait().unwrap();
    let mut warnings = String::new();
    stderr.read_to_string(&mut warnings).unwrap();
    assert!(status.success(), "{warnings}");
    assert!(
        warnings.contains(PRODUCER_TERMINATED_WARNING),
        "the child did not warn: {warnings:?}"
    );
    let prefix = format!("tensormem_{}_", child.id());
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&prefix))
        .collect();
    assert!(
        left.is_empty(),
        "left in /dev/shm by the exited producer: {left:?}"
    );
    // The consumer still releases its slot and closes what it opened.
    drop(received);
    drop(consumer);
    assert_eq!(driver.open_mappings(), 0);
}

/// A batch sent and never opened (its consumer killed before it opened it) does not pin the
/// producer's memory: once freed and past the producer's limit, `collect` gives the slot up, and an
/// open that comes too late is refused rather than mapping memory that may be in use again.
#[test]
fn a_batch_never_opened_is_given_up_and_a_late_open_refused() {
    if std::env::var(ROLE).is_ok() {
        // Killed before it opens anything.
        println!("@@started");
        std::thread::sleep(std::time::Duration::from_secs(600));
        return;
    }
    let allocator = Arc::new(CachingAllocator::new(SimDevice::new(1 << 30)));
    let producer = IpcProducer::with_config(
        Arc::new(FakeDriver::default()),
        tensormem_ipc::ProducerConfig {
            expire_unopened_batches: Some(std::time::Duration::ZERO),
            ..tensormem_ipc::ProducerConfig::default()
        },
    );
    let (model, handle) = share_model_batch(&allocator, &producer);
    // Another share keeps the ref-counter file in use, so that a late open finds it.
    let (_kept, _kept_handle) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    let (mut child, mut out) = spawn_batch(
        "a_batch_never_opened_is_given_up_and_a_late_open_refused",
        "consumer",
        &handle,
    );
    expect(&mut out, "started");
    child.kill9();
    drop(model);
    assert!(producer.collect(), "the unopened batch's memory is freed");
    let stats = producer.stats();
    assert_eq!((stats.limbo, stats.slots_reclaimed), (0, 1));
    assert_eq!(allocator.memory_stats().allocated_bytes.all.current, 4096);
    let late = IpcConsumer::new(Arc::new(FakeDriver::default()));
    match late.open_batch(&handle, S) {
        Err(tensormem_ipc::Error::ShareExpired { slot, .. }) => assert_eq!(slot, handle.slot()),
        other => panic!("a late open must be refused, got {other:?}"),
    }
}

/// Single shares do not expire by default: a PyTorch consumer never claims the slot it holds, so
/// a share with no claim may well be in use.
#[test]
fn single_shares_never_opened_stay_held_by_default() {
    let (allocator, producer) = setup();
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(4096, S).unwrap(), S)
        .unwrap();
    drop(shared);
    assert!(!producer.collect());
    assert_eq!(producer.stats().limbo, 1, "held, as PyTorch holds it");
    // Opened and released later, it is freed as usual.
    let consumer = IpcConsumer::new(Arc::new(FakeDriver::default()));
    drop(consumer.open(&handle, S).unwrap());
    assert!(producer.collect());
    assert_eq!(producer.stats().limbo, 0);
}
