//! Loading the CUDA driver, initialising it once, and turning `CUresult` codes into [`DeviceError`]s.
//!
//! cudarc's dynamic loading panics when `libcuda.so` cannot be found (and when a symbol is missing from an
//! old driver). This module is the only place that calls the driver before it is known to be usable: it
//! checks for the library with cudarc's fallible probe, calls `cuInit` under `catch_unwind`, and checks the
//! driver version, so that a machine without a driver or device gets a [`DeviceError`] instead of a panic.

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::device::{DeviceError, DeviceResult};

/// The oldest driver API version this backend calls into (12.3: `cuStreamGetCaptureInfo_v3`).
const MIN_DRIVER_VERSION: i32 = 12030;

/// `CUDA_ERROR_NO_DEVICE`, used for the "no driver library" case too: there is no device to use.
const NO_DEVICE: i32 = sys::CUresult::CUDA_ERROR_NO_DEVICE as i32;

/// Turns the `CUresult` of driver call `call` into `Ok(())` or a [`DeviceError`]: the one place a CUDA
/// driver result code becomes an error, for this crate and for the crates built on it (IPC, the PyTorch
/// plugin), as cudarc's `result` layer does for its own calls.
///
/// `CUDA_SUCCESS` is `Ok(())`. Any other code is [`DeviceError::Driver`] with `call`, the code as a
/// number, and the driver's name and description of it (`cuGetErrorName`, `cuGetErrorString`:
/// `"CUDA_ERROR_INVALID_VALUE: invalid argument"`; `"unknown CUDA error <code>"` for a code the driver
/// does not know). Codes that are not failures for the caller (`CUDA_ERROR_NOT_READY` from a query,
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`) are matched before calling this. Calls that create
/// memory go through the crate's allocating twin instead, which turns `CUDA_ERROR_OUT_OF_MEMORY` into
/// [`DeviceError::OutOfMemory`] so that the allocator frees cached memory and retries.
///
/// Call it only with the result of a driver call that returned (the driver library is then loaded:
/// naming the code asks the driver).
///
/// # Errors
///
/// [`DeviceError::Driver`] for every code but `CUDA_SUCCESS`.
///
/// # References
///
/// - [Error handling](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__ERROR.html)
/// - [`CUresult`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html)
#[doc(alias = "CUresult")]
#[doc(alias = "cuGetErrorName")]
#[inline]
pub fn check(call: &'static str, result: sys::CUresult) -> DeviceResult<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(error(call, result))
    }
}

/// The allocating twin of [`check`]: `CUDA_ERROR_OUT_OF_MEMORY` becomes [`DeviceError::OutOfMemory`]
/// for `bytes`, any other code as [`check`] has it.
#[inline]
pub(crate) fn check_alloc(
    call: &'static str,
    result: sys::CUresult,
    bytes: usize,
) -> DeviceResult<()> {
    if result == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Err(DeviceError::OutOfMemory {
            bytes: bytes as u64,
        })
    } else {
        check(call, result)
    }
}

/// The [`DeviceError`] of a failed driver call: its code, and the driver's name and description of it
/// (`cuGetErrorName`, `cuGetErrorString`).
#[cold]
pub(crate) fn error(call: &'static str, result: sys::CUresult) -> DeviceError {
    DeviceError::Driver {
        call,
        code: result as i32,
        message: describe(result),
    }
}

/// `"CUDA_ERROR_INVALID_VALUE: invalid argument"` for a code, from the driver's own tables.
fn describe(result: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: an error code only reaches here from a driver call, so the driver library is loaded; both
    // calls write a pointer to a static NUL-terminated string or leave the out-parameter untouched (it
    // stays null when the code is unknown, which is checked before reading).
    let (name_ok, text_ok) = unsafe {
        (
            sys::cuGetErrorName(result, &mut name) == sys::CUresult::CUDA_SUCCESS
                && !name.is_null(),
            sys::cuGetErrorString(result, &mut text) == sys::CUresult::CUDA_SUCCESS
                && !text.is_null(),
        )
    };
    let name = name_ok.then(|| owned(name));
    let text = text_ok.then(|| owned(text));
    match (name, text) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        (Some(n), None) => n,
        _ => format!("unknown CUDA error {}", result as i32),
    }
}

/// Copies a driver-owned C string.
fn owned(ptr: *const std::ffi::c_char) -> String {
    // SAFETY: only called with non-null pointers from `cuGetErrorName`/`cuGetErrorString`, which point to
    // the driver's static NUL-terminated strings.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// Loads and initialises the driver once per process; later calls return the first outcome.
///
/// # Errors
///
/// [`DeviceError::Driver`] with code `CUDA_ERROR_NO_DEVICE` (100) when `libcuda.so` cannot be loaded, the
/// driver's own error when `cuInit` fails (no device, driver/library mismatch, ...), and a driver error
/// naming the version when the driver is older than CUDA 12.3.
///
/// # References
///
/// - [`cuInit`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__INITIALIZE.html) (Initialization)
/// - [`cuDriverGetVersion`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VERSION.html) (Version Management)
pub fn init() -> DeviceResult<()> {
    static INIT: OnceLock<DeviceResult<()>> = OnceLock::new();
    INIT.get_or_init(init_once).clone()
}

fn init_once() -> DeviceResult<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names and closes them again.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::Driver {
            call: "dlopen(libcuda.so)",
            code: NO_DEVICE,
            message:
                "the NVIDIA driver library libcuda.so was not found; install the NVIDIA driver or \
                      add its directory to LD_LIBRARY_PATH"
                    .to_owned(),
        });
    }
    // cudarc resolves each symbol on first use and panics if it is missing; catch that here for the
    // first two calls so a broken or foreign libcuda.so gives an error, not an abort.
    let versioned = std::panic::catch_unwind(|| {
        // SAFETY: `cuInit(0)` has no preconditions (flags must be 0).
        check("cuInit", unsafe { sys::cuInit(0) })?;
        let mut version = 0;
        // SAFETY: `version` is a valid out-parameter for the duration of the call.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut version)
        })?;
        Ok(version)
    });
    let version = match versioned {
        Ok(result) => result?,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "unknown failure".to_owned());
            return Err(DeviceError::Driver {
                call: "cuInit",
                code: NO_DEVICE,
                message: format!("the CUDA driver library could not be used: {what}"),
            });
        }
    };
    if version < MIN_DRIVER_VERSION {
        return Err(DeviceError::Driver {
            call: "cuDriverGetVersion",
            code: sys::CUresult::CUDA_ERROR_NOT_SUPPORTED as i32,
            message: format!(
                "the CUDA driver supports CUDA {}.{}; tensormem needs 12.3 or newer: update the NVIDIA driver",
                version / 1000,
                (version % 1000) / 10
            ),
        });
    }
    tracing::debug!(version, "CUDA driver initialised");
    Ok(())
}

/// The number of CUDA devices the driver sees (`cuDeviceGetCount`), after [`init`].
///
/// # Errors
///
/// The errors of [`init`]; `cuInit` reports a machine with a driver but no device as
/// `CUDA_ERROR_NO_DEVICE`.
///
/// # References
///
/// - [`cuDeviceGetCount`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html) (Device Management)
#[doc(alias = "cuDeviceGetCount")]
pub fn device_count() -> DeviceResult<u32> {
    init()?;
    let mut count = 0;
    // SAFETY: the driver is initialised; `count` is a valid out-parameter.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(u32::try_from(count).unwrap_or(0))
}

/// The driver's handle of device `ordinal` (`cuDeviceGet`), after [`init`].
///
/// # Errors
///
/// The errors of [`init`]; `CUDA_ERROR_INVALID_DEVICE` when there is no such device.
pub(crate) fn device_handle(ordinal: u32) -> DeviceResult<sys::CUdevice> {
    init()?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(no_such_device(ordinal, count));
    }
    let mut dev = 0;
    // SAFETY: the driver is initialised, the ordinal is in range and `dev` is a valid out-parameter.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32)
    })?;
    Ok(dev)
}

/// The error for a device ordinal past the device count (`CUDA_ERROR_INVALID_DEVICE`).
#[cold]
pub(crate) fn no_such_device(ordinal: u32, count: u32) -> DeviceError {
    DeviceError::Driver {
        call: "cuDeviceGet",
        code: sys::CUresult::CUDA_ERROR_INVALID_DEVICE as i32,
        message: match count {
            0 => format!("CUDA_ERROR_INVALID_DEVICE: there is no CUDA device {ordinal}; this machine has none"),
            _ => format!(
                "CUDA_ERROR_INVALID_DEVICE: there is no CUDA device {ordinal}; this machine has {count} \
                 (ordinals 0 to {})",
                count - 1
            ),
        },
    }
}

/// One integer attribute of a device (`cuDeviceGetAttribute`).
pub(crate) fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> DeviceResult<i32> {
    let mut value = 0;
    // SAFETY: `dev` came from `cuDeviceGet` after `cuInit`; `value` is a valid out-parameter.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut value, attr, dev)
    })?;
    Ok(value)
}

/// The `CUresult` of a driver code kept in a [`DeviceError`], for cudarc's error slot
/// (`CudaContext::record_err`): the common codes map to themselves, any other to
/// `CUDA_ERROR_UNKNOWN` (the exact code stays in the [`DeviceError`]). Codes are matched rather than
/// transmuted, since a `DeviceError` can be built with any number.
pub(crate) fn result_of(code: i32) -> Option<sys::CUresult> {
    use sys::CUresult as R;
    Some(match code {
        0 => return None,
        1 => R::CUDA_ERROR_INVALID_VALUE,
        2 => R::CUDA_ERROR_OUT_OF_MEMORY,
        3 => R::CUDA_ERROR_NOT_INITIALIZED,
        4 => R::CUDA_ERROR_DEINITIALIZED,
        100 => R::CUDA_ERROR_NO_DEVICE,
        101 => R::CUDA_ERROR_INVALID_DEVICE,
        201 => R::CUDA_ERROR_INVALID_CONTEXT,
        400 => R::CUDA_ERROR_INVALID_HANDLE,
        700 => R::CUDA_ERROR_ILLEGAL_ADDRESS,
        719 => R::CUDA_ERROR_LAUNCH_FAILED,
        _ => R::CUDA_ERROR_UNKNOWN,
    })
}
