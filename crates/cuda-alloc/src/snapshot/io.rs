//! Reading and writing snapshot files: pickles (gzip-compressed or not) and JSON (feature
//! `snapshot-io`).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use super::model::Snapshot;
#[cfg(doc)]
use super::MAX_DEPTH;
use super::{convert, json, pickle, unpickle, ReadLimits, SnapshotError, SnapshotResult};

/// The gzip magic number.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// How much of an input is read before its first bytes are judged: data that is neither a pickle,
/// gzip nor JSON (`/dev/zero`, a binary) is refused without reading the rest.
const HEAD: u64 = 64 << 10;

impl Snapshot {
    /// Reads a pickled snapshot (as `_dump_snapshot` writes it), gzip-compressed or not, within the
    /// default [`ReadLimits`].
    ///
    /// # Errors
    /// [`SnapshotError`] when the stream fails or does not hold a snapshot;
    /// [`SnapshotError::TooLarge`] when it exceeds a limit.
    pub fn read_pickle<R: Read>(reader: R) -> SnapshotResult<Snapshot> {
        Snapshot::read_pickle_with_limits(reader, &ReadLimits::DEFAULT)
    }

    /// [`read_pickle`](Self::read_pickle) within the given limits.
    ///
    /// # Errors
    /// As [`read_pickle`](Self::read_pickle).
    pub fn read_pickle_with_limits<R: Read>(
        reader: R,
        limits: &ReadLimits,
    ) -> SnapshotResult<Snapshot> {
        let data = read_capped(reader, &INPUT, limits.max_input_bytes, |source| {
            SnapshotError::Io {
                action: "reading the snapshot",
                source,
            }
        })?;
        Snapshot::from_pickle_bytes_with_limits(&data, limits)
    }

    /// Reads a pickled snapshot from bytes, gzip-compressed or not, within the default
    /// [`ReadLimits`] (the input's size is the caller's: only decompression and the values built
    /// are bounded).
    ///
    /// # Errors
    /// As [`read_pickle`](Self::read_pickle).
    pub fn from_pickle_bytes(data: &[u8]) -> SnapshotResult<Snapshot> {
        Snapshot::from_pickle_bytes_with_limits(data, &ReadLimits::DEFAULT)
    }

    /// [`from_pickle_bytes`](Self::from_pickle_bytes) within the given limits.
    ///
    /// # Errors
    /// As [`read_pickle`](Self::read_pickle).
    pub fn from_pickle_bytes_with_limits(
        data: &[u8],
        limits: &ReadLimits,
    ) -> SnapshotResult<Snapshot> {
        if data.starts_with(&GZIP_MAGIC) {
            let plain = gunzip(data, limits)?;
            return Snapshot::from_plain_pickle(&plain, limits);
        }
        Snapshot::from_plain_pickle(data, limits)
    }

    fn from_plain_pickle(data: &[u8], limits: &ReadLimits) -> SnapshotResult<Snapshot> {
        convert::snapshot_from_value(unpickle::unpickle(
            data,
            limits.max_values,
            limits.max_memory_bytes,
        )?)
    }

    /// Reads a snapshot file: a pickle (gzip-compressed or not) or, when it starts with `{`, JSON,
    /// within the default [`ReadLimits`].
    ///
    /// # Errors
    /// [`SnapshotError::File`] when the file cannot be read; [`SnapshotError::TooLarge`] when it
    /// exceeds a limit (a file that never ends, such as `/dev/zero`, is refused, not read forever);
    /// otherwise as [`read_pickle`](Self::read_pickle) / [`read_json`](Self::read_json).
    pub fn read_file(path: impl AsRef<Path>) -> SnapshotResult<Snapshot> {
        Snapshot::read_file_with_limits(path, &ReadLimits::DEFAULT)
    }

    /// [`read_file`](Self::read_file) within the given limits.
    ///
    /// # Errors
    /// As [`read_file`](Self::read_file).
    pub fn read_file_with_limits(
        path: impl AsRef<Path>,
        limits: &ReadLimits,
    ) -> SnapshotResult<Snapshot> {
        let path = path.as_ref();
        let file_error = |source| SnapshotError::File {
            action: "read",
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(file_error)?;
        let data = read_capped(file, &INPUT, limits.max_input_bytes, file_error)?;
        if starts_like_json(&data) {
            return read_json_bytes(&data);
        }
        Snapshot::from_pickle_bytes_with_limits(&data, limits)
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
        let data = read_capped(
            BufReader::new(reader),
            &JSON_INPUT,
            ReadLimits::DEFAULT.max_input_bytes,
            |source| SnapshotError::Io {
                action: "reading the snapshot",
                source,
            },
        )?;
        read_json_bytes(&data)
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
}

fn read_json_bytes(data: &[u8]) -> SnapshotResult<Snapshot> {
    let value: serde_json::Value = serde_json::from_slice(data)?;
    convert::snapshot_from_value(json::from_json(&value))
}

/// Whether data starts (after whitespace) with `{`, as the JSON form does.
fn starts_like_json(data: &[u8]) -> bool {
    data.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// What a capped read is reading, for its errors and for judging its first bytes.
struct Stage {
    /// The start of [`SnapshotError::TooLarge`]'s message.
    what: &'static str,
    /// The [`ReadLimits`] field that bounds it.
    limit: &'static str,
    /// Judges the first bytes: refuses data that cannot be what this stage reads.
    judge: fn(&[u8]) -> SnapshotResult<()>,
}

const INPUT: Stage = Stage {
    what: "the input holds",
    limit: "max_input_bytes",
    judge: |head| {
        if head.starts_with(&GZIP_MAGIC) || starts_like_json(head) {
            Ok(())
        } else {
            unpickle::check_start(head)
        }
    },
};

const JSON_INPUT: Stage = Stage {
    what: "the input holds",
    limit: "max_input_bytes",
    judge: |_| Ok(()),
};

const DECOMPRESSED: Stage = Stage {
    what: "the gzip data expands to",
    limit: "max_decompressed_bytes",
    judge: unpickle::check_start,
};

/// Reads everything `reader` gives, up to `cap` bytes: more is [`SnapshotError::TooLarge`]. The
/// first [`HEAD`] bytes are judged before the rest is read, so data that is not a snapshot at all
/// is refused at once.
fn read_capped<R: Read>(
    reader: R,
    stage: &Stage,
    cap: u64,
    io_error: impl Fn(std::io::Error) -> SnapshotError,
) -> SnapshotResult<Vec<u8>> {
    let mut data = Vec::new();
    let mut limited = reader.take(cap.saturating_add(1));
    (&mut limited)
        .take(HEAD)
        .read_to_end(&mut data)
        .map_err(&io_error)?;
    (stage.judge)(&data)?;
    limited.read_to_end(&mut data).map_err(io_error)?;
    if data.len() as u64 > cap {
        return Err(SnapshotError::TooLarge {
            what: stage.what,
            bound: cap,
            unit: "bytes",
            limit: stage.limit,
        });
    }
    Ok(data)
}

/// Decompresses gzip data, at most `limits.max_decompressed_bytes` of it.
fn gunzip(data: &[u8], limits: &ReadLimits) -> SnapshotResult<Vec<u8>> {
    read_capped(
        flate2::read::MultiGzDecoder::new(data),
        &DECOMPRESSED,
        limits.max_decompressed_bytes,
        |e| SnapshotError::Compressed {
            reason: e.to_string(),
        },
    )
}
