//! The wire form of a batch: [`BatchHandle`], its segments and views, and their binary encoding
//! (see the [module docs](crate::batch)).

use tensormem_shm::ShmName;

use super::check::validate;
use super::model::{BatchSegment, BatchView, NO_SEGMENT};
use crate::chunks::{ChunkHandle, MAX_CHUNKS};
use crate::driver::{EventHandle, MemHandle, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
use crate::handle::SegmentMemory;
use crate::reader::Reader;

const MAGIC: &[u8; 4] = b"TMIB";
/// The newest batch encoding this crate writes and reads: version 2, which also carries ranges of
/// expandable segments. A batch of device allocations only is written as version 1, byte for byte
/// the encoding of earlier releases, which read it; both versions are read (see the
/// [module docs](crate::batch#binary-encoding)).
pub const BATCH_ENCODING_VERSION: u16 = 2;
/// The first encoding: segments are device allocations, with no kind byte.
const ALLOCATIONS_VERSION: u16 = 1;
const FLAG_EVENT: u16 = 1;
const HEADER_LEN: usize = 102;
const SEGMENT_LEN: usize = IPC_HANDLE_SIZE + 8;
const VIEW_FIXED_LEN: usize = 22;
/// Version 2's segment kinds: a device allocation (as in version 1), a range of chunks.
const KIND_ALLOCATION: u8 = 0;
const KIND_CHUNKS: u8 = 1;
/// A range of chunks before its descriptors: pid, chunk size, chunk count.
const CHUNKS_HEADER_LEN: usize = 16;
/// The fewest bytes a version 2 segment takes: its kind and a range of one chunk.
const MIN_SEGMENT_LEN_V2: usize = 1 + CHUNKS_HEADER_LEN + 4;

impl BatchSegment {
    /// The bytes of this segment in the wire form of `version` (1: no kind byte).
    fn encode_into(&self, version: u16, out: &mut Vec<u8>) {
        match &self.memory {
            SegmentMemory::Allocation(handle) => {
                if version != ALLOCATIONS_VERSION {
                    out.push(KIND_ALLOCATION);
                }
                out.extend_from_slice(&handle.0);
                out.extend_from_slice(&self.size.to_le_bytes());
            }
            SegmentMemory::Chunks(chunks) => {
                debug_assert_ne!(version, ALLOCATIONS_VERSION);
                out.push(KIND_CHUNKS);
                out.extend_from_slice(&chunks.pid.to_le_bytes());
                out.extend_from_slice(&chunks.chunk_size.to_le_bytes());
                out.extend_from_slice(&(chunks.fds.len() as u32).to_le_bytes());
                for fd in &chunks.fds {
                    out.extend_from_slice(&fd.to_le_bytes());
                }
            }
        }
    }

    /// Reads segment `i` in the wire form of `version`; every count is checked against the
    /// bytes left before anything is allocated from it.
    fn decode_from(r: &mut Reader<'_>, version: u16, i: usize) -> Result<Self> {
        let kind = if version == ALLOCATIONS_VERSION {
            KIND_ALLOCATION
        } else {
            r.u8("segment kind")?
        };
        match kind {
            KIND_ALLOCATION => {
                let mem_handle = MemHandle(r.array::<IPC_HANDLE_SIZE>("segment memory handle")?);
                let size = r.u64("integer")?;
                Ok(Self::allocation(mem_handle, size))
            }
            KIND_CHUNKS => {
                let pid = r.u32("integer")?;
                let chunk_size = r.u64("integer")?;
                let count = r.u32("integer")? as usize;
                if count == 0 || count > MAX_CHUNKS {
                    return Err(malformed(format!(
                        "segment {i} names {count} chunks (1 to {MAX_CHUNKS} expected)"
                    )));
                }
                let fds = r
                    .take(count * 4, "chunk descriptors")?
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                Ok(Self::chunks(ChunkHandle {
                    pid,
                    chunk_size,
                    fds,
                }))
            }
            other => Err(malformed(format!(
                "segment {i} is of unknown kind {other} (0: a device allocation, 1: chunks of an \
                 expandable segment)"
            ))),
        }
    }
}

fn malformed(problem: String) -> Error {
    Error::MalformedBatch { problem }
}

/// Everything a consumer needs to open many tensors of another process at once (see the
/// [module docs](crate::batch)). Made by [`BatchBuilder::share`](crate::BatchBuilder::share) or
/// [`BatchHandle::decode`], so that its fields always hold together (views inside their segments,
/// distinct names, no partial overlap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHandle {
    device: u32,
    ref_counter: ShmName,
    slot: u64,
    event: Option<EventHandle>,
    producer: u64,
    segments: Vec<BatchSegment>,
    views: Vec<BatchView>,
    /// View indices in name order (for [`view`](Self::view)).
    by_name: Vec<u32>,
}

/// Segments and views that passed [`validate`], before a slot is taken for them.
#[derive(Clone)]
pub(crate) struct CheckedBatch {
    segments: Vec<BatchSegment>,
    views: Vec<BatchView>,
    by_name: Vec<u32>,
}

impl CheckedBatch {
    /// Checks `segments` and `views` as [`BatchHandle::decode`] does; the problem, if any, is
    /// returned as text for the caller to wrap in its error.
    pub(crate) fn new(
        segments: Vec<BatchSegment>,
        views: Vec<BatchView>,
    ) -> std::result::Result<Self, String> {
        let by_name = validate(&segments, &views)?;
        Ok(Self {
            segments,
            views,
            by_name,
        })
    }

    /// The segments, in order.
    pub(crate) fn segments(&self) -> &[BatchSegment] {
        &self.segments
    }

    pub(crate) fn into_handle(
        self,
        device: u32,
        ref_counter: ShmName,
        slot: u64,
        event: Option<EventHandle>,
        producer: u64,
    ) -> BatchHandle {
        BatchHandle {
            device,
            ref_counter,
            slot,
            event,
            producer,
            segments: self.segments,
            views: self.views,
            by_name: self.by_name,
        }
    }
}

impl BatchHandle {
    /// The device ordinal.
    #[must_use]
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The ref-counter file holding the message's slot.
    #[must_use]
    pub fn ref_counter(&self) -> &ShmName {
        &self.ref_counter
    }

    /// The message's slot in the ref-counter file (one for every view).
    #[must_use]
    pub fn slot(&self) -> u64 {
        self.slot
    }

    /// The event the consumer's stream waits for, if any.
    #[must_use]
    pub fn event(&self) -> Option<&EventHandle> {
        self.event.as_ref()
    }

    /// The producer's random id (lets a consumer keep its events open).
    #[must_use]
    pub fn producer(&self) -> u64 {
        self.producer
    }

    /// The segments, one memory handle or range of chunks each.
    #[must_use]
    pub fn segments(&self) -> &[BatchSegment] {
        &self.segments
    }

    /// The views, in the order they were added.
    #[must_use]
    pub fn views(&self) -> &[BatchView] {
        &self.views
    }

    /// The view named `name`.
    #[must_use]
    pub fn view(&self, name: &str) -> Option<&BatchView> {
        find(&self.by_name, |i| self.views[i].name.as_str(), name).map(|i| &self.views[i])
    }

    pub(crate) fn by_name(&self) -> &[u32] {
        &self.by_name
    }

    /// The encoding version [`encode`](Self::encode) writes for this batch: 1 for device
    /// allocations only (what earlier releases read), [`BATCH_ENCODING_VERSION`] where a segment
    /// is a range of an expandable segment.
    #[must_use]
    pub fn encoding_version(&self) -> u16 {
        if self.segments.iter().any(BatchSegment::is_chunks) {
            BATCH_ENCODING_VERSION
        } else {
            ALLOCATIONS_VERSION
        }
    }

    /// The binary encoding (see the [module docs](crate::batch)), in the version
    /// [`encoding_version`](Self::encoding_version) says.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let version = self.encoding_version();
        let name = self.ref_counter.as_str().as_bytes();
        let tags: usize = self.views.iter().map(|v| v.name.len()).sum();
        let chunks: usize = self
            .segments
            .iter()
            .map(|s| match &s.memory {
                SegmentMemory::Chunks(c) => CHUNKS_HEADER_LEN + 4 * c.fds.len(),
                SegmentMemory::Allocation(_) => SEGMENT_LEN,
            })
            .sum();
        let mut out = Vec::with_capacity(
            HEADER_LEN
                + name.len()
                + self.segments.len()
                + chunks
                + self.views.len() * VIEW_FIXED_LEN
                + tags,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        let flags = if self.event.is_some() { FLAG_EVENT } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&(self.segments.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.views.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.producer.to_le_bytes());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&self.event.map_or([0; IPC_HANDLE_SIZE], |e| e.0));
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        for segment in &self.segments {
            segment.encode_into(version, &mut out);
        }
        for view in &self.views {
            out.extend_from_slice(&view.segment.unwrap_or(NO_SEGMENT).to_le_bytes());
            out.extend_from_slice(&view.offset.to_le_bytes());
            out.extend_from_slice(&view.len.to_le_bytes());
            out.extend_from_slice(&(view.name.len() as u16).to_le_bytes());
            out.extend_from_slice(view.name.as_bytes());
        }
        out
    }

    /// Decodes [`encode`](Self::encode)'s bytes, checking every field (see the
    /// [module docs](crate::batch)).
    ///
    /// # Errors
    ///
    /// [`Error::MalformedBatch`] naming the first problem found; for a version this build does
    /// not read (a newer release's), the versions it reads.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = malformed;
        if bytes.len() < HEADER_LEN {
            return Err(bad(format!(
                "{} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            )));
        }
        if &bytes[..4] != MAGIC {
            return Err(bad("wrong magic (not a batch handle)".into()));
        }
        let mut r = Reader::new(bytes, 4, |problem| Error::MalformedBatch { problem });
        let version = r.u16("integer")?;
        if !(ALLOCATIONS_VERSION..=BATCH_ENCODING_VERSION).contains(&version) {
            return Err(bad(format!(
                "encoding version {version}, this build reads versions {ALLOCATIONS_VERSION} to \
                 {BATCH_ENCODING_VERSION}; use the same tensormem-ipc version on both sides"
            )));
        }
        let flags = r.u16("integer")?;
        if flags & !FLAG_EVENT != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let device = r.u32("integer")?;
        let segment_count = r.u32("integer")? as usize;
        let view_count = r.u32("integer")? as usize;
        let producer = r.u64("integer")?;
        let slot = r.u64("integer")?;
        let event_bytes = r.array::<IPC_HANDLE_SIZE>("event handle")?;
        let event = (flags & FLAG_EVENT != 0).then_some(EventHandle(event_bytes));
        let name_len = usize::from(r.u16("integer")?);
        if name_len == 0 {
            return Err(bad("no ref-counter file name".into()));
        }
        let name = r.take(name_len, "ref-counter file name")?;
        let ref_counter =
            ShmName::from_bytes(name).map_err(|e| bad(format!("ref-counter file name: {e}")))?;
        // Counts are checked against what is left before anything is allocated from them.
        let left = bytes.len() - r.at;
        if segment_count == 0 || view_count == 0 {
            return Err(bad(format!(
                "{segment_count} segments and {view_count} views; a batch has at least one of each"
            )));
        }
        let segment_len = if version == ALLOCATIONS_VERSION {
            SEGMENT_LEN
        } else {
            MIN_SEGMENT_LEN_V2
        };
        let needed = segment_count
            .checked_mul(segment_len)
            .and_then(|s| view_count.checked_mul(VIEW_FIXED_LEN).map(|v| (s, v)))
            .and_then(|(s, v)| s.checked_add(v));
        if needed.is_none_or(|needed| needed > left) {
            return Err(bad(format!(
                "{segment_count} segments and {view_count} views need more than the {left} bytes \
                 left (truncated, or counts that do not match)"
            )));
        }
        let mut segments = Vec::with_capacity(segment_count);
        for i in 0..segment_count {
            segments.push(BatchSegment::decode_from(&mut r, version, i)?);
        }
        if version != ALLOCATIONS_VERSION && !segments.iter().any(BatchSegment::is_chunks) {
            return Err(bad(format!(
                "encoding version {version} without a range of chunks; a batch of device \
                 allocations only is written as version {ALLOCATIONS_VERSION}"
            )));
        }
        let mut views = Vec::with_capacity(view_count);
        for i in 0..view_count {
            let segment = r.u32("integer")?;
            let offset = r.u64("integer")?;
            let len = r.u64("integer")?;
            let tag_len = usize::from(r.u16("integer")?);
            let tag = r.take(tag_len, "view name")?;
            let name = std::str::from_utf8(tag)
                .map_err(|e| bad(format!("the name of view {i} is not UTF-8: {e}")))?
                .to_owned();
            views.push(BatchView {
                name,
                segment: (segment != NO_SEGMENT).then_some(segment),
                offset,
                len,
            });
        }
        if r.at != bytes.len() {
            return Err(bad(format!(
                "{} bytes, but the header and entries describe {}",
                bytes.len(),
                r.at
            )));
        }
        Ok(CheckedBatch::new(segments, views)
            .map_err(bad)?
            .into_handle(device, ref_counter, slot, event, producer))
    }
}

/// Binary search of `name` among indices sorted by `key`.
pub(super) fn find<'k>(
    sorted: &[u32],
    key: impl Fn(usize) -> &'k str,
    name: &str,
) -> Option<usize> {
    sorted
        .binary_search_by(|&i| key(i as usize).cmp(name))
        .ok()
        .map(|at| sorted[at] as usize)
}

#[cfg(test)]
mod tests;
