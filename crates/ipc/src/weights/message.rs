//! [`WeightsMessage`]: what a consumer needs to open a publication, and its binary encoding.

use tensormem_shm::ShmName;

use super::meta::{DType, TensorMeta, MAX_DIMS};
use crate::batch::BatchHandle;
use crate::driver::{EventHandle, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
use crate::reader::Reader;

const MAGIC: &[u8; 4] = b"TMIW";
/// The encoding version of [`WeightsMessage`] this crate writes and reads.
pub const WEIGHTS_ENCODING_VERSION: u16 = 1;

/// A publication as a consumer receives it: the batch of its memory (one memory handle or range of
/// expandable-segment chunks per segment, one view per tensor, one ref-counter slot for this
/// consumer), each tensor's element type, shape and
/// strides, the producer's version channel and the event it records each version on.
///
/// # Binary encoding (version 1)
///
/// All integers little-endian.
///
/// | bytes | field |
/// | --- | --- |
/// | 0..4 | magic `TMIW` |
/// | 4..6 | version (1) |
/// | 6..8 | reserved (0) |
/// | 8..72 | the producer's version event (`cuIpcGetEventHandle`) |
/// | 72..74 | length `N` of the channel's shared-memory name, then the name |
/// | then 4 + `B` | length `B` of the batch, then the batch ([`BatchHandle::encode`]: version 1 for device allocations only, version 2 with ranges of chunks) |
/// | then per view of the batch, in its order | element type (1), dimensions `D` (1), `D` sizes (8 each), `D` strides in elements (8 each) |
///
/// Decoding checks every field: the batch as [`BatchHandle::decode`] does, known element types, at
/// most [`MAX_DIMS`] dimensions, each tensor inside its view (its span no longer than the view),
/// and the exact length. Anything else is [`Error::MalformedWeights`]. The message's own layout is
/// the same whatever the batch's version; a build that reads only version 1 batches refuses a
/// message carrying ranges of chunks with [`Error::MalformedBatch`] naming the batch's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsMessage {
    pub(crate) batch: BatchHandle,
    pub(crate) metas: Vec<TensorMeta>,
    pub(crate) channel: ShmName,
    pub(crate) event: EventHandle,
}

impl WeightsMessage {
    /// The batch of the publication's memory.
    #[must_use]
    pub fn batch(&self) -> &BatchHandle {
        &self.batch
    }

    /// The name of the publication's version channel (a file in `/dev/shm`, removed when the
    /// publisher is dropped or its process exits).
    #[must_use]
    pub fn channel(&self) -> &ShmName {
        &self.channel
    }

    /// Each tensor's element type, shape and strides, in the batch's view order.
    #[must_use]
    pub fn metas(&self) -> &[TensorMeta] {
        &self.metas
    }

    /// The binary encoding (see the type's docs).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let batch = self.batch.encode();
        let name = self.channel.as_str().as_bytes();
        let mut out = Vec::with_capacity(80 + name.len() + batch.len() + self.metas.len() * 40);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&WEIGHTS_ENCODING_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.event.0);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&(batch.len() as u32).to_le_bytes());
        out.extend_from_slice(&batch);
        for meta in &self.metas {
            out.push(meta.dtype.code());
            out.push(meta.shape.len() as u8);
            for &size in &meta.shape {
                out.extend_from_slice(&size.to_le_bytes());
            }
            for &stride in &meta.strides {
                out.extend_from_slice(&stride.to_le_bytes());
            }
        }
        out
    }

    /// Decodes [`encode`](Self::encode)'s bytes, checking every field.
    ///
    /// # Errors
    ///
    /// [`Error::MalformedWeights`] naming the first problem found ([`Error::MalformedBatch`] for
    /// the batch inside).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |problem: String| Error::MalformedWeights { problem };
        let mut r = Reader::new(bytes, 0, |problem| Error::MalformedWeights { problem });
        if r.take(4, "magic")? != MAGIC {
            return Err(bad("wrong magic (not a weights message)".into()));
        }
        let version = r.u16("version")?;
        if version != WEIGHTS_ENCODING_VERSION {
            return Err(bad(format!(
                "encoding version {version}, this build reads version \
                 {WEIGHTS_ENCODING_VERSION}; use the same tensormem version on both sides"
            )));
        }
        if r.u16("reserved")? != 0 {
            return Err(bad("reserved bits set".into()));
        }
        let event = r.array::<IPC_HANDLE_SIZE>("event handle")?;
        let name_len = usize::from(r.u16("channel name length")?);
        let channel = ShmName::from_bytes(r.take(name_len, "channel name")?)
            .map_err(|e| bad(format!("channel name: {e}")))?;
        let batch_len = r.u32("batch length")? as usize;
        let batch = BatchHandle::decode(r.take(batch_len, "batch")?)?;
        let mut metas = Vec::with_capacity(batch.views().len());
        for view in batch.views() {
            let what = || format!("tensor {:?}", view.name);
            let dtype = r.u8("element type")?;
            let dtype = DType::from_code(dtype)
                .ok_or_else(|| bad(format!("{}: unknown element type code {dtype}", what())))?;
            let dims = usize::from(r.u8("dimensions")?);
            if dims > MAX_DIMS {
                return Err(bad(format!(
                    "{}: {dims} dimensions (at most {MAX_DIMS})",
                    what()
                )));
            }
            let mut shape = Vec::with_capacity(dims);
            for _ in 0..dims {
                shape.push(r.u64("size")?);
            }
            let mut strides = Vec::with_capacity(dims);
            for _ in 0..dims {
                strides.push(r.u64("stride")?);
            }
            let meta = TensorMeta {
                dtype,
                shape,
                strides,
            };
            if meta.span() > view.len || (meta.span() == u64::MAX) {
                return Err(bad(format!(
                    "{}: {meta} spans {} bytes, past its view of {} bytes",
                    what(),
                    meta.span(),
                    view.len
                )));
            }
            metas.push(meta);
        }
        if r.at != bytes.len() {
            return Err(bad(format!(
                "{} bytes after the last tensor",
                bytes.len() - r.at
            )));
        }
        Ok(Self {
            batch,
            metas,
            channel,
            event: EventHandle(event),
        })
    }
}
