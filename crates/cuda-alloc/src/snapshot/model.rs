//! The snapshot's typed model: what `torch.cuda.memory._snapshot()` returns, field for field.

use std::fmt;

use super::pyvalue::PyValue;
use crate::device::{DeviceAddress, StreamId};

/// Keys of a dict that the model does not know, with their values, in file order. Kept so that a
/// snapshot read and written again loses nothing.
pub type OtherKeys = Vec<(String, PyValue)>;

/// A memory snapshot: the allocator's segments with their blocks, the trace of allocator events per
/// device, and the settings the allocator ran with (the dict `torch.cuda.memory._snapshot()` returns and
/// `_dump_snapshot` pickles).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Snapshot {
    /// `segments`: every segment the allocator holds (on all devices), each with its blocks.
    pub segments: Vec<Segment>,
    /// `device_traces`: for each device index, the recorded allocator events in the order they happened
    /// (oldest first; the ring buffer keeps the last `max_entries`). Empty lists when history was off.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// `allocator_settings`: the configuration in force (PyTorch 2.1 and later write it).
    pub allocator_settings: Option<AllocatorSettings>,
    /// `external_annotations`: user annotations recorded with the trace (PyTorch 2.6 and later).
    pub external_annotations: Option<Vec<ExternalAnnotation>>,
    /// `host_segments`: the pinned host allocator's blocks, written by PyTorch versions that record
    /// host memory when `_record_memory_history(record_pinned_host_memory=True)` is on; `None` when absent.
    pub host_segments: Option<Vec<HostSegment>>,
    /// `host_traces`: the pinned host allocator's recorded events, oldest first (as
    /// [`host_segments`](Self::host_segments)); `None` when absent.
    pub host_traces: Option<Vec<TraceEntry>>,
    /// Top-level keys not listed above, and `host_segments` / `host_traces` in a form the model
    /// does not know (kept as written).
    pub other: OtherKeys,
}

/// One segment: a region obtained from the device in one piece (`cudaMalloc`), or an expandable segment.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Segment {
    /// `device`: the device index.
    pub device: i64,
    /// `address`: the segment's first byte.
    pub address: u64,
    /// `total_size`: bytes in the segment (for an expandable segment, bytes mapped).
    pub total_size: u64,
    /// `allocated_size`: bytes of its blocks handed out and not freed.
    pub allocated_size: u64,
    /// `active_size`: bytes of its blocks handed out or waiting for other streams before they are free.
    pub active_size: u64,
    /// `requested_size`: bytes the callers of the allocated blocks asked for (before rounding).
    pub requested_size: u64,
    /// `stream`: the stream the segment belongs to, as an integer (PyTorch writes `int64(stream)`).
    pub stream: u64,
    /// `segment_type`: which pool the segment serves.
    pub segment_type: SegmentType,
    /// `segment_pool_id`: the memory pool that owns the segment, a tuple of two ints: `(0, 0)` for the
    /// default pools, otherwise the id of a private pool (CUDA graphs, `torch.cuda.MemPool`).
    pub segment_pool_id: (u64, u64),
    /// `is_expandable`: whether this is an expandable segment.
    pub is_expandable: bool,
    /// `frames`: the stack that allocated the segment, when history recorded stacks; else empty.
    pub frames: Vec<Frame>,
    /// `blocks`: the segment's blocks, in address order, covering it without gaps.
    pub blocks: Vec<Block>,
    /// Keys not listed above.
    pub other: OtherKeys,
}

impl Segment {
    /// The stream as the allocator names it.
    #[must_use]
    pub fn stream_id(&self) -> StreamId {
        StreamId(self.stream)
    }
}

/// One entry of `host_segments`: a block the pinned host allocator holds from the system
/// (`cudaHostAlloc`), as a segment of one block (the host allocator does not split blocks).
/// Keys a file lacks read as their defaults, and the sizes as on a device [`Segment`]: computed
/// from the blocks when absent.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct HostSegment {
    /// `address`: the first byte.
    pub address: u64,
    /// `total_size`: bytes held from the system.
    pub total_size: u64,
    /// `allocated_size`: bytes handed out and not freed.
    pub allocated_size: u64,
    /// `active_size`: bytes handed out, or freed and waiting for streams that used them.
    pub active_size: u64,
    /// `requested_size`: bytes the callers of the active blocks asked for.
    pub requested_size: u64,
    /// `frames`: the stack that allocated the segment, when history recorded stacks; else empty.
    pub frames: Vec<Frame>,
    /// `blocks`: the segment's blocks (one).
    pub blocks: Vec<Block>,
    /// Keys not listed above.
    pub other: OtherKeys,
}

/// `segment_type`: the pool a segment serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum SegmentType {
    /// `'small'`: the pool of blocks up to 1 MiB (2 MiB segments).
    Small,
    /// `'large'`: the pool of larger blocks.
    #[default]
    Large,
}

impl SegmentType {
    /// The string PyTorch writes.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            SegmentType::Small => "small",
            SegmentType::Large => "large",
        }
    }
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Block {
    /// `address`: the block's first byte.
    pub address: u64,
    /// `size`: bytes in the block (the rounded size).
    pub size: u64,
    /// `requested_size`: bytes the caller asked for; for a free block, what its last user asked for.
    pub requested_size: u64,
    /// `state`: whether the block is handed out.
    pub state: BlockState,
    /// `frames`: the stack that allocated the block, when history recorded stacks; else empty.
    pub frames: Vec<Frame>,
    /// Keys not listed above.
    pub other: OtherKeys,
}

impl Block {
    /// The block's address as a device pointer.
    #[must_use]
    pub fn ptr(&self) -> DeviceAddress {
        DeviceAddress(self.address)
    }
}

/// `state` of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum BlockState {
    /// `'active_allocated'`: handed out to a caller.
    ActiveAllocated,
    /// `'active_pending_free'`: freed by its caller, waiting for events on other streams that used it.
    ActivePendingFree,
    /// `'inactive'`: free, cached for reuse.
    #[default]
    Inactive,
}

impl BlockState {
    /// The string PyTorch writes.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// A stack frame recorded with an allocation (`_record_memory_history(stacks=...)`).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Frame {
    /// `filename`: the source file.
    pub filename: String,
    /// `line`: the line in it.
    pub line: i64,
    /// `name`: the function.
    pub name: String,
    /// Keys not listed above (`_snapshot(augment_with_fx_traces=True)` adds FX node details).
    pub other: OtherKeys,
}

/// One recorded allocator event (an entry of `device_traces[d]`).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TraceEntry {
    /// `action`: what happened.
    pub action: TraceAction,
    /// `addr`: the address of the block or segment concerned. For [`TraceAction::Oom`] PyTorch writes this
    /// value under the key `device_free` instead: the bytes the device reported free.
    pub addr: u64,
    /// `size`: bytes. `alloc` carries the size the caller asked for; `free_requested` / `free_completed`
    /// the block's requested size; segment events the segment's (or mapped range's) size; `oom` the
    /// request that failed.
    pub size: u64,
    /// `stream`: the stream of the block or segment, as an integer.
    pub stream: u64,
    /// `time_us`: when, in microseconds since the Unix epoch.
    pub time_us: i64,
    /// `frames`: the stack of the event, when history recorded stacks (the key is absent otherwise).
    pub frames: Option<Vec<Frame>>,
    /// `compile_context`: the `torch.compile` context of the event (PyTorch 2.6 and later; `'N/A'` when
    /// none).
    pub compile_context: Option<String>,
    /// `user_metadata`: metadata attached with `torch.cuda.memory._set_memory_metadata` (PyTorch 2.7 and
    /// later; empty when none).
    pub user_metadata: Option<String>,
    /// `pool_id`: the memory pool of the block or segment, a tuple of two ints as a segment's
    /// `segment_pool_id` (`(0, 0)` for the default pools), written by PyTorch versions after 2.11;
    /// `None` when absent (PyTorch 2.11 does not write it).
    pub pool_id: Option<(u64, u64)>,
    /// Keys not listed above.
    pub other: OtherKeys,
}

impl TraceEntry {
    /// The stream as the allocator names it.
    #[must_use]
    pub fn stream_id(&self) -> StreamId {
        StreamId(self.stream)
    }

    /// The address as a device pointer (meaningless for `oom`, where [`addr`](Self::addr) holds the free
    /// bytes).
    #[must_use]
    pub fn ptr(&self) -> DeviceAddress {
        DeviceAddress(self.addr)
    }

    /// For an `oom` event, the bytes the device reported free (`device_free`).
    #[must_use]
    pub fn device_free(&self) -> Option<u64> {
        (self.action == TraceAction::Oom).then_some(self.addr)
    }
}

/// `action` of a trace entry.
#[derive(Clone, Debug, PartialEq, Eq, Default, Hash)]
pub enum TraceAction {
    /// `'alloc'`: a block was handed out.
    #[default]
    Alloc,
    /// `'free_requested'`: the caller freed a block (it may still wait for other streams).
    FreeRequested,
    /// `'free_completed'`: the block is free (its streams' events completed).
    FreeCompleted,
    /// `'segment_alloc'`: a segment was obtained from the device (`cudaMalloc`).
    SegmentAlloc,
    /// `'segment_free'`: a segment was returned to the device (`cudaFree`).
    SegmentFree,
    /// `'segment_map'`: memory was mapped into an expandable segment.
    SegmentMap,
    /// `'segment_unmap'`: memory was unmapped from an expandable segment.
    SegmentUnmap,
    /// `'oom'`: an allocation failed for lack of memory.
    Oom,
    /// `'snapshot'`: a snapshot was taken.
    Snapshot,
    /// `'user_defined'`: an annotation recorded by the user.
    UserDefined,
    /// An action this crate does not know (from a newer PyTorch), kept as written.
    Other(String),
}

impl TraceAction {
    /// The string PyTorch writes.
    #[must_use]
    pub fn as_str(&self) -> &str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
            TraceAction::Snapshot => "snapshot",
            TraceAction::UserDefined => "user_defined",
            TraceAction::Other(other) => other,
        }
    }

    /// The action PyTorch writes as `name`.
    #[must_use]
    pub fn from_name(name: &str) -> TraceAction {
        match name {
            "alloc" => TraceAction::Alloc,
            "free_requested" => TraceAction::FreeRequested,
            "free_completed" => TraceAction::FreeCompleted,
            "segment_alloc" => TraceAction::SegmentAlloc,
            "segment_free" => TraceAction::SegmentFree,
            "segment_map" => TraceAction::SegmentMap,
            "segment_unmap" => TraceAction::SegmentUnmap,
            "oom" => TraceAction::Oom,
            "snapshot" => TraceAction::Snapshot,
            "user_defined" => TraceAction::UserDefined,
            other => TraceAction::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for TraceAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `allocator_settings`: the configuration the allocator ran with. Each field is `None` when the file
/// lacks the key (older PyTorch); see [`AllocatorSettings::to_config`] and
/// [`AllocatorSettings::from_config`].
#[derive(Clone, Debug, PartialEq, Default)]
pub struct AllocatorSettings {
    /// `PYTORCH_CUDA_ALLOC_CONF`: the last configuration string applied (from the environment or
    /// `_set_allocator_settings`), as written.
    pub config_string: Option<String>,
    /// `max_split_size`: in bytes; `-1` for unlimited.
    pub max_split_size: Option<i64>,
    /// `garbage_collection_threshold`: `0.0` when off.
    pub garbage_collection_threshold: Option<f64>,
    /// `expandable_segments`.
    pub expandable_segments: Option<bool>,
    /// `pinned_num_register_threads`.
    pub pinned_num_register_threads: Option<u64>,
    /// `release_lock_on_cudamalloc`.
    pub release_lock_on_cudamalloc: Option<bool>,
    /// `pinned_use_cuda_host_register`.
    pub pinned_use_cuda_host_register: Option<bool>,
    /// `graph_capture_record_stream_reuse` (PyTorch 2.9 and later).
    pub graph_capture_record_stream_reuse: Option<bool>,
    /// `roundup_power2_divisions`: `(interval start in MiB, divisions)` pairs by interval start; PyTorch
    /// writes a dict `{'1': d0, '2': d1, '4': d2, ..., '32768': d15}` with string keys. The readers keep one
    /// pair per start: of keys naming the same start (`'8'` and `'08'`) the later one wins, as a repeated
    /// boundary does in the configuration grammar.
    pub roundup_power2_divisions: Option<Vec<(u64, u64)>>,
    /// Keys not listed above.
    pub other: OtherKeys,
}

/// One entry of `external_annotations`: a user annotation (`stage` and `name` are what
/// `torch.cuda.memory` records; other metadata keys are kept in `other`).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ExternalAnnotation {
    /// `device`: the device index.
    pub device: Option<i64>,
    /// `time_us`: when, in microseconds since the Unix epoch.
    pub time_us: Option<i64>,
    /// `stage`: `'START'` or `'END'`.
    pub stage: Option<String>,
    /// `name`: the annotated region.
    pub name: Option<String>,
    /// Keys not listed above.
    pub other: OtherKeys,
}
