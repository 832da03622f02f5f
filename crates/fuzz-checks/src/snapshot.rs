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

/// Reads `data` as a JSON snapshot, with the same fixed-point check as [`pickle`] (through JSON), and
/// checks that what it read also pickles and reads back.
///
/// # Panics
/// When the reader panics, or what the writer wrote does not read back to a fixed point.
pub fn json(data: &[u8]) {
    let Ok(snapshot) = Snapshot::read_json(data) else {
        return;
    };
    let once = json_round_trip(&snapshot);
    let twice = json_round_trip(&once);
    assert_eq!(
        format!("{twice:?}"),
        format!("{once:?}"),
        "a snapshot written as JSON changes when written and read again"
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
