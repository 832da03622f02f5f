//! Files that are not snapshots get a typed error, never a panic: random files, truncated and damaged
//! pickles, pickles of other data, hostile pickles (deep nesting, recursion, reference bombs).

#![cfg(feature = "snapshot-io")]

use std::path::PathBuf;

use proptest::prelude::*;
use tensormem_cuda_alloc::snapshot::{PyValue, Snapshot, SnapshotError, MAX_DEPTH};

fn multistream_bytes() -> Vec<u8> {
    let dir = std::env::var_os("TENSORMEM_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces"));
    std::fs::read(dir.join("multistream.pickle")).unwrap()
}

fn error(bytes: &[u8]) -> SnapshotError {
    match Snapshot::from_pickle_bytes(bytes) {
        Ok(_) => panic!("{} bytes should not read as a snapshot", bytes.len()),
        Err(e) => e,
    }
}

#[test]
fn empty_and_random_files_are_not_pickles() {
    assert!(matches!(error(b""), SnapshotError::NotPickle { .. }));
    let e = error(b"[package]\nname = \"x\"\n");
    assert!(matches!(e, SnapshotError::NotPickle { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with("not a memory snapshot: not a pickle file (it starts with bytes 5b 70"),
        "{e}"
    );
    let e = error(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    assert!(matches!(e, SnapshotError::NotPickle { .. }), "{e}");
}

#[test]
fn truncated_pickles_say_so() {
    let bytes = multistream_bytes();
    for cut in [1, 2, 11, 100, bytes.len() / 2, bytes.len() - 1] {
        let e = error(&bytes[..cut]);
        assert!(
            matches!(e, SnapshotError::Pickle { .. }),
            "cut at {cut}: {e}"
        );
        assert!(e.to_string().contains("truncated"), "cut at {cut}: {e}");
    }
}

#[test]
fn pickles_of_other_data_are_not_snapshots() {
    // pickle.dumps([1, 2, 3], protocol=4)
    let list = b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02K\x03e.";
    let e = error(list);
    assert!(matches!(e, SnapshotError::NotASnapshot { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("the pickle holds a list, not a dict"),
        "{e}"
    );
    // pickle.dumps({'a': 1}, protocol=2)
    let dict = b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01K\x01s.";
    let e = error(dict);
    assert!(matches!(e, SnapshotError::NotASnapshot { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("no 'segments' key (its keys: \"a\")"),
        "{e}"
    );
    // pickle.dumps(None, protocol=0)
    assert!(matches!(error(b"N."), SnapshotError::NotASnapshot { .. }));
}

#[test]
fn pickles_of_objects_are_refused() {
    // pickle.dumps(datetime.date(2020, 1, 1), protocol=2)
    let date = b"\x80\x02cdatetime\ndate\nq\x00c_codecs\nencode\nq\x01X\x05\x00\x00\x00\x07\xc3\xa4\x01\x01q\x02X\x06\x00\x00\x00latin1q\x03\x86q\x04Rq\x05\x85q\x06Rq\x07.";
    let e = error(date);
    assert!(matches!(e, SnapshotError::UnsupportedPickle { .. }), "{e}");
    assert!(e.to_string().contains("GLOBAL datetime.date"), "{e}");
    // protocol 4 uses STACK_GLOBAL
    let e = error(b"\x80\x04\x8c\x08datetime\x8c\x04date\x93.");
    assert!(e.to_string().contains("STACK_GLOBAL"), "{e}");
}

/// A real snapshot as plain data, with segment 2's dict changed by `edit`.
fn with_segment_2(edit: impl FnOnce(&mut Vec<(PyValue, PyValue)>)) -> PyValue {
    let mut value = Snapshot::from_pickle_bytes(&multistream_bytes())
        .unwrap()
        .to_value();
    let PyValue::Dict(top) = &mut value else {
        panic!("a snapshot is a dict")
    };
    let PyValue::List(segments) = &mut top[0].1 else {
        panic!("segments is a list")
    };
    let PyValue::Dict(segment) = &mut segments[2] else {
        panic!("a segment is a dict")
    };
    edit(segment);
    value
}

#[test]
fn wrong_field_types_name_the_field() {
    let value = with_segment_2(|segment| {
        let size = segment
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some("total_size"))
            .unwrap();
        size.1 = "big".into();
    });
    let e = Snapshot::from_value(value).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid snapshot: segments[2].total_size: expected an int, found str \"big\""
    );
    let value = with_segment_2(|segment| segment.retain(|(k, _)| k.as_str() != Some("total_size")));
    let e = Snapshot::from_value(value).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid snapshot: segments[2]: the key 'total_size' is missing"
    );
    let value = with_segment_2(|segment| {
        segment.push((PyValue::Int(5), PyValue::None));
    });
    let e = Snapshot::from_value(value).unwrap_err();
    assert!(
        e.to_string().contains("segments[2]: expected string keys"),
        "{e}"
    );
    let value = with_segment_2(|segment| {
        let state = segment
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some("segment_type"))
            .unwrap();
        state.1 = "huge".into();
    });
    let e = Snapshot::from_value(value).unwrap_err();
    assert!(
        e.to_string()
            .contains("segments[2].segment_type: expected 'small' or 'large', found 'huge'"),
        "{e}"
    );
}

#[test]
fn hostile_pickles_get_errors() {
    // A list nested 100 000 deep: MARK x n, LIST x n.
    let n = 100_000;
    let mut deep = vec![0x80, 4];
    deep.extend(std::iter::repeat_n(b'(', n));
    deep.extend(std::iter::repeat_n(b'l', n));
    deep.push(b'.');
    let e = error(&deep);
    assert!(
        e.to_string()
            .contains(&format!("more than {MAX_DEPTH} levels")),
        "{e}"
    );

    // A list that contains itself: EMPTY_LIST MEMOIZE BINGET 0 APPEND STOP.
    let e = error(b"\x80\x04]\x94h\x00a.");
    assert!(matches!(e, SnapshotError::UnsupportedPickle { .. }), "{e}");

    // A reference bomb: T0 = (0,); T(k+1) = (Tk, Tk) for 60 levels (2^60 values once expanded).
    let mut bomb = vec![0x80, 4, b'K', 0, 0x85, 0x94];
    for level in 0u8..60 {
        bomb.extend([b'h', level, b'h', level, 0x86, 0x94]);
    }
    bomb.push(b'.');
    let e = error(&bomb);
    assert!(matches!(e, SnapshotError::UnsupportedPickle { .. }), "{e}");
    assert!(e.to_string().contains("far more values"), "{e}");

    // The same doubling through DUP: 0, then (DUP, TUPLE2) 60 times.
    let mut dup_bomb = vec![0x80, 4, b'K', 0];
    for _ in 0..60 {
        dup_bomb.extend([b'2', 0x86]);
    }
    dup_bomb.push(b'.');
    let e = error(&dup_bomb);
    assert!(e.to_string().contains("far more values"), "{e}");

    // Length fields far past the end of the data.
    let e = error(b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7fabc");
    assert!(e.to_string().contains("truncated"), "{e}");
    // Opcodes with nothing on the stack.
    assert!(matches!(error(b"\x80\x04a."), SnapshotError::Pickle { .. }));
    assert!(matches!(error(b"\x80\x04."), SnapshotError::Pickle { .. }));
    assert!(matches!(error(b"\x80\x04u."), SnapshotError::Pickle { .. }));
    assert!(matches!(
        error(b"\x80\x04h\x05."),
        SnapshotError::Pickle { .. }
    ));
    // A future protocol.
    assert!(matches!(
        error(b"\x80\x09N."),
        SnapshotError::UnsupportedPickle { .. }
    ));
}

#[test]
fn damaged_gzip_is_reported() {
    let snapshot = Snapshot::from_pickle_bytes(&multistream_bytes()).unwrap();
    let mut gz = Vec::new();
    snapshot.write_pickle_gz(&mut gz).unwrap();
    let half = &gz[..gz.len() / 2];
    assert!(matches!(error(half), SnapshotError::Compressed { .. }));
    let mut flipped = gz.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x55;
    assert!(Snapshot::from_pickle_bytes(&flipped).is_err());
}

#[test]
fn bad_json_is_reported() {
    assert!(matches!(
        Snapshot::read_json(&b"{\"segments\": ["[..]),
        Err(SnapshotError::Json(_))
    ));
    assert!(matches!(
        Snapshot::read_json(&b"[1, 2]"[..]),
        Err(SnapshotError::NotASnapshot { .. })
    ));
    assert!(matches!(
        Snapshot::read_json(&b"{\"segments\": [{\"address\": -1}]}"[..]),
        Err(SnapshotError::Invalid { .. })
    ));
}

#[test]
fn every_truncation_of_a_real_pickle_is_an_error() {
    let bytes = multistream_bytes();
    // Every cut in the first and last kilobyte, and every 61st byte in between.
    let cuts = (0..1024)
        .chain((1024..bytes.len() - 1024).step_by(61))
        .chain(bytes.len() - 1024..bytes.len());
    for cut in cuts {
        assert!(
            Snapshot::from_pickle_bytes(&bytes[..cut]).is_err(),
            "a cut at {cut} read as a snapshot"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Snapshot::from_pickle_bytes(&bytes);
    }

    #[test]
    fn random_opcode_soup_never_panics(ops in proptest::collection::vec(
        proptest::sample::select(b"()]}0125aeldstu.NKJhgqp\x85\x86\x87\x88\x89\x8a\x8c\x8f\x90\x91\x94\x95".to_vec()), 0..256)
    ) {
        let mut bytes = vec![0x80, 4];
        bytes.extend(ops);
        let _ = Snapshot::from_pickle_bytes(&bytes);
    }

    #[test]
    fn damaged_real_pickles_never_panic(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = multistream_bytes();
        for (at, byte) in flips {
            let at = at.index(bytes.len());
            bytes[at] = byte;
        }
        let _ = Snapshot::from_pickle_bytes(&bytes);
    }
}
