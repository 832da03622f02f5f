//! The wire form of a batch: [`BatchHandle`], its segments and views, and their binary encoding
//! (see the [module docs](crate::batch)).

use tensormem_shm::ShmName;

use crate::driver::{EventHandle, MemHandle, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
use crate::reader::Reader;

const MAGIC: &[u8; 4] = b"TMIB";
/// The batch encoding version this crate writes and reads.
pub const BATCH_ENCODING_VERSION: u16 = 1;
const FLAG_EVENT: u16 = 1;
const HEADER_LEN: usize = 102;
const SEGMENT_LEN: usize = IPC_HANDLE_SIZE + 8;
const VIEW_FIXED_LEN: usize = 22;
/// The segment index of a zero-byte view that names no memory.
const NO_SEGMENT: u32 = u32::MAX;

/// One segment of a batch: a base allocation of the producer, named by its memory handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSegment {
    /// The IPC handle of the base allocation.
    pub mem_handle: MemHandle,
    /// Its size in bytes, as the producer's allocator knows it (checked against the real size of
    /// the mapping when opened).
    pub size: u64,
}

/// One tensor of a batch: a named range of one of its segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchView {
    /// The application's name for it (a state dict's key); distinct within a batch.
    pub name: String,
    /// The index of its segment in [`BatchHandle::segments`]; `None` for a zero-byte view of an
    /// empty allocation, which names no memory.
    pub segment: Option<u32>,
    /// Where it starts in the segment.
    pub offset: u64,
    /// Its length in bytes (exact: the bytes asked for, not the allocator's rounded block).
    pub len: u64,
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

    /// The segments, one memory handle each.
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

    /// The binary encoding (see the [module docs](crate::batch)).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let name = self.ref_counter.as_str().as_bytes();
        let tags: usize = self.views.iter().map(|v| v.name.len()).sum();
        let mut out = Vec::with_capacity(
            HEADER_LEN
                + name.len()
                + self.segments.len() * SEGMENT_LEN
                + self.views.len() * VIEW_FIXED_LEN
                + tags,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&BATCH_ENCODING_VERSION.to_le_bytes());
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
            out.extend_from_slice(&segment.mem_handle.0);
            out.extend_from_slice(&segment.size.to_le_bytes());
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
    /// [`Error::MalformedBatch`] naming the first problem found.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |problem: String| Error::MalformedBatch { problem };
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
        if version != BATCH_ENCODING_VERSION {
            return Err(bad(format!(
                "encoding version {version}, this build reads version {BATCH_ENCODING_VERSION}; \
                 use the same tensormem-ipc version on both sides"
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
        let needed = segment_count
            .checked_mul(SEGMENT_LEN)
            .and_then(|s| view_count.checked_mul(VIEW_FIXED_LEN).map(|v| (s, v)))
            .and_then(|(s, v)| s.checked_add(v));
        if needed.is_none_or(|needed| needed > left) {
            return Err(bad(format!(
                "{segment_count} segments and {view_count} views need more than the {left} bytes \
                 left (truncated, or counts that do not match)"
            )));
        }
        let mut segments = Vec::with_capacity(segment_count);
        for _ in 0..segment_count {
            let mem_handle = MemHandle(r.array::<IPC_HANDLE_SIZE>("segment memory handle")?);
            let size = r.u64("integer")?;
            segments.push(BatchSegment { mem_handle, size });
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

/// Reads fields in order, every read checked against the end.
/// Checks a batch's segments and views (see the module docs); returns the view indices in name
/// order.
fn validate(
    segments: &[BatchSegment],
    views: &[BatchView],
) -> std::result::Result<Vec<u32>, String> {
    if segments.is_empty() || views.is_empty() {
        return Err(format!(
            "{} segments and {} views; a batch has at least one of each",
            segments.len(),
            views.len()
        ));
    }
    if segments.len() >= NO_SEGMENT as usize || views.len() > u32::MAX as usize {
        return Err("too many segments or views".into());
    }
    let mut used = vec![false; segments.len()];
    for (i, segment) in segments.iter().enumerate() {
        if segment.size == 0 {
            return Err(format!("segment {i} has a size of 0 bytes"));
        }
    }
    let mut handles: Vec<(&[u8], usize)> = segments
        .iter()
        .enumerate()
        .map(|(i, s)| (&s.mem_handle.0[..], i))
        .collect();
    handles.sort_unstable();
    if let Some(w) = handles.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!(
            "segments {} and {} have the same memory handle",
            w[0].1, w[1].1
        ));
    }
    // (segment, offset, len, view) of the views with bytes, for the overlap check.
    let mut ranges = Vec::with_capacity(views.len());
    for (i, view) in views.iter().enumerate() {
        if view.name.len() > usize::from(u16::MAX) {
            return Err(format!(
                "the name of view {i} is {} bytes long, more than {}",
                view.name.len(),
                u16::MAX
            ));
        }
        let Some(segment) = view.segment else {
            if view.offset != 0 || view.len != 0 {
                return Err(format!(
                    "view {i} ({:?}) names no segment but claims {} bytes at offset {}",
                    view.name, view.len, view.offset
                ));
            }
            continue;
        };
        let Some(seg) = segments.get(segment as usize) else {
            return Err(format!(
                "view {i} ({:?}) names segment {segment}, but there are {}",
                view.name,
                segments.len()
            ));
        };
        used[segment as usize] = true;
        let end = view.offset.checked_add(view.len);
        if end.is_none_or(|end| end > seg.size) {
            return Err(format!(
                "view {i} ({:?}) claims {} bytes at offset {} of segment {segment}, which has {} \
                 bytes",
                view.name, view.len, view.offset, seg.size
            ));
        }
        if view.len > 0 {
            ranges.push((segment, view.offset, view.len, i));
        }
    }
    if let Some(unused) = used.iter().position(|u| !u) {
        return Err(format!("segment {unused} is named by no view"));
    }
    ranges.sort_unstable();
    // The furthest end so far in the current segment, and the range that reached it.
    let mut reach: Option<(u32, u64, u64, usize)> = None;
    for &(segment, offset, len, i) in &ranges {
        if let Some((seg, start, end, j)) = reach {
            if seg == segment && offset < end {
                let same = start == offset && end == offset + len;
                if !same {
                    return Err(format!(
                        "views {j} ({:?}) and {i} ({:?}) overlap in segment {segment} (bytes \
                         {start}..{end} and {offset}..{}); views may share bytes only as exact \
                         aliases of one range",
                        views[j].name,
                        views[i].name,
                        offset + len
                    ));
                }
                continue;
            }
        }
        reach = Some((segment, offset, offset + len, i));
    }
    let mut by_name: Vec<u32> = (0..views.len() as u32).collect();
    by_name.sort_unstable_by(|&a, &b| views[a as usize].name.cmp(&views[b as usize].name));
    if let Some(w) = by_name
        .windows(2)
        .find(|w| views[w[0] as usize].name == views[w[1] as usize].name)
    {
        return Err(format!(
            "views {} and {} have the same name {:?}; names are keys and must be distinct",
            w[0], w[1], views[w[0] as usize].name
        ));
    }
    Ok(by_name)
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn mem(tag: u8) -> MemHandle {
        MemHandle([tag; IPC_HANDLE_SIZE])
    }

    fn view(name: &str, segment: u32, offset: u64, len: u64) -> BatchView {
        BatchView {
            name: name.into(),
            segment: Some(segment),
            offset,
            len,
        }
    }

    fn sample(event: bool) -> BatchHandle {
        CheckedBatch::new(
            vec![
                BatchSegment {
                    mem_handle: mem(1),
                    size: 2 << 20,
                },
                BatchSegment {
                    mem_handle: mem(2),
                    size: 1001,
                },
            ],
            vec![
                view("wte.weight", 0, 512, 1_000_003),
                view("lm_head.weight", 0, 512, 1_000_003), // tied: an exact alias
                view("ln.bias", 1, 0, 1000),
                view("ln.weight", 1, 1000, 1),
                view("tail", 0, (2 << 20) - 7, 7),
                BatchView {
                    name: "empty".into(),
                    segment: None,
                    offset: 0,
                    len: 0,
                },
                view("edge", 0, 2 << 20, 0),
            ],
        )
        .unwrap()
        .into_handle(
            2,
            ShmName::new("/tensormem_1_2_3").unwrap(),
            77,
            event.then_some(EventHandle([5; 64])),
            0xfeed,
        )
    }

    fn malformed(bytes: &[u8]) -> String {
        match BatchHandle::decode(bytes) {
            Err(Error::MalformedBatch { problem }) => problem,
            other => panic!("expected MalformedBatch, got {other:?}"),
        }
    }

    /// The offset of view `i`'s fixed part in `sample`'s encoding.
    fn view_at(handle: &BatchHandle, i: usize) -> usize {
        HEADER_LEN
            + handle.ref_counter.as_str().len()
            + handle.segments.len() * SEGMENT_LEN
            + handle.views[..i]
                .iter()
                .map(|v| VIEW_FIXED_LEN + v.name.len())
                .sum::<usize>()
    }

    #[test]
    fn batches_round_trip_with_odd_sizes_offsets_aliases_and_empty_views() {
        for event in [false, true] {
            let h = sample(event);
            let bytes = h.encode();
            let back = BatchHandle::decode(&bytes).unwrap();
            assert_eq!(back, h);
            assert_eq!(back.view("ln.weight").unwrap().offset, 1000);
            assert_eq!(back.view("wte.weight").unwrap().len, 1_000_003);
            assert_eq!(back.view("empty").unwrap().segment, None);
            assert!(back.view("missing").is_none());
            assert_eq!(back.event().is_some(), event);
        }
    }

    #[test]
    fn every_truncation_and_extension_is_refused() {
        let bytes = sample(true).encode();
        for cut in 0..bytes.len() {
            malformed(&bytes[..cut]);
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(malformed(&longer).contains("describe"));
    }

    #[test]
    fn header_fields_are_checked() {
        let bytes = sample(false).encode();
        let mut b = bytes.clone();
        b[0] = b'X';
        assert!(malformed(&b).contains("magic"));
        let mut b = bytes.clone();
        b[4] = 9;
        assert!(malformed(&b).contains("version 9"));
        let mut b = bytes.clone();
        b[6] = 0x40;
        assert!(malformed(&b).contains("flags"));
        let mut b = bytes.clone();
        b[HEADER_LEN + 3] = b'/';
        assert!(malformed(&b).contains("file name"));
        let mut b = bytes.clone();
        b[100..102].copy_from_slice(&0u16.to_le_bytes());
        assert!(malformed(&b).contains("no ref-counter file"));
    }

    #[test]
    fn hostile_counts_are_refused_before_anything_is_allocated() {
        let bytes = sample(false).encode();
        for (at, count) in [
            (12, u32::MAX),
            (16, u32::MAX),
            (12, 3),
            (16, 8),
            (12, 0),
            (16, 0),
        ] {
            let mut b = bytes.clone();
            b[at..at + 4].copy_from_slice(&count.to_le_bytes());
            malformed(&b);
        }
        // A view count that fits the bytes but leaves a name running past the end.
        let mut b = bytes.clone();
        b[16..20].copy_from_slice(&1u32.to_le_bytes());
        assert!(malformed(&b).contains("describe"));
    }

    #[test]
    fn views_past_their_segment_or_naming_no_segment_are_refused() {
        let h = sample(false);
        let bytes = h.encode();
        let seg_size_at = HEADER_LEN + h.ref_counter.as_str().len() + SEGMENT_LEN + 64;
        // Segment 1 shrunk under view "ln.weight" (1000..1001).
        let mut b = bytes.clone();
        b[seg_size_at..seg_size_at + 8].copy_from_slice(&1000u64.to_le_bytes());
        assert!(malformed(&b).contains("ln.weight"));
        // A zero-sized segment.
        let mut b = bytes.clone();
        b[seg_size_at..seg_size_at + 8].copy_from_slice(&0u64.to_le_bytes());
        assert!(malformed(&b).contains("size of 0"));
        // An offset past the segment, and one that overflows with the length.
        for offset in [(2u64 << 20) + 1, u64::MAX - 2] {
            let at = view_at(&h, 4) + 4;
            let mut b = bytes.clone();
            b[at..at + 8].copy_from_slice(&offset.to_le_bytes());
            assert!(malformed(&b).contains("\"tail\""));
        }
        // A segment index past the count.
        let at = view_at(&h, 2);
        let mut b = bytes.clone();
        b[at..at + 4].copy_from_slice(&2u32.to_le_bytes());
        assert!(malformed(&b).contains("names segment 2"));
        // No segment, but bytes claimed.
        let at = view_at(&h, 5);
        let mut b = bytes.clone();
        b[at + 12..at + 20].copy_from_slice(&4u64.to_le_bytes());
        assert!(malformed(&b).contains("names no segment"));
        // A segment no view names: both views of segment 1 moved to segment 0.
        let mut b = bytes;
        for i in [2, 3] {
            let at = view_at(&h, i);
            b[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
        }
        assert!(malformed(&b).contains("segment 1 is named by no view"));
    }

    #[test]
    fn overlaps_duplicates_and_bad_names_are_refused() {
        let seg = || {
            vec![BatchSegment {
                mem_handle: mem(1),
                size: 4096,
            }]
        };
        let make = |views| {
            CheckedBatch::new(seg(), views)
                .map(|c| c.into_handle(0, ShmName::new("/tensormem_9_9_9").unwrap(), 0, None, 0))
        };
        // Partial overlaps, nested ranges, a range overlapping the second of two aliases.
        for views in [
            vec![view("a", 0, 0, 100), view("b", 0, 99, 10)],
            vec![view("a", 0, 0, 1000), view("b", 0, 10, 20)],
            vec![view("a", 0, 0, 100), view("b", 0, 0, 50)],
            vec![
                view("a", 0, 0, 100),
                view("a2", 0, 0, 100),
                view("c", 0, 50, 100),
            ],
            vec![
                view("big", 0, 0, 4096),
                view("x", 0, 500, 1),
                view("y", 0, 4000, 8),
            ],
        ] {
            let problem = make(views).err().unwrap();
            assert!(problem.contains("overlap"), "{problem}");
        }
        // Adjacent ranges and zero-length views inside others are fine.
        make(vec![
            view("a", 0, 0, 100),
            view("b", 0, 100, 100),
            view("z", 0, 50, 0),
        ])
        .unwrap();
        let problem = make(vec![view("a", 0, 0, 10), view("a", 0, 10, 10)])
            .err()
            .unwrap();
        assert!(problem.contains("same name"), "{problem}");
        // Two segments with one memory handle.
        let problem = CheckedBatch::new(
            vec![seg()[0], seg()[0]],
            vec![view("a", 0, 0, 1), view("b", 1, 0, 1)],
        )
        .err()
        .unwrap();
        assert!(problem.contains("same memory handle"), "{problem}");
        // Names must be UTF-8.
        let h = make(vec![view("a", 0, 0, 10)]).unwrap();
        let mut b = h.encode();
        let last = b.len() - 1;
        b[last] = 0xff;
        assert!(malformed(&b).contains("UTF-8"));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = BatchHandle::decode(&bytes);
        }

        #[test]
        fn mutated_batches_never_panic_and_decode_only_to_valid_batches(
            at in 0usize..400, value in any::<u8>()
        ) {
            let mut bytes = sample(true).encode();
            let at = at % bytes.len();
            bytes[at] = value;
            if let Ok(h) = BatchHandle::decode(&bytes) {
                // Whatever decodes re-encodes to the same bytes and satisfies the checks.
                prop_assert_eq!(h.encode(), bytes);
                for v in h.views() {
                    if let Some(s) = v.segment {
                        prop_assert!(v.offset + v.len <= h.segments()[s as usize].size);
                    }
                }
            }
        }
    }
}
