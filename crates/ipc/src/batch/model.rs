//! A batch's data: its segments (memory of the producer the consumer maps once each) and its views
//! (named ranges of them). What [`check`](super::check) validates and [`wire`](super::wire)
//! encodes.

use crate::chunks::ChunkHandle;
use crate::driver::MemHandle;
use crate::handle::SegmentMemory;

/// The segment index of a zero-byte view that names no memory.
pub(super) const NO_SEGMENT: u32 = u32::MAX;

/// One segment of a batch: memory of the producer that the consumer maps once, in one piece. A
/// base allocation, named by its CUDA IPC memory handle, or a range of an expandable segment,
/// named by its chunks (mapped contiguously, in order, by the consumer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSegment {
    /// What names its memory. Views' offsets count from the allocation's start, or from the first
    /// chunk's start.
    pub memory: SegmentMemory,
    /// Its size in bytes: an allocation's as the producer's allocator knows it (checked against
    /// the real size of the mapping when opened); the extent of the chunks
    /// ([`ChunkHandle::extent`]) for a range of chunks.
    pub size: u64,
}

impl BatchSegment {
    /// A base allocation of `size` bytes, named by its memory handle.
    #[must_use]
    pub fn allocation(mem_handle: MemHandle, size: u64) -> Self {
        Self {
            memory: SegmentMemory::Allocation(mem_handle),
            size,
        }
    }

    /// A range of an expandable segment: `chunks`, their extent in bytes.
    #[must_use]
    pub fn chunks(chunks: ChunkHandle) -> Self {
        Self {
            size: chunks.extent(),
            memory: SegmentMemory::Chunks(chunks),
        }
    }

    /// Whether it is a range of chunks of an expandable segment.
    pub(super) fn is_chunks(&self) -> bool {
        matches!(self.memory, SegmentMemory::Chunks(_))
    }
}

/// One tensor of a batch: a named range of one of its segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchView {
    /// The application's name for it (a state dict's key); distinct within a batch.
    pub name: String,
    /// The index of its segment in [`BatchHandle::segments`](super::BatchHandle::segments); `None` for a zero-byte view of an
    /// empty allocation, which names no memory.
    pub segment: Option<u32>,
    /// Where it starts in the segment.
    pub offset: u64,
    /// Its length in bytes (exact: the bytes asked for, not the allocator's rounded block).
    pub len: u64,
}
