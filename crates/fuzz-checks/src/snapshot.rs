//! The snapshot readers: pickle (optionally gzip) and JSON.

use tensormem_cuda_alloc::snapshot::Snapshot;

/// Reads `data` as a pickled snapshot. A snapshot that reads must write and read back the same
/// (compared through `Debug`, so that NaN floats compare equal).
///
/// # Panics
/// When the reader panics, or a snapshot it read does not survive a write and a read.
pub fn pickle(data: &[u8]) {
    let Ok(snapshot) = Snapshot::from_pickle_bytes(data) else {
        return;
    };
    let again = pickle_round_trip(&snapshot);
    assert_eq!(
        format!("{again:?}"),
        format!("{snapshot:?}"),
        "pickle round trip changed the snapshot"
    );
}

/// Writes `snapshot` as a pickle and reads it back.
fn pickle_round_trip(snapshot: &Snapshot) -> Snapshot {
    let mut written = Vec::new();
    snapshot
        .write_pickle(&mut written)
        .expect("a snapshot that was read can be written");
    Snapshot::from_pickle_bytes(&written).expect("a written snapshot reads back")
}

/// Reads `data` as a JSON snapshot, with the same round trip as [`pickle`] (through JSON), and checks
/// that what it read also pickles and reads back.
///
/// # Panics
/// When the reader panics, or a snapshot it read does not survive a write and a read.
pub fn json(data: &[u8]) {
    let Ok(snapshot) = Snapshot::read_json(data) else {
        return;
    };
    let again = json_round_trip(&snapshot);
    assert_eq!(
        format!("{again:?}"),
        format!("{snapshot:?}"),
        "JSON round trip changed the snapshot"
    );
    pickle_round_trip(&snapshot);
}

/// Writes `snapshot` as JSON and reads it back.
fn json_round_trip(snapshot: &Snapshot) -> Snapshot {
    let mut written = Vec::new();
    snapshot
        .write_json(&mut written)
        .expect("a snapshot that was read can be written as JSON");
    Snapshot::read_json(written.as_slice()).expect("written JSON reads back")
}
