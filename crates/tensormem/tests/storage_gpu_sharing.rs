//! CUDA storages on a real GPU, sharing in detail: exact sizes (odd sizes at offsets inside the
//! allocator's segments) with another Rust process and with PyTorch both ways, empty storages both
//! ways, and one caching allocator per device for the process (storages' memory in the device API's
//! statistics). Each test is `#[ignore]`d (`cargo xtask test-gpu` and the bundle's run.sh run them
//! with `--include-ignored`); without a device it says `skipped: ...`, and fails instead with
//! `TENSORMEM_REQUIRE_GPU=1`.
//!
//! The cross-process test runs this binary again (`--exact NAME`) as the consumer, with
//! `TENSORMEM_SHARING_GPU_ROLE` set.
#![cfg(feature = "cuda")]

use std::io::{BufRead, Write};
use std::process::Stdio;
use std::sync::Arc;

use tensormem::cuda;
use tensormem::ipc::TorchShareTuple;
use tensormem::storage::{storage_copy, CudaContext, IpcHandle, Storage, StorageKind};
use tensormem_test_support::{child, gpu, hex, python, torch, unhex};

const ROLE: &str = "TENSORMEM_SHARING_GPU_ROLE";
const MIB: usize = 1 << 20;
/// Odd sizes in the small pool and the large pool.
const SIZES: [usize; 3] = [1, 1000, MIB + 3];

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// Storages of [`SIZES`] filled with [`pattern`], each behind a small storage so that it starts
/// inside its segment; the fillers are returned too, to keep them alive.
fn odd_storages(ctx: &Arc<CudaContext>) -> (Vec<Storage>, Vec<Storage>) {
    let mut fillers = Vec::new();
    let mut storages = Vec::new();
    for (i, &size) in SIZES.iter().enumerate() {
        fillers.push(Storage::new_cuda(ctx, if size > MIB { 3 * MIB } else { 512 }).unwrap());
        let storage = Storage::new_cuda(ctx, size).unwrap();
        storage_copy(&storage, &Storage::from_vec(pattern(size, i as u8)), false).unwrap();
        storages.push(storage);
    }
    (storages, fillers)
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn odd_sizes_at_offsets_round_trip_exactly_between_processes() {
    if std::env::var(ROLE).is_ok() {
        let ctx = CudaContext::new(0).unwrap();
        for line in std::io::stdin().lock().lines() {
            let line = line.unwrap();
            let (index, wire) = line.split_once(' ').unwrap();
            let index: usize = index.parse().unwrap();
            let handle = IpcHandle::decode(&unhex(wire)).unwrap();
            let received = Storage::new_shared_cuda(&ctx, &handle).unwrap();
            let size = SIZES.get(index).copied().unwrap_or(0);
            assert_eq!(received.nbytes(), size, "the sender's size, exactly");
            if size == 0 {
                assert_eq!(received.kind(), StorageKind::Cuda, "a new empty storage");
            } else {
                assert_eq!(received.to_vec().unwrap(), pattern(size, index as u8));
                // A copy into a storage of the sender's size works.
                let copy = Storage::new_cuda(&ctx, size).unwrap();
                storage_copy(&copy, &received, false).unwrap();
                assert_eq!(copy.to_vec().unwrap(), pattern(size, index as u8));
            }
            println!("@@ok {index}");
        }
        return;
    }
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    let ctx = CudaContext::new(0).unwrap();
    let (storages, _fillers) = odd_storages(&ctx);
    let mut child = child::this_test("odd_sizes_at_offsets_round_trip_exactly_between_processes")
        .env(ROLE, "consumer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for (i, storage) in storages.iter().enumerate() {
            let handle = storage.share_cuda().unwrap();
            assert_eq!(handle.size, SIZES[i] as u64);
            assert!(
                handle.offset > 0,
                "size {} lies inside its segment",
                SIZES[i]
            );
            writeln!(stdin, "{i} {}", hex(&handle.encode())).unwrap();
        }
        let empty = Storage::new_cuda(&ctx, 0).unwrap().share_cuda().unwrap();
        assert!(empty.is_empty());
        writeln!(stdin, "{} {}", SIZES.len(), hex(&empty.encode())).unwrap();
    }
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "consumer failed:\n{stdout}");
    for i in 0..=SIZES.len() {
        assert!(stdout.contains(&format!("@@ok {i}")), "{stdout}");
    }
    drop(storages);
    cuda::ipc_collect().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn empty_storages_are_shared_and_rebuilt() {
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    let ctx = CudaContext::new(0).unwrap();
    let empty = Storage::new_cuda(&ctx, 0).unwrap();
    let handle = empty.share_cuda().unwrap();
    assert_eq!(handle, IpcHandle::empty(0));
    assert!(handle.to_torch().is_empty());
    let rebuilt = Storage::new_shared_cuda(&ctx, &handle).unwrap();
    assert_eq!(rebuilt.nbytes(), 0);
    assert_eq!(rebuilt.kind(), StorageKind::Cuda);
    // Sharable again, as PyTorch's rebuilt empty storage.
    assert!(rebuilt.share_cuda().unwrap().is_empty());
    tensormem::storage::release_ipc_counter(&ctx, &handle).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn storages_use_the_device_apis_allocator() {
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    let ctx = CudaContext::new(0).unwrap();
    let device_api = cuda::caching_allocator(Some(0)).unwrap();
    assert!(
        std::ptr::eq(&**ctx.caching_allocator().unwrap(), device_api),
        "one caching allocator for the device"
    );
    let other = CudaContext::new(0).unwrap();
    assert!(Arc::ptr_eq(
        ctx.caching_allocator().unwrap(),
        other.caching_allocator().unwrap()
    ));
    let before = cuda::memory_allocated(Some(0)).unwrap();
    let storage = Storage::new_cuda(&ctx, 1000).unwrap();
    assert_eq!(cuda::memory_allocated(Some(0)).unwrap(), before + 1024);
    let stats = cuda::memory_stats(Some(0)).unwrap();
    assert!(stats["allocated_bytes.all.current"] >= 1024);
    let snapshot = cuda::memory_snapshot().unwrap();
    assert!(
        !snapshot.segments.is_empty(),
        "the storage's segment is in the device API's snapshot"
    );
    drop(storage);
    assert_eq!(cuda::memory_allocated(Some(0)).unwrap(), before);
    cuda::empty_cache().unwrap();
    if before == 0 {
        assert_eq!(cuda::memory_reserved(Some(0)).unwrap(), 0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorch_receives_odd_sized_and_empty_storages_with_their_sizes() {
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    // PyTorch's own rebuild: _new_shared_cuda for memory, a new empty storage for a tuple without a
    // handle (torch.multiprocessing's rebuild_cuda_tensor).
    let script = r#"
import sys, torch
torch.cuda.set_device(0)
def field(text):
    return None if text == "-" else bytes.fromhex(text)
for line in sys.stdin:
    f = line.split()
    dev, handle, size, off = int(f[0]), field(f[1]), int(f[2]), int(f[3])
    if handle is None:
        s = torch.UntypedStorage(size, device=f"cuda:{dev}")
    else:
        s = torch.UntypedStorage._new_shared_cuda(dev, handle, size, off, field(f[4]), int(f[5]),
                                                  field(f[6]) or bytes(64), f[7] == "1")
    last = int(torch.tensor([], dtype=torch.uint8, device=f"cuda:{dev}").set_(s)[-1].item()) if size else -1
    print(s.nbytes(), last, flush=True)
    del s
    torch.cuda.synchronize()
"#;
    let ctx = CudaContext::new(0).unwrap();
    let (storages, _fillers) = odd_storages(&ctx);
    let empty = Storage::new_cuda(&ctx, 0).unwrap();
    let mut lines = String::new();
    for storage in storages.iter().chain(std::iter::once(&empty)) {
        lines.push_str(&storage.share_cuda().unwrap().to_torch().to_line());
        lines.push('\n');
    }
    let mut child = python::command()
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "python failed:\n{stdout}");
    let mut expected: Vec<String> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| format!("{n} {}", pattern(n, i as u8)[n - 1]))
        .collect();
    expected.push("0 -1".into());
    assert_eq!(stdout.lines().collect::<Vec<_>>(), expected);
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn rust_receives_pytorchs_odd_sized_and_empty_storages_with_their_sizes() {
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    if !torch::python_with_torch_cuda() {
        return;
    }
    let script = r#"
import sys, torch
torch.cuda.set_device(0)
keep = []
def hexf(b):
    return "-" if b is None else b.hex()
for n in [1, 1000, (1 << 20) + 3, 0]:
    keep.append(torch.empty(512 if n < (1 << 20) else 3 << 20, dtype=torch.uint8, device="cuda:0"))
    t = torch.full((n,), 5, dtype=torch.uint8, device="cuda:0")
    keep.append(t)
    dev, h, size, off, rc, slot, ev, sync = t.untyped_storage()._share_cuda_()
    print(dev, hexf(h), size, off, hexf(rc), slot, hexf(ev), int(bool(sync)), flush=True)
torch.cuda.synchronize()
sys.stdin.readline()
"#;
    let mut child = python::command()
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let ctx = CudaContext::new(0).unwrap();
    for n in [1usize, 1000, MIB + 3, 0] {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let tuple = TorchShareTuple::from_line(line.trim()).unwrap();
        assert_eq!(tuple.size, n as u64);
        assert_eq!(tuple.is_empty(), n == 0);
        let handle = IpcHandle::from_torch(&tuple).unwrap();
        let received = Storage::new_shared_cuda(&ctx, &handle).unwrap();
        assert_eq!(received.nbytes(), n);
        assert_eq!(received.to_vec().unwrap(), vec![5u8; n]);
    }
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_batch_of_storages_travels_between_processes_as_one_message() {
    use tensormem::storage::{new_shared_cuda_batch, share_cuda_batch, BatchEntry, BatchHandle};
    const TEST: &str = "a_batch_of_storages_travels_between_processes_as_one_message";
    if std::env::var(ROLE).is_ok() {
        let ctx = CudaContext::new(0).unwrap();
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        let batch = BatchHandle::decode(&unhex(line.trim())).unwrap();
        let received = new_shared_cuda_batch(&ctx, &batch).unwrap();
        for (name, storage) in &received {
            let (kind, index) = name.split_once('.').unwrap();
            let index: usize = index.parse().unwrap();
            let size = SIZES[index];
            let whole = pattern(size, index as u8);
            let expected = match kind {
                "whole" => whole,
                // A view of the same storage without its first and last byte.
                _ => whole[1..size - 1].to_vec(),
            };
            assert_eq!(storage.nbytes(), expected.len(), "{name}");
            assert_eq!(storage.to_vec().unwrap(), expected, "{name}");
        }
        println!("@@ok {}", received.len());
        return;
    }
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    let ctx = CudaContext::new(0).unwrap();
    let (storages, _fillers) = odd_storages(&ctx);
    let names: Vec<(String, String)> = (0..SIZES.len())
        .map(|i| (format!("whole.{i}"), format!("view.{i}")))
        .collect();
    let mut entries = Vec::new();
    for (i, storage) in storages.iter().enumerate() {
        // Views of one batch may not overlap: a storage travels whole, or as a view inside it.
        if SIZES[i] <= 2 {
            entries.push(BatchEntry::whole(&names[i].0, storage));
        } else {
            entries.push(BatchEntry {
                name: &names[i].1,
                storage,
                offset: 1,
                len: SIZES[i] - 2,
            });
        }
    }
    let batch = share_cuda_batch(&entries).unwrap();
    let mut child = child::this_test(TEST)
        .env(ROLE, "consumer")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "{}", hex(&batch.encode())).unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "consumer failed:\n{stdout}");
    assert!(
        stdout.contains(&format!("@@ok {}", entries.len())),
        "{stdout}"
    );
    drop(entries);
    drop(storages);
    cuda::ipc_collect().unwrap();
}
