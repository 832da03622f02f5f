//! The status codes the plugin's C functions return (declared in `csrc/tensormem_abi.h`),
//! below both the error type that maps each error to one and the functions that return them
//! ([`native`](crate::native), which re-exports them).

use std::ffi::c_int;

/// The call succeeded.
pub const TM_OK: c_int = 0;
/// The call failed because device memory ran out (PyTorch raises `torch.OutOfMemoryError`).
pub const TM_OUT_OF_MEMORY: c_int = 1;
/// The call failed for another reason (see [`tensormem_last_error`](crate::tensormem_last_error)).
pub const TM_ERROR: c_int = -1;
/// The code of a last error that is a refusal of PyTorch's allocator for the process's backend
/// ([`tensormem_last_error_code`](crate::tensormem_last_error_code)); the calls that fail so return
/// [`TM_ERROR`].
pub const TM_UNSUPPORTED: c_int = 2;
