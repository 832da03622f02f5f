//! [`SegmentMemory`]: what names the memory another process maps, in every wire format of the
//! crate (single handles, batches, weights messages): a device allocation's CUDA IPC memory handle,
//! or the physical chunks of an expandable segment, and PyTorch's bytes for each.

// TORCH_HANDLE_VERSION: the version byte PyTorch 2.x writes before a handle's type
// (`SHAREABLE_HANDLE_VERSION`; later versions keep the `'c'` payload, so any version is read).
use crate::chunks::{ChunkHandle, TORCH_EXPANDABLE, TORCH_HANDLE_VERSION};
use crate::driver::{MemHandle, IPC_HANDLE_SIZE};
use crate::error::{Error, Result};

/// PyTorch 2.x's versioned memory handle: a version byte, a type byte, then the CUDA handle.
const TORCH_HANDLE_LEN: usize = 2 + IPC_HANDLE_SIZE;
/// The type byte of a `cudaMalloc` allocation's handle (`SHAREABLE_CUDA_MALLOC`).
const TORCH_CUDA_MALLOC: u8 = b'c';

/// What names the memory of a share: a device allocation's CUDA IPC handle, or the chunks of an
/// expandable segment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SegmentMemory {
    /// A device allocation (`cuMemAlloc`), by its CUDA IPC handle (`cuIpcGetMemHandle`; PyTorch's
    /// handle type `'c'`).
    Allocation(MemHandle),
    /// Physical chunks of an expandable segment, by the producer's file descriptors (PyTorch's
    /// handle type `'e'`, see [`crate::chunks`]).
    Chunks(ChunkHandle),
}

impl SegmentMemory {
    /// The memory named by the `handle` bytes of PyTorch's tuple: `'e'` handles of expandable
    /// segments, `'c'` handles, or the bare 64-byte CUDA handle.
    ///
    /// # Errors
    ///
    /// As [`ChunkHandle::from_torch`] and [`MemHandle::from_torch`].
    pub fn from_torch(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != IPC_HANDLE_SIZE && bytes.get(1) == Some(&TORCH_EXPANDABLE) {
            return ChunkHandle::from_torch(bytes).map(Self::Chunks);
        }
        MemHandle::from_torch(bytes).map(Self::Allocation)
    }

    /// The `handle` bytes of PyTorch's tuple: a device allocation's bare 64-byte CUDA handle
    /// (which every PyTorch 2.x accepts), or an expandable segment's `'e'` handle.
    #[must_use]
    pub fn to_torch(&self) -> Vec<u8> {
        match self {
            Self::Allocation(handle) => handle.0.to_vec(),
            Self::Chunks(chunks) => chunks.to_torch(),
        }
    }
}

impl MemHandle {
    /// The CUDA handle inside a memory handle PyTorch sends: its versioned form (a version byte,
    /// the type `'c'`, the 64-byte CUDA handle) or the bare 64 bytes older PyTorch sends.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidTuple`] for an expandable segment's handle (type `'e'`: chunks, which
    /// [`SegmentMemory::from_torch`] reads) or an unknown type; [`Error::HandleLength`] for any
    /// other length.
    pub fn from_torch(bytes: &[u8]) -> Result<Self> {
        Ok(MemHandle(match bytes.len() {
            TORCH_HANDLE_LEN => match bytes[1] {
                TORCH_CUDA_MALLOC => array(&bytes[2..]),
                TORCH_EXPANDABLE => {
                    return Err(Error::InvalidTuple {
                        problem: "the handle is an expandable segment's chunks, not a device \
                                  allocation's; read it with SegmentMemory::from_torch"
                            .into(),
                    })
                }
                other => {
                    return Err(Error::InvalidTuple {
                        problem: format!("unknown handle type {other:#04x} (version {})", bytes[0]),
                    })
                }
            },
            _ => fixed("handle", bytes)?,
        }))
    }

    /// This handle in PyTorch 2.x's versioned form (version 2, type `'c'`, the CUDA handle), what
    /// PyTorch's own allocator returns from `shareIpcHandle`.
    #[must_use]
    pub fn to_torch(&self) -> [u8; TORCH_HANDLE_LEN] {
        let mut out = [0; TORCH_HANDLE_LEN];
        out[0] = TORCH_HANDLE_VERSION;
        out[1] = TORCH_CUDA_MALLOC;
        out[2..].copy_from_slice(&self.0);
        out
    }
}

/// `bytes` (exactly `N` of them) as an array.
pub(crate) fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(bytes);
    out
}

/// `bytes` as a 64-byte CUDA IPC handle, or [`Error::HandleLength`] naming `field`.
pub(crate) fn fixed(field: &'static str, bytes: &[u8]) -> Result<[u8; IPC_HANDLE_SIZE]> {
    if bytes.len() == IPC_HANDLE_SIZE {
        Ok(array(bytes))
    } else {
        Err(Error::HandleLength {
            field,
            len: bytes.len(),
            expected: IPC_HANDLE_SIZE,
        })
    }
}
