//! Memory snapshots in PyTorch's format: read what `torch.cuda.memory._dump_snapshot` wrote, write files
//! PyTorch's tools open.
//!
//! A snapshot is PyTorch's picture of its caching allocator: every segment with its blocks, the recorded
//! trace of allocator events (when `_record_memory_history` was on), and the allocator settings. PyTorch
//! returns it from `torch.cuda.memory._snapshot()` as plain Python data and `_dump_snapshot(path)` pickles
//! it; `python -m torch.cuda._memory_viz` and <https://pytorch.org/memory_viz> draw it.
//!
//! [`Snapshot`] is that data typed. It reads pickles (optionally gzip-compressed) and writes pickles that
//! Python's `pickle.load` turns back into the same dicts, lists, tuples, ints and strings; keys it does not
//! know are kept and written back. JSON is there for readers without Python.
//!
//! ```no_run
//! use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction};
//!
//! let snapshot = Snapshot::read_file("gpt2_train.pickle")?;
//! let allocs = snapshot.trace(0).iter().filter(|e| e.action == TraceAction::Alloc).count();
//! println!("{} segments, {allocs} allocations traced", snapshot.segments.len());
//! snapshot.write_pickle_file("copy.pickle")?;
//! # Ok::<(), tensormem_cuda_alloc::snapshot::SnapshotError>(())
//! ```
//!
//! The pickle reader is this module's own: it runs only the opcodes that build plain data, without
//! recursion, so a file that is not a snapshot (or is hostile) gets a [`SnapshotError`], never a crash.

mod convert;
mod json;
mod model;
mod pickle;
mod pyvalue;
mod settings;
mod unpickle;

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

pub use model::{
    AllocatorSettings, Block, BlockState, ExternalAnnotation, Frame, OtherKeys, Segment,
    SegmentType, Snapshot, TraceAction, TraceEntry,
};
pub use pyvalue::{PyValue, MAX_DEPTH};

use crate::config::ConfigError;

/// The most bytes a gzip-compressed snapshot may expand to (a guard against decompression bombs).
pub const MAX_DECOMPRESSED_BYTES: u64 = 4 << 30;

/// Why a snapshot could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Reading or writing a file failed.
    #[error("cannot {action} {}: {source}", path.display())]
    File {
        /// `"read"`, `"create"` or `"write"`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Reading from or writing to a stream failed.
    #[error("{action} failed: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The data is not a pickle at all.
    #[error("not a memory snapshot: not a pickle file ({reason}); expected what torch.cuda.memory._dump_snapshot writes")]
    NotPickle {
        /// What gave it away.
        reason: String,
    },
    /// The pickle is malformed or truncated.
    #[error("malformed pickle at byte {offset}: {reason}")]
    Pickle {
        /// Byte offset of the opcode at fault (the data's length when it ended too early).
        offset: usize,
        /// What was wrong.
        reason: String,
    },
    /// The pickle is valid but uses features a snapshot never does (objects of classes, recursion).
    #[error("not a memory snapshot: unsupported pickle content at byte {offset}: {reason}")]
    UnsupportedPickle {
        /// Byte offset of the opcode at fault.
        offset: usize,
        /// What was found.
        reason: String,
    },
    /// The data is plain Python data but not a snapshot.
    #[error(
        "not a memory snapshot: {reason}; expected a dict with 'segments' and 'device_traces' as \
             torch.cuda.memory._snapshot() returns"
    )]
    NotASnapshot {
        /// What was found instead.
        reason: String,
    },
    /// A snapshot field has the wrong type or value.
    #[error("invalid snapshot: {path}: {reason}")]
    Invalid {
        /// Where: `segments[3].blocks[0].size`.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// The gzip layer of a compressed snapshot is damaged.
    #[error("cannot decompress the gzip-compressed snapshot: {reason}")]
    Compressed {
        /// What was wrong.
        reason: String,
    },
    /// The JSON form could not be read or written.
    #[error("snapshot JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The recorded allocator settings do not make a configuration.
    #[error("the snapshot's allocator settings are not usable: {reason}")]
    Config {
        /// What was wrong.
        reason: String,
        /// The configuration parser's error, when there is one.
        #[source]
        source: Option<ConfigError>,
    },
}

impl SnapshotError {
    pub(crate) fn write(source: std::io::Error) -> SnapshotError {
        SnapshotError::Io {
            action: "writing the snapshot",
            source,
        }
    }
}

/// `Result` with a [`SnapshotError`].
pub type SnapshotResult<T> = Result<T, SnapshotError>;

/// The gzip magic number.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

impl Snapshot {
    /// Reads a pickled snapshot (as `_dump_snapshot` writes it), gzip-compressed or not.
    ///
    /// # Errors
    /// [`SnapshotError`] when the stream fails or does not hold a snapshot.
    pub fn read_pickle<R: Read>(mut reader: R) -> SnapshotResult<Snapshot> {
        let mut data = Vec::new();
        reader
            .read_to_end(&mut data)
            .map_err(|source| SnapshotError::Io {
                action: "reading the snapshot",
                source,
            })?;
        Snapshot::from_pickle_bytes(&data)
    }

    /// Reads a pickled snapshot from bytes, gzip-compressed or not.
    ///
    /// # Errors
    /// As [`read_pickle`](Self::read_pickle).
    pub fn from_pickle_bytes(data: &[u8]) -> SnapshotResult<Snapshot> {
        if data.starts_with(&GZIP_MAGIC) {
            let plain = gunzip(data)?;
            return Snapshot::from_pickle_bytes_uncompressed(&plain);
        }
        Snapshot::from_pickle_bytes_uncompressed(data)
    }

    fn from_pickle_bytes_uncompressed(data: &[u8]) -> SnapshotResult<Snapshot> {
        convert::snapshot_from_value(unpickle::unpickle(data)?)
    }

    /// Reads a snapshot file: a pickle (gzip-compressed or not) or, when it starts with `{`, JSON.
    ///
    /// # Errors
    /// [`SnapshotError::File`] when the file cannot be read; otherwise as
    /// [`read_pickle`](Self::read_pickle) / [`read_json`](Self::read_json).
    pub fn read_file(path: impl AsRef<Path>) -> SnapshotResult<Snapshot> {
        let path = path.as_ref();
        let data = std::fs::read(path).map_err(|source| SnapshotError::File {
            action: "read",
            path: path.to_owned(),
            source,
        })?;
        let first = data.iter().find(|b| !b.is_ascii_whitespace());
        if first == Some(&b'{') {
            return Snapshot::read_json(data.as_slice());
        }
        Snapshot::from_pickle_bytes(&data)
    }

    /// Alias of [`read_file`](Self::read_file), for symmetry with
    /// [`write_pickle_file`](Self::write_pickle_file).
    ///
    /// # Errors
    /// As [`read_file`](Self::read_file).
    pub fn read_pickle_file(path: impl AsRef<Path>) -> SnapshotResult<Snapshot> {
        Snapshot::read_file(path)
    }

    /// Writes the snapshot as a pickle (protocol 4) that `pickle.load` and PyTorch's `_memory_viz` read.
    ///
    /// # Errors
    /// [`SnapshotError::Io`] when writing fails; [`SnapshotError::Invalid`] for values nested deeper than
    /// [`MAX_DEPTH`] in unknown keys.
    pub fn write_pickle<W: Write>(&self, writer: W) -> SnapshotResult<()> {
        pickle::write_pickle(writer, &self.to_value())
    }

    /// Writes the snapshot as a pickle file (see [`write_pickle`](Self::write_pickle)).
    ///
    /// # Errors
    /// [`SnapshotError::File`] when the file cannot be created; as [`write_pickle`](Self::write_pickle).
    pub fn write_pickle_file(&self, path: impl AsRef<Path>) -> SnapshotResult<()> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|source| SnapshotError::File {
            action: "create",
            path: path.to_owned(),
            source,
        })?;
        self.write_pickle(file).map_err(|e| match e {
            SnapshotError::Io { source, .. } => SnapshotError::File {
                action: "write",
                path: path.to_owned(),
                source,
            },
            other => other,
        })
    }

    /// Writes the snapshot as gzip-compressed pickle, which [`read_pickle`](Self::read_pickle) reads (Python
    /// reads it with `pickle.load(gzip.open(path))`).
    ///
    /// # Errors
    /// As [`write_pickle`](Self::write_pickle).
    pub fn write_pickle_gz<W: Write>(&self, writer: W) -> SnapshotResult<()> {
        let mut encoder = flate2::write::GzEncoder::new(writer, flate2::Compression::default());
        self.write_pickle(&mut encoder)?;
        encoder.finish().map_err(SnapshotError::write)?;
        Ok(())
    }

    /// Reads the JSON form written by [`write_json`](Self::write_json) (the same keys as the pickle).
    ///
    /// # Errors
    /// [`SnapshotError::Json`] for malformed JSON; as [`read_pickle`](Self::read_pickle) for content that
    /// is not a snapshot.
    pub fn read_json<R: Read>(reader: R) -> SnapshotResult<Snapshot> {
        let value: serde_json::Value = serde_json::from_reader(BufReader::new(reader))?;
        convert::snapshot_from_value(json::from_json(&value))
    }

    /// Writes the snapshot as JSON with the pickle's keys (tuples become arrays).
    ///
    /// # Errors
    /// [`SnapshotError::Json`] when writing fails.
    pub fn write_json<W: Write>(&self, writer: W) -> SnapshotResult<()> {
        let mut writer = BufWriter::new(writer);
        serde_json::to_writer(&mut writer, &json::to_json(&self.to_value()))?;
        writer.flush().map_err(SnapshotError::write)
    }

    /// The snapshot as the plain Python data `torch.cuda.memory._snapshot()` returns.
    #[must_use]
    pub fn to_value(&self) -> PyValue {
        convert::snapshot_to_value(self)
    }

    /// A snapshot from plain Python data (the inverse of [`to_value`](Self::to_value)).
    ///
    /// # Errors
    /// [`SnapshotError::NotASnapshot`] or [`SnapshotError::Invalid`] when the data is not a snapshot.
    pub fn from_value(value: PyValue) -> SnapshotResult<Snapshot> {
        convert::snapshot_from_value(value)
    }

    /// The recorded events of device `device`, oldest first (empty when none were recorded).
    #[must_use]
    pub fn trace(&self, device: usize) -> &[TraceEntry] {
        self.device_traces.get(device).map_or(&[], Vec::as_slice)
    }

    /// Every device's recorded events: `(device index, events oldest first)`, devices in order.
    pub fn traces(&self) -> impl Iterator<Item = (usize, &[TraceEntry])> + '_ {
        self.device_traces
            .iter()
            .enumerate()
            .map(|(device, trace)| (device, trace.as_slice()))
    }

    /// Total number of recorded events over all devices.
    #[must_use]
    pub fn event_count(&self) -> usize {
        self.device_traces.iter().map(Vec::len).sum()
    }
}

fn gunzip(data: &[u8]) -> SnapshotResult<Vec<u8>> {
    let mut plain = Vec::new();
    let decoder = flate2::read::MultiGzDecoder::new(data);
    decoder
        .take(MAX_DECOMPRESSED_BYTES + 1)
        .read_to_end(&mut plain)
        .map_err(|e| SnapshotError::Compressed {
            reason: e.to_string(),
        })?;
    if plain.len() as u64 > MAX_DECOMPRESSED_BYTES {
        return Err(SnapshotError::Compressed {
            reason: format!(
                "it expands to more than {} GiB",
                MAX_DECOMPRESSED_BYTES >> 30
            ),
        });
    }
    Ok(plain)
}
