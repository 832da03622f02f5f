//! Reading and writing snapshot files: pickles (gzip-compressed or not) and JSON (feature
//! `snapshot-io`).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use super::model::Snapshot;
#[cfg(doc)]
use super::MAX_DEPTH;
use super::{
    convert, json, pickle, unpickle, SnapshotError, SnapshotResult, MAX_DECOMPRESSED_BYTES,
};

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
