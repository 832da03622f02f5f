//! `attach_allocator_trace_tracker`: a tracker sees every trace entry, in order, whether or not the
//! history ring buffer is recording.

use std::sync::{Arc, Mutex};

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::TraceAction;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};

type Seen = Arc<Mutex<Vec<(TraceAction, u64, u64)>>>;

fn tracked(alloc: &CachingAllocator<SimDevice>) -> Seen {
    let seen: Seen = Arc::default();
    let sink = Arc::clone(&seen);
    alloc.attach_allocator_trace_tracker(Box::new(move |entry| {
        sink.lock()
            .unwrap()
            .push((entry.action.clone(), entry.addr, entry.size));
    }));
    seen
}

#[test]
fn a_tracker_sees_every_entry_without_history() {
    let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
    let seen = tracked(&alloc);
    let a = alloc.allocate(3000, StreamId(0)).unwrap();
    let ptr = a.ptr().addr();
    alloc.free(a).unwrap();
    alloc.record_annotation("step");
    alloc.empty_cache().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            (TraceAction::SegmentAlloc, ptr, 2 << 20),
            (TraceAction::Alloc, ptr, 3000),
            (TraceAction::FreeRequested, ptr, 3000),
            (TraceAction::FreeCompleted, ptr, 3000),
            (TraceAction::UserDefined, 0, 0),
            (TraceAction::SegmentFree, ptr, 2 << 20),
        ]
    );
    assert!(alloc.trace().is_empty(), "history stays off");
}

#[test]
fn trackers_see_what_history_records_and_out_of_memory_errors() {
    let alloc = CachingAllocator::new(SimDevice::new(64 << 20));
    alloc.record_history(true, 100);
    let first = tracked(&alloc);
    let second = tracked(&alloc);
    let a = alloc.allocate(10 << 20, StreamId(0)).unwrap();
    assert!(alloc.allocate(1 << 30, StreamId(0)).is_err());
    alloc.free(a).unwrap();
    let recorded: Vec<(TraceAction, u64, u64)> = alloc
        .trace()
        .into_iter()
        .map(|e| (e.action, e.addr, e.size))
        .collect();
    assert_eq!(*first.lock().unwrap(), recorded);
    assert_eq!(*second.lock().unwrap(), recorded);
    assert!(recorded.iter().any(|(a, _, _)| *a == TraceAction::Oom));
}
