//! The memory under a publication's tensors, found by address: the device allocation each lies in
//! (`cuMemGetAddressRange`, its CUDA IPC memory handle), or, for memory of the virtual memory
//! management calls (an expandable segment's chunks, `cuMemCreate` + `cuMemMap`), the chunks it
//! spans, each exported once as a file descriptor the publication keeps open.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use tensormem_cuda_alloc::{Device, DeviceAddress};

use super::meta::{PublishedTensor, TensorMeta};
use crate::batch::{BatchView, CheckedBatch, SegmentTable};
use crate::chunks::ChunkHandle;
use crate::driver::{IpcDriver, MemHandle};
use crate::error::{Error, Result};
use crate::handle::SegmentMemory;
use crate::opened::check_shareable;
use crate::producer::IpcProducer;

/// What [`find`] found: the batch every message of the publication carries, each tensor's layout,
/// and the descriptors of the chunks it names (open while the publication lives).
pub(super) struct PublishedMemory {
    pub(super) checked: CheckedBatch,
    pub(super) metas: Vec<TensorMeta>,
    pub(super) chunk_fds: Vec<OwnedFd>,
    /// Segments that are ranges of chunks.
    pub(super) chunk_segments: usize,
}

/// What the memory at a mapping's start was found to be.
#[derive(Clone, Copy)]
enum Kind {
    /// A device allocation, with its memory handle.
    Allocation(MemHandle),
    /// One chunk of virtual-memory-managed memory, its size and descriptor.
    Chunk(usize, RawFd),
}

/// Locates every tensor (see the [module docs](self)) and checks the batch they make.
///
/// # Errors
///
/// [`Error::InvalidBatch`] for a tensor whose layout does not check, that runs past its
/// allocation or past the mapped memory, that spans chunks of different sizes, or that lies in
/// memory with neither a memory handle nor exportable chunks; for no tensor with bytes; for what
/// the batch's checks refuse (names given twice for different bytes, partial overlaps);
/// [`Error::ReceivedMemory`] for memory this process received; [`Error::Driver`] where the
/// driver refuses to say where a tensor lies.
pub(super) fn find<D: Device, B: IpcDriver>(
    producer: &IpcProducer<D, B>,
    device: u32,
    tensors: &[PublishedTensor],
) -> Result<PublishedMemory> {
    let invalid = |problem: String| Error::InvalidBatch { problem };
    let driver = producer.driver_arc();
    let mut table = SegmentTable::default();
    let mut kinds: HashMap<u64, Kind> = HashMap::new();
    let mut chunk_fds = Vec::new();
    // Per tensor: its piece in the table, `None` without bytes.
    let mut pieces = Vec::with_capacity(tensors.len());
    for t in tensors {
        t.meta
            .check()
            .map_err(|p| invalid(format!("tensor {:?}: {p}", t.name)))?;
        let len = t.meta.span();
        if len == 0 {
            pieces.push(None);
            continue;
        }
        check_shareable(device, t.ptr)?;
        let (base, size) = driver.address_range(device, t.ptr)?;
        let kind = match kinds.get(&base.0) {
            Some(&kind) => kind,
            None => {
                let kind = match producer.handle_of(device, base, size) {
                    Ok(handle) => Kind::Allocation(handle),
                    Err(no_handle) => {
                        let exported = driver.export_mapping(device, base).map_err(|err| {
                            invalid(format!(
                                "tensor {:?} lies in memory with neither a CUDA IPC memory handle \
                                 ({no_handle}) nor chunks that can be exported ({err}); publish \
                                 memory of cuMemAlloc, or of cuMemCreate made with the POSIX \
                                 file-descriptor handle type (the expandable segments of \
                                 tensormem's allocator and of PyTorch's are)",
                                t.name
                            ))
                        })?;
                        let (size, fd) = keep(
                            &mut kinds,
                            &mut chunk_fds,
                            exported.base,
                            exported.size,
                            exported.fd,
                        );
                        Kind::Chunk(size, fd)
                    }
                };
                kinds.insert(base.0, kind);
                kind
            }
        };
        let offset = t.ptr.0 - base.0;
        let piece = match kind {
            Kind::Allocation(handle) => {
                if offset.checked_add(len).is_none_or(|end| end > size as u64) {
                    return Err(invalid(format!(
                        "tensor {:?} ({}) spans {len} bytes from offset {offset} of an \
                         allocation of {size} bytes",
                        t.name, t.meta
                    )));
                }
                table.add_allocation(base.0, size as u64, handle)
            }
            Kind::Chunk(chunk_size, fd) => {
                let fds = chunks_under(
                    driver.as_ref(),
                    device,
                    t,
                    (base.0, chunk_size, fd),
                    &mut kinds,
                    &mut chunk_fds,
                )?;
                table.add_chunks(
                    base.0,
                    ChunkHandle {
                        pid: std::process::id(),
                        chunk_size: chunk_size as u64,
                        fds,
                    },
                )
            }
        };
        pieces.push(Some(piece));
    }
    let (segments, placements) = table.finish();
    if segments.is_empty() {
        return Err(invalid(
            "every tensor is empty (no bytes); there is no memory to publish".into(),
        ));
    }
    let chunk_segments = segments
        .iter()
        .filter(|s| matches!(s.memory, SegmentMemory::Chunks(_)))
        .count();
    let views = tensors
        .iter()
        .zip(&pieces)
        .map(|(t, piece)| match piece {
            Some(piece) => {
                let placed = placements[*piece];
                BatchView {
                    name: t.name.clone(),
                    segment: Some(placed.segment),
                    offset: t.ptr.0 - placed.base,
                    len: t.meta.span(),
                }
            }
            None => BatchView {
                name: t.name.clone(),
                segment: None,
                offset: 0,
                len: 0,
            },
        })
        .collect();
    let checked = CheckedBatch::new(segments, views).map_err(invalid)?;
    Ok(PublishedMemory {
        checked,
        metas: tensors.iter().map(|t| t.meta.clone()).collect(),
        chunk_fds,
        chunk_segments,
    })
}

/// Records the chunk of `size` bytes mapped at `base` and keeps its descriptor; its size and
/// descriptor number.
fn keep(
    kinds: &mut HashMap<u64, Kind>,
    fds: &mut Vec<OwnedFd>,
    base: DeviceAddress,
    size: usize,
    fd: OwnedFd,
) -> (usize, RawFd) {
    let raw = fd.as_raw_fd();
    fds.push(fd);
    kinds.insert(base.0, Kind::Chunk(size, raw));
    (size, raw)
}

/// The descriptors of the chunks tensor `t` spans, from the chunk `first` (its start, size and
/// descriptor) on: each next mapping exported once (`export_mapping`), all of one size.
fn chunks_under<B: IpcDriver>(
    driver: &B,
    device: u32,
    t: &PublishedTensor,
    first: (u64, usize, RawFd),
    kinds: &mut HashMap<u64, Kind>,
    fds: &mut Vec<OwnedFd>,
) -> Result<Vec<RawFd>> {
    let invalid = |problem: String| Error::InvalidBatch { problem };
    let (mut at, chunk_size, fd) = first;
    let end = t.ptr.0 + t.meta.span();
    let mut out = vec![fd];
    at += chunk_size as u64;
    while at < end {
        let (size, fd) = match kinds.get(&at) {
            Some(&Kind::Chunk(size, fd)) => (size, fd),
            _ => {
                let exported = driver
                    .export_mapping(device, DeviceAddress(at))
                    .map_err(|err| {
                        invalid(format!(
                            "tensor {:?} ({}) runs past the chunks mapped under it, at {:#x} \
                             ({err})",
                            t.name, t.meta, at
                        ))
                    })?;
                if exported.base.0 != at {
                    return Err(invalid(format!(
                        "tensor {:?}: the mapping after {:#x} starts at {}, not where the one \
                         before ends",
                        t.name, at, exported.base
                    )));
                }
                keep(kinds, fds, exported.base, exported.size, exported.fd)
            }
        };
        if size != chunk_size {
            return Err(invalid(format!(
                "tensor {:?} ({}) spans chunks of {chunk_size} and {size} bytes; the chunks under \
                 one tensor must be of one size",
                t.name, t.meta
            )));
        }
        out.push(fd);
        at += size as u64;
    }
    Ok(out)
}
