//! PyTorch's own snapshot tool, `python3 -m torch.cuda._memory_viz`, on snapshots made here on the
//! simulated device: whole, per pool, without traces, and with the pinned host allocator's
//! segments and trace. Needs no GPU, only a `python3` that imports torch (a CPU build will do).
//!
//! `#[ignore]`d: CI has no torch. `cargo xtask test-gpu` (and the bundle's `run.sh`) runs these
//! where torch imports; elsewhere run them with
//! `cargo test -p tensormem-cuda-alloc --test memory_viz -- --ignored`, which skips (saying so)
//! when torch cannot be imported unless `TENSORMEM_REQUIRE_TORCH=1`.
#![cfg(feature = "snapshot-io")]

mod common;

use std::path::Path;

use common::*;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator};
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::{MempoolId, RecordContext};
use tensormem_test_support::{python, torch};

/// Every `_memory_viz` command that works offline (`segments` and `memory` fetch flamegraph.pl),
/// on `file`; the plots are HTML pages that embed the snapshot.
fn memory_viz_reads(dir: &Path, file: &Path, snapshot: &Snapshot) {
    let file = file.to_str().unwrap();
    let stats = python::run(&["-m", "torch.cuda._memory_viz", "stats", file]);
    assert!(
        stats.contains(&format!("segments: {}\n", snapshot.segments.len())),
        "{file}: {stats}"
    );
    let trace = python::run(&["-m", "torch.cuda._memory_viz", "trace", file]);
    let entries = snapshot.device_traces.iter().flatten().count();
    if entries > 0 {
        assert!(!trace.trim().is_empty(), "{file}: an empty trace listing");
    }
    for plot in ["trace_plot", "segment_plot"] {
        let html = dir.join(format!("{plot}.html"));
        let html = html.to_str().unwrap();
        python::run(&["-m", "torch.cuda._memory_viz", plot, file, "-o", html]);
        let page = std::fs::read_to_string(html).unwrap();
        assert!(page.contains("<script"), "{plot} of {file} wrote no page");
    }
}

#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn memory_viz_opens_whole_pool_light_and_host_snapshots() {
    if !torch::python_with_torch() {
        return;
    }
    let pool = MempoolId(1, 0);
    let a = sim(GIB);
    a.record_history_with_context(true, 10_000, RecordContext::All);
    let outside = a.allocate(3 * MIB, S0).unwrap();
    let small = a.allocate(1000, S0).unwrap();
    a.begin_allocate_to_pool(pool, |s| s == S0).unwrap();
    let inside = a.allocate(5 * MIB, S0).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    a.free(small).unwrap();
    let host = HostCachingAllocator::new(SimDevice::new(1 << 30), HeapSource);
    host.record_history(true, 1000, RecordContext::All);
    let pinned = host.allocate(5000).unwrap();
    let freed = host.allocate(70_000).unwrap();
    host.free(freed).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut full = a.snapshot();
    host.add_to_snapshot(&mut full, true);
    assert!(full.host_segments.as_ref().is_some_and(|s| !s.is_empty()));
    assert!(full.host_traces.as_ref().is_some_and(|t| !t.is_empty()));
    assert!(full
        .device_traces
        .iter()
        .flatten()
        .any(|e| e.pool_id == Some((1, 0))));
    let pooled = a.snapshot_with(Some(pool), true);
    let mut light = a.snapshot_with(None, false);
    host.add_to_snapshot(&mut light, false);
    for (name, snapshot) in [("full", &full), ("pooled", &pooled), ("light", &light)] {
        let file = dir.path().join(format!("{name}.pickle"));
        snapshot.write_pickle_file(&file).unwrap();
        memory_viz_reads(dir.path(), &file, snapshot);
    }

    // The keys newer PyTorch writes, with the types it gives them.
    let check = format!(
        "import pickle\n\
         full = pickle.load(open({full:?}, 'rb'))\n\
         light = pickle.load(open({light:?}, 'rb'))\n\
         assert light['device_traces'] == [], light['device_traces']\n\
         assert 'host_traces' not in light, light.keys()\n\
         assert all(type(e['pool_id']) is tuple for e in full['device_traces'][0])\n\
         h = full['host_segments']\n\
         sizes = sorted(b['requested_size'] for s in h for b in s['blocks'] if b['state'] == 'active_allocated')\n\
         assert sizes == [5000], h\n\
         actions = [e['action'] for e in full['host_traces']]\n\
         assert actions.count('alloc') == 2 and actions.count('free_completed') >= 1, actions\n\
         print('ok')\n",
        full = dir.path().join("full.pickle"),
        light = dir.path().join("light.pickle"),
    );
    assert_eq!(python::run(&["-c", &check]).trim(), "ok");

    host.free(pinned).unwrap();
    a.free(inside).unwrap();
    a.free(outside).unwrap();
    a.release_pool(pool).unwrap();
}
