//! Snapshot files: the real PyTorch traces read, checked field by field, written and read back (by this
//! crate and by Python's `pickle`), in pickle, gzip and JSON form.

#![cfg(feature = "snapshot-io")]

use std::path::PathBuf;
use std::process::Command;

use tensormem_cuda_alloc::config::{AllocatorConfig, MB};
use tensormem_cuda_alloc::snapshot::{
    AllocatorSettings, Block, BlockState, PyValue, Segment, SegmentType, Snapshot, SnapshotError,
    TraceAction, TraceEntry,
};
use tensormem_cuda_alloc::StreamId;
use tensormem_test_support::python;

const TRACES: [&str; 3] = [
    "gpt2_train",
    "gpt2_train__expandable_segments-True",
    "multistream",
];

/// Where the traces are: `$TENSORMEM_TRACES_DIR`, else the repository's `traces/`.
fn traces_dir() -> PathBuf {
    std::env::var_os("TENSORMEM_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces"))
}

fn trace_path(name: &str) -> PathBuf {
    traces_dir().join(format!("{name}.pickle"))
}

fn read(name: &str) -> Snapshot {
    Snapshot::read_file(trace_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn count(trace: &[TraceEntry], action: TraceAction) -> usize {
    trace.iter().filter(|e| e.action == action).count()
}

#[test]
fn gpt2_train_contents() {
    let s = read("gpt2_train");
    assert_eq!(s.segments.len(), 76);
    assert_eq!(
        s.segments.iter().map(|seg| seg.blocks.len()).sum::<usize>(),
        80
    );
    let first = &s.segments[0];
    assert_eq!(first.device, 0);
    assert_eq!(first.address, 140_009_558_507_520);
    assert_eq!(first.total_size, 824_180_736);
    assert_eq!(
        (
            first.allocated_size,
            first.active_size,
            first.requested_size
        ),
        (0, 0, 0)
    );
    assert_eq!(first.stream_id(), StreamId(0));
    assert_eq!(first.segment_type, SegmentType::Large);
    assert_eq!(first.segment_pool_id, (0, 0));
    assert!(!first.is_expandable);
    assert!(first.frames.is_empty() && first.other.is_empty());
    assert_eq!(first.blocks.len(), 1);
    let block = &first.blocks[0];
    assert_eq!(
        (block.address, block.size, block.requested_size),
        (140_009_558_507_520, 824_180_736, 77_194_752)
    );
    assert_eq!(block.state, BlockState::Inactive);

    assert_eq!(s.device_traces.len(), 1);
    let trace = s.trace(0);
    assert_eq!(trace.len(), 9679);
    assert_eq!(s.event_count(), 9679);
    assert_eq!(count(trace, TraceAction::Alloc), 3203);
    assert_eq!(count(trace, TraceAction::FreeRequested), 3200);
    assert_eq!(count(trace, TraceAction::FreeCompleted), 3200);
    assert_eq!(count(trace, TraceAction::SegmentAlloc), 76);
    let e = &trace[0];
    assert_eq!(e.action, TraceAction::SegmentAlloc);
    assert_eq!(
        (e.addr, e.size, e.stream, e.time_us),
        (140_016_739_155_968, 155_189_248, 0, 1_795_312_855_967_299)
    );
    assert_eq!(e.compile_context.as_deref(), Some("N/A"));
    assert_eq!(e.user_metadata.as_deref(), Some(""));
    assert_eq!(e.frames, None, "context=None records no frames");
    assert_eq!(trace[1].action, TraceAction::Alloc);
    assert_eq!(trace[1].size, 154_389_504);
    assert!(
        trace.windows(2).all(|w| w[0].time_us <= w[1].time_us),
        "events are in time order"
    );
    assert!(s.trace(1).is_empty());

    let settings = s.allocator_settings.as_ref().expect("allocator_settings");
    assert_eq!(settings.config_string.as_deref(), Some(""));
    assert_eq!(settings.max_split_size, Some(-1));
    assert_eq!(settings.garbage_collection_threshold, Some(0.0));
    assert_eq!(settings.expandable_segments, Some(false));
    assert_eq!(settings.graph_capture_record_stream_reuse, Some(false));
    let table = settings
        .roundup_power2_divisions
        .as_ref()
        .expect("roundup table");
    assert_eq!(table.len(), 16);
    assert_eq!(table[0], (1, 0));
    assert_eq!(table[15], (32768, 0));
    assert_eq!(settings.to_config().unwrap(), AllocatorConfig::default());

    let annotations = s
        .external_annotations
        .as_ref()
        .expect("external_annotations");
    assert!(!annotations.is_empty());
    assert_eq!(annotations[0].stage.as_deref(), Some("START"));
    assert_eq!(
        annotations[0].name.as_deref(),
        Some("Optimizer.step#AdamW.step")
    );
    assert_eq!(annotations[0].device, Some(0));
    assert!(s.other.is_empty());
}

#[test]
fn expandable_segments_contents() {
    let s = read("gpt2_train__expandable_segments-True");
    assert_eq!(s.segments.len(), 2);
    assert!(s.segments.iter().all(|seg| seg.is_expandable));
    let seg = &s.segments[0];
    assert_eq!(seg.total_size, 5_934_940_160);
    assert_eq!(seg.blocks.len() + s.segments[1].blocks.len(), 8);
    assert_eq!(seg.blocks[1].state, BlockState::ActiveAllocated);
    assert_eq!(
        seg.blocks[1].address,
        seg.blocks[0].address + seg.blocks[0].size,
        "blocks tile the segment"
    );
    let trace = s.trace(0);
    assert_eq!(trace.len(), 9676);
    assert_eq!(count(trace, TraceAction::SegmentMap), 73);
    assert_eq!(count(trace, TraceAction::SegmentAlloc), 0);
    let config = s.allocator_settings.as_ref().unwrap().to_config().unwrap();
    assert!(config.expandable_segments);
    assert_eq!(
        config,
        AllocatorConfig::parse("expandable_segments:True").unwrap()
    );
}

#[test]
fn multistream_contents() {
    let s = read("multistream");
    assert_eq!(s.segments.len(), 8);
    assert!(s.segments.iter().any(|seg| seg.stream == 1_066_460_448));
    let trace = s.trace(0);
    assert_eq!(trace.len(), 1207);
    assert_eq!(count(trace, TraceAction::Alloc), 400);
    assert_eq!(count(trace, TraceAction::FreeCompleted), 399);
    let streams: std::collections::BTreeSet<u64> = trace.iter().map(|e| e.stream).collect();
    assert_eq!(streams.len(), 2);
    assert_eq!(s.external_annotations.as_deref(), Some(&[][..]));
}

#[test]
fn every_trace_round_trips_through_pickle() {
    for name in TRACES {
        let original = read(name);
        let mut bytes = Vec::new();
        original.write_pickle(&mut bytes).unwrap();
        let back = Snapshot::from_pickle_bytes(&bytes).unwrap();
        assert!(back == original, "{name}: the copy differs");
        // Strings are memoized: the copy is no larger than PyTorch's own file.
        let original_len = std::fs::metadata(trace_path(name)).unwrap().len() as usize;
        assert!(
            bytes.len() <= original_len * 11 / 10,
            "{name}: {} bytes written, {original_len} read",
            bytes.len()
        );
    }
}

#[test]
fn every_trace_round_trips_through_gzip_and_json() {
    for name in TRACES {
        let original = read(name);
        let mut gz = Vec::new();
        original.write_pickle_gz(&mut gz).unwrap();
        assert_eq!(&gz[..2], &[0x1f, 0x8b]);
        assert_eq!(
            Snapshot::from_pickle_bytes(&gz).unwrap(),
            original,
            "{name} gzip"
        );

        let mut json = Vec::new();
        original.write_json(&mut json).unwrap();
        assert_eq!(json[0], b'{');
        assert!(
            Snapshot::read_json(json.as_slice()).unwrap() == original,
            "{name}: JSON copy differs"
        );
    }
}

#[test]
fn files_are_detected_by_content() {
    let dir = tempfile::tempdir().unwrap();
    let original = read("multistream");
    let pickle = dir.path().join("a.pickle");
    original.write_pickle_file(&pickle).unwrap();
    assert_eq!(Snapshot::read_pickle_file(&pickle).unwrap(), original);
    let gz = dir.path().join("a.pickle.gz");
    original
        .write_pickle_gz(std::fs::File::create(&gz).unwrap())
        .unwrap();
    assert_eq!(Snapshot::read_file(&gz).unwrap(), original);
    let json = dir.path().join("a.json");
    original
        .write_json(std::fs::File::create(&json).unwrap())
        .unwrap();
    assert_eq!(Snapshot::read_file(&json).unwrap(), original);

    let missing = dir.path().join("missing.pickle");
    let e = Snapshot::read_file(&missing).unwrap_err();
    assert!(
        matches!(e, SnapshotError::File { action: "read", .. }),
        "{e}"
    );
    assert!(e.to_string().contains("missing.pickle"), "{e}");
    let e = original
        .write_pickle_file(dir.path().join("no/such/dir/x.pickle"))
        .unwrap_err();
    assert!(
        matches!(
            e,
            SnapshotError::File {
                action: "create",
                ..
            }
        ),
        "{e}"
    );
}

/// A snapshot built by hand, as the allocator builds one from its state.
fn built_snapshot() -> Snapshot {
    let config =
        AllocatorConfig::parse("max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:8]")
            .unwrap();
    Snapshot {
        segments: vec![Segment {
            device: 0,
            address: 0x7f00_0000_0000,
            total_size: 2 * MB as u64,
            allocated_size: 512,
            active_size: 1024,
            requested_size: 500,
            stream: 0x5555_0000,
            segment_type: SegmentType::Small,
            segment_pool_id: (1, 7),
            blocks: vec![
                Block {
                    address: 0x7f00_0000_0000,
                    size: 512,
                    requested_size: 500,
                    state: BlockState::ActiveAllocated,
                    ..Block::default()
                },
                Block {
                    address: 0x7f00_0000_0200,
                    size: 512,
                    requested_size: 512,
                    state: BlockState::ActivePendingFree,
                    ..Block::default()
                },
                Block {
                    address: 0x7f00_0000_0400,
                    size: 2 * MB as u64 - 1024,
                    ..Block::default()
                },
            ],
            ..Segment::default()
        }],
        device_traces: vec![vec![
            TraceEntry {
                action: TraceAction::SegmentAlloc,
                addr: 0x7f00_0000_0000,
                size: 2 * MB as u64,
                stream: 0x5555_0000,
                time_us: 1,
                ..TraceEntry::default()
            },
            TraceEntry {
                action: TraceAction::Oom,
                addr: 12345,
                size: 1 << 40,
                time_us: 2,
                ..TraceEntry::default()
            },
            TraceEntry {
                action: TraceAction::Other("future_action".into()),
                stream: u64::MAX - 5,
                ..TraceEntry::default()
            },
        ]],
        allocator_settings: Some(AllocatorSettings::from_config(&config)),
        external_annotations: None,
        host_segments: None,
        host_traces: None,
        other: vec![(
            "tensormem".into(),
            PyValue::Tuple(vec![PyValue::from(1i64), PyValue::None]),
        )],
    }
}

#[test]
fn built_snapshots_round_trip() {
    let s = built_snapshot();
    let mut bytes = Vec::new();
    s.write_pickle(&mut bytes).unwrap();
    assert_eq!(Snapshot::from_pickle_bytes(&bytes).unwrap(), s);
    let value = s.to_value();
    // OOM entries carry `device_free`, not `addr`; stream handles are written as int64.
    let oom = &value.get("device_traces").unwrap();
    let PyValue::List(traces) = oom else {
        panic!("device_traces is a list")
    };
    let PyValue::List(entries) = &traces[0] else {
        panic!("a trace is a list")
    };
    assert_eq!(entries[1].get("device_free"), Some(&PyValue::Int(12345)));
    assert_eq!(entries[1].get("addr"), None);
    assert_eq!(entries[2].get("stream"), Some(&PyValue::Int(-6)));
    assert_eq!(s.trace(0)[1].device_free(), Some(12345));
    assert_eq!(s.trace(0)[0].device_free(), None);
    let seg = value.get("segments").unwrap();
    let PyValue::List(segs) = seg else { panic!() };
    assert_eq!(
        segs[0].get("segment_pool_id"),
        Some(&PyValue::Tuple(vec![PyValue::Int(1), PyValue::Int(7)]))
    );
    assert_eq!(Snapshot::from_value(value).unwrap(), s);
    assert_eq!(
        s.allocator_settings.as_ref().unwrap().to_config().unwrap(),
        {
            AllocatorConfig::parse(
                "max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:8]",
            )
            .unwrap()
        }
    );
}

#[test]
fn settings_from_config_match_pytorchs_layout() {
    let config =
        AllocatorConfig::parse("expandable_segments:True,roundup_power2_divisions:4").unwrap();
    let settings = AllocatorSettings::from_config(&config);
    assert_eq!(settings.max_split_size, Some(-1));
    assert_eq!(settings.expandable_segments, Some(true));
    let table = settings.roundup_power2_divisions.clone().unwrap();
    assert_eq!(
        table.iter().map(|&(start, _)| start).collect::<Vec<_>>(),
        (0..16).map(|i| 1u64 << i).collect::<Vec<_>>()
    );
    assert!(table.iter().all(|&(_, d)| d == 4));
    assert_eq!(settings.to_config().unwrap(), config);

    let odd = AllocatorSettings {
        roundup_power2_divisions: Some(vec![(3, 1)]),
        ..AllocatorSettings::default()
    };
    assert!(matches!(odd.to_config(), Err(SnapshotError::Config { .. })));
    let bad = AllocatorSettings {
        config_string: Some("bogus:1".into()),
        ..AllocatorSettings::default()
    };
    let e = bad.to_config().unwrap_err();
    assert!(e.to_string().contains("bogus:1"), "{e}");
}

/// A snapshot whose `allocator_settings.roundup_power2_divisions` has the given `(key, divisions)` entries,
/// in this order.
fn snapshot_with_divisions(entries: &[(&str, i64)]) -> Snapshot {
    let table = entries
        .iter()
        .map(|&(key, d)| (PyValue::from(key), PyValue::from(d)))
        .collect();
    let settings = vec![(
        PyValue::from("roundup_power2_divisions"),
        PyValue::Dict(table),
    )];
    let value = PyValue::Dict(vec![
        (PyValue::from("segments"), PyValue::List(Vec::new())),
        (PyValue::from("device_traces"), PyValue::List(Vec::new())),
        (PyValue::from("allocator_settings"), PyValue::Dict(settings)),
    ]);
    Snapshot::from_value(value).unwrap()
}

fn divisions(snapshot: &Snapshot) -> Vec<(u64, u64)> {
    let settings = snapshot.allocator_settings.as_ref().unwrap();
    settings.roundup_power2_divisions.clone().unwrap()
}

/// Finding F2: keys naming the same interval start (`"8"` and `"08"`) are one boundary, and the later
/// one wins, as a repeated boundary does in the configuration grammar; the table survives a write.
#[test]
fn repeated_division_boundaries_keep_the_later_value() {
    let later_08 = snapshot_with_divisions(&[("1", 2), ("8", 1), ("2", 2), ("08", 4)]);
    assert_eq!(divisions(&later_08), vec![(1, 2), (2, 2), (8, 4)]);
    let config = later_08
        .allocator_settings
        .as_ref()
        .unwrap()
        .to_config()
        .unwrap();
    assert_eq!(
        config,
        AllocatorConfig::parse("roundup_power2_divisions:[1:2,8:1,2:2,8:4]").unwrap()
    );
    assert_eq!(config.roundup_divisions_for(8 * MB), 4);
    let later_8 = snapshot_with_divisions(&[("08", 4), ("8", 1)]);
    assert_eq!(divisions(&later_8), vec![(8, 1)]);

    for snapshot in [&later_08, &later_8] {
        let mut pickled = Vec::new();
        snapshot.write_pickle(&mut pickled).unwrap();
        let again = Snapshot::from_pickle_bytes(&pickled).unwrap();
        assert_eq!(again.allocator_settings, snapshot.allocator_settings);
        let mut written = Vec::new();
        snapshot.write_json(&mut written).unwrap();
        let again = Snapshot::read_json(written.as_slice()).unwrap();
        assert_eq!(again.allocator_settings, snapshot.allocator_settings);
    }
}

/// JSON objects are read in key order (`"08"` before `"8"`), so there the key `"8"` is the later one.
#[test]
fn repeated_division_boundaries_in_json_are_one_entry() {
    let json = br#"{"segments": [], "device_traces": [], "allocator_settings":
        {"roundup_power2_divisions": {"8": 1, "08": 4, "16": 2}}}"#;
    let snapshot = Snapshot::read_json(&json[..]).unwrap();
    assert_eq!(divisions(&snapshot), vec![(8, 1), (16, 2)]);
    let mut written = Vec::new();
    snapshot.write_json(&mut written).unwrap();
    let again = Snapshot::read_json(written.as_slice()).unwrap();
    assert_eq!(divisions(&again), divisions(&snapshot));
}

/// The Python pickle checks run python3: they are `#[ignore]`d so that a machine without it
/// reports them as ignored, never as passed; `.ci/run` runs them (`cargo test -p
/// tensormem-cuda-alloc --test snapshot -- --ignored`), and there a missing python3 is a failure.
fn python3() -> &'static str {
    if let Err(reason) = python::probe("import pickle") {
        panic!(
            "the Python pickle checks need python3 on PATH ({reason}); leave out --ignored where there is none"
        );
    }
    python::PYTHON
}

fn run_python(python: &str, script: &str, args: &[&std::path::Path]) {
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Python's `pickle.load` reads the files written here into exactly the data of PyTorch's originals.
#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn python_reads_written_snapshots_as_the_originals() {
    let python = python3();
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import pickle, sys
original = pickle.load(open(sys.argv[1], 'rb'))
written = pickle.load(open(sys.argv[2], 'rb'))
def check(a, b, path):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()) or set(a) == set(b), f"{path}: keys differ"
        for k in a: check(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)): check(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
check(original, written, "snapshot")
assert all(type(s['segment_pool_id']) is tuple for s in written['segments'])
"#;
    for name in TRACES {
        let written = dir.path().join(format!("{name}.pickle"));
        read(name).write_pickle_file(&written).unwrap();
        run_python(python, script, &[&trace_path(name), &written]);
    }
}

/// This crate reads what Python writes with every pickle protocol, not only PyTorch's default.
#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn reads_every_pickle_protocol_python_writes() {
    let python = python3();
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import pickle, sys
data = pickle.load(open(sys.argv[1], 'rb'))
for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
    with open(f"{sys.argv[2]}/p{protocol}.pickle", 'wb') as f:
        pickle.dump(data, f, protocol=protocol)
"#;
    let expected = read("multistream");
    run_python(python, script, &[&trace_path("multistream"), dir.path()]);
    for protocol in 0..=5 {
        let path = dir.path().join(format!("p{protocol}.pickle"));
        if !path.exists() {
            continue;
        }
        let got = Snapshot::read_file(&path).unwrap_or_else(|e| panic!("protocol {protocol}: {e}"));
        assert_eq!(got, expected, "protocol {protocol}");
    }
}

/// Unknown keys at every level come back from Python exactly, tuples and sets included.
#[test]
#[ignore = "needs python3 (.ci/run runs it with --ignored)"]
fn python_keeps_unknown_keys() {
    let python = python3();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("extra.pickle");
    let make = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
d['future'] = {'t': (1, 2.5, None), 's': {1, 2}, 'f': frozenset({'a'}), 'b': b'\x00\xff', 'big': 2**100, 'neg': -2**40}
d['segments'][0]['extra'] = [True, 'x']
d['segments'][0]['blocks'][0]['extra'] = 7
d['device_traces'][0][0]['extra'] = {'k': (3,)}
d['allocator_settings']['new_setting'] = 'on'
pickle.dump(d, open(sys.argv[2], 'wb'))
"#;
    run_python(python, make, &[&trace_path("multistream"), &source]);
    let s = Snapshot::read_file(&source).unwrap();
    assert_eq!(s.segments[0].other.len(), 1);
    assert_eq!(
        s.segments[0].blocks[0].other,
        vec![("extra".to_owned(), PyValue::Int(7))]
    );
    assert_eq!(
        s.other.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["future"]
    );
    let written = dir.path().join("written.pickle");
    s.write_pickle_file(&written).unwrap();
    run_python(
        python,
        "import pickle, sys\nassert pickle.load(open(sys.argv[1], 'rb')) == pickle.load(open(sys.argv[2], 'rb'))",
        &[&source, &written],
    );
}
