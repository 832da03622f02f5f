//! The typed model to and from [`PyValue`] trees, with errors that say where in the file a value was
//! wrong (`segments[3].blocks[0].size: expected int, found str`).

use std::fmt;

use super::model::{
    AllocatorSettings, Block, BlockState, ExternalAnnotation, Frame, HostSegment, OtherKeys,
    Segment, SegmentType, Snapshot, TraceAction, TraceEntry,
};
use super::pyvalue::PyValue;
use super::{SnapshotError, SnapshotResult};

/// Where a value sits in the snapshot, as a chain of keys and indices on the stack: built for free while
/// converting, rendered (`segments[3].blocks[0].size`) only for an error message.
#[derive(Clone, Copy)]
enum Path<'a> {
    Top,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Top => f.write_str("(top level)"),
            Path::Key(Path::Top, key) => f.write_str(key),
            Path::Key(parent, key) => write!(f, "{parent}.{key}"),
            Path::Index(parent, index) => write!(f, "{parent}[{index}]"),
        }
    }
}

fn invalid(path: &Path<'_>, reason: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid {
        path: path.to_string(),
        reason: reason.into(),
    }
}

fn expected(path: &Path<'_>, what: &str, found: &PyValue) -> SnapshotError {
    invalid(
        path,
        format!("expected {what}, found {} {found}", found.type_name()),
    )
}

/// The entries of a dict with string keys, taken out one by one.
struct Fields<'p> {
    path: &'p Path<'p>,
    entries: Vec<(String, PyValue)>,
}

impl<'p> Fields<'p> {
    fn new(value: PyValue, path: &'p Path<'p>) -> SnapshotResult<Fields<'p>> {
        let PyValue::Dict(items) = value else {
            return Err(expected(path, "a dict", &value));
        };
        let mut entries = Vec::with_capacity(items.len());
        for (key, value) in items {
            match key {
                PyValue::Str(key) => entries.push((key, value)),
                other => return Err(expected(path, "string keys", &other)),
            }
        }
        Ok(Fields { path, entries })
    }

    fn take(&mut self, key: &str) -> Option<PyValue> {
        let index = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(index).1)
    }

    fn optional<T>(
        &mut self,
        key: &str,
        convert: impl FnOnce(PyValue, &Path<'_>) -> SnapshotResult<T>,
    ) -> SnapshotResult<Option<T>> {
        let path = Path::Key(self.path, key);
        self.take(key)
            .map(|value| convert(value, &path))
            .transpose()
    }

    fn required<T>(
        &mut self,
        key: &str,
        convert: impl FnOnce(PyValue, &Path<'_>) -> SnapshotResult<T>,
    ) -> SnapshotResult<T> {
        match self.take(key) {
            Some(value) => convert(value, &Path::Key(self.path, key)),
            None => Err(invalid(self.path, format!("the key '{key}' is missing"))),
        }
    }

    fn rest(self) -> OtherKeys {
        self.entries
    }
}

fn int(value: PyValue, path: &Path<'_>) -> SnapshotResult<i128> {
    match value {
        PyValue::Int(i) => Ok(i),
        other => Err(expected(path, "an int", &other)),
    }
}

fn unsigned(value: PyValue, path: &Path<'_>) -> SnapshotResult<u64> {
    let i = int(value, path)?;
    u64::try_from(i).map_err(|_| {
        invalid(
            path,
            format!("expected a non-negative int below 2^64, found {i}"),
        )
    })
}

fn signed(value: PyValue, path: &Path<'_>) -> SnapshotResult<i64> {
    let i = int(value, path)?;
    i64::try_from(i).map_err(|_| {
        invalid(
            path,
            format!("expected an int that fits in 64 bits, found {i}"),
        )
    })
}

/// A stream handle: PyTorch writes `int64(stream)`, so handles past 2^63 appear negative.
fn stream(value: PyValue, path: &Path<'_>) -> SnapshotResult<u64> {
    let i = int(value, path)?;
    if let Ok(signed) = i64::try_from(i) {
        return Ok(signed as u64);
    }
    u64::try_from(i).map_err(|_| {
        invalid(
            path,
            format!("expected a stream handle (64-bit int), found {i}"),
        )
    })
}

fn boolean(value: PyValue, path: &Path<'_>) -> SnapshotResult<bool> {
    match value {
        PyValue::Bool(b) => Ok(b),
        other => Err(expected(path, "a bool", &other)),
    }
}

fn float(value: PyValue, path: &Path<'_>) -> SnapshotResult<f64> {
    match value {
        PyValue::Float(x) => Ok(x),
        PyValue::Int(i) => Ok(i as f64),
        other => Err(expected(path, "a float", &other)),
    }
}

fn string(value: PyValue, path: &Path<'_>) -> SnapshotResult<String> {
    match value {
        PyValue::Str(s) => Ok(s),
        other => Err(expected(path, "a str", &other)),
    }
}

fn list(value: PyValue, path: &Path<'_>) -> SnapshotResult<Vec<PyValue>> {
    match value {
        PyValue::List(items) | PyValue::Tuple(items) => Ok(items),
        other => Err(expected(path, "a list", &other)),
    }
}

fn list_of<T>(
    value: PyValue,
    path: &Path<'_>,
    mut convert: impl FnMut(PyValue, &Path<'_>) -> SnapshotResult<T>,
) -> SnapshotResult<Vec<T>> {
    list(value, path)?
        .into_iter()
        .enumerate()
        .map(|(i, item)| convert(item, &Path::Index(path, i)))
        .collect()
}

fn pool_id(value: PyValue, path: &Path<'_>) -> SnapshotResult<(u64, u64)> {
    let items = list(value, path)?;
    match <[PyValue; 2]>::try_from(items) {
        Ok([first, second]) => Ok((unsigned(first, path)?, unsigned(second, path)?)),
        Err(items) => Err(invalid(
            path,
            format!("expected a pair of ints, found {} items", items.len()),
        )),
    }
}

fn frames(value: PyValue, path: &Path<'_>) -> SnapshotResult<Vec<Frame>> {
    list_of(value, path, |item, path| {
        let mut f = Fields::new(item, path)?;
        Ok(Frame {
            filename: f.optional("filename", string)?.unwrap_or_default(),
            line: f.optional("line", signed)?.unwrap_or_default(),
            name: f.optional("name", string)?.unwrap_or_default(),
            other: f.rest(),
        })
    })
}

pub(crate) fn snapshot_from_value(value: PyValue) -> SnapshotResult<Snapshot> {
    let PyValue::Dict(items) = value else {
        return Err(SnapshotError::NotASnapshot {
            reason: format!("the pickle holds a {}, not a dict", value.type_name()),
        });
    };
    if !items.iter().any(|(k, _)| k.as_str() == Some("segments")) {
        let keys: Vec<String> = items.iter().take(8).map(|(k, _)| k.to_string()).collect();
        return Err(SnapshotError::NotASnapshot {
            reason: format!(
                "the dict has no 'segments' key (its keys: {})",
                keys.join(", ")
            ),
        });
    }
    let mut f = Fields::new(PyValue::Dict(items), &Path::Top)?;
    let segments = f.required("segments", |v, path| list_of(v, path, segment))?;
    let device_traces = f
        .optional("device_traces", |v, path| {
            list_of(v, path, |trace, path| list_of(trace, path, trace_entry))
        })?
        .unwrap_or_default();
    let allocator_settings = f.optional("allocator_settings", settings)?;
    let external_annotations = f.optional("external_annotations", |v, path| {
        list_of(v, path, annotation)
    })?;
    // The host keys are newer than PyTorch 2.11; a form the model does not know stays as written.
    let mut kept = Vec::new();
    let host_segments = lenient(&mut f, &mut kept, "host_segments", |v, path| {
        list_of(v, path, host_segment)
    });
    let host_traces = lenient(&mut f, &mut kept, "host_traces", |v, path| {
        list_of(v, path, trace_entry)
    });
    let mut other = f.rest();
    other.extend(kept);
    Ok(Snapshot {
        segments,
        device_traces,
        allocator_settings,
        external_annotations,
        host_segments,
        host_traces,
        other,
    })
}

/// The value of `key` converted, or `None` when it is absent or does not convert (then it goes to
/// `kept` as written).
fn lenient<T>(
    f: &mut Fields<'_>,
    kept: &mut OtherKeys,
    key: &str,
    convert: impl FnOnce(PyValue, &Path<'_>) -> SnapshotResult<T>,
) -> Option<T> {
    let value = f.take(key)?;
    match convert(value.clone(), &Path::Key(&Path::Top, key)) {
        Ok(converted) => Some(converted),
        Err(error) => {
            tracing::debug!(%error, "snapshot key {key} kept as written");
            kept.push((key.to_owned(), value));
            None
        }
    }
}

fn host_segment(value: PyValue, path: &Path<'_>) -> SnapshotResult<HostSegment> {
    let mut f = Fields::new(value, path)?;
    let address = f.optional("address", unsigned)?.unwrap_or_default();
    let total_size = f.optional("total_size", unsigned)?;
    let allocated_size = f.optional("allocated_size", unsigned)?;
    let active_size = f.optional("active_size", unsigned)?;
    let requested_size = f.optional("requested_size", unsigned)?;
    let segment_frames = f.optional("frames", frames)?.unwrap_or_default();
    let mut next_address = address;
    let blocks = f
        .optional("blocks", |v, path| {
            list_of(v, path, |item, path| {
                let b = block(item, path, next_address)?;
                next_address = b.address.wrapping_add(b.size);
                Ok(b)
            })
        })?
        .unwrap_or_default();
    let sum = |keep: fn(&Block) -> bool, size: fn(&Block) -> u64| {
        blocks.iter().filter(|b| keep(b)).map(size).sum()
    };
    Ok(HostSegment {
        address,
        total_size: total_size.unwrap_or_else(|| sum(|_| true, |b| b.size)),
        allocated_size: allocated_size
            .unwrap_or_else(|| sum(|b| b.state == BlockState::ActiveAllocated, |b| b.size)),
        active_size: active_size
            .unwrap_or_else(|| sum(|b| b.state != BlockState::Inactive, |b| b.size)),
        requested_size: requested_size
            .unwrap_or_else(|| sum(|b| b.state != BlockState::Inactive, |b| b.requested_size)),
        frames: segment_frames,
        blocks,
        other: f.rest(),
    })
}

fn segment(value: PyValue, path: &Path<'_>) -> SnapshotResult<Segment> {
    let mut f = Fields::new(value, path)?;
    let address = f.required("address", unsigned)?;
    let segment_type = f.required("segment_type", |v, path| match string(v, path)?.as_str() {
        "small" => Ok(SegmentType::Small),
        "large" => Ok(SegmentType::Large),
        other => Err(invalid(
            path,
            format!("expected 'small' or 'large', found '{other}'"),
        )),
    })?;
    let device = f.required("device", signed)?;
    let total_size = f.required("total_size", unsigned)?;
    let allocated_size = f.optional("allocated_size", unsigned)?;
    let active_size = f.optional("active_size", unsigned)?;
    let requested_size = f.optional("requested_size", unsigned)?;
    let stream = f.required("stream", stream)?;
    let segment_pool_id = f.optional("segment_pool_id", pool_id)?.unwrap_or_default();
    let is_expandable = f.optional("is_expandable", boolean)?.unwrap_or_default();
    let segment_frames = f.optional("frames", frames)?.unwrap_or_default();
    let mut next_address = address;
    let blocks = f.required("blocks", |v, path| {
        list_of(v, path, |item, path| {
            let b = block(item, path, next_address)?;
            next_address = b.address.wrapping_add(b.size);
            Ok(b)
        })
    })?;
    let sum = |keep: fn(&Block) -> bool, size: fn(&Block) -> u64| {
        blocks.iter().filter(|b| keep(b)).map(size).sum()
    };
    Ok(Segment {
        device,
        address,
        total_size,
        allocated_size: allocated_size
            .unwrap_or_else(|| sum(|b| b.state == BlockState::ActiveAllocated, |b| b.size)),
        active_size: active_size
            .unwrap_or_else(|| sum(|b| b.state != BlockState::Inactive, |b| b.size)),
        requested_size: requested_size.unwrap_or_else(|| {
            sum(
                |b| b.state == BlockState::ActiveAllocated,
                |b| b.requested_size,
            )
        }),
        stream,
        segment_type,
        segment_pool_id,
        is_expandable,
        frames: segment_frames,
        blocks,
        other: f.rest(),
    })
}

/// A block; `default_address` (the end of the previous block) serves files from PyTorch versions that did
/// not write block addresses.
fn block(value: PyValue, path: &Path<'_>, default_address: u64) -> SnapshotResult<Block> {
    let mut f = Fields::new(value, path)?;
    Ok(Block {
        address: f.optional("address", unsigned)?.unwrap_or(default_address),
        size: f.required("size", unsigned)?,
        requested_size: f.optional("requested_size", unsigned)?.unwrap_or_default(),
        state: f.required("state", |v, path| match string(v, path)?.as_str() {
            "active_allocated" => Ok(BlockState::ActiveAllocated),
            "active_pending_free" => Ok(BlockState::ActivePendingFree),
            "inactive" => Ok(BlockState::Inactive),
            other => Err(invalid(
                path,
                format!("expected 'active_allocated', 'active_pending_free' or 'inactive', found '{other}'"),
            )),
        })?,
        frames: f.optional("frames", frames)?.unwrap_or_default(),
        other: f.rest(),
    })
}

fn trace_entry(value: PyValue, path: &Path<'_>) -> SnapshotResult<TraceEntry> {
    let mut f = Fields::new(value, path)?;
    let action = f.required("action", |v, path| match v {
        PyValue::Str(name) => Ok(TraceAction::from_name(&name)),
        other => Err(expected(path, "a str", &other)),
    })?;
    let addr = match f.optional("addr", unsigned)? {
        Some(addr) => addr,
        None => f.required("device_free", unsigned)?,
    };
    Ok(TraceEntry {
        action,
        addr,
        size: f.required("size", unsigned)?,
        stream: f.required("stream", stream)?,
        time_us: f.optional("time_us", signed)?.unwrap_or_default(),
        frames: f.optional("frames", frames)?,
        compile_context: f.optional("compile_context", string)?,
        user_metadata: f.optional("user_metadata", string)?,
        pool_id: f.optional("pool_id", pool_id)?,
        other: f.rest(),
    })
}

fn settings(value: PyValue, path: &Path<'_>) -> SnapshotResult<AllocatorSettings> {
    let mut f = Fields::new(value, path)?;
    Ok(AllocatorSettings {
        config_string: f.optional("PYTORCH_CUDA_ALLOC_CONF", string)?,
        max_split_size: f.optional("max_split_size", signed)?,
        garbage_collection_threshold: f.optional("garbage_collection_threshold", float)?,
        expandable_segments: f.optional("expandable_segments", boolean)?,
        pinned_num_register_threads: f.optional("pinned_num_register_threads", unsigned)?,
        release_lock_on_cudamalloc: f.optional("release_lock_on_cudamalloc", boolean)?,
        pinned_use_cuda_host_register: f.optional("pinned_use_cuda_host_register", boolean)?,
        graph_capture_record_stream_reuse: f
            .optional("graph_capture_record_stream_reuse", boolean)?,
        roundup_power2_divisions: f.optional("roundup_power2_divisions", roundup_table)?,
        other: f.rest(),
    })
}

/// `{'1': d0, '2': d1, ...}` as `(interval start in MiB, divisions)` pairs in interval order (PyTorch's
/// order; a JSON object may come back sorted as text).
/// Reads `allocator_settings.roundup_power2_divisions`: `(interval start in MiB, divisions)` by start.
///
/// Keys that name the same start (`"8"` and `"08"`) collapse into one entry whose value is the later key's,
/// as a repeated key does in a Python dict and a repeated boundary does in the configuration grammar
/// (`roundup_power2_divisions:[8:1,8:4]` sets 4). Keeping both would write the key `"8"` twice, which
/// reads back as one entry (finding F2 in `docs/reliability.md`).
fn roundup_table(value: PyValue, path: &Path<'_>) -> SnapshotResult<Vec<(u64, u64)>> {
    let table = Fields::new(value, path)?;
    let pairs = table
        .rest()
        .into_iter()
        .map(|(key, divisions)| {
            let start = key.parse::<u64>().map_err(|_| {
                invalid(
                    path,
                    format!("expected interval starts in MiB as keys, found '{key}'"),
                )
            })?;
            Ok((start, unsigned(divisions, &Path::Key(path, &key))?))
        })
        .collect::<SnapshotResult<Vec<_>>>()?;
    Ok(later_starts_override(pairs))
}

/// Sorts `(start, divisions)` pairs by start, keeping for each start only the last pair given for it.
fn later_starts_override(mut pairs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    // A stable sort keeps pairs with the same start in their input order: the last one wins.
    pairs.sort_by_key(|&(start, _)| start);
    let mut table: Vec<(u64, u64)> = Vec::with_capacity(pairs.len());
    for (start, divisions) in pairs {
        match table.last_mut() {
            Some(last) if last.0 == start => last.1 = divisions,
            _ => table.push((start, divisions)),
        }
    }
    table
}

fn annotation(value: PyValue, path: &Path<'_>) -> SnapshotResult<ExternalAnnotation> {
    let mut f = Fields::new(value, path)?;
    Ok(ExternalAnnotation {
        device: f.optional("device", signed)?,
        time_us: f.optional("time_us", signed)?,
        stage: f.optional("stage", string)?,
        name: f.optional("name", string)?,
        other: f.rest(),
    })
}

/// Builds a dict from `(key, value)` pairs followed by the unknown keys.
fn dict(known: Vec<(&str, PyValue)>, other: &OtherKeys) -> PyValue {
    let mut items: Vec<(PyValue, PyValue)> = known
        .into_iter()
        .map(|(k, v)| (PyValue::from(k), v))
        .collect();
    items.extend(
        other
            .iter()
            .map(|(k, v)| (PyValue::Str(k.clone()), v.clone())),
    );
    PyValue::Dict(items)
}

fn optional<T>(
    known: &mut Vec<(&str, PyValue)>,
    key: &'static str,
    value: Option<T>,
    to: impl FnOnce(T) -> PyValue,
) {
    if let Some(value) = value {
        known.push((key, to(value)));
    }
}

fn frames_value(frames: &[Frame]) -> PyValue {
    PyValue::List(
        frames
            .iter()
            .map(|fr| {
                dict(
                    vec![
                        ("filename", PyValue::from(fr.filename.as_str())),
                        ("line", PyValue::from(fr.line)),
                        ("name", PyValue::from(fr.name.as_str())),
                    ],
                    &fr.other,
                )
            })
            .collect(),
    )
}

pub(crate) fn snapshot_to_value(snapshot: &Snapshot) -> PyValue {
    let mut known = vec![
        (
            "segments",
            PyValue::List(snapshot.segments.iter().map(segment_value).collect()),
        ),
        (
            "device_traces",
            PyValue::List(
                snapshot
                    .device_traces
                    .iter()
                    .map(|trace| PyValue::List(trace.iter().map(trace_entry_value).collect()))
                    .collect(),
            ),
        ),
    ];
    optional(
        &mut known,
        "allocator_settings",
        snapshot.allocator_settings.as_ref(),
        settings_value,
    );
    optional(
        &mut known,
        "external_annotations",
        snapshot.external_annotations.as_ref(),
        |list| PyValue::List(list.iter().map(annotation_value).collect()),
    );
    optional(
        &mut known,
        "host_segments",
        snapshot.host_segments.as_ref(),
        |list| PyValue::List(list.iter().map(host_segment_value).collect()),
    );
    optional(
        &mut known,
        "host_traces",
        snapshot.host_traces.as_ref(),
        |list| PyValue::List(list.iter().map(trace_entry_value).collect()),
    );
    dict(known, &snapshot.other)
}

fn blocks_value(blocks: &[Block]) -> PyValue {
    PyValue::List(
        blocks
            .iter()
            .map(|b| {
                dict(
                    vec![
                        ("address", PyValue::from(b.address)),
                        ("size", PyValue::from(b.size)),
                        ("requested_size", PyValue::from(b.requested_size)),
                        ("state", PyValue::from(b.state.as_str())),
                        ("frames", frames_value(&b.frames)),
                    ],
                    &b.other,
                )
            })
            .collect(),
    )
}

fn host_segment_value(s: &HostSegment) -> PyValue {
    dict(
        vec![
            ("address", PyValue::from(s.address)),
            ("total_size", PyValue::from(s.total_size)),
            ("allocated_size", PyValue::from(s.allocated_size)),
            ("active_size", PyValue::from(s.active_size)),
            ("requested_size", PyValue::from(s.requested_size)),
            ("frames", frames_value(&s.frames)),
            ("blocks", blocks_value(&s.blocks)),
        ],
        &s.other,
    )
}

fn segment_value(s: &Segment) -> PyValue {
    dict(
        vec![
            ("device", PyValue::from(s.device)),
            ("address", PyValue::from(s.address)),
            ("total_size", PyValue::from(s.total_size)),
            ("allocated_size", PyValue::from(s.allocated_size)),
            ("active_size", PyValue::from(s.active_size)),
            ("requested_size", PyValue::from(s.requested_size)),
            ("stream", PyValue::from(s.stream as i64)),
            ("segment_type", PyValue::from(s.segment_type.as_str())),
            (
                "segment_pool_id",
                PyValue::Tuple(vec![
                    PyValue::from(s.segment_pool_id.0),
                    PyValue::from(s.segment_pool_id.1),
                ]),
            ),
            ("is_expandable", PyValue::from(s.is_expandable)),
            ("frames", frames_value(&s.frames)),
            ("blocks", blocks_value(&s.blocks)),
        ],
        &s.other,
    )
}

fn trace_entry_value(e: &TraceEntry) -> PyValue {
    let addr_key = if e.action == TraceAction::Oom {
        "device_free"
    } else {
        "addr"
    };
    let mut known = vec![
        ("action", PyValue::from(e.action.as_str())),
        (addr_key, PyValue::from(e.addr)),
        ("size", PyValue::from(e.size)),
        ("stream", PyValue::from(e.stream as i64)),
        ("time_us", PyValue::from(e.time_us)),
    ];
    optional(
        &mut known,
        "compile_context",
        e.compile_context.as_deref(),
        PyValue::from,
    );
    optional(
        &mut known,
        "user_metadata",
        e.user_metadata.as_deref(),
        PyValue::from,
    );
    optional(&mut known, "pool_id", e.pool_id, |(first, second)| {
        PyValue::Tuple(vec![PyValue::from(first), PyValue::from(second)])
    });
    optional(&mut known, "frames", e.frames.as_deref(), frames_value);
    dict(known, &e.other)
}

fn settings_value(s: &AllocatorSettings) -> PyValue {
    let mut known = Vec::new();
    optional(
        &mut known,
        "PYTORCH_CUDA_ALLOC_CONF",
        s.config_string.as_deref(),
        PyValue::from,
    );
    optional(
        &mut known,
        "max_split_size",
        s.max_split_size,
        PyValue::from,
    );
    optional(
        &mut known,
        "garbage_collection_threshold",
        s.garbage_collection_threshold,
        PyValue::from,
    );
    optional(
        &mut known,
        "expandable_segments",
        s.expandable_segments,
        PyValue::from,
    );
    optional(
        &mut known,
        "pinned_num_register_threads",
        s.pinned_num_register_threads,
        PyValue::from,
    );
    optional(
        &mut known,
        "release_lock_on_cudamalloc",
        s.release_lock_on_cudamalloc,
        PyValue::from,
    );
    optional(
        &mut known,
        "pinned_use_cuda_host_register",
        s.pinned_use_cuda_host_register,
        PyValue::from,
    );
    optional(
        &mut known,
        "graph_capture_record_stream_reuse",
        s.graph_capture_record_stream_reuse,
        PyValue::from,
    );
    optional(
        &mut known,
        "roundup_power2_divisions",
        s.roundup_power2_divisions.as_ref(),
        |table| {
            PyValue::Dict(
                table
                    .iter()
                    .map(|(start, d)| (PyValue::Str(start.to_string()), PyValue::from(*d)))
                    .collect(),
            )
        },
    );
    dict(known, &s.other)
}

fn annotation_value(a: &ExternalAnnotation) -> PyValue {
    let mut known = Vec::new();
    optional(&mut known, "stage", a.stage.as_deref(), PyValue::from);
    optional(&mut known, "name", a.name.as_deref(), PyValue::from);
    optional(&mut known, "device", a.device, PyValue::from);
    optional(&mut known, "time_us", a.time_us, PyValue::from);
    dict(known, &a.other)
}
