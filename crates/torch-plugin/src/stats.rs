//! tensormem's statistics and snapshots for Python, which reads them through `ctypes`: PyTorch's own
//! `torch.cuda.memory_stats()` does not work while a pluggable allocator is current.

use std::ffi::{c_char, c_int, CStr, CString};

use tensormem::cuda;
use tensormem_runtime::DeviceMemory;

use crate::boundary::call;
use crate::devices;
use crate::error::{Error, Result};

/// `device`'s allocator statistics as a JSON object under the flat keys of
/// `torch.cuda.memory_stats()` (`"reserved_bytes.all.peak"`, ...), or null on error (see
/// [`tensormem_last_error`](crate::tensormem_last_error)). Free the string with
/// [`tensormem_string_free`].
#[no_mangle]
pub extern "C" fn tensormem_memory_stats_json(device: c_int) -> *mut c_char {
    call("tensormem_memory_stats_json", std::ptr::null_mut(), || {
        let stats = crate::native::device_stats(device)?.to_flat();
        let json = serde_json::Value::from_iter(
            stats
                .into_iter()
                .map(|(key, value)| (key, serde_json::Value::from(value))),
        );
        Ok(into_c_string(json.to_string()))
    })
}

fn into_c_string(text: String) -> *mut c_char {
    // JSON escapes control characters, so there is no interior NUL; an empty string if there were.
    CString::new(text).unwrap_or_default().into_raw()
}

/// Frees a string returned by the plugin. Null is ignored.
///
/// # Safety
///
/// `text` is null or a string returned by [`tensormem_memory_stats_json`], not freed before.
#[no_mangle]
pub unsafe extern "C" fn tensormem_string_free(text: *mut c_char) {
    if text.is_null() {
        return;
    }
    // SAFETY: `text` came from `CString::into_raw` in this library and is freed once (the caller's
    // obligation); dropping it cannot panic.
    drop(unsafe { CString::from_raw(text) });
}

/// Resets the peaks of `device`'s statistics to their current values
/// (`torch.cuda.reset_peak_memory_stats`; under `backend:cudaMallocAsync` the memory pool's
/// high-water marks). Returns 0, or -1 on error.
#[no_mangle]
pub extern "C" fn tensormem_reset_peak_stats(device: c_int) -> c_int {
    call("tensormem_reset_peak_stats", -1, || {
        devices::served(device)?.reset_peak_stats()?;
        Ok(0)
    })
}

/// Writes a snapshot of every device's allocator to `path` as the pickle
/// `torch.cuda.memory._dump_snapshot` writes (open it with `python -m torch.cuda._memory_viz` or
/// <https://pytorch.org/memory_viz>). Turn history on first with [`tensormem_record_history`] for a
/// trace. Returns 0, or -1 on error.
///
/// # Safety
///
/// `path` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tensormem_dump_snapshot(path: *const c_char) -> c_int {
    call("tensormem_dump_snapshot", -1, || {
        // SAFETY: `path` is null or NUL-terminated (our caller's obligation).
        let path = unsafe { c_path(path) }?;
        cuda::dump_snapshot(path)?;
        Ok(0)
    })
}

/// Starts (`enabled != 0`) or stops recording allocator events, at most `max_entries` per device, for
/// [`tensormem_dump_snapshot`] (`torch.cuda.memory._record_memory_history`). Returns 0, or -1 on error.
#[no_mangle]
pub extern "C" fn tensormem_record_history(enabled: c_int, max_entries: usize) -> c_int {
    call("tensormem_record_history", -1, || {
        crate::native::history(enabled != 0, max_entries)?;
        Ok(0)
    })
}

/// The path `path` points to.
///
/// # Safety
///
/// As [`tensormem_dump_snapshot`].
unsafe fn c_path<'a>(path: *const c_char) -> Result<&'a str> {
    if path.is_null() {
        return Err(Error::NullArgument { what: "path" });
    }
    // SAFETY: `path` is non-null and NUL-terminated (the caller's obligation).
    let path = unsafe { CStr::from_ptr(path) };
    path.to_str().map_err(|_| Error::InvalidPath)
}
