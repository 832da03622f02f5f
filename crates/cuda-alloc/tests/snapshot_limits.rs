//! Bounds on reading snapshots (`ReadLimits`): pickle bombs, gzip bombs and inputs that never end get
//! a typed error instead of exhausting memory or reading forever.

#![cfg(feature = "snapshot-io")]

use std::io::Write;
use std::path::PathBuf;

use tensormem_cuda_alloc::snapshot::{ReadLimits, Snapshot, SnapshotError};

fn traces_dir() -> PathBuf {
    std::env::var_os("TENSORMEM_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces"))
}

/// A protocol-4 pickle of one list holding `count` copies of the opcode `item`.
fn list_of(item: &[u8], count: usize) -> Vec<u8> {
    let mut pickle = b"\x80\x04]\x94(".to_vec();
    for _ in 0..count {
        pickle.extend_from_slice(item);
    }
    pickle.extend_from_slice(b"e.");
    pickle
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(data).unwrap();
    encoder.finish().unwrap()
}

fn limits(change: impl FnOnce(&mut ReadLimits)) -> ReadLimits {
    let mut limits = ReadLimits::default();
    change(&mut limits);
    limits
}

fn too_large(result: Result<Snapshot, SnapshotError>) -> &'static str {
    match result {
        Err(SnapshotError::TooLarge { limit, .. }) => limit,
        Err(other) => panic!("expected TooLarge, got {other}"),
        Ok(_) => panic!("expected TooLarge, got a snapshot"),
    }
}

#[test]
fn many_small_values_stop_at_max_values() {
    // 2 bytes a value (`K\x01`), the shape of the reported bomb, scaled down.
    let bomb = list_of(b"K\x01", 100_000);
    let tight = limits(|l| l.max_values = 50_000);
    assert_eq!(
        too_large(Snapshot::from_pickle_bytes_with_limits(&bomb, &tight)),
        "max_values"
    );
    // 1 byte a value: `None`, empty containers.
    for item in [&b"N"[..], b"]", b"}", b")"] {
        let bomb = list_of(item, 100_000);
        assert_eq!(
            too_large(Snapshot::from_pickle_bytes_with_limits(&bomb, &tight)),
            "max_values"
        );
    }
    // Under the limit the same data is read (and found not to be a snapshot).
    let roomy = limits(|l| l.max_values = 200_000);
    let e = Snapshot::from_pickle_bytes_with_limits(&bomb, &roomy).unwrap_err();
    assert!(matches!(e, SnapshotError::NotASnapshot { .. }), "{e}");
}

#[test]
fn the_error_says_which_limit_and_how_to_raise_it() {
    let bomb = list_of(b"N", 1000);
    let e =
        Snapshot::from_pickle_bytes_with_limits(&bomb, &limits(|l| l.max_values = 10)).unwrap_err();
    let message = e.to_string();
    assert!(message.contains("more than 10 values"), "{message}");
    assert!(message.contains("ReadLimits::max_values"), "{message}");
}

#[test]
fn copies_of_a_long_string_count_its_length() {
    // A 64 KiB string stored in the memo, then fetched 2000 times: 4 bytes of pickle for every 64 KiB
    // copy (128 MiB in all) under the default limits.
    let mut bomb = b"\x80\x04X".to_vec();
    bomb.extend_from_slice(&(64u32 << 10).to_le_bytes());
    bomb.extend(std::iter::repeat_n(b'x', 64 << 10));
    bomb.extend_from_slice(b"\x94(");
    for _ in 0..2000 {
        bomb.extend_from_slice(b"h\x00");
    }
    bomb.extend_from_slice(b"l.");
    let e = Snapshot::from_pickle_bytes(&bomb).unwrap_err();
    assert!(
        matches!(
            e,
            SnapshotError::TooLarge { .. } | SnapshotError::UnsupportedPickle { .. }
        ),
        "{e}"
    );
}

#[test]
fn a_gzip_bomb_stops_at_max_decompressed_bytes() {
    let plain = list_of(b"N", 4 << 20);
    let bomb = gzip(&plain);
    assert!(bomb.len() < plain.len() / 100);
    let tight = limits(|l| l.max_decompressed_bytes = 1 << 20);
    assert_eq!(
        too_large(Snapshot::from_pickle_bytes_with_limits(&bomb, &tight)),
        "max_decompressed_bytes"
    );
}

#[test]
fn gzip_of_something_else_is_refused_after_its_first_bytes() {
    // 64 MiB of zeros in 64 kB of gzip: refused as not a pickle once the first bytes are out.
    let bomb = gzip(&vec![0u8; 64 << 20]);
    let e = Snapshot::from_pickle_bytes(&bomb).unwrap_err();
    assert!(matches!(e, SnapshotError::NotPickle { .. }), "{e}");
}

#[test]
fn a_file_larger_than_max_input_bytes_is_refused() {
    let path = traces_dir().join("multistream.pickle");
    let size = std::fs::metadata(&path).unwrap().len();
    let tight = limits(|l| l.max_input_bytes = size - 1);
    assert_eq!(
        too_large(Snapshot::read_file_with_limits(&path, &tight)),
        "max_input_bytes"
    );
    let exact = limits(|l| l.max_input_bytes = size);
    Snapshot::read_file_with_limits(&path, &exact).unwrap();
}

#[test]
fn dev_zero_is_refused_not_read_forever() {
    let e = Snapshot::read_file("/dev/zero").unwrap_err();
    assert!(matches!(e, SnapshotError::NotPickle { .. }), "{e}");
    let e = Snapshot::read_pickle(std::fs::File::open("/dev/zero").unwrap()).unwrap_err();
    assert!(matches!(e, SnapshotError::NotPickle { .. }), "{e}");
}

#[test]
fn an_endless_stream_of_pickle_opcodes_stops_at_max_input_bytes() {
    // An endless reader whose bytes are valid opcodes (`N`): it passes the first-bytes check and is
    // cut off at the input limit.
    struct Nones;
    impl std::io::Read for Nones {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            buf.fill(b'N');
            Ok(buf.len())
        }
    }
    let tight = limits(|l| l.max_input_bytes = 1 << 20);
    assert_eq!(
        too_large(Snapshot::read_pickle_with_limits(Nones, &tight)),
        "max_input_bytes"
    );
}

#[test]
fn real_snapshots_read_within_the_default_limits() {
    for name in ["gpt2_train", "multistream", "oom_pressure"] {
        let path = traces_dir().join(format!("{name}.pickle"));
        Snapshot::read_file(&path).unwrap();
        let gz = gzip(&std::fs::read(&path).unwrap());
        Snapshot::from_pickle_bytes(&gz).unwrap();
    }
}
