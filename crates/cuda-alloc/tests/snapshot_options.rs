//! Snapshots as newer PyTorch writes them: per-pool snapshots (`MemPool.snapshot`),
//! `include_traces=False`, `pool_id` on trace entries, and the pinned host allocator's
//! `host_segments` / `host_traces`; read, written, and made by the allocators.
#![cfg(feature = "snapshot-io")]

mod common;

use common::*;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator};
use tensormem_cuda_alloc::snapshot::{
    Block, BlockState, HostSegment, PyValue, Snapshot, TraceAction, TraceEntry,
};
use tensormem_cuda_alloc::{MempoolId, RecordContext, StreamId};

const POOL: MempoolId = MempoolId(1, 0);

fn round_trip(snapshot: &Snapshot) -> Snapshot {
    let mut bytes = Vec::new();
    snapshot.write_pickle(&mut bytes).unwrap();
    let back = Snapshot::from_pickle_bytes(&bytes).unwrap();
    let mut json = Vec::new();
    snapshot.write_json(&mut json).unwrap();
    assert_eq!(Snapshot::read_json(json.as_slice()).unwrap(), back);
    back
}

fn key<'a>(value: &'a PyValue, name: &str) -> Option<&'a PyValue> {
    match value {
        PyValue::Dict(items) => items
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v),
        _ => None,
    }
}

#[test]
fn a_pool_snapshot_has_only_that_pools_segments_and_the_whole_trace() {
    let a = sim(GIB);
    a.record_history(true, 1000);
    let outside = a.allocate(12 * MIB, S0).unwrap();
    a.begin_allocate_to_pool(POOL, |s| s == S0).unwrap();
    let inside = a.allocate(12 * MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();

    let all = a.snapshot();
    assert_eq!(all.segments.len(), 2);
    let pooled = a.snapshot_with(Some(POOL), true);
    assert_eq!(pooled.segments.len(), 1);
    assert_eq!(pooled.segments[0].segment_pool_id, (1, 0));
    assert_eq!(pooled.segments[0].address, inside.ptr().0);
    // The trace is not filtered by pool (as in PyTorch): the default pool's alloc is there.
    assert!(pooled
        .trace(0)
        .iter()
        .any(|e| e.action == TraceAction::Alloc && e.addr == outside.ptr().0));
    // The default id means every pool.
    assert_eq!(
        a.snapshot_with(Some(MempoolId::DEFAULT), true)
            .segments
            .len(),
        2
    );
    // Filtering a whole snapshot gives the same segments.
    assert_eq!(all.filtered(Some((1, 0)), true).segments, pooled.segments);
    a.free(inside).unwrap();
    a.free(outside).unwrap();
    a.release_pool(POOL).unwrap();
}

#[test]
fn without_traces_device_traces_is_an_empty_list_and_a_snapshot_entry_is_still_recorded() {
    let a = sim(GIB);
    a.record_history(true, 1000);
    let x = a.allocate(MIB, S0).unwrap();
    let light = a.snapshot_with(None, false);
    assert!(light.device_traces.is_empty());
    assert_eq!(light.segments.len(), 1);
    let value = light.to_value();
    assert_eq!(
        key(&value, "device_traces"),
        Some(&PyValue::List(Vec::new()))
    );
    assert_eq!(round_trip(&light), light);
    let full = a.snapshot();
    let snapshots = full
        .trace(0)
        .iter()
        .filter(|e| e.action == TraceAction::Snapshot)
        .count();
    assert_eq!(snapshots, 1, "the light snapshot was recorded in the trace");
    let filtered = full.clone().filtered(None, false);
    assert!(filtered.device_traces.is_empty());
    assert_eq!(filtered.segments, full.segments);
    a.free(x).unwrap();
}

#[test]
fn pool_id_on_trace_entries_is_read_and_written_as_a_tuple() {
    let entry = TraceEntry {
        action: TraceAction::Alloc,
        addr: 0x7f00_0000_0000,
        size: 4096,
        pool_id: Some((1, 7)),
        ..TraceEntry::default()
    };
    let snapshot = Snapshot {
        device_traces: vec![vec![entry.clone(), TraceEntry::default()]],
        ..Snapshot::default()
    };
    let value = snapshot.to_value();
    let traces = key(&value, "device_traces").unwrap();
    let PyValue::List(devices) = traces else {
        panic!("{traces:?}")
    };
    let PyValue::List(entries) = &devices[0] else {
        panic!()
    };
    assert_eq!(
        key(&entries[0], "pool_id"),
        Some(&PyValue::Tuple(vec![
            PyValue::from(1u64),
            PyValue::from(7u64)
        ]))
    );
    assert_eq!(
        key(&entries[1], "pool_id"),
        None,
        "absent stays absent (2.11)"
    );
    let back = round_trip(&snapshot);
    assert_eq!(back.trace(0)[0].pool_id, Some((1, 7)));
    assert_eq!(back, snapshot);
}

#[test]
fn host_segments_and_traces_round_trip() {
    let snapshot = Snapshot {
        host_segments: Some(vec![HostSegment {
            address: 0x7000_0000,
            total_size: 8192,
            allocated_size: 8192,
            active_size: 8192,
            requested_size: 5000,
            blocks: vec![Block {
                address: 0x7000_0000,
                size: 8192,
                requested_size: 5000,
                state: BlockState::ActiveAllocated,
                ..Block::default()
            }],
            ..HostSegment::default()
        }]),
        host_traces: Some(vec![TraceEntry {
            action: TraceAction::SegmentAlloc,
            addr: 0x7000_0000,
            size: 8192,
            ..TraceEntry::default()
        }]),
        ..Snapshot::default()
    };
    let back = round_trip(&snapshot);
    assert_eq!(back, snapshot);
    assert_eq!(back.host_trace().len(), 1);
    assert!(Snapshot::default().host_trace().is_empty());
    let value = Snapshot::default().to_value();
    assert_eq!(key(&value, "host_segments"), None, "absent unless recorded");
}

#[test]
fn host_segments_missing_keys_read_with_sizes_from_their_blocks() {
    let block = PyValue::Dict(vec![
        (PyValue::from("size"), PyValue::from(4096u64)),
        (PyValue::from("requested_size"), PyValue::from(100u64)),
        (PyValue::from("state"), PyValue::from("active_allocated")),
    ]);
    let segment = PyValue::Dict(vec![
        (PyValue::from("address"), PyValue::from(0x5000u64)),
        (PyValue::from("blocks"), PyValue::List(vec![block])),
        (PyValue::from("is_pinned"), PyValue::Bool(true)),
    ]);
    let value = PyValue::Dict(vec![
        (PyValue::from("segments"), PyValue::List(Vec::new())),
        (PyValue::from("host_segments"), PyValue::List(vec![segment])),
    ]);
    let s = Snapshot::from_value(value).unwrap();
    let host = &s.host_segments.as_ref().unwrap()[0];
    assert_eq!(
        (host.total_size, host.allocated_size, host.requested_size),
        (4096, 4096, 100)
    );
    assert_eq!(host.blocks[0].address, 0x5000);
    assert_eq!(host.other.len(), 1, "unknown keys kept");
}

#[test]
fn host_keys_of_an_unknown_form_are_kept_as_written() {
    let odd = PyValue::Dict(vec![(PyValue::from("cpu"), PyValue::from(1i64))]);
    let value = PyValue::Dict(vec![
        (PyValue::from("segments"), PyValue::List(Vec::new())),
        (PyValue::from("host_traces"), odd.clone()),
    ]);
    let s = Snapshot::from_value(value).unwrap();
    assert_eq!(s.host_traces, None);
    assert_eq!(s.other, vec![("host_traces".to_owned(), odd.clone())]);
    assert_eq!(key(&s.to_value(), "host_traces"), Some(&odd));
}

#[test]
fn the_host_allocator_adds_its_blocks_and_recorded_events_to_a_snapshot() {
    let host = HostCachingAllocator::new(SimDevice::new(1 << 30), HeapSource);
    let before = host.allocate(100).unwrap();
    host.record_history(true, 100, RecordContext::Never);
    assert!(host.history_enabled());
    let a = host.allocate(5000).unwrap();
    let b = host.allocate(3000).unwrap();
    host.record_stream(&b, StreamId(3)).unwrap();
    host.free(b).unwrap();
    let mut snapshot = sim(GIB).snapshot();
    host.add_to_snapshot(&mut snapshot, true);
    let segments = snapshot.host_segments.clone().unwrap();
    assert_eq!(segments.len(), 3);
    assert!(segments.windows(2).all(|w| w[0].address < w[1].address));
    let state = |addr: *const u8| {
        segments
            .iter()
            .find(|s| s.address == addr as u64)
            .map(|s| (s.blocks[0].state, s.total_size, s.blocks[0].requested_size))
            .unwrap()
    };
    assert_eq!(state(a.as_ptr()), (BlockState::ActiveAllocated, 8192, 5000));
    assert_eq!(state(before.as_ptr()).0, BlockState::ActiveAllocated);
    let b_addr = segments
        .iter()
        .find(|s| s.blocks[0].state == BlockState::ActivePendingFree)
        .map(|s| s.address)
        .expect("b waits for stream 3");
    let actions: Vec<(TraceAction, u64)> = snapshot
        .host_trace()
        .iter()
        .map(|e| (e.action.clone(), e.size))
        .collect();
    assert_eq!(
        actions,
        [
            (TraceAction::SegmentAlloc, 8192),
            (TraceAction::Alloc, 5000),
            (TraceAction::SegmentAlloc, 4096),
            (TraceAction::Alloc, 3000),
            (TraceAction::FreeRequested, 3000),
        ]
    );
    host.device().complete_stream_work(StreamId(3));
    host.free(a).unwrap();
    host.empty_cache().unwrap();
    let trace = host.trace();
    let tail: Vec<(TraceAction, u64)> = trace[5..]
        .iter()
        .map(|e| (e.action.clone(), e.addr))
        .collect();
    assert!(tail.contains(&(TraceAction::FreeCompleted, b_addr)));
    assert!(tail.contains(&(TraceAction::SegmentFree, b_addr)));
    assert_eq!(
        tail.iter()
            .filter(|(action, _)| *action == TraceAction::SegmentFree)
            .count(),
        2
    );
    // Without traces: segments only.
    let mut light = Snapshot::default();
    host.add_to_snapshot(&mut light, false);
    assert_eq!(light.host_segments.as_ref().map(Vec::len), Some(1));
    assert_eq!(light.host_traces, None);
    assert_eq!(round_trip(&snapshot), snapshot);
    host.record_history(false, 1, RecordContext::Never);
    assert!(host.trace().is_empty());
    host.free(before).unwrap();
}
