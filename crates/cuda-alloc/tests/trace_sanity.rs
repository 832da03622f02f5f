//! A compact replay of the recorded PyTorch traces on the simulated device: every allocation must land
//! at the address PyTorch chose, and the final statistics must equal PyTorch's `memory_stats()`.
//! (The full replay tool lives in the CLI; this checks the allocator core's decisions.)

#![cfg(feature = "snapshot-io")]

use std::collections::HashMap;
use std::path::PathBuf;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction};
use tensormem_cuda_alloc::{Allocation, CachingAllocator, StreamId};

/// A device total consistent with the expandable trace's reservations (8054.4 chunks of 20 MiB between
/// its two segments): PyTorch reserves `ceil(total * 9 / 8 / chunk)` chunks per segment.
const DEVICE_TOTAL: u64 = 150_120_000_000;

fn traces() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces")
}

fn replay(name: &str) {
    let snapshot = Snapshot::read_file(traces().join(format!("{name}.pickle"))).unwrap();
    let expected: HashMap<String, serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(traces().join(format!("{name}.stats.json"))).unwrap(),
    )
    .unwrap();
    let config = snapshot
        .allocator_settings
        .as_ref()
        .unwrap()
        .to_config()
        .unwrap();
    let trace = &snapshot.device_traces[0];
    let device = SimDevice::new(DEVICE_TOTAL);
    // New segments get the addresses the real device returned, in order.
    let chunk = |small: bool| if small { 2u64 << 20 } else { 20 << 20 };
    let reservation =
        |small: bool| (DEVICE_TOTAL + DEVICE_TOTAL / 8).div_ceil(chunk(small)) * chunk(small);
    let mut reserved: Vec<(u64, u64)> = Vec::new();
    for e in trace {
        match e.action {
            TraceAction::SegmentAlloc => device.push_addresses([e.addr]),
            // A map outside every known reservation starts a new expandable segment.
            TraceAction::SegmentMap
                if !reserved.iter().any(|&(b, s)| e.addr >= b && e.addr < b + s) =>
            {
                let small = e.size == 2 << 20;
                reserved.push((e.addr, reservation(small)));
                device.push_addresses([e.addr]);
            }
            _ => {}
        }
    }
    let allocator = CachingAllocator::with_config(device, config);
    let streams: Vec<StreamId> = {
        let mut s: Vec<u64> = trace.iter().map(|e| e.stream).collect();
        s.sort_unstable();
        s.dedup();
        s.into_iter().map(StreamId).collect()
    };
    let mut live: HashMap<u64, Allocation> = HashMap::new();
    let mut pending: HashMap<u64, StreamId> = HashMap::new();
    for (i, e) in trace.iter().enumerate() {
        match e.action {
            TraceAction::Alloc => {
                let a = allocator
                    .allocate(e.size as usize, e.stream_id())
                    .unwrap_or_else(|err| panic!("{name} event {i}: {err}"));
                assert_eq!(
                    a.ptr().0,
                    e.addr,
                    "{name} event {i}: alloc of {} bytes",
                    e.size
                );
                live.insert(e.addr, a);
            }
            TraceAction::FreeRequested => {
                let a = live.remove(&e.addr).expect("freed address is live");
                let completes_now = trace
                    .get(i + 1)
                    .is_some_and(|n| n.action == TraceAction::FreeCompleted && n.addr == e.addr);
                if !completes_now {
                    // Used on the other stream (record_stream): free completes when its work does.
                    let other = *streams.iter().find(|&&s| s != e.stream_id()).unwrap();
                    allocator.record_stream(&a, other).unwrap();
                    pending.insert(e.addr, other);
                }
                allocator.free(a).unwrap();
            }
            TraceAction::FreeCompleted => {
                if let Some(stream) = pending.remove(&e.addr) {
                    allocator.device().complete_stream_markers(stream, 1);
                }
            }
            _ => {}
        }
    }
    allocator.check_invariants().unwrap();
    let flat = allocator.memory_stats().to_flat();
    let mut mismatches = Vec::new();
    for (key, value) in &expected {
        let Some(want) = value.as_i64() else { continue };
        if let Some(&have) = flat.get(key) {
            if have != want {
                mismatches.push(format!("{key}: ours {have}, PyTorch {want}"));
            }
        }
    }
    assert!(mismatches.is_empty(), "{name}:\n{}", mismatches.join("\n"));
}

#[test]
fn gpt2_train() {
    replay("gpt2_train");
}

#[test]
fn gpt2_train_expandable_segments() {
    replay("gpt2_train__expandable_segments-True");
}

#[test]
fn multistream() {
    replay("multistream");
}
