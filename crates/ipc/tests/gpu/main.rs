//! CUDA IPC on a real GPU, between real processes, and against PyTorch.
//!
//! Every test is `#[ignore]`d: `cargo xtask test-gpu` and the bundle's `run.sh` run them with
//! `--include-ignored`. Run without a CUDA driver and device, a test prints
//! `skipped: no CUDA driver/device (...)` and passes, unless `TENSORMEM_REQUIRE_GPU=1` (which they set)
//! makes it fail. The PyTorch interop tests skip when `python3 -c 'import torch'` fails, unless
//! `TENSORMEM_REQUIRE_TORCH=1`.
//!
//! The tests re-execute this binary (running only themselves) as the peer process: a consumer that
//! reads commands on stdin, or a producer; an environment variable gives the role.
#![cfg(feature = "cuda")]

use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{self, check, CudaBackend};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, StreamId};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::{
    ChunkFdRoutes, ConsumerConfig, IpcConsumer, IpcHandle, IpcProducer, TorchShareTuple,
    RECEIVED_MEMORY_MESSAGE, REF_COUNTER_FILE_SIZE,
};
use tensormem_test_support::{child, gpu, hex, python, torch, unhex};

mod weights;

const ROLE: &str = "TENSORMEM_IPC_GPU_ROLE";
const S: StreamId = StreamId::DEFAULT;
const SCRIPT: &str = include_str!("../python/ipc_interop.py");

type Allocator = Arc<CachingAllocator<CudaBackend>>;
type Producer = IpcProducer<CudaBackend, CudaIpcDriver>;

/// Device 0's allocator, a producer, and the lock; `None` (after saying why) without a GPU.
fn gpu() -> Option<(Allocator, Producer, MutexGuard<'static, ()>)> {
    let lock = gpu::lock();
    gpu::devices(cuda::device_count())?;
    let device = CudaBackend::new(0).expect("opening device 0");
    let driver = Arc::new(CudaIpcDriver::new().expect("loading the driver"));
    Some((
        Arc::new(CachingAllocator::new(device)),
        IpcProducer::new(driver),
        lock,
    ))
}

fn current() {
    CudaBackend::new(0).unwrap().make_current().unwrap();
}

/// Fills device memory and waits for the fill: `cuMemsetD8` on device memory is asynchronous with
/// respect to the host, and the other process reads what this one wrote as soon as it is told to.
fn fill(ptr: DeviceAddress, value: u8, len: usize) {
    current();
    // SAFETY: `ptr..ptr+len` is device memory of device 0 this test owns or received.
    check("cuMemsetD8", unsafe {
        sys::cuMemsetD8_v2(ptr.0, value, len)
    })
    .unwrap();
    // SAFETY: no arguments; the test's context is current (`current`).
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }).unwrap();
}

fn read(ptr: DeviceAddress, len: usize) -> Vec<u8> {
    current();
    let mut out = vec![0u8; len];
    // SAFETY: as in `fill`; `out` has room for `len` bytes.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr.0, len)
    })
    .unwrap();
    out
}

/// A peer process, killed if the test ends first.
struct Peer {
    child: child::Peer,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl Peer {
    /// This binary running only `test`, in role `role`.
    fn this(test: &str, role: &str) -> Self {
        Self::this_with(test, role, &[])
    }

    /// [`this`](Self::this) with more environment variables.
    fn this_with(test: &str, role: &str, vars: &[(&str, &str)]) -> Self {
        let mut cmd = child::this_test(test);
        cmd.envs(vars.iter().copied()).env(ROLE, role);
        Self::spawn(cmd)
    }

    /// The interop script with `args`, expandable segments on in its allocator when `expandable`.
    fn python_with(args: &[&str], expandable: bool) -> Self {
        let script =
            std::env::temp_dir().join(format!("tensormem_ipc_interop_{}.py", std::process::id()));
        std::fs::write(&script, SCRIPT).unwrap();
        let mut cmd = python::command();
        cmd.arg(&script).args(args);
        if expandable {
            cmd.env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
        }
        Self::spawn(cmd)
    }

    fn python(args: &[&str]) -> Self {
        let script =
            std::env::temp_dir().join(format!("tensormem_ipc_interop_{}.py", std::process::id()));
        std::fs::write(&script, SCRIPT).unwrap();
        let mut cmd = python::command();
        cmd.arg(&script).args(args);
        Self::spawn(cmd)
    }

    fn spawn(mut cmd: Command) -> Self {
        let (mut child, output) = child::spawn(cmd.stdin(Stdio::piped()));
        let input = child.stdin.take().unwrap();
        Self {
            child,
            input: Some(input),
            output,
        }
    }

    fn send(&mut self, line: &str) {
        let input = self
            .input
            .as_mut()
            .expect("the peer's input is open until finish");
        writeln!(input, "{line}").unwrap();
        input.flush().unwrap();
    }

    /// The fields after `@@<what>` on the next protocol line.
    fn expect(&mut self, what: &str) -> Vec<String> {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.output.read_line(&mut line).unwrap() > 0,
                "peer ended before @@{what}"
            );
            if let Some(at) = line.find("@@") {
                let mut fields = line[at + 2..].split_whitespace().map(str::to_owned);
                let tag = fields.next().unwrap_or_default();
                assert_eq!(tag, what, "peer said: {}", line.trim());
                return fields.collect();
            }
        }
    }

    fn kill9(&mut self) {
        self.child.kill9();
    }

    /// Closes the peer's input and checks that it exits successfully.
    fn finish(mut self) {
        drop(self.input.take());
        assert!(self.child.wait().unwrap().success(), "the peer failed");
    }
}

/// The consumer peer: reads `open HEX EXPECT WRITE`, `hold HEX`, `drop`, answers each.
fn consumer_role() {
    let driver = Arc::new(CudaIpcDriver::new().unwrap());
    let idle = std::env::var("TENSORMEM_IPC_IDLE").map_or(0, |v| v.parse().unwrap());
    let chunk_fds = match std::env::var("TENSORMEM_IPC_ROUTES").as_deref() {
        Ok("socket") => ChunkFdRoutes::SocketOnly,
        Ok("pidfd") => ChunkFdRoutes::PidfdOnly,
        _ => ChunkFdRoutes::Auto,
    };
    let consumer = IpcConsumer::with_config(
        driver,
        ConsumerConfig {
            idle_mem_handles: idle,
            chunk_fds,
            ..ConsumerConfig::default()
        },
    );
    let mut held = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["open", handle, expect, write] => {
                let handle = IpcHandle::decode(&unhex(handle)).unwrap();
                let received = consumer.open(&handle, S).unwrap();
                let len = received.size() as usize;
                let ends = [
                    read(received.ptr(), 1)[0],
                    read(received.ptr().offset(len - 1), 1)[0],
                ];
                let expect: u8 = expect.parse().unwrap();
                assert_eq!(ends, [expect, expect], "the producer's bytes");
                fill(
                    received.ptr().offset(len / 2),
                    write.parse().unwrap(),
                    len - len / 2,
                );
                let route = received.fd_route();
                drop(received);
                println!("@@ok {route:?}");
            }
            ["hold", handle] => {
                let handle = IpcHandle::decode(&unhex(handle)).unwrap();
                held.push(consumer.open(&handle, S).unwrap());
                println!("@@held");
            }
            ["drop"] => {
                held.clear();
                println!("@@dropped");
            }
            _ => panic!("unknown command {line:?}"),
        }
    }
}

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_consumer_process_reads_and_writes_the_producers_memory() {
    if role().is_some() {
        return consumer_role();
    }
    let Some((allocator, producer, _lock)) = gpu() else {
        return;
    };
    let stream = allocator.device().create_stream().unwrap();
    let mut peer = Peer::this(
        "a_consumer_process_reads_and_writes_the_producers_memory",
        "consumer",
    );
    for size in [4096usize, 1 << 20, 64 << 20] {
        let allocation = allocator.allocate(size, stream.id()).unwrap();
        fill(allocation.ptr(), 0x11, size);
        // The producer's stream is busy (held by a host function, then a fill): the share records
        // an event, and the consumer must wait for it to see the fill.
        // SAFETY: the host function makes no CUDA call; the fill writes memory this test owns.
        unsafe {
            stream
                .launch_host_fn(|| std::thread::sleep(std::time::Duration::from_millis(50)))
                .unwrap();
            stream.memset_d8(allocation.ptr(), 0x22, size).unwrap();
        }
        let (mut shared, handle) = producer.share(&allocator, allocation, stream.id()).unwrap();
        assert!(
            handle.event.is_some(),
            "a busy stream is shared with an event"
        );
        peer.send(&format!("open {} 34 51", hex(&handle.encode())));
        peer.expect("ok");
        let back = read(shared.ptr(), size);
        assert!(back[..size / 2].iter().all(|&b| b == 0x22));
        assert!(
            back[size / 2..].iter().all(|&b| b == 51),
            "the consumer's writes are visible"
        );
        assert_eq!(shared.outstanding(), 0, "the consumer released its slot");
        // An idle stream needs no event.
        fill(shared.ptr(), 0x22, size);
        stream.synchronize().unwrap();
        let again = shared.share(stream.id()).unwrap();
        assert!(
            again.event.is_none(),
            "an idle stream is shared without an event"
        );
        peer.send(&format!("open {} 34 68", hex(&again.encode())));
        peer.expect("ok");
        drop(shared);
        assert_eq!(producer.stats().limbo, 0);
    }
    let stats = producer.stats();
    assert_eq!((stats.idle_stream_shares, stats.events_in_use), (3, 0));
    peer.finish();
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    producer.collect();
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn ten_thousand_shares_rotate_files_between_processes() {
    if role().is_some() {
        return consumer_role();
    }
    let Some((allocator, producer, _lock)) = gpu() else {
        return;
    };
    let mut peer = Peer::this(
        "ten_thousand_shares_rotate_files_between_processes",
        "consumer",
    );
    let allocation = allocator.allocate(4096, S).unwrap();
    fill(allocation.ptr(), 5, 4096);
    let mut shared = producer.adopt(&allocator, allocation);
    let mut files = std::collections::HashSet::new();
    for _ in 0..REF_COUNTER_FILE_SIZE + 20 {
        let handle = shared.share(S).unwrap();
        files.insert(handle.ref_counter.clone().unwrap());
        peer.send(&format!("open {} 5 5", hex(&handle.encode())));
        peer.expect("ok");
    }
    assert_eq!(files.len(), 2);
    assert_eq!(shared.outstanding(), 0);
    peer.finish();
    drop(shared);
    producer.collect();
    for name in files {
        assert!(!name.path().exists(), "{name} left in /dev/shm");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn threads_share_at_once_with_one_consumer_process() {
    if role().is_some() {
        return consumer_role();
    }
    let Some((allocator, producer, _lock)) = gpu() else {
        return;
    };
    let peer = Mutex::new(Peer::this(
        "threads_share_at_once_with_one_consumer_process",
        "consumer",
    ));
    std::thread::scope(|s| {
        for t in 0..8u8 {
            let (allocator, producer, peer) = (&allocator, &producer, &peer);
            s.spawn(move || {
                for i in 0..25usize {
                    let size = 4096 << (i % 6);
                    let allocation = allocator.allocate(size, S).unwrap();
                    fill(allocation.ptr(), t, size);
                    let (mut shared, handle) = producer.share(allocator, allocation, S).unwrap();
                    {
                        let mut peer = peer.lock().unwrap();
                        peer.send(&format!("open {} {t} {}", hex(&handle.encode()), t + 100));
                        peer.expect("ok");
                    }
                    assert_eq!(read(shared.ptr().offset(size - 1), 1)[0], t + 100);
                    assert_eq!(shared.outstanding(), 0);
                }
            });
        }
    });
    peer.into_inner().unwrap().finish();
    producer.collect();
    let stats = producer.stats();
    assert_eq!(
        (stats.shares, stats.limbo, stats.events_in_use),
        (200, 0, 0)
    );
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn kill9_of_the_consumer_frees_its_memory() {
    if role().is_some() {
        return consumer_role();
    }
    let Some((allocator, producer, _lock)) = gpu() else {
        return;
    };
    let mut peer = Peer::this("kill9_of_the_consumer_frees_its_memory", "consumer");
    let (shared, handle) = producer
        .share(&allocator, allocator.allocate(1 << 20, S).unwrap(), S)
        .unwrap();
    peer.send(&format!("hold {}", hex(&handle.encode())));
    peer.expect("held");
    drop(shared);
    assert!(!producer.collect());
    assert_eq!(producer.stats().limbo, 1);
    peer.kill9();
    assert!(producer.collect());
    assert_eq!(producer.stats().slots_reclaimed, 1);
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    assert!(!handle.ref_counter.as_ref().unwrap().path().exists());
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn kill9_of_the_producer_leaves_nothing_behind() {
    if role().is_some() {
        let (allocator, producer, _lock) = gpu().unwrap();
        let (_shared, handle) = producer
            .share(&allocator, allocator.allocate(1 << 20, S).unwrap(), S)
            .unwrap();
        println!("@@handle {}", hex(&handle.encode()));
        std::thread::sleep(std::time::Duration::from_secs(600));
        return;
    }
    let Some((_allocator, _producer, _lock)) = gpu() else {
        return;
    };
    let mut peer = Peer::this("kill9_of_the_producer_leaves_nothing_behind", "producer");
    let handle = IpcHandle::decode(&unhex(&peer.expect("handle")[0])).unwrap();
    let consumer = IpcConsumer::new(Arc::new(CudaIpcDriver::new().unwrap()));
    let received = consumer.open(&handle, S).unwrap();
    peer.kill9();
    drop(received);
    drop(consumer);
    assert!(
        !handle.ref_counter.as_ref().unwrap().path().exists(),
        "the dead producer's file was removed"
    );
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_pytorch_consumer_opens_tensormem_memory() {
    if role().is_some() {
        return;
    }
    let Some((allocator, producer, _lock)) = gpu() else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    let size = 1 << 20;
    let allocation = allocator.allocate(size, S).unwrap();
    fill(allocation.ptr(), 9, size);
    let (mut shared, handle) = producer.share(&allocator, allocation, S).unwrap();
    let mut peer = Peer::python(&["consume"]);
    peer.send(&format!("{} 9 77", handle.to_torch().to_line()));
    let refused = peer.expect("reshare-refused").join(" ").replace('_', " ");
    assert_eq!(refused, RECEIVED_MEMORY_MESSAGE, "our message is PyTorch's");
    peer.expect("released");
    peer.finish();
    assert_eq!(
        read(shared.ptr().offset(size - 1), 1)[0],
        77,
        "PyTorch's writes are visible"
    );
    assert_eq!(read(shared.ptr(), 1)[0], 9);
    assert_eq!(
        shared.outstanding(),
        0,
        "PyTorch's release set the slot back to 0"
    );
    drop(shared);
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn tensormem_opens_a_pytorch_share() {
    if role().is_some() {
        return;
    }
    let Some((_allocator, _producer, _lock)) = gpu() else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    let size = 1 << 20;
    let mut peer = Peer::python(&["produce", &size.to_string()]);
    let tuple = TorchShareTuple::from_line(&peer.expect("tuple").join(" ")).unwrap();
    let handle = IpcHandle::from_torch(&tuple).unwrap();
    let consumer = IpcConsumer::new(Arc::new(CudaIpcDriver::new().unwrap()));
    let received = consumer.open(&handle, S).unwrap();
    assert_eq!(received.size(), size as u64);
    assert!(
        read(received.ptr(), size).iter().all(|&b| b == 7),
        "PyTorch's bytes"
    );
    fill(received.ptr().offset(size - 1), 0x33, 1);
    drop(received);
    // The slot in PyTorch's own ref-counter file is back to 0.
    let file = tensormem_shm::MapOptions::new()
        .map_shm(handle.ref_counter.as_ref().unwrap())
        .unwrap();
    let slot: &std::sync::atomic::AtomicI64 = file
        .mapping()
        .atomic(tensormem_shm::REFCOUNT_HEADER_LEN + 8 * handle.slot as usize)
        .unwrap();
    assert_eq!(slot.load(std::sync::atomic::Ordering::Acquire), 0);
    drop(file);
    peer.send("released");
    let done = peer.expect("done");
    assert_eq!(done[0], "51", "PyTorch sees our write (0x33)");
    assert_eq!(
        done[2], "0",
        "PyTorch freed its memory: nothing left in its limbo"
    );
    peer.finish();
}

/// Device 0's allocator with expandable segments, and a producer (see [`gpu`]).
fn expandable_gpu() -> Option<(Allocator, Producer, MutexGuard<'static, ()>)> {
    let (_, producer, lock) = gpu()?;
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let device = CudaBackend::new(0).expect("opening device 0");
    Some((
        Arc::new(CachingAllocator::with_config(device, config)),
        producer,
        lock,
    ))
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn expandable_segment_memory_is_shared_between_processes_both_ways_of_taking_descriptors() {
    const TEST: &str =
        "expandable_segment_memory_is_shared_between_processes_both_ways_of_taking_descriptors";
    if role().is_some() {
        return consumer_role();
    }
    let Some((allocator, producer, _lock)) = expandable_gpu() else {
        return;
    };
    // A first block, so that the shared ones start inside their chunks.
    let first = allocator.allocate(512, S).unwrap();
    for (routes, expected) in [("auto", None), ("socket", Some("Some(Socket)"))] {
        let mut peer = Peer::this_with(TEST, "consumer", &[("TENSORMEM_IPC_ROUTES", routes)]);
        for size in [1usize, 1000, (1 << 20) + 3, (25 << 20) + 7] {
            let allocation = allocator.allocate(size, S).unwrap();
            fill(allocation.ptr(), 0x22, size);
            let (mut shared, handle) = producer.share(&allocator, allocation, S).unwrap();
            let tensormem_ipc::SegmentMemory::Chunks(chunks) = &handle.memory else {
                panic!("memory of an expandable segment is shared as chunks: {handle:?}");
            };
            assert_eq!(handle.size, size as u64, "the exact size travels");
            assert!(handle.offset + handle.size <= chunks.extent());
            // The same block shared again names the same descriptors (one export per chunk).
            let again = shared.share(S).unwrap();
            assert_eq!(again.memory, handle.memory);
            peer.send(&format!("open {} 34 51", hex(&handle.encode())));
            let route = peer.expect("ok").join(" ");
            if let Some(expected) = expected {
                assert_eq!(route, expected);
            } else {
                assert!(route.starts_with("Some("), "{route}");
            }
            fill(shared.ptr(), 0x22, size);
            peer.send(&format!("open {} 34 68", hex(&again.encode())));
            peer.expect("ok");
            let back = read(shared.ptr(), size);
            assert!(
                back[size / 2..].iter().all(|&b| b == 68),
                "the consumer's writes are visible ({size} bytes)"
            );
            assert_eq!(shared.outstanding(), 0, "the consumer released its slots");
            drop(shared);
        }
        peer.finish();
    }
    allocator.free(first).unwrap();
    assert_eq!(producer.stats().limbo, 0);
    assert_eq!(allocator.memory_stats().active_bytes.all.current, 0);
    producer.collect();
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_pytorch_consumer_opens_tensormem_expandable_memory() {
    if role().is_some() {
        return;
    }
    let Some((allocator, producer, _lock)) = expandable_gpu() else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    let first = allocator.allocate(512, S).unwrap();
    for size in [1000usize, (25 << 20) + 7] {
        let allocation = allocator.allocate(size, S).unwrap();
        fill(allocation.ptr(), 9, size);
        let (mut shared, handle) = producer.share(&allocator, allocation, S).unwrap();
        let tuple = handle.to_torch();
        assert_eq!(
            &tuple.handle[..2],
            &[2, b'e'],
            "PyTorch's expandable-segment handle"
        );
        let mut peer = Peer::python(&["consume"]);
        peer.send(&format!("{} 9 77", tuple.to_line()));
        peer.expect("reshare-refused");
        peer.expect("released");
        peer.finish();
        assert_eq!(
            read(shared.ptr().offset(size - 1), 1)[0],
            77,
            "PyTorch's writes"
        );
        assert_eq!(read(shared.ptr(), 1)[0], 9);
        assert_eq!(
            shared.outstanding(),
            0,
            "PyTorch's release set the slot back to 0"
        );
        drop(shared);
    }
    allocator.free(first).unwrap();
    assert_eq!(producer.stats().limbo, 0);
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn tensormem_opens_a_pytorch_expandable_share() {
    if role().is_some() {
        return;
    }
    let Some((_allocator, _producer, _lock)) = gpu() else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    let size = (25 << 20) + 3;
    let mut peer = Peer::python_with(&["produce", &size.to_string()], true);
    let tuple = TorchShareTuple::from_line(&peer.expect("tuple").join(" ")).unwrap();
    assert_eq!(
        &tuple.handle[..2],
        &[2, b'e'],
        "PyTorch shared an expandable segment"
    );
    let handle = IpcHandle::from_torch(&tuple).unwrap();
    let driver = Arc::new(CudaIpcDriver::new().unwrap());
    // A PyTorch producer has no descriptor socket: the socket-only way fails and says so.
    let socket_only = IpcConsumer::with_config(
        Arc::clone(&driver),
        ConsumerConfig {
            chunk_fds: ChunkFdRoutes::SocketOnly,
            ..ConsumerConfig::default()
        },
    );
    let err = socket_only.open(&handle, S).unwrap_err().to_string();
    assert!(err.contains("no descriptor socket"), "{err}");
    let consumer = IpcConsumer::new(driver);
    let received = consumer.open(&handle, S).unwrap();
    assert_eq!(received.size(), size as u64);
    assert_eq!(
        received.fd_route(),
        Some(tensormem_ipc::FdRoute::PidfdGetfd)
    );
    assert!(
        read(received.ptr(), size).iter().all(|&b| b == 7),
        "PyTorch's bytes"
    );
    fill(received.ptr().offset(size - 1), 0x33, 1);
    drop(received);
    peer.send("released");
    let done = peer.expect("done");
    assert_eq!(done[0], "51", "PyTorch sees our write (0x33)");
    peer.finish();
}
