//! A C caller's arguments read with a check: out-parameters, arrays and strings, a null or a
//! string that is not UTF-8 refused with an error naming the argument.

use std::ffi::{c_char, CStr};

use crate::error::{Error, Result};

/// Writes `value` through `out`, which must not be null.
///
/// # Safety
///
/// `out` is null or valid for a write of one `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T, what: &'static str) -> Result<()> {
    if out.is_null() {
        return Err(Error::NullArgument { what });
    }
    // SAFETY: non-null (checked above) and valid for a write (the caller's obligation).
    unsafe { out.write(value) };
    Ok(())
}

/// `len` items from `ptr` (which may be null only when `len` is 0).
///
/// # Safety
///
/// `ptr` is valid for reads of `len` items, unless `len` is 0, and they are not written while the
/// slice is used.
pub(crate) unsafe fn items<'a, T>(
    ptr: *const T,
    len: usize,
    what: &'static str,
) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::NullArgument { what });
    }
    // SAFETY: non-null, valid for `len` reads (the caller's obligation), not written meanwhile.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The UTF-8 text of C string `text`, the `index`th of argument `what`.
///
/// # Safety
///
/// `text` is null or a NUL-terminated string that outlives the result.
pub(crate) unsafe fn text<'a>(
    text: *const c_char,
    what: &'static str,
    index: usize,
) -> Result<&'a str> {
    if text.is_null() {
        return Err(Error::NullArgument { what });
    }
    // SAFETY: non-null and NUL-terminated (the caller's obligation).
    let bytes = unsafe { CStr::from_ptr(text) };
    bytes.to_str().map_err(|_| {
        Error::InvalidWeightsArgument(format!(
            "{what}[{index}] ({}) is not valid UTF-8: pass names and type names as UTF-8",
            bytes.to_string_lossy()
        ))
    })
}
