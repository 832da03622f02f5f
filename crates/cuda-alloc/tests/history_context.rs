//! Memory history with call stacks (`record_history_with_context`): which entries and blocks carry
//! `frames` at each context level, and that the frames name the allocating code (file, line, function)
//! as PyTorch's `_memory_viz` displays them.
#![cfg(feature = "stacks")]

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::{Frame, TraceAction};
use tensormem_cuda_alloc::{Allocation, CachingAllocator, RecordContext, StreamId};

const S: StreamId = StreamId(0);

#[inline(never)]
fn allocate_here(alloc: &CachingAllocator<SimDevice>, size: usize) -> Allocation {
    alloc.allocate(size, S).unwrap()
}

#[inline(never)]
fn free_here(alloc: &CachingAllocator<SimDevice>, a: Allocation) {
    alloc.free(a).unwrap();
}

fn names(frames: &[Frame], function: &str) -> bool {
    frames.iter().any(|f| {
        f.name.contains(function) && f.filename.ends_with("history_context.rs") && f.line > 0
    })
}

/// One run at `context`: a live block and a freed one; returns the live block's snapshot frames and
/// the trace.
fn run(context: RecordContext) -> (Vec<Frame>, Vec<tensormem_cuda_alloc::snapshot::TraceEntry>) {
    let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
    alloc.record_history_with_context(true, 100, context);
    assert_eq!(alloc.history_context(), context);
    let live = allocate_here(&alloc, 4096);
    let freed = allocate_here(&alloc, 8192);
    free_here(&alloc, freed);
    let snapshot = alloc.snapshot();
    let block = snapshot
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.address == live.ptr().addr())
        .unwrap()
        .clone();
    alloc.free(live).unwrap();
    alloc.check_invariants().unwrap();
    (block.frames, alloc.trace())
}

fn frames_of(
    trace: &[tensormem_cuda_alloc::snapshot::TraceEntry],
    action: TraceAction,
) -> Vec<Option<Vec<Frame>>> {
    trace
        .iter()
        .filter(|e| e.action == action)
        .map(|e| e.frames.clone())
        .collect()
}

#[test]
fn never_records_no_frames() {
    let (block, trace) = run(RecordContext::Never);
    assert!(block.is_empty());
    assert!(trace.iter().all(|e| e.frames.is_none()));
    assert!(!trace.is_empty(), "the trace is still recorded");
}

#[test]
fn state_keeps_the_stack_of_live_blocks_only() {
    let (block, trace) = run(RecordContext::State);
    assert!(names(&block, "allocate_here"), "{block:#?}");
    assert!(
        block[0].name.contains("allocate_here"),
        "the first frame is the caller's, not the allocator's: {:#?}",
        &block[..3.min(block.len())]
    );
    assert!(trace.iter().all(|e| e.frames.is_none()));
}

#[test]
fn alloc_puts_the_allocation_stack_on_its_entries() {
    let (block, trace) = run(RecordContext::Alloc);
    assert!(names(&block, "allocate_here"));
    for action in [
        TraceAction::Alloc,
        TraceAction::FreeRequested,
        TraceAction::FreeCompleted,
    ] {
        for frames in frames_of(&trace, action.clone()) {
            let frames = frames.expect("an allocation stack");
            assert!(names(&frames, "allocate_here"), "{action:?}: {frames:#?}");
        }
    }
    let segment = frames_of(&trace, TraceAction::SegmentAlloc);
    assert!(names(segment[0].as_ref().unwrap(), "allocate_here"));
}

#[test]
fn all_puts_the_freeing_stack_on_free_entries() {
    let (_, trace) = run(RecordContext::All);
    let requested = frames_of(&trace, TraceAction::FreeRequested);
    let first = requested[0].as_ref().unwrap();
    assert!(names(first, "free_here"), "{first:#?}");
    assert!(!names(first, "allocate_here"));
    let completed = frames_of(&trace, TraceAction::FreeCompleted);
    assert!(names(completed[0].as_ref().unwrap(), "free_here"));
}

#[test]
fn turning_history_off_drops_the_context() {
    let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
    alloc.record_history_with_context(true, 10, RecordContext::All);
    alloc.record_history(false, 10);
    assert_eq!(alloc.history_context(), RecordContext::Never);
    let a = allocate_here(&alloc, 512);
    free_here(&alloc, a);
    assert!(alloc.trace().is_empty());
}

#[test]
fn a_free_held_back_by_another_stream_keeps_its_stacks_until_it_completes() {
    let alloc = CachingAllocator::new(SimDevice::new(1 << 30));
    alloc.record_history_with_context(true, 100, RecordContext::All);
    let a = allocate_here(&alloc, 4096);
    alloc.record_stream(&a, StreamId(7)).unwrap();
    free_here(&alloc, a);
    alloc.check_invariants().unwrap();
    let pending = alloc.snapshot();
    let block = &pending.segments[0].blocks[0];
    assert!(
        names(&block.frames, "allocate_here"),
        "the pending block shows its allocation"
    );
    assert!(
        names(&pending.segments[0].frames, "allocate_here"),
        "the segment shows the allocation that made it"
    );
    alloc.device().complete_stream_work(StreamId(7));
    let b = allocate_here(&alloc, 4096); // processes the event: the free completes
    alloc.check_invariants().unwrap();
    let completed = frames_of(&alloc.trace(), TraceAction::FreeCompleted);
    assert!(names(completed[0].as_ref().unwrap(), "free_here"));
    free_here(&alloc, b);
    alloc.check_invariants().unwrap();
}
