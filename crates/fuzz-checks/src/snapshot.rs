//! The snapshot readers: pickle (optionally gzip) and JSON.

use tensormem_cuda_alloc::snapshot::Snapshot;

/// Reads `data` as a pickled snapshot. A snapshot that reads must write, and what it writes must be a
/// fixed point: read back and written again, it gives the same snapshot (compared through `Debug`,
/// so that NaN floats compare equal).
///
/// The first write may normalise what was read (finding F2 in `docs/reliability.md`: the division
/// boundaries `"8"` and `"08"` are both kept as 8 and written as one dict key twice), so the first
/// read and the second may differ.
///
/// # Panics
/// When the reader panics, or what the writer wrote does not read back to a fixed point.
pub fn pickle(data: &[u8]) {
    let Ok(snapshot) = Snapshot::from_pickle_bytes(data) else {
        return;
    };
    let once = pickle_round_trip(&snapshot);
    let twice = pickle_round_trip(&once);
    assert_eq!(
        format!("{twice:?}"),
        format!("{once:?}"),
        "a written snapshot changes when written and read again"
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
