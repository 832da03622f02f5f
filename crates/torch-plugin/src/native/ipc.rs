//! CUDA IPC for the C++ layer (PyTorch's `shareIpcHandle` and `getIpcDevPtr`), so that
//! `torch.multiprocessing` shares CUDA tensors allocated on tensormem with any PyTorch process, on
//! tensormem or on PyTorch's own allocator, and opens theirs.
//!
//! The handles are PyTorch 2.x's, byte for byte:
//!
//! - `[2]['c']` and the 64-byte `cudaIpcMemHandle_t` of the device allocation holding the memory
//!   ([`HANDLE_LEN`] bytes; the bare 64 bytes older PyTorch sends are read too);
//! - `[2]['e']`, a 24-byte header (producer pid, zero padding, chunk size, number of chunks) and one
//!   `i32` file descriptor per chunk, for memory of an expandable segment
//!   ([`EXPANDABLE_HANDLE_HEADER_LEN`] + 4 bytes a chunk; see [`tensormem::ipc::chunks`]).
//!
//! The memory's offset from the start of what the handle names travels beside it. Since `'e'`
//! handles vary in length, [`tensormem_ipc_share`] takes the caller's buffer capacity and reports the
//! length it needs, as `snprintf` does.
//!
//! A producer shares an expandable segment's memory by exporting each chunk under the block once
//! (`CachingAllocator::shareable_segment`) and offering the descriptors on its descriptor socket, for
//! consumers that may not `pidfd_getfd` it. A consumer takes copies of the descriptors
//! (`pidfd_getfd`, else the producer's socket), maps the chunks into an address range of its own that
//! covers only them, and closes the copies.
//!
//! Under `backend:cudaMallocAsync` both directions are refused with PyTorch's messages
//! ("cudaMallocAsync does not yet support shareIpcHandle", "... getIpcDevPtr"), before any device
//! is touched.
//!
//! A consumer opens what one handle names once per process: handles naming the same memory (the
//! same CUDA handle, or the same producer and chunks, whatever the padding) share the mapping, which
//! is closed when the last user is done ([`tensormem_ipc_close`]; chunk mappings are unmapped and
//! their address range freed after the device has finished its queued work, as PyTorch does). No
//! mapping is kept without a user.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;
use tensormem::cuda::{self, AsyncUnsupported};
use tensormem::ipc::driver::cuda::CudaIpcDriver;
use tensormem::ipc::{
    chunks, ChunkFdRoutes, ChunkHandle, IpcDriver, MemHandle, SegmentMemory, IPC_HANDLE_SIZE,
};
use tensormem_cuda_alloc::backend::cuda::check;
use tensormem_cuda_alloc::{DeviceAddress, ShareableSegment};
use tensormem_runtime::DeviceMemory;

use super::{owner, status};
use crate::devices;
use crate::error::{Error, Result};

/// `sizeof(cudaIpcMemHandle_t)`.
const CUDA_HANDLE: usize = IPC_HANDLE_SIZE;
/// The length of the handle of memory in a device allocation (type `'c'`) PyTorch's allocator
/// writes.
pub const HANDLE_LEN: usize = 2 + CUDA_HANDLE;
/// The length of the handle of memory in an expandable segment (type `'e'`) before its
/// descriptors, which take 4 bytes each.
pub const EXPANDABLE_HANDLE_HEADER_LEN: usize = 2 + 24;

/// The driver calls that import and unmap chunks, loaded on first use.
fn chunk_driver() -> Result<&'static CudaIpcDriver> {
    static DRIVER: OnceLock<CudaIpcDriver> = OnceLock::new();
    if let Some(driver) = DRIVER.get() {
        return Ok(driver);
    }
    let loaded = CudaIpcDriver::new()?;
    Ok(DRIVER.get_or_init(|| loaded))
}

/// Writes PyTorch's handle of the memory at `ptr` (the start of an allocation of tensormem's) and
/// the memory's offset from the start of what the handle names (PyTorch's `shareIpcHandle`).
///
/// `*len` receives the handle's length: [`HANDLE_LEN`] for memory of a device allocation,
/// [`EXPANDABLE_HANDLE_HEADER_LEN`] + 4 per chunk for memory of an expandable segment. The handle is
/// written to `out` only if it fits in `capacity` bytes; otherwise nothing is written there and the
/// caller calls again with a buffer of `*len` bytes (sharing the same allocation again gives the
/// same handle). `*offset` is written either way.
///
/// # Safety
///
/// `out` is valid for writes of `capacity` bytes (it may be null when `capacity` is 0); `len` and
/// `offset` are valid for one write each.
#[no_mangle]
pub unsafe extern "C" fn tensormem_ipc_share(
    ptr: *mut c_void,
    out: *mut u8,
    capacity: usize,
    len: *mut usize,
    offset: *mut isize,
) -> c_int {
    status("tensormem_ipc_share", || {
        if len.is_null() || offset.is_null() || (out.is_null() && capacity > 0) {
            return Err(Error::NullArgument {
                what: "out, len or offset",
            });
        }
        let (bytes, at) = share(DeviceAddress(ptr as u64))?;
        // SAFETY: `offset` is non-null (checked above) and valid for a write (the caller's
        // obligation).
        unsafe { offset.write(at) };
        // SAFETY: `out` is valid for `capacity` bytes and `len` for a write (the caller's
        // obligation); `len` is non-null and `out` is non-null unless `capacity` is 0 (checked
        // above).
        unsafe { write_handle(&bytes, out, capacity, len) };
        Ok(())
    })
}

/// PyTorch's handle of the memory at `ptr` and the memory's offset in what the handle names.
fn share(ptr: DeviceAddress) -> Result<(Vec<u8>, isize)> {
    cuda::backend_supports(AsyncUnsupported::ShareIpcHandle)?;
    let allocator = owner(ptr)?
        .native(AsyncUnsupported::ShareIpcHandle)
        .map_err(cuda::Error::from)?;
    match allocator.shareable_segment(ptr)? {
        ShareableSegment::Allocation { base, .. } => {
            allocator.device().make_current()?;
            let mut handle = sys::CUipcMemHandle {
                reserved: [0; CUDA_HANDLE],
            };
            // SAFETY: `base` is the start of a live device allocation of this context (the
            // allocator's segment); `handle` is a valid out-parameter.
            check("cuIpcGetMemHandle", unsafe {
                sys::cuIpcGetMemHandle(&mut handle, base.0)
            })?;
            let bytes = MemHandle(handle.reserved.map(|b| b as u8))
                .to_torch()
                .to_vec();
            Ok((bytes, (ptr.0 - base.0) as isize))
        }
        ShareableSegment::Chunks(export) => {
            // Consumers that may not pidfd_getfd this process take the descriptors from its socket.
            chunks::offer(&export.fds);
            let at = (ptr.0 - export.base.0) as isize;
            let handle = ChunkHandle {
                pid: std::process::id(),
                chunk_size: export.chunk_size,
                fds: export.fds,
            };
            Ok((handle.to_torch(), at))
        }
    }
}

/// Copies `bytes` to `out` if they fit in `capacity` bytes, and writes their length to `*len`
/// either way.
///
/// # Safety
///
/// `len` is valid for a write; `out` for writes of `capacity` bytes (not used when `capacity` is
/// smaller than `bytes`).
unsafe fn write_handle(bytes: &[u8], out: *mut u8, capacity: usize, len: *mut usize) {
    if bytes.len() <= capacity {
        // SAFETY: `out` is valid for `capacity >= bytes.len()` bytes (the caller's obligation) and
        // cannot overlap a Rust-owned vector.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, bytes.len()) };
    }
    // SAFETY: valid for a write (the caller's obligation).
    unsafe { len.write(bytes.len()) };
}

/// What this process opened, by what the handle names: the mapping and its users.
static OPENED: Mutex<Option<HashMap<SegmentMemory, Opened>>> = Mutex::new(None);

#[derive(Clone, Copy, Debug)]
struct Opened {
    /// The start of the mapping (what `getIpcDevPtr` returns; PyTorch adds the offset).
    ptr: u64,
    /// Opens not closed yet.
    users: usize,
    /// How to close it.
    mapping: Mapping,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mapping {
    /// `cuIpcOpenMemHandle`; closed with `cuIpcCloseMemHandle`.
    Allocation,
    /// Chunks imported into a range of `size` bytes reserved on `device`; closed with `cuMemUnmap`
    /// and `cuMemAddressFree`.
    Chunks { device: u32, size: usize },
}

/// Opens the memory a handle from [`tensormem_ipc_share`] (or from PyTorch) names on `device`, into
/// `*out` (the start of what the handle names; PyTorch adds the offset). Each open is closed with
/// [`tensormem_ipc_close`]; memory already open in this process is shared.
///
/// Memory of an expandable segment is opened with copies of the producer's descriptors, taken with
/// `pidfd_getfd` (which needs permission to ptrace the producer, as in PyTorch) or, from a tensormem
/// producer, from its descriptor socket; the error says what each way answered.
///
/// # Safety
///
/// `handle` is valid for reads of `len` bytes; `out` for a write of one pointer.
#[no_mangle]
pub unsafe extern "C" fn tensormem_ipc_open(
    handle: *const u8,
    len: usize,
    device: c_int,
    out: *mut *mut c_void,
) -> c_int {
    status("tensormem_ipc_open", || {
        cuda::backend_supports(AsyncUnsupported::GetIpcDevPtr)?;
        if handle.is_null() || out.is_null() {
            return Err(Error::NullArgument {
                what: "handle or out",
            });
        }
        // SAFETY: valid for `len` reads (the caller's obligation), non-null (checked above).
        let key = SegmentMemory::from_torch(unsafe { std::slice::from_raw_parts(handle, len) })?;
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        let table = opened.get_or_insert_with(HashMap::new);
        if let Some(entry) = table.get_mut(&key) {
            entry.users += 1;
            // SAFETY: non-null (checked above), valid for writes.
            unsafe { out.write(entry.ptr as *mut c_void) };
            return Ok(());
        }
        let (ptr, mapping) = match &key {
            SegmentMemory::Allocation(handle) => {
                devices::served(device)?.device().make_current()?;
                let raw = sys::CUipcMemHandle {
                    reserved: handle.0.map(|b| b as _),
                };
                let mut ptr: sys::CUdeviceptr = 0;
                // SAFETY: `ptr` is a valid out-parameter; the driver checks the handle.
                check("cuIpcOpenMemHandle", unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        raw,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                })?;
                (ptr, Mapping::Allocation)
            }
            SegmentMemory::Chunks(chunks) => import(chunks, device)?,
        };
        table.insert(
            key,
            Opened {
                ptr,
                users: 1,
                mapping,
            },
        );
        // SAFETY: non-null (checked above), valid for writes.
        unsafe { out.write(ptr as *mut c_void) };
        Ok(())
    })
}

/// Maps the chunks `handle` names on `device`: the start of the mapping and how to close it.
fn import(handle: &ChunkHandle, device: c_int) -> Result<(u64, Mapping)> {
    let size = handle
        .chunk_size
        .checked_mul(handle.fds.len() as u64)
        .and_then(|size| usize::try_from(size).ok())
        .ok_or_else(|| {
            Error::IpcHandle(format!(
                "the handle names {} chunks of {} bytes, more than an address space holds: it is \
                 not one PyTorch or tensormem wrote",
                handle.fds.len(),
                handle.chunk_size
            ))
        })?;
    let (fds, route) = handle.take_descriptors(ChunkFdRoutes::Auto)?;
    let device = devices::served(device)?.device().ordinal();
    let base = chunk_driver()?.import_chunks(device, handle.chunk_size as usize, &fds)?;
    tracing::debug!(
        producer = handle.pid,
        chunks = fds.len(),
        ?route,
        ptr = %base,
        "opened the chunks of an expandable segment"
    );
    Ok((base.0, Mapping::Chunks { device, size }))
}

/// One user of memory opened by [`tensormem_ipc_open`] is done; the last closes the mapping.
#[no_mangle]
pub extern "C" fn tensormem_ipc_close(ptr: *mut c_void) -> c_int {
    status("tensormem_ipc_close", || {
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        let table = opened.get_or_insert_with(HashMap::new);
        let Some((key, entry)) = table.iter_mut().find(|(_, e)| e.ptr == ptr as u64) else {
            return Err(Error::UnknownPointer { ptr: ptr as u64 });
        };
        entry.users -= 1;
        if entry.users > 0 {
            return Ok(());
        }
        let key = key.clone();
        let Some(closed) = table.remove(&key) else {
            return Ok(());
        };
        close(closed)
    })
}

/// Unmaps what one entry of the table mapped (its last user is done).
fn close(closed: Opened) -> Result<()> {
    match closed.mapping {
        Mapping::Allocation => {
            // SAFETY: `ptr` was opened by `cuIpcOpenMemHandle` and has no user left.
            check("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(closed.ptr)
            })?;
            Ok(())
        }
        Mapping::Chunks { device, size } => {
            // Unmapping does not wait for queued work, which may still use the memory.
            // `device` is an ordinal the driver accepted, so it fits a `c_int`.
            devices::served(device as c_int)?.device().make_current()?;
            // SAFETY: the device's context is current; no arguments.
            check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() }).map_err(|e| {
                Error::IpcHandle(format!(
                    "the device failed while closing shared memory at {:#x} ({e}); the mapping \
                     is left in place",
                    closed.ptr
                ))
            })?;
            // SAFETY: the range is exactly one `import_chunks` returned on `device` (kept in the
            // table with its size), removed from the table so closed once, and idle: its last user
            // is done and the device has finished the work queued before.
            unsafe { chunk_driver()?.close_chunks(device, DeviceAddress(closed.ptr), size) }?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks() -> ChunkHandle {
        ChunkHandle {
            pid: 551,
            chunk_size: 20 << 20,
            fds: vec![51, 52],
        }
    }

    #[test]
    fn pytorch_handles_of_both_kinds_are_read() {
        let written = MemHandle([7; CUDA_HANDLE]).to_torch();
        assert_eq!(written.len(), HANDLE_LEN);
        assert_eq!(&written[..2], &[2, b'c']);
        assert_eq!(
            SegmentMemory::from_torch(&written).unwrap(),
            SegmentMemory::Allocation(MemHandle([7; CUDA_HANDLE]))
        );
        assert_eq!(
            SegmentMemory::from_torch(&[9u8; CUDA_HANDLE]).unwrap(),
            SegmentMemory::Allocation(MemHandle([9; CUDA_HANDLE]))
        );
        let expandable = chunks().to_torch();
        assert_eq!(expandable.len(), EXPANDABLE_HANDLE_HEADER_LEN + 4 * 2);
        assert_eq!(
            SegmentMemory::from_torch(&expandable).unwrap(),
            SegmentMemory::Chunks(chunks())
        );
        let err = SegmentMemory::from_torch(&[1, 2, 3])
            .unwrap_err()
            .to_string();
        assert!(err.contains("3 bytes"), "{err}");
    }

    #[test]
    fn handles_of_the_same_chunks_share_one_entry_whatever_their_padding() {
        let mut a = chunks().to_torch();
        let b = chunks().to_torch();
        a[2 + 5] = 0xAB; // PyTorch leaves the header's padding uninitialised
        let (a, b) = (
            SegmentMemory::from_torch(&a).unwrap(),
            SegmentMemory::from_torch(&b).unwrap(),
        );
        let mut table = HashMap::new();
        table.insert(a, 1);
        assert_eq!(table.get(&b), Some(&1));
        let other = ChunkHandle {
            fds: vec![51, 53],
            ..chunks()
        };
        assert!(!table.contains_key(&SegmentMemory::Chunks(other)));
    }

    #[test]
    fn a_short_buffer_gets_the_length_and_no_bytes() {
        let bytes = chunks().to_torch();
        let mut out = [0u8; 8];
        let mut len = 0;
        // SAFETY: `out` holds 8 bytes; `len` is a valid out-parameter.
        unsafe { write_handle(&bytes, out.as_mut_ptr(), out.len(), &mut len) };
        assert_eq!(len, bytes.len());
        assert_eq!(out, [0; 8], "nothing written past a short buffer");
        let mut out = vec![0u8; 64];
        // SAFETY: `out` holds 64 bytes; `len` is a valid out-parameter.
        unsafe { write_handle(&bytes, out.as_mut_ptr(), out.len(), &mut len) };
        assert_eq!(len, bytes.len());
        assert_eq!(&out[..len], &bytes[..]);
        // SAFETY: a null buffer of capacity 0 is only measured.
        unsafe { write_handle(&bytes, std::ptr::null_mut(), 0, &mut len) };
        assert_eq!(len, bytes.len());
    }
}
