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
//! # #[cfg(feature = "snapshot-io")]
//! # fn main() -> Result<(), tensormem_cuda_alloc::snapshot::SnapshotError> {
//! use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction};
//!
//! let snapshot = Snapshot::read_file("gpt2_train.pickle")?;
//! let allocs = snapshot.trace(0).iter().filter(|e| e.action == TraceAction::Alloc).count();
//! println!("{} segments, {allocs} allocations traced", snapshot.segments.len());
//! snapshot.write_pickle_file("copy.pickle")?;
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "snapshot-io"))]
//! # fn main() {}
//! ```
//!
//! Files need the feature `snapshot-io` (on by default): the pickle reader and writer, gzip and JSON.
//! Without it the typed model and its conversion to and from [`PyValue`] remain.
//!
//! The pickle reader is this module's own: it runs only the opcodes that build plain data, without
//! recursion, so a file that is not a snapshot (or is hostile) gets a [`SnapshotError`], never a crash.
//! What reading may take is bounded (`ReadLimits`: bytes read, bytes a gzip layer expands to, values
//! the pickle builds, bytes the reader holds), so a pickle or gzip bomb, or an input that never ends,
//! gets [`SnapshotError::TooLarge`] rather than exhausting memory, and memory the system refuses is
//! [`SnapshotError::OutOfMemory`], never an abort. docs/dependencies.md says why this is
//! not serde-pickle.

mod convert;
#[cfg(feature = "snapshot-io")]
mod io;
#[cfg(feature = "snapshot-io")]
mod json;
#[cfg(feature = "snapshot-io")]
mod limits;
mod model;
#[cfg(feature = "snapshot-io")]
mod pickle;
mod pyvalue;
mod settings;
#[cfg(feature = "snapshot-io")]
mod unpickle;

use std::path::PathBuf;

#[cfg(feature = "snapshot-io")]
pub use limits::ReadLimits;
pub use model::{
    AllocatorSettings, Block, BlockState, ExternalAnnotation, Frame, HostSegment, OtherKeys,
    Segment, SegmentType, Snapshot, TraceAction, TraceEntry,
};
pub use pyvalue::{PyValue, MAX_DEPTH};

use crate::config::ConfigError;

/// The most bytes a gzip-compressed snapshot may expand to by default (a guard against
/// decompression bombs; `ReadLimits::max_decompressed_bytes` sets another).
pub const MAX_DECOMPRESSED_BYTES: u64 = 1 << 30;

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
    /// Reading the snapshot would exceed one of the limits of `ReadLimits` (a file far larger than
    /// snapshots are, or a hostile one).
    #[error(
        "refusing the snapshot: {what} more than {bound} {unit} (ReadLimits::{limit}); raise that \
         limit only if the file is trusted"
    )]
    TooLarge {
        /// What grew too large: `"the input holds"`, `"the gzip data expands to"`, `"the pickle builds"`,
        /// `"reading the pickle holds"`.
        what: &'static str,
        /// The bound that was exceeded.
        bound: u64,
        /// Its unit: `"bytes"` or `"values"`.
        unit: &'static str,
        /// The name of the `ReadLimits` field: `"max_input_bytes"`, `"max_decompressed_bytes"`,
        /// `"max_values"`, `"max_memory_bytes"`.
        limit: &'static str,
    },
    /// The system refused memory the snapshot reader asked for (within its limits): the process may
    /// use less than the limits allow (`ulimit -v`, a cgroup), or the machine is short of memory.
    #[error(
        "cannot read the snapshot: the system refused {bytes} bytes of memory; lower \
         ReadLimits::max_memory_bytes (and max_decompressed_bytes) below what this process may use, \
         or free memory"
    )]
    OutOfMemory {
        /// The size of the allocation that failed.
        bytes: u64,
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
    #[cfg(feature = "snapshot-io")]
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
    #[cfg(feature = "snapshot-io")]
    pub(crate) fn write(source: std::io::Error) -> SnapshotError {
        SnapshotError::Io {
            action: "writing the snapshot",
            source,
        }
    }
}

/// `Result` with a [`SnapshotError`].
pub type SnapshotResult<T> = Result<T, SnapshotError>;

impl Snapshot {
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

    /// Total number of recorded events over all devices (the host's `host_traces` not counted).
    #[must_use]
    pub fn event_count(&self) -> usize {
        self.device_traces.iter().map(Vec::len).sum()
    }

    /// The recorded events of the pinned host allocator (`host_traces`), oldest first; empty when
    /// none were recorded.
    #[must_use]
    pub fn host_trace(&self) -> &[TraceEntry] {
        self.host_traces.as_deref().unwrap_or(&[])
    }

    /// The snapshot PyTorch's `snapshot(mempool_id, include_traces)` gives from this one: only the
    /// segments of pool `pool` (all of them for `None` or `(0, 0)`, as PyTorch filters), and, unless
    /// `include_traces`, no traces at all (`device_traces` an empty list, `host_traces` absent, no
    /// `external_annotations` entries). The traces, when kept, are whole: PyTorch does not filter
    /// them by pool.
    #[must_use]
    pub fn filtered(mut self, pool: Option<(u64, u64)>, include_traces: bool) -> Snapshot {
        if let Some(pool) = pool.filter(|&p| p != (0, 0)) {
            self.segments.retain(|s| s.segment_pool_id == pool);
        }
        if !include_traces {
            self.device_traces.clear();
            self.host_traces = None;
            if let Some(annotations) = &mut self.external_annotations {
                annotations.clear();
            }
        }
        self
    }
}
