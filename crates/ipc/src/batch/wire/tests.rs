//! The batch encoding's round trips and refusals: both versions, every truncation, hostile counts
//! and fields, and byte-for-byte compatibility of version 1 with earlier releases.

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
            BatchSegment::allocation(mem(1), 2 << 20),
            BatchSegment::allocation(mem(2), 1001),
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
    let seg = || vec![BatchSegment::allocation(mem(1), 4096)];
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
        vec![seg()[0].clone(), seg()[0].clone()],
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

/// What the first release's encoder wrote for `sample(true)`: version 1, which stays the
/// encoding of batches of device allocations.
const GOLDEN_V1: &str = concat!(
    "544d494201000100020000000200000007000000edfe0000000000004d000000000000000505050505050505",
    "0505050505050505050505050505050505050505050505050505050505050505050505050505050505050505",
    "05050505050505050505050510002f74656e736f726d656d5f315f325f330101010101010101010101010101",
    "0101010101010101010101010101010101010101010101010101010101010101010101010101010101010101",
    "0101010101010000200000000000020202020202020202020202020202020202020202020202020202020202",
    "02020202020202020202020202020202020202020202020202020202020202020202e9030000000000000000",
    "0000000200000000000043420f00000000000a007774652e7765696768740000000000020000000000004342",
    "0f00000000000e006c6d5f686561642e776569676874010000000000000000000000e8030000000000000700",
    "6c6e2e6269617301000000e803000000000000010000000000000009006c6e2e77656967687400000000f9ff",
    "1f0000000000070000000000000004007461696cffffffff000000000000000000000000000000000500656d",
    "7074790000000000002000000000000000000000000000040065646765",
);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A batch of both kinds of segment: a device allocation, a range of three chunks, and a range of
/// one small-pool chunk.
fn mixed() -> BatchHandle {
    let chunks = |fds: &[i32], chunk_size: u64| {
        BatchSegment::chunks(ChunkHandle {
            pid: 4242,
            chunk_size,
            fds: fds.to_vec(),
        })
    };
    CheckedBatch::new(
        vec![
            chunks(&[31, 32, 33], 20 << 20),
            BatchSegment::allocation(mem(1), 4096),
            chunks(&[40], 2 << 20),
        ],
        vec![
            view("a", 0, 0, 12 << 20),
            // Crosses from the first chunk into the second.
            view("b", 0, 12 << 20, 12 << 20),
            view("c", 1, 512, 1000),
            view("small", 2, 7, 1 << 20),
            view("tail", 0, (60 << 20) - 3, 3),
        ],
    )
    .unwrap()
    .into_handle(
        0,
        ShmName::new("/tensormem_1_2_3").unwrap(),
        5,
        Some(EventHandle([5; 64])),
        0xbeef,
    )
}

/// Where segment `i`'s kind byte is in `mixed()`'s encoding.
fn segment_at(handle: &BatchHandle, i: usize) -> usize {
    HEADER_LEN
        + handle.ref_counter.as_str().len()
        + handle.segments[..i]
            .iter()
            .map(|s| match &s.memory {
                SegmentMemory::Allocation(_) => 1 + SEGMENT_LEN,
                SegmentMemory::Chunks(c) => 1 + CHUNKS_HEADER_LEN + 4 * c.fds.len(),
            })
            .sum::<usize>()
}

#[test]
fn batches_of_allocations_keep_the_first_encoding_byte_for_byte() {
    let h = sample(true);
    assert_eq!(h.encoding_version(), 1);
    assert_eq!(hex(&h.encode()), GOLDEN_V1);
    let old: Vec<u8> = (0..GOLDEN_V1.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&GOLDEN_V1[i..i + 2], 16).unwrap())
        .collect();
    assert_eq!(BatchHandle::decode(&old).unwrap(), h);
}

#[test]
fn ranges_of_chunks_travel_beside_allocations_in_version_2() {
    let h = mixed();
    assert_eq!(h.encoding_version(), BATCH_ENCODING_VERSION);
    let bytes = h.encode();
    assert_eq!(&bytes[4..6], &2u16.to_le_bytes());
    let back = BatchHandle::decode(&bytes).unwrap();
    assert_eq!(back, h);
    assert_eq!(back.segments()[0].size, 60 << 20);
    let SegmentMemory::Chunks(chunks) = &back.segments()[0].memory else {
        panic!("segment 0 is a range of chunks: {:?}", back.segments()[0]);
    };
    assert_eq!((chunks.pid, &chunks.fds[..]), (4242, &[31, 32, 33][..]));
    assert_eq!(back.view("b").unwrap().offset, 12 << 20);
    for cut in 0..bytes.len() {
        malformed(&bytes[..cut]);
    }
    let mut longer = bytes;
    longer.push(0);
    assert!(malformed(&longer).contains("describe"));
}

#[test]
fn hostile_ranges_of_chunks_are_refused() {
    let h = mixed();
    let bytes = h.encode();
    let at = segment_at(&h, 0);
    let (pid, size, count, fds) = (at + 1, at + 5, at + 13, at + 17);
    let with = |at: usize, value: &[u8]| {
        let mut b = bytes.clone();
        b[at..at + value.len()].copy_from_slice(value);
        malformed(&b)
    };
    assert!(with(at, &[7]).contains("unknown kind 7"));
    assert!(with(count, &0u32.to_le_bytes()).contains("0 chunks"));
    // More chunks than any device has, and more than the bytes there: refused before any
    // descriptor is read.
    assert!(with(count, &u32::MAX.to_le_bytes()).contains("chunks (1 to"));
    assert!(with(count, &1000u32.to_le_bytes()).contains("truncated"));
    assert!(with(size, &(3u64 << 20).to_le_bytes()).contains("multiple of 2 MiB"));
    assert!(with(size, &0u64.to_le_bytes()).contains("size of 0"));
    // A chunk size that makes the range overflow.
    assert!(with(size, &(u64::MAX - (2 << 20) + 1).to_le_bytes()).contains("cover"));
    assert!(with(fds + 4, &(-1i32).to_le_bytes()).contains("negative"));
    // One chunk named twice, within a range and across ranges.
    assert!(with(fds + 4, &31i32.to_le_bytes()).contains("named twice"));
    let second = segment_at(&h, 2);
    assert!(with(second + 17, &33i32.to_le_bytes()).contains("named twice"));
    assert!(with(second + 1, &4243u32.to_le_bytes()).contains("one producer"));
    assert!(with(pid, &4243u32.to_le_bytes()).contains("one producer"));
    // Smaller chunks under the same views: the views run past the range.
    assert!(with(size, &(2u64 << 20).to_le_bytes()).contains("(\"a\") claims"));
    // Version 1 has no kind byte: the message read as version 1 does not add up.
    assert!(!with(4, &1u16.to_le_bytes()).is_empty());
    assert!(with(4, &3u16.to_le_bytes()).contains("versions 1 to 2"));
}

#[test]
fn version_2_is_only_for_batches_with_chunks() {
    // A batch of allocations written in version 2's form would decode to a batch that encodes
    // otherwise: refused, so that every batch has one encoding.
    let h = sample(false);
    let mut v2 = Vec::new();
    v2.extend_from_slice(&h.encode()[..HEADER_LEN + h.ref_counter.as_str().len()]);
    v2[4..6].copy_from_slice(&2u16.to_le_bytes());
    for s in h.segments() {
        s.encode_into(2, &mut v2);
    }
    v2.extend_from_slice(
        &h.encode()[HEADER_LEN + h.ref_counter.as_str().len() + 2 * SEGMENT_LEN..],
    );
    assert!(
        malformed(&v2).contains("without a range of chunks"),
        "{}",
        malformed(&v2)
    );
}

proptest! {
    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = BatchHandle::decode(&bytes);
    }

    #[test]
    fn mutated_batches_never_panic_and_decode_only_to_valid_batches(
        at in 0usize..600, value in any::<u8>(), chunks in any::<bool>()
    ) {
        let mut bytes = if chunks { mixed() } else { sample(true) }.encode();
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
