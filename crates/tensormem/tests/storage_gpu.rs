//! CUDA storages on a real GPU: allocation, host <-> device and device <-> device copies (one
//! device and across devices), and sharing with another process through CUDA IPC. Each GPU test is
//! `#[ignore]`d (`cargo xtask test-gpu` and the bundle's run.sh run them with `--include-ignored`);
//! run without a device, it says `skipped: no CUDA driver/device (...)`, and fails instead with
//! `TENSORMEM_REQUIRE_GPU=1` (which they set).
//!
//! The sharing test runs this binary again (`--exact NAME`) as the consumer, with
//! `TENSORMEM_STORAGE_GPU_ROLE` set.
#![cfg(feature = "cuda")]

use std::process::Stdio;
use std::sync::Arc;

use tensormem::cuda;
use tensormem::storage::{
    release_ipc_counter, storage_copy, CudaContext, Device, Error, IpcHandle, Storage, StorageKind,
};
use tensormem_test_support::{child, gpu, hex, python, torch, unhex};

const ROLE: &str = "TENSORMEM_STORAGE_GPU_ROLE";
const ARG: &str = "TENSORMEM_STORAGE_GPU_ARG";
const MIB: usize = 1 << 20;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn host(bytes: Vec<u8>) -> Storage {
    Storage::from_vec(bytes)
}

#[test]
fn host_storages_refuse_cuda_operations() {
    let s = Storage::new(16);
    assert!(matches!(
        s.share_cuda(),
        Err(Error::WrongDevice {
            expected: "CUDA",
            ..
        })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn cuda_storages_read_write_fill_and_copy_on_one_device() {
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    let ctx = CudaContext::new(0).unwrap();
    let n = 3 * MIB + 5;
    let dev = Storage::new_cuda(&ctx, n).unwrap();
    assert_eq!(dev.device(), Device::Cuda(0));
    assert_eq!(dev.kind(), StorageKind::Cuda);
    assert!(dev.is_shared(), "PyTorch: every CUDA storage is shared");
    dev.share_memory_().unwrap(); // a CUDA storage is left alone
    assert_eq!(dev.kind(), StorageKind::Cuda);
    assert!(matches!(dev.share_fd(), Err(Error::WrongDevice { .. })));

    // H2D from private memory, D2H into private memory.
    storage_copy(&dev, &host(pattern(n, 1)), false).unwrap();
    let back = Storage::new(n);
    storage_copy(&back, &dev, false).unwrap();
    assert_eq!(back.to_vec().unwrap(), pattern(n, 1));

    // Byte access and fill.
    dev.write_at(n - 1, &[0xEE]).unwrap();
    let mut last = [0u8; 1];
    dev.read_at(n - 1, &mut last).unwrap();
    assert_eq!(last, [0xEE]);
    assert!(matches!(
        dev.read_at(n, &mut last),
        Err(Error::OutOfBounds { .. })
    ));
    dev.fill(9).unwrap();
    assert_eq!(dev.to_vec().unwrap(), vec![9u8; n]);

    // H2D from and D2H into shared host memory (staged).
    let shared = Storage::new_shared_fd_storage(n as u64).unwrap();
    shared.write_at(0, &pattern(n, 2)).unwrap();
    storage_copy(&dev, &shared, false).unwrap();
    let shared_back = Storage::new_shared_fd_storage(n as u64).unwrap();
    storage_copy(&shared_back, &dev, false).unwrap();
    assert_eq!(shared_back.to_vec().unwrap(), pattern(n, 2));

    // D2D, blocking and not.
    let other = Storage::new_cuda(&ctx, n).unwrap();
    storage_copy(&other, &dev, false).unwrap();
    assert_eq!(other.to_vec().unwrap(), pattern(n, 2));
    dev.fill(4).unwrap();
    storage_copy(&other, &dev, true).unwrap();
    ctx.synchronize().unwrap();
    assert_eq!(other.to_vec().unwrap(), vec![4u8; n]);

    // D2D between two contexts (two streams) of the same device.
    let ctx2 = CudaContext::with_allocator(Arc::clone(ctx.caching_allocator().unwrap())).unwrap();
    let third = Storage::new_cuda(&ctx2, n).unwrap();
    storage_copy(&third, &other, false).unwrap();
    assert_eq!(third.to_vec().unwrap(), vec![4u8; n]);

    assert!(matches!(
        storage_copy(&Storage::new_cuda(&ctx, n - 1).unwrap(), &dev, false),
        Err(Error::SizeMismatch { .. })
    ));
}

#[test]
#[ignore = "needs two CUDA GPUs (cargo xtask test-gpu runs it)"]
fn copies_across_devices() {
    let Some(count) = gpu::devices(cuda::device_count()) else {
        return;
    };
    if count < 2 {
        eprintln!("skipped: one device only");
        return;
    }
    let (a, b) = (CudaContext::new(0).unwrap(), CudaContext::new(1).unwrap());
    let n = 5 * MIB;
    let on_a = Storage::new_cuda(&a, n).unwrap();
    let on_b = Storage::new_cuda(&b, n).unwrap();
    storage_copy(&on_a, &host(pattern(n, 3)), false).unwrap();
    storage_copy(&on_b, &on_a, false).unwrap(); // peer access or staging, the driver decides
    assert_eq!(on_b.device(), Device::Cuda(1));
    assert_eq!(on_b.to_vec().unwrap(), pattern(n, 3));
    on_b.fill(1).unwrap();
    storage_copy(&on_a, &on_b, true).unwrap();
    a.synchronize().unwrap();
    assert_eq!(on_a.to_vec().unwrap(), vec![1u8; n]);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn cuda_storages_shared_with_another_process() {
    if let Ok(role) = std::env::var(ROLE) {
        assert_eq!(role, "consumer");
        let handle = IpcHandle::decode(&unhex(&std::env::var(ARG).unwrap())).unwrap();
        let ctx = CudaContext::new(handle.device).unwrap();
        let received = Storage::new_shared_cuda(&ctx, &handle).unwrap();
        assert_eq!(received.kind(), StorageKind::CudaReceived);
        assert_eq!(received.to_vec().unwrap(), pattern(2 * MIB, 7));
        received.write_at(0, &[0xAB]).unwrap();
        assert!(matches!(received.share_cuda(), Err(Error::ReceivedCuda)));
        // A second handle to the same memory, released without being kept.
        let second = IpcHandle::decode(&unhex(
            &std::env::var("TENSORMEM_STORAGE_GPU_ARG2").unwrap(),
        ))
        .unwrap();
        release_ipc_counter(&ctx, &second).unwrap();
        drop(received);
        println!("@@consumer done");
        return;
    }
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    let ctx = CudaContext::new(0).unwrap();
    let storage = Storage::new_cuda(&ctx, 2 * MIB).unwrap();
    storage_copy(&storage, &host(pattern(2 * MIB, 7)), false).unwrap();
    let first = storage.share_cuda().unwrap();
    let second = storage.share_cuda().unwrap();
    let torch = first.to_torch(); // PyTorch's 8-tuple carries the same fields
    assert_eq!(IpcHandle::from_torch(&torch).unwrap().slot, first.slot);

    let child = child::this_test("cuda_storages_shared_with_another_process")
        .env(ROLE, "consumer")
        .env(ARG, hex(&first.encode()))
        .env("TENSORMEM_STORAGE_GPU_ARG2", hex(&second.encode()))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "consumer failed:\n{stdout}");
    assert!(stdout.contains("@@consumer done"), "{stdout}");
    let mut byte = [0u8; 1];
    storage.read_at(0, &mut byte).unwrap();
    assert_eq!(
        byte,
        [0xAB],
        "the consumer's write is visible to the producer"
    );
    drop(storage); // both handles were released: the memory goes back at once
    assert!(ctx.producer().collect() || ctx.producer().stats().limbo == 0);
}

const PY_VIEW: &str = r#"
import sys, torch
def view(storage, size, device):
    t = torch.empty(0, dtype=torch.uint8, device=device)
    try:
        t.set_(storage, 0, (size,), (1,))
    except TypeError:
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        t.set_(typed, 0, (size,), (1,))
    return t
"#;

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorch_opens_a_cuda_storage_rust_shared() {
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    let script = format!(
        "{PY_VIEW}\n{}",
        r#"
f = sys.stdin.readline().split()
dev, size = int(f[0]), int(f[2])
torch.cuda.set_device(dev)
s = torch.UntypedStorage._new_shared_cuda(dev, bytes.fromhex(f[1]), size, int(f[3]),
    bytes.fromhex(f[4]), int(f[5]), bytes.fromhex(f[6]), f[7] == "1")
t = view(s, size, f"cuda:{dev}")
print(int(t[0].item()), int(t[-1].item()), flush=True)
t[0] = 0x77
torch.cuda.synchronize()
del t, s
"#
    );
    let ctx = CudaContext::new(0).unwrap();
    let storage = Storage::new_cuda(&ctx, MIB).unwrap();
    storage.fill(0x21).unwrap();
    let line = storage.share_cuda().unwrap().to_torch().to_line();
    let mut child = python::command()
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{line}").unwrap();
    }
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "python failed:\n{stdout}");
    assert_eq!(stdout.trim(), "33 33", "PyTorch read Rust's bytes");
    let mut first = [0u8; 1];
    storage.read_at(0, &mut first).unwrap();
    assert_eq!(first, [0x77], "Rust sees PyTorch's write");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn rust_opens_a_cuda_storage_pytorch_shared() {
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    let script = r#"
import sys, torch
torch.cuda.set_device(0)
t = torch.full((4096,), 9, dtype=torch.uint8, device="cuda:0")
dev, h, size, off, rc, slot, ev, sync = t.untyped_storage()._share_cuda_()
print(dev, h.hex(), size, off, rc.hex(), slot, ev.hex(), int(sync), flush=True)
sys.stdin.readline()
torch.cuda.synchronize()
print(int(t[1].item()), flush=True)
"#;
    let mut child = python::command()
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let tuple = tensormem::ipc::TorchShareTuple::from_line(line.trim()).unwrap();
    let handle = IpcHandle::from_torch(&tuple).unwrap();
    let ctx = CudaContext::new(handle.device).unwrap();
    let received = Storage::new_shared_cuda(&ctx, &handle).unwrap();
    assert_eq!(received.kind(), StorageKind::CudaReceived);
    assert_eq!(received.to_vec().unwrap(), vec![9u8; 4096]);
    received.write_at(1, &[0x42]).unwrap();
    assert!(matches!(received.share_cuda(), Err(Error::ReceivedCuda)));
    drop(received); // releases PyTorch's ref counter
    {
        use std::io::Write;
        child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    }
    let mut answer = String::new();
    std::io::BufRead::read_line(&mut out, &mut answer).unwrap();
    assert_eq!(answer.trim(), "66", "PyTorch sees Rust's write");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}
