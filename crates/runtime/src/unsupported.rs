//! [`AsyncUnsupported`]: what `backend:cudaMallocAsync` refuses, with PyTorch's words.

use std::fmt;

/// What PyTorch's `backend:cudaMallocAsync` refuses (`c10/cuda/CUDAMallocAsyncAllocator.cpp` and the
/// defaults of `CUDAAllocator` it does not override), and what of tensormem needs the caching
/// allocator. [`Error::AsyncUnsupported`](crate::Error::AsyncUnsupported) carries it; its message is PyTorch's line, word for word,
/// then a line on what to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncUnsupported {
    /// Snapshots (`torch.cuda.memory_snapshot`, `memory._dump_snapshot`; PyTorch's `snapshot`).
    Snapshot,
    /// Memory history (`torch.cuda.memory._record_memory_history`; `recordHistory`,
    /// `isHistoryEnabled`).
    RecordHistory,
    /// Out-of-memory observers (`attachOutOfMemoryObserver`).
    AttachOutOfMemoryObserver,
    /// Trace trackers (`attachAllocatorTraceTracker`).
    AttachAllocatorTraceTracker,
    /// Private pools: `torch.cuda.MemPool()` (`createOrIncrefPool`).
    CreateOrIncrefPool,
    /// A pool's users (`getPoolUseCount`).
    GetPoolUseCount,
    /// `MemPool(use_on_oom=True)` (`setUseOnOOM`).
    SetUseOnOom,
    /// `MemPool(no_split=True)` (`setNoSplit`).
    SetNoSplit,
    /// CUDA graph trees' check of a pool's live allocations (`checkPoolLiveAllocations`).
    CheckPoolLiveAllocations,
    /// CUDA graph trees' checkpoints (`getCheckpointState`).
    GetCheckpointState,
    /// CUDA graph trees' restores (`setCheckpointPoolState`).
    SetCheckpointPoolState,
    /// Sharing memory with another process (`shareIpcHandle`).
    ShareIpcHandle,
    /// Opening memory another process shared (`getIpcDevPtr`).
    GetIpcDevPtr,
    /// Expandable segments' sizes (`getExpandableSegmentSizes`).
    GetExpandableSegmentSizes,
    /// tensormem's own: what only the caching allocator does (`caching_allocator`, sleeping and
    /// waking private pools).
    CachingAllocator,
}

impl AsyncUnsupported {
    /// Every refusal, for tests and for [`from_method`](Self::from_method).
    pub const ALL: [AsyncUnsupported; 15] = [
        Self::Snapshot,
        Self::RecordHistory,
        Self::AttachOutOfMemoryObserver,
        Self::AttachAllocatorTraceTracker,
        Self::CreateOrIncrefPool,
        Self::GetPoolUseCount,
        Self::SetUseOnOom,
        Self::SetNoSplit,
        Self::CheckPoolLiveAllocations,
        Self::GetCheckpointState,
        Self::SetCheckpointPoolState,
        Self::ShareIpcHandle,
        Self::GetIpcDevPtr,
        Self::GetExpandableSegmentSizes,
        Self::CachingAllocator,
    ];

    /// The method of PyTorch's `CUDAAllocator` that refuses it (tensormem's function for
    /// [`CachingAllocator`](Self::CachingAllocator)).
    #[must_use]
    pub const fn method(self) -> &'static str {
        match self {
            Self::Snapshot => "snapshot",
            Self::RecordHistory => "recordHistory",
            Self::AttachOutOfMemoryObserver => "attachOutOfMemoryObserver",
            Self::AttachAllocatorTraceTracker => "attachAllocatorTraceTracker",
            Self::CreateOrIncrefPool => "createOrIncrefPool",
            Self::GetPoolUseCount => "getPoolUseCount",
            Self::SetUseOnOom => "setUseOnOOM",
            Self::SetNoSplit => "setNoSplit",
            Self::CheckPoolLiveAllocations => "checkPoolLiveAllocations",
            Self::GetCheckpointState => "getCheckpointState",
            Self::SetCheckpointPoolState => "setCheckpointPoolState",
            Self::ShareIpcHandle => "shareIpcHandle",
            Self::GetIpcDevPtr => "getIpcDevPtr",
            Self::GetExpandableSegmentSizes => "getExpandableSegmentSizes",
            Self::CachingAllocator => "caching_allocator",
        }
    }

    /// The refusal of PyTorch's method `method` (as [`method`](Self::method) spells it;
    /// `isHistoryEnabled` is [`RecordHistory`](Self::RecordHistory), as in PyTorch).
    #[must_use]
    pub fn from_method(method: &str) -> Option<Self> {
        if method == "isHistoryEnabled" {
            return Some(Self::RecordHistory);
        }
        Self::ALL.into_iter().find(|what| what.method() == method)
    }

    /// PyTorch's message for it, word for word (tensormem's own for
    /// [`CachingAllocator`](Self::CachingAllocator)).
    #[must_use]
    pub fn pytorch_message(self) -> String {
        match self {
            Self::Snapshot => "Calling snapshot with backend:cudaMallocAsync is not meaningful. (For \
                               backend:native, snapshot returns a detailed summary of all blocks \
                               tracked by the allocator, but the cudaMallocAsync backend does not \
                               track individual blocks.)"
                .to_owned(),
            Self::GetExpandableSegmentSizes => {
                "CUDAMallocAsyncAllocator does not yet support getExpandableSegmentSizes.".to_owned()
            }
            Self::CachingAllocator => "the native caching allocator does not serve this process \
                                       (backend:cudaMallocAsync does): caching_allocator, sleeping and \
                                       waking private pools need it"
                .to_owned(),
            other => format!(
                "cudaMallocAsync does not yet support {}. If you need it, please file an issue \
                 describing your use case.",
                other.method()
            ),
        }
    }
}

impl fmt::Display for AsyncUnsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}\n(tensormem serves this process with backend:cudaMallocAsync because its allocator \
             configuration asks for it; to use this, start the process without backend:cudaMallocAsync \
             in TENSORMEM_ALLOC_CONF, or else in PYTORCH_CUDA_ALLOC_CONF, or else in \
             PYTORCH_ALLOC_CONF: the first of them that is set)",
            self.pytorch_message()
        )
    }
}
