//! PyTorch interop on a real GPU, where `python3 -c 'import torch'` works: PyTorch's own tools read
//! tensormem's snapshots, tensormem reads PyTorch's, and the statistics have the same keys.
//!
//! Skipped when torch cannot be imported, unless `TENSORMEM_REQUIRE_TORCH=1` (set by `cargo xtask
//! test-gpu` and the bundle's `run.sh` where torch imports).

use std::collections::BTreeSet;
use std::path::Path;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction};
use tensormem_cuda_alloc::CachingAllocator;

use crate::harness::{gpu, Gpus};
use tensormem_test_support::{python, torch};

/// The GPUs, if there are GPUs and `python3` imports torch; else `None` after saying why.
fn gpu_and_torch() -> Option<Gpus> {
    let gpus = gpu()?;
    torch::python_with_torch().then_some(gpus)
}

/// Bytes the way `torch.cuda._memory_viz` prints them (`Bytes.__repr__`: `f"{num:3.1f}{unit}B"`).
fn viz_bytes(bytes: u64) -> String {
    let mut num = bytes as f64;
    for unit in ["", "Ki", "Mi", "Gi", "Ti", "Pi"] {
        if num.abs() < 1024.0 {
            return format!("{num:3.1}{unit}B");
        }
        num /= 1024.0;
    }
    format!("{num:.1}EiB")
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorch_memory_viz_reads_a_tensormem_snapshot() {
    let Some(_gpus) = gpu_and_torch() else { return };
    let alloc = CachingAllocator::new(CudaBackend::new(0).unwrap());
    alloc.record_history(true, 10_000);
    let stream = alloc.device().create_stream().unwrap();
    let kept: Vec<_> = [512, 1 << 20, 3 << 20, 30 << 20]
        .into_iter()
        .map(|size| alloc.allocate(size, stream.id()).unwrap())
        .collect();
    let dropped = alloc.allocate(5 << 20, stream.id()).unwrap();
    alloc.free(dropped).unwrap();
    let snapshot = alloc.snapshot();
    assert!(!snapshot.segments.is_empty());
    let reserved: u64 = snapshot.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(reserved, alloc.reserved_bytes());

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tensormem_snapshot.pickle");
    snapshot.write_pickle_file(&file).unwrap();

    // `stats` also asserts, in Python, that every segment's blocks add up to its size.
    let stats = python::run(&["-m", "torch.cuda._memory_viz", "stats", path_str(&file)]);
    assert!(
        stats.contains(&format!("segments: {}\n", snapshot.segments.len())),
        "{stats}"
    );
    assert!(
        stats.contains(&format!("total_reserved: {}\n", viz_bytes(reserved))),
        "{stats}"
    );
    let trace = python::run(&["-m", "torch.cuda._memory_viz", "trace", path_str(&file)]);
    assert!(trace.contains("Device 0 ----------------"), "{trace}");
    let allocs = snapshot
        .trace(0)
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
        .count();
    assert_eq!(allocs, 5, "five allocations were traced");

    for a in kept {
        alloc.free(a).unwrap();
    }
    alloc.empty_cache().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorch_reads_pool_light_and_host_snapshots() {
    use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator};
    use tensormem_cuda_alloc::{MempoolId, RecordContext};

    let Some(_gpus) = gpu_and_torch() else { return };
    let alloc = CachingAllocator::new(CudaBackend::new(0).unwrap());
    alloc.record_history(true, 10_000);
    let stream = alloc.device().create_stream().unwrap();
    let pool = MempoolId(1, 0);
    let outside = alloc.allocate(3 << 20, stream.id()).unwrap();
    let sid = stream.id();
    alloc
        .begin_allocate_to_pool(pool, move |s| s == sid)
        .unwrap();
    let inside = alloc.allocate(5 << 20, stream.id()).unwrap();
    alloc.end_allocate_to_pool(pool).unwrap();
    let host = HostCachingAllocator::new(CudaBackend::new(0).unwrap(), HeapSource);
    host.record_history(true, 1000, RecordContext::Never);
    let pinned = host.allocate(5000).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut full = alloc.snapshot();
    for entry in full.device_traces.iter_mut().flatten() {
        entry.pool_id = Some((0, 0));
    }
    host.add_to_snapshot(&mut full, true);
    let pooled = alloc.snapshot_with(Some(pool), true);
    assert_eq!(pooled.segments.len(), 1);
    let light = alloc.snapshot_with(None, false);
    for (name, snapshot) in [("full", &full), ("pooled", &pooled), ("light", &light)] {
        let file = dir.path().join(format!("{name}.pickle"));
        snapshot.write_pickle_file(&file).unwrap();
        let stats = python::run(&["-m", "torch.cuda._memory_viz", "stats", path_str(&file)]);
        assert!(
            stats.contains(&format!("segments: {}\n", snapshot.segments.len())),
            "{name}: {stats}"
        );
        python::run(&["-m", "torch.cuda._memory_viz", "trace", path_str(&file)]);
    }
    // The types PyTorch gives these keys.
    let check = format!(
        "import pickle\n\
         full = pickle.load(open({:?}, 'rb'))\n\
         light = pickle.load(open({:?}, 'rb'))\n\
         assert light['device_traces'] == [], light['device_traces']\n\
         assert all(type(e['pool_id']) is tuple for e in full['device_traces'][0])\n\
         h = full['host_segments']\n\
         assert len(h) == 1 and h[0]['blocks'][0]['requested_size'] == 5000, h\n\
         assert [e['action'] for e in full['host_traces']] == ['segment_alloc', 'alloc'], full['host_traces']\n\
         print('ok')\n",
        path_str(&dir.path().join("full.pickle")),
        path_str(&dir.path().join("light.pickle"))
    );
    assert_eq!(python::run(&["-c", &check]).trim(), "ok");

    // And PyTorch's own light and pool snapshots read here.
    let file = dir.path().join("torch_light.pickle");
    let script = format!(
        "import pickle, torch\n\
         torch.cuda.memory._record_memory_history(max_entries=1000)\n\
         p = torch.cuda.MemPool()\n\
         a = torch.empty(1 << 20, dtype=torch.uint8, device='cuda')\n\
         with torch.cuda.use_mem_pool(p):\n\
         \x20   b = torch.empty(3 << 20, dtype=torch.uint8, device='cuda')\n\
         s = torch._C._cuda_memorySnapshot((p.id[0], p.id[1], False))\n\
         pickle.dump(s, open({:?}, 'wb'))\n",
        path_str(&file)
    );
    python::run(&["-c", &script]);
    let theirs = Snapshot::read_pickle_file(&file).unwrap();
    assert!(theirs.device_traces.is_empty());
    assert_eq!(theirs.segments.len(), 1, "{:?}", theirs.segments);
    assert_ne!(theirs.segments[0].segment_pool_id, (0, 0));

    host.free(pinned).unwrap();
    alloc.free(inside).unwrap();
    alloc.free(outside).unwrap();
    alloc.release_pool(pool).unwrap();
    alloc.empty_cache().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn tensormem_reads_a_snapshot_pytorch_dumped_on_this_gpu() {
    let Some(_gpus) = gpu_and_torch() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("torch_snapshot.pickle");
    let script = format!(
        "import torch\n\
         torch.cuda.memory._record_memory_history(max_entries=1000, stacks='python')\n\
         a = torch.empty(3 << 20, dtype=torch.uint8, device='cuda')\n\
         b = torch.empty(512, dtype=torch.uint8, device='cuda')\n\
         del a\n\
         torch.cuda.memory._dump_snapshot({:?})\n",
        path_str(&file)
    );
    python::run(&["-c", &script]);
    let snapshot = Snapshot::read_pickle_file(&file).unwrap();
    assert!(
        snapshot.segments.len() >= 2,
        "a small and a large segment: {:?}",
        snapshot.segments
    );
    let trace = snapshot.trace(0);
    let allocs: Vec<u64> = trace
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
        .map(|e| e.size)
        .collect();
    assert!(
        allocs.contains(&(3 << 20)) && allocs.contains(&512),
        "allocations traced: {allocs:?}"
    );
    assert!(trace.iter().any(|e| e.action == TraceAction::FreeRequested));
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn memory_stats_have_pytorchs_keys() {
    let Some(_gpus) = gpu_and_torch() else { return };
    let printed = python::run(&[
        "-c",
        "import torch\n\
         x = torch.empty(1 << 20, device='cuda')\n\
         print('\\n'.join(sorted(torch.cuda.memory_stats(0).keys())))\n",
    ]);
    let torch_keys: BTreeSet<&str> = printed.lines().filter(|l| !l.is_empty()).collect();
    let alloc = CachingAllocator::new(CudaBackend::new(0).unwrap());
    let ours = alloc.memory_stats().to_flat();
    let our_keys: BTreeSet<&str> = ours.keys().map(String::as_str).collect();
    let missing: Vec<_> = torch_keys.difference(&our_keys).collect();
    let extra: Vec<_> = our_keys.difference(&torch_keys).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "keys PyTorch has and tensormem lacks: {missing:?}; keys only tensormem has: {extra:?}"
    );
}
