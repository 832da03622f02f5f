//! CUDA IPC for the C++ layer (PyTorch's `shareIpcHandle` and `getIpcDevPtr`), so that
//! `torch.multiprocessing` shares CUDA tensors allocated on tensormem with any PyTorch process, on
//! tensormem or on PyTorch's own allocator, and opens theirs.
//!
//! The handle is PyTorch 2.x's: a version byte (2), the type byte `'c'` (memory from a device
//! allocation) and the 64-byte `cudaIpcMemHandle_t` of the segment holding the memory; the memory's
//! offset in the segment travels beside it (written and read by `tensormem_ipc::MemHandle`, as for
//! PyTorch's tuples in tensormem-ipc; later version bytes are read too). A consumer opens each segment once per process: handles of
//! one segment share the mapping, which is closed when the last user is done
//! ([`tensormem_ipc_close`]).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use cudarc::driver::sys;
use tensormem::ipc::{MemHandle, IPC_HANDLE_SIZE};
use tensormem_cuda_alloc::{DeviceAddress, DeviceError, Error as AllocError};

use super::status;
use crate::allocate::owner;
use crate::devices;
use crate::error::{Error, Result};

/// `sizeof(cudaIpcMemHandle_t)`.
const CUDA_HANDLE: usize = IPC_HANDLE_SIZE;
/// The length of the versioned handle PyTorch's allocator writes.
pub const HANDLE_LEN: usize = 2 + CUDA_HANDLE;

fn driver(call: &'static str, result: sys::CUresult) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Driver {
            call,
            code: result as i32,
            message: format!("{result:?}"),
        }
        .into())
    }
}

/// Writes the handle of the memory at `ptr` into `out` (`HANDLE_LEN` bytes) and its offset in its
/// segment into `*offset` (PyTorch's `shareIpcHandle`).
///
/// Memory of expandable segments cannot be shared this way yet: the error says so.
///
/// # Safety
///
/// `out` is valid for writes of 66 bytes and `offset` for one `ptrdiff_t`.
#[no_mangle]
pub unsafe extern "C" fn tensormem_ipc_share(
    ptr: *mut c_void,
    out: *mut u8,
    offset: *mut isize,
) -> c_int {
    status("tensormem_ipc_share", || {
        if out.is_null() || offset.is_null() {
            return Err(Error::NullArgument {
                what: "out or offset",
            });
        }
        let ptr = DeviceAddress(ptr as u64);
        let allocator = owner(ptr)?;
        let (base, _) = allocator.base_allocation(ptr).map_err(|e| match e {
            AllocError::ExpandableNotShareable { .. } => Error::IpcHandle(format!(
                "memory at {:#x} is in an expandable segment, which tensormem cannot share through \
                 CUDA IPC yet; run the producer without expandable_segments:True",
                ptr.0
            )),
            other => other.into(),
        })?;
        allocator.device().make_current()?;
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; CUDA_HANDLE],
        };
        // SAFETY: `base` is the start of a live device allocation of this context (the allocator's
        // segment); `handle` is a valid out-parameter.
        driver("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base.0)
        })?;
        let bytes = MemHandle(handle.reserved.map(|b| b as u8)).to_torch();
        // SAFETY: `out` is valid for `HANDLE_LEN` bytes and `offset` for one write (the caller's
        // obligation), both non-null (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, HANDLE_LEN);
            offset.write((ptr.0 - base.0) as isize);
        }
        Ok(())
    })
}

/// Segments this process opened: by CUDA handle, the mapping and its users.
static OPENED: Mutex<Option<HashMap<[u8; CUDA_HANDLE], Opened>>> = Mutex::new(None);

#[derive(Clone, Copy, Debug)]
struct Opened {
    ptr: u64,
    users: usize,
}

/// Opens the memory a handle from [`tensormem_ipc_share`] (or from PyTorch) names on `device`, into
/// `*out` (the segment's start; PyTorch adds the offset). Each open is closed with
/// [`tensormem_ipc_close`]; a segment already open in this process is shared.
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
        if handle.is_null() || out.is_null() {
            return Err(Error::NullArgument {
                what: "handle or out",
            });
        }
        // SAFETY: valid for `len` reads (the caller's obligation), non-null (checked above).
        let key = MemHandle::from_torch(unsafe { std::slice::from_raw_parts(handle, len) })?.0;
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        let table = opened.get_or_insert_with(HashMap::new);
        if let Some(entry) = table.get_mut(&key) {
            entry.users += 1;
            // SAFETY: non-null (checked above), valid for writes.
            unsafe { out.write(entry.ptr as *mut c_void) };
            return Ok(());
        }
        devices::allocator(device)?.device().make_current()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; CUDA_HANDLE],
        };
        for (slot, &b) in raw.reserved.iter_mut().zip(&key) {
            *slot = b as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-parameter; the driver checks the handle.
        driver("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        table.insert(key, Opened { ptr, users: 1 });
        // SAFETY: non-null (checked above), valid for writes.
        unsafe { out.write(ptr as *mut c_void) };
        Ok(())
    })
}

/// One user of memory opened by [`tensormem_ipc_open`] is done; the last closes the mapping.
#[no_mangle]
pub extern "C" fn tensormem_ipc_close(ptr: *mut c_void) -> c_int {
    status("tensormem_ipc_close", || {
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        let table = opened.get_or_insert_with(HashMap::new);
        let Some((&key, entry)) = table.iter_mut().find(|(_, e)| e.ptr == ptr as u64) else {
            return Err(Error::UnknownPointer { ptr: ptr as u64 });
        };
        entry.users -= 1;
        if entry.users == 0 {
            let ptr = entry.ptr;
            table.remove(&key);
            // SAFETY: `ptr` was opened by `cuIpcOpenMemHandle` and has no user left.
            driver("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(ptr)
            })?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opened(bytes: &[u8]) -> Result<[u8; CUDA_HANDLE]> {
        Ok(MemHandle::from_torch(bytes)?.0)
    }

    #[test]
    fn pytorch_handles_are_read_and_others_refused() {
        let written = MemHandle([7; CUDA_HANDLE]).to_torch();
        assert_eq!(written.len(), HANDLE_LEN);
        assert_eq!(&written[..2], &[2, b'c']);
        assert_eq!(opened(&written).unwrap(), [7u8; CUDA_HANDLE]);
        assert_eq!(opened(&[9u8; CUDA_HANDLE]).unwrap(), [9u8; CUDA_HANDLE]);
        let mut expandable = written;
        expandable[1] = b'e';
        let err = opened(&expandable).unwrap_err().to_string();
        assert!(err.contains("expandable"), "{err}");
        let err = opened(&[1, 2, 3]).unwrap_err().to_string();
        assert!(err.contains("3 bytes"), "{err}");
    }
}
