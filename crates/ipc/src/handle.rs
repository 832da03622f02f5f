//! [`IpcHandle`]: what a consumer needs to open shared CUDA memory, with a compact versioned binary
//! encoding and a conversion to and from PyTorch's 8-tuple ([`TorchShareTuple`]).
//!
//! # Binary encoding (version 1)
//!
//! All integers little-endian; 174 bytes plus the name.
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `TMIH` |
//! | 4..6 | version (1) |
//! | 6..8 | flags: bit 0 = an event must be waited on |
//! | 8..12 | device ordinal |
//! | 12..20 | size in bytes |
//! | 20..28 | offset in the base allocation |
//! | 28..36 | ref-counter slot |
//! | 36..100 | memory handle of the base allocation |
//! | 100..164 | event handle (zeros when flag 0 is clear) |
//! | 164..172 | producer id (0: unknown) |
//! | 172..174 | length of the ref-counter file name |
//! | 174.. | the name (`/tensormem_...`, valid shm name) |
//!
//! With flag bit 1 the memory is chunks of an expandable segment ([`SegmentMemory::Chunks`]): the
//! 64-byte memory handle is zeros and after the name come the producer's pid (`u32`), the chunk
//! size (`u64`), the number of chunks (`u32`) and one descriptor (`i32`) per chunk.
//!
//! Decoding checks the magic, version, known flags, exact length and the name's validity.
//!
//! # Empty storages
//!
//! A zero-byte storage has no device memory, and PyTorch still shares it: `_share_cuda_` gives
//! `(device, None, 0, 0, None, 0, None, None)`, and the receiving side
//! (`torch.multiprocessing`'s `rebuild_cuda_tensor`) makes a new empty storage on that device. Here
//! that is [`IpcHandle::empty`]: no ref-counter file (`ref_counter` is `None`), size, offset and
//! slot 0, no event, a zeroed memory handle; encoded with a name length of 0.

use tensormem_shm::ShmName;

use crate::chunks::ChunkHandle;
use crate::driver::{EventHandle, MemHandle, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};
pub use crate::segment::SegmentMemory;
use crate::segment::{array, fixed};

const MAGIC: &[u8; 4] = b"TMIH";
/// The encoding version this crate writes and reads.
pub const ENCODING_VERSION: u16 = 1;
const FLAG_EVENT: u16 = 1;
const FLAG_CHUNKS: u16 = 2;
const FIXED_LEN: usize = 174;

/// Everything a consumer needs to open memory another process shared (the content of PyTorch's
/// `_share_cuda_` tuple).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcHandle {
    /// The device ordinal.
    pub device: u32,
    /// What names the segment the memory lies in: the device allocation's IPC handle, or the
    /// expandable segment's chunks under the shared block.
    pub memory: SegmentMemory,
    /// The shared memory's size in bytes.
    pub size: u64,
    /// Where the shared memory starts: in the device allocation, or from the first chunk's start.
    pub offset: u64,
    /// The ref-counter file; `None` only for an [empty](Self::empty) storage's handle, which
    /// names no memory.
    pub ref_counter: Option<ShmName>,
    /// The slot (index of the `int64` counter) in the ref-counter file.
    pub slot: u64,
    /// The event the consumer's stream must wait for before using the memory, if any
    /// (`event_sync_required`).
    pub event: Option<EventHandle>,
    /// A random id of the producer (one per `IpcProducer`), 0 when unknown (PyTorch's tuples). A
    /// consumer keeps the events of a known producer open between shares: that producer reuses
    /// each event only after the share it served was released, and never destroys one while it lives.
    pub producer: u64,
}

impl IpcHandle {
    /// The binary encoding (see the [module docs](self)).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let name = self
            .ref_counter
            .as_ref()
            .map_or(&[][..], |name| name.as_str().as_bytes());
        let mut out = Vec::with_capacity(FIXED_LEN + name.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&ENCODING_VERSION.to_le_bytes());
        let mut flags = if self.event.is_some() { FLAG_EVENT } else { 0 };
        let (mem_handle, chunks) = match &self.memory {
            SegmentMemory::Allocation(handle) => (handle.0, None),
            SegmentMemory::Chunks(chunks) => {
                flags |= FLAG_CHUNKS;
                ([0; IPC_HANDLE_SIZE], Some(chunks))
            }
        };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&mem_handle);
        out.extend_from_slice(&self.event.map_or([0; IPC_HANDLE_SIZE], |e| e.0));
        out.extend_from_slice(&self.producer.to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name);
        if let Some(chunks) = chunks {
            out.extend_from_slice(&chunks.pid.to_le_bytes());
            out.extend_from_slice(&chunks.chunk_size.to_le_bytes());
            out.extend_from_slice(&(chunks.fds.len() as u32).to_le_bytes());
            for fd in &chunks.fds {
                out.extend_from_slice(&fd.to_le_bytes());
            }
        }
        out
    }

    /// Decodes [`encode`](Self::encode)'s bytes.
    ///
    /// # Errors
    ///
    /// [`Error::MalformedHandle`] for a wrong magic, an unknown version or flag, a length that does not
    /// match, or an invalid file name.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |problem: String| Error::MalformedHandle { problem };
        if bytes.len() < FIXED_LEN {
            return Err(bad(format!(
                "{} bytes, shorter than the {FIXED_LEN}-byte fixed part",
                bytes.len()
            )));
        }
        if &bytes[..4] != MAGIC {
            return Err(bad("wrong magic (not an IPC handle)".into()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(array(&bytes[i..i + 4]));
        let u64_at = |i: usize| u64::from_le_bytes(array(&bytes[i..i + 8]));
        let version = u16_at(4);
        if version != ENCODING_VERSION {
            return Err(bad(format!(
                "encoding version {version}, this build reads version {ENCODING_VERSION}; use the \
                 same tensormem-ipc version on both sides"
            )));
        }
        let flags = u16_at(6);
        if flags & !(FLAG_EVENT | FLAG_CHUNKS) != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let name_len = usize::from(u16_at(172));
        let name_end = FIXED_LEN + name_len;
        let memory = if flags & FLAG_CHUNKS == 0 {
            if bytes.len() != name_end {
                return Err(bad(format!(
                    "{} bytes, but the header says {name_end}",
                    bytes.len()
                )));
            }
            SegmentMemory::Allocation(MemHandle(array(&bytes[36..100])))
        } else {
            let chunks = decode_chunks(bytes, name_end).map_err(bad)?;
            if bytes[36..100].iter().any(|&b| b != 0) {
                return Err(bad("chunks and a memory handle both set".into()));
            }
            SegmentMemory::Chunks(chunks)
        };
        let handle = Self {
            device: u32_at(8),
            size: u64_at(12),
            offset: u64_at(20),
            slot: u64_at(28),
            memory,
            event: (flags & FLAG_EVENT != 0).then(|| EventHandle(array(&bytes[100..164]))),
            producer: u64_at(164),
            ref_counter: None,
        };
        if name_len == 0 {
            // An empty storage's handle: nothing else may be set.
            let empty = Self {
                producer: handle.producer,
                ..Self::empty(handle.device)
            };
            if handle != empty {
                return Err(bad(
                    "no ref-counter file name, but the handle is not an empty storage's (size, \
                     offset, slot, memory or event handle set)"
                        .into(),
                ));
            }
            return Ok(handle);
        }
        let ref_counter = ShmName::from_bytes(&bytes[FIXED_LEN..name_end])
            .map_err(|e| bad(format!("ref-counter file name: {e}")))?;
        Ok(Self {
            ref_counter: Some(ref_counter),
            ..handle
        })
    }

    /// The handle of an empty (zero-byte) storage on `device`: no memory, no ref-counter slot, no
    /// event (PyTorch's `_share_cuda_` of an empty storage, `(device, None, 0, 0, None, 0, None,
    /// None)`). Opening it maps nothing: the receiver makes an empty storage of the device.
    #[must_use]
    pub fn empty(device: u32) -> Self {
        Self {
            device,
            memory: SegmentMemory::Allocation(MemHandle([0; IPC_HANDLE_SIZE])),
            size: 0,
            offset: 0,
            ref_counter: None,
            slot: 0,
            event: None,
            producer: 0,
        }
    }

    /// Whether this is an [empty](Self::empty) storage's handle (it names no memory).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ref_counter.is_none()
    }

    /// The same content as PyTorch's `_share_cuda_` tuple. An [empty](Self::empty) storage's handle
    /// gives PyTorch's tuple of an empty storage (see [`TorchShareTuple::is_empty`]).
    #[must_use]
    pub fn to_torch(&self) -> TorchShareTuple {
        let Some(ref_counter) = &self.ref_counter else {
            return TorchShareTuple::empty(i64::from(self.device));
        };
        TorchShareTuple {
            device: i64::from(self.device),
            handle: self.memory.to_torch(),
            size: self.size,
            offset: self.offset,
            ref_counter: ref_counter.as_str().as_bytes().to_vec(),
            ref_counter_offset: self.slot,
            event_handle: self.event.map_or([0; IPC_HANDLE_SIZE], |e| e.0).to_vec(),
            event_sync_required: self.event.is_some(),
        }
    }

    /// A handle from PyTorch's tuple, every field checked.
    ///
    /// # Errors
    ///
    /// The memory handle may be the raw 64-byte CUDA handle (PyTorch 1.x, and what
    /// [`to_torch`](Self::to_torch) sends, which PyTorch 2.x accepts) or PyTorch 2.x's 66-byte
    /// versioned one (version byte, type `'c'`, the CUDA handle).
    ///
    /// # Errors
    ///
    /// A tuple of an empty storage (no memory handle, see [`TorchShareTuple::is_empty`]) gives
    /// [`IpcHandle::empty`].
    ///
    /// [`Error::HandleLength`] for a memory handle of another length (or a required event handle
    /// that is not 64 bytes); [`Error::InvalidTuple`] for an expandable segment's handle that does
    /// not add up ([`ChunkHandle::from_torch`]), a fabric handle, an unknown handle type, a
    /// negative or too large device, an invalid file name, or no memory handle with a size other
    /// than 0.
    pub fn from_torch(tuple: &TorchShareTuple) -> Result<Self> {
        let device = u32::try_from(tuple.device).map_err(|_| Error::InvalidTuple {
            problem: format!("device {} is not a device ordinal", tuple.device),
        })?;
        if tuple.handle.is_empty() {
            if tuple.size != 0 {
                return Err(Error::InvalidTuple {
                    problem: format!(
                        "no memory handle (an empty storage's tuple) but a size of {} bytes",
                        tuple.size
                    ),
                });
            }
            return Ok(Self::empty(device));
        }
        let memory = SegmentMemory::from_torch(&tuple.handle)?;
        let event = if tuple.event_sync_required {
            Some(EventHandle(fixed("event_handle", &tuple.event_handle)?))
        } else {
            None
        };
        let ref_counter =
            ShmName::from_bytes(&tuple.ref_counter).map_err(|e| Error::InvalidTuple {
                problem: format!("ref_counter: {e}"),
            })?;
        Ok(Self {
            device,
            memory,
            size: tuple.size,
            offset: tuple.offset,
            ref_counter: Some(ref_counter),
            slot: tuple.ref_counter_offset,
            event,
            producer: 0,
        })
    }
}

/// The chunk part after the name (see the [module docs](self)), which must end the bytes.
fn decode_chunks(bytes: &[u8], from: usize) -> std::result::Result<ChunkHandle, String> {
    let rest = bytes.get(from..).unwrap_or_default();
    if rest.len() < 16 {
        return Err(format!(
            "{} bytes of chunks, shorter than their 16-byte header",
            rest.len()
        ));
    }
    let pid = u32::from_le_bytes(array(&rest[..4]));
    let chunk_size = u64::from_le_bytes(array(&rest[4..12]));
    let count = u32::from_le_bytes(array(&rest[12..16])) as usize;
    if rest.len() - 16 != count.saturating_mul(4) {
        return Err(format!(
            "{count} chunks in {} bytes (4 bytes each)",
            rest.len() - 16
        ));
    }
    let chunks = ChunkHandle {
        pid,
        chunk_size,
        fds: rest[16..]
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(array(b)))
            .collect(),
    };
    match chunks.problem() {
        Some(problem) => Err(problem),
        None => Ok(chunks),
    }
}

/// PyTorch's `_share_cuda_()` tuple, field for field: `(device, handle, size_bytes, offset_bytes,
/// ref_counter, ref_counter_offset, event_handle, event_sync_required)`, what
/// `torch.UntypedStorage._new_shared_cuda(*tuple)` takes.
///
/// An empty storage's tuple has `None` for `handle`, `ref_counter`, `event_handle` and
/// `event_sync_required`: here empty byte strings and `false` ([`TorchShareTuple::empty`],
/// [`TorchShareTuple::is_empty`]). PyTorch rebuilds it as a new empty storage of the device
/// (`rebuild_cuda_tensor`), not with `_new_shared_cuda`, which takes bytes only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchShareTuple {
    /// `device`: the device ordinal.
    pub device: i64,
    /// `handle`: the 64-byte `cudaIpcMemHandle_t` of the base allocation.
    pub handle: Vec<u8>,
    /// `size_bytes`: the storage's size.
    pub size: u64,
    /// `offset_bytes`: the storage's offset in the base allocation.
    pub offset: u64,
    /// `ref_counter`: the ref-counter file name, as bytes.
    pub ref_counter: Vec<u8>,
    /// `ref_counter_offset`: the slot in the file.
    pub ref_counter_offset: u64,
    /// `event_handle`: the 64-byte `cudaIpcEventHandle_t` (meaningless when not required).
    pub event_handle: Vec<u8>,
    /// `event_sync_required`: whether the consumer must wait for the event.
    pub event_sync_required: bool,
}

impl TorchShareTuple {
    /// PyTorch's tuple of an empty storage on `device`: `(device, None, 0, 0, None, 0, None, None)`.
    #[must_use]
    pub fn empty(device: i64) -> Self {
        Self {
            device,
            handle: Vec::new(),
            size: 0,
            offset: 0,
            ref_counter: Vec::new(),
            ref_counter_offset: 0,
            event_handle: Vec::new(),
            event_sync_required: false,
        }
    }

    /// Whether this is an empty storage's tuple: no memory handle (PyTorch's `None`).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.handle.is_empty()
    }

    /// One line of text, fields separated by spaces, bytes in hex (`-` for an empty string,
    /// PyTorch's `None` in an empty storage's tuple), the flag as `0`/`1`: what the interop scripts
    /// exchange (`bytes.fromhex` on the Python side).
    #[must_use]
    pub fn to_line(&self) -> String {
        format!(
            "{} {} {} {} {} {} {} {}",
            self.device,
            to_hex(&self.handle),
            self.size,
            self.offset,
            to_hex(&self.ref_counter),
            self.ref_counter_offset,
            to_hex(&self.event_handle),
            u8::from(self.event_sync_required)
        )
    }

    /// Parses [`to_line`](Self::to_line)'s format.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidTuple`] naming the field that does not parse.
    pub fn from_line(line: &str) -> Result<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let bad = |problem: String| Error::InvalidTuple { problem };
        if fields.len() != 8 {
            return Err(bad(format!("{} fields, expected 8", fields.len())));
        }
        let int = |i: usize, name: &str| {
            fields[i]
                .parse::<u64>()
                .map_err(|e| bad(format!("{name} {:?}: {e}", fields[i])))
        };
        Ok(Self {
            device: fields[0]
                .parse()
                .map_err(|e| bad(format!("device {:?}: {e}", fields[0])))?,
            handle: from_hex(fields[1]).ok_or_else(|| bad("handle is not hex".into()))?,
            size: int(2, "size")?,
            offset: int(3, "offset")?,
            ref_counter: from_hex(fields[4]).ok_or_else(|| bad("ref_counter is not hex".into()))?,
            ref_counter_offset: int(5, "ref_counter_offset")?,
            event_handle: from_hex(fields[6])
                .ok_or_else(|| bad("event_handle is not hex".into()))?,
            event_sync_required: match fields[7] {
                "0" => false,
                "1" => true,
                other => return Err(bad(format!("event_sync_required {other:?}"))),
            },
        })
    }
}

fn to_hex(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "-".into();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(text: &str) -> Option<Vec<u8>> {
    if text == "-" {
        return Some(Vec::new());
    }
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(event: bool) -> IpcHandle {
        IpcHandle {
            device: 3,
            memory: SegmentMemory::Allocation(MemHandle([7; 64])),
            size: 4096,
            offset: 512,
            ref_counter: Some(ShmName::new("/tensormem_1_2_3").unwrap()),
            slot: 9999,
            event: event.then_some(EventHandle([9; 64])),
            producer: 0,
        }
    }

    #[test]
    fn encoding_round_trips_and_checks_every_field() {
        for event in [false, true] {
            let h = IpcHandle {
                producer: 0x1234_5678_9abc,
                ..sample(event)
            };
            let bytes = h.encode();
            assert_eq!(bytes.len(), FIXED_LEN + "/tensormem_1_2_3".len());
            assert_eq!(IpcHandle::decode(&bytes).unwrap(), h);
        }
        let bytes = sample(true).encode();
        for cut in [0, 10, FIXED_LEN - 1, bytes.len() - 1] {
            assert!(matches!(
                IpcHandle::decode(&bytes[..cut]),
                Err(Error::MalformedHandle { .. })
            ));
        }
        let mut longer = bytes.clone();
        longer.push(b'x');
        assert!(IpcHandle::decode(&longer).is_err());
        let mut wrong = bytes.clone();
        wrong[0] = b'X';
        assert!(IpcHandle::decode(&wrong).is_err());
        let mut version = bytes.clone();
        version[4] = 2;
        let err = IpcHandle::decode(&version).unwrap_err().to_string();
        assert!(err.contains("version 2"), "{err}");
        let mut flags = bytes.clone();
        flags[6] = 0x82;
        assert!(IpcHandle::decode(&flags).is_err());
        let mut name = bytes;
        let at = FIXED_LEN + 5;
        name[at] = b'/';
        assert!(IpcHandle::decode(&name).is_err());
    }

    #[test]
    fn torch_tuple_round_trips_and_checks_lengths() {
        for event in [false, true] {
            let h = sample(event);
            let t = h.to_torch();
            assert_eq!(t.handle.len(), 64);
            assert_eq!(t.event_handle.len(), 64);
            assert_eq!(t.event_sync_required, event);
            assert_eq!(IpcHandle::from_torch(&t).unwrap(), h);
            assert_eq!(TorchShareTuple::from_line(&t.to_line()).unwrap(), t);
        }
        let mut t = sample(true).to_torch();
        t.handle.pop();
        assert!(matches!(
            IpcHandle::from_torch(&t),
            Err(Error::HandleLength {
                field: "handle",
                len: 63,
                ..
            })
        ));
        let mut t = sample(true).to_torch();
        t.event_handle.push(0);
        assert!(matches!(
            IpcHandle::from_torch(&t),
            Err(Error::HandleLength {
                field: "event_handle",
                len: 65,
                ..
            })
        ));
        // PyTorch 2.x's versioned handle: version, 'c', the CUDA handle.
        let mut t = sample(true).to_torch();
        t.handle = [&[2u8, b'c'][..], &[7u8; 64][..]].concat();
        assert_eq!(IpcHandle::from_torch(&t).unwrap(), sample(true));
        // 'e' with garbage after it: a hostile expandable segment's handle, refused.
        t.handle[1] = b'e';
        assert!(matches!(
            IpcHandle::from_torch(&t),
            Err(Error::InvalidTuple { .. })
        ));
        // A real expandable segment's handle round-trips, through PyTorch's tuple and the
        // binary encoding.
        let chunks = IpcHandle {
            memory: SegmentMemory::Chunks(ChunkHandle {
                pid: 4242,
                chunk_size: 20 << 20,
                fds: vec![33, 34, 35],
            }),
            offset: 1049088,
            ..sample(true)
        };
        assert_eq!(IpcHandle::from_torch(&chunks.to_torch()).unwrap(), chunks);
        assert_eq!(IpcHandle::decode(&chunks.encode()).unwrap(), chunks);
        let mut t = sample(true).to_torch();
        t.handle = [&[2u8, b'e'][..], &[7u8; 64][..]].concat();
        t.handle[1] = b'x';
        assert!(matches!(
            IpcHandle::from_torch(&t),
            Err(Error::InvalidTuple { .. })
        ));
        t.handle.push(0);
        assert!(matches!(
            IpcHandle::from_torch(&t),
            Err(Error::HandleLength { len: 67, .. })
        ));
        // The versioned form PyTorch's allocator writes, read back; a later version byte too.
        let written = MemHandle([7; 64]).to_torch();
        assert_eq!(&written[..2], &[2, b'c']);
        assert_eq!(MemHandle::from_torch(&written).unwrap(), MemHandle([7; 64]));
        let mut later = written;
        later[0] = 3;
        assert_eq!(MemHandle::from_torch(&later).unwrap(), MemHandle([7; 64]));
        // Not required: PyTorch's event bytes are then meaningless and not checked.
        let mut t = sample(false).to_torch();
        t.event_handle.clear();
        assert!(IpcHandle::from_torch(&t).is_ok());
        let mut t = sample(false).to_torch();
        t.device = -1;
        assert!(matches!(
            IpcHandle::from_torch(&t),
            Err(Error::InvalidTuple { .. })
        ));
        let mut t = sample(false).to_torch();
        t.ref_counter = b"no-slash".to_vec();
        assert!(matches!(
            IpcHandle::from_torch(&t),
            Err(Error::InvalidTuple { .. })
        ));
        assert!(TorchShareTuple::from_line("1 2 3").is_err());
        assert!(
            TorchShareTuple::from_line(&sample(true).to_torch().to_line().replace(" 1", " 2"))
                .is_err()
        );
    }

    #[test]
    fn empty_storage_handles_round_trip_as_pytorch_sends_them() {
        let empty = IpcHandle::empty(2);
        assert!(empty.is_empty());
        assert!(!sample(false).is_empty());
        let bytes = empty.encode();
        assert_eq!(bytes.len(), FIXED_LEN);
        assert_eq!(IpcHandle::decode(&bytes).unwrap(), empty);
        // PyTorch's `(device, None, 0, 0, None, 0, None, None)`.
        let t = empty.to_torch();
        assert_eq!(t, TorchShareTuple::empty(2));
        assert!(t.is_empty() && t.handle.is_empty() && t.ref_counter.is_empty());
        assert!(t.event_handle.is_empty() && !t.event_sync_required);
        assert_eq!((t.size, t.offset, t.ref_counter_offset), (0, 0, 0));
        assert_eq!(IpcHandle::from_torch(&t).unwrap(), empty);
        assert_eq!(t.to_line(), "2 - 0 0 - 0 - 0");
        assert_eq!(TorchShareTuple::from_line(&t.to_line()).unwrap(), t);
        // No memory handle but a size: not an empty storage's tuple.
        let sized = TorchShareTuple {
            size: 1000,
            ..TorchShareTuple::empty(0)
        };
        let err = IpcHandle::from_torch(&sized).unwrap_err().to_string();
        assert!(err.contains("1000 bytes"), "{err}");
        // No name but fields set: malformed.
        for bad in [
            IpcHandle {
                size: 1,
                ..IpcHandle::empty(0)
            },
            IpcHandle {
                slot: 3,
                ..IpcHandle::empty(0)
            },
            IpcHandle {
                event: Some(EventHandle([1; 64])),
                ..IpcHandle::empty(0)
            },
        ] {
            assert!(matches!(
                IpcHandle::decode(&bad.encode()),
                Err(Error::MalformedHandle { .. })
            ));
        }
    }

    #[test]
    fn chunks_whose_extent_overflows_are_refused_not_multiplied() {
        // A positive multiple of 2 MiB whose extent over two chunks passes 2^64.
        let huge = ChunkHandle {
            pid: 7,
            chunk_size: u64::MAX - (2 << 20) + 1,
            fds: vec![3, 4],
        };
        assert_eq!(huge.extent(), u64::MAX, "saturates");
        let h = IpcHandle {
            memory: SegmentMemory::Chunks(huge.clone()),
            ..sample(true)
        };
        let err = IpcHandle::decode(&h.encode()).unwrap_err().to_string();
        assert!(err.contains("more than 2^64"), "{err}");
        let err = IpcHandle::from_torch(&h.to_torch())
            .unwrap_err()
            .to_string();
        assert!(err.contains("more than 2^64"), "{err}");
        // Built in code and opened: refused before any descriptor is taken.
        let driver = std::sync::Arc::new(crate::driver::fake::FakeDriver::default());
        let opened = crate::opened::OpenedBase::open(
            &driver,
            0,
            &SegmentMemory::Chunks(huge),
            crate::ChunkFdRoutes::Auto,
            std::time::Duration::from_millis(10),
        );
        assert!(matches!(opened, Err(Error::InvalidTuple { .. })));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = IpcHandle::decode(&bytes);
        }

        #[test]
        fn any_handle_round_trips(device in any::<u32>(), size in any::<u64>(), offset in any::<u64>(),
                                  slot in any::<u64>(), mem in any::<[u8; 32]>(), event in any::<bool>()) {
            let mut m = [0u8; 64];
            m[..32].copy_from_slice(&mem);
            let h = IpcHandle {
                device, size, offset, slot,
                memory: SegmentMemory::Allocation(MemHandle(m)),
                ref_counter: Some(ShmName::new("/tensormem_5_6_7").unwrap()),
                event: event.then_some(EventHandle(m)),
                producer: slot ^ size,
            };
            prop_assert_eq!(IpcHandle::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn any_chunk_handle_round_trips(pid in any::<u32>(), granules in 1u64..1000,
                                        fds in proptest::collection::vec(0i32..i32::MAX, 1..50)) {
            let h = IpcHandle {
                memory: SegmentMemory::Chunks(ChunkHandle { pid, chunk_size: granules << 21, fds }),
                ..sample(true)
            };
            prop_assert_eq!(IpcHandle::decode(&h.encode()).unwrap(), h.clone());
            if pid <= i32::MAX as u32 {
                prop_assert_eq!(IpcHandle::from_torch(&h.to_torch()).unwrap(), h);
            }
        }
    }
}
