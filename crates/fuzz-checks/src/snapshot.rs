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
    let mut written = Vec::new();
    snapshot
        .write_pickle(&mut written)
        .expect("a snapshot that was read can be written");
    let again = Snapshot::from_pickle_bytes(&written).expect("a written snapshot reads back");
    assert_eq!(
        format!("{again:?}"),
        format!("{snapshot:?}"),
        "pickle round trip changed the snapshot"
    );
}

/// Reads `data` as a JSON snapshot, with the same round trip as [`pickle`] (through JSON, and
/// through pickle).
///
/// # Panics
/// When the reader panics, or a snapshot it read does not survive a write and a read.
pub fn json(data: &[u8]) {
    let Ok(snapshot) = Snapshot::read_json(data) else {
        return;
    };
    let mut written = Vec::new();
    snapshot
        .write_json(&mut written)
        .expect("a snapshot that was read can be written as JSON");
    let again = Snapshot::read_json(written.as_slice()).expect("written JSON reads back");
    assert_eq!(
        format!("{again:?}"),
        format!("{snapshot:?}"),
        "JSON round trip changed the snapshot"
    );
    let mut pickled = Vec::new();
    snapshot
        .write_pickle(&mut pickled)
        .expect("a snapshot read from JSON can be pickled");
    Snapshot::from_pickle_bytes(&pickled).expect("a snapshot read from JSON reads back as pickle");
}
