//! The C boundary: every exported function runs its body through [`call`], which stops panics,
//! keeps errors as the thread's last error, and leaves the caller's current CUDA context as it was.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys;

use crate::error::{set_last_error, Error, Result};

/// Runs `body` for the exported function `call`: returns its value, or `failed` after keeping the
/// error (or the panic, as [`Error::Panicked`]) as the thread's last error and logging it. The
/// caller's current CUDA context is the same afterwards.
///
/// A panic never unwinds into the C caller (which would abort the process or be undefined).
#[inline]
pub(crate) fn call<T>(call: &'static str, failed: T, body: impl FnOnce() -> Result<T>) -> T {
    let _context = ContextGuard::save();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => value,
        Ok(Err(error)) => {
            report(call, &error);
            failed
        }
        Err(payload) => {
            let error = Error::Panicked {
                call,
                message: panic_message(payload.as_ref()),
            };
            report(call, &error);
            failed
        }
    }
}

#[cold]
fn report(call: &'static str, error: &Error) {
    tracing::error!(call, %error, "tensormem plugin call failed");
    set_last_error(error);
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_owned()
    }
}

/// Restores the calling thread's current CUDA context when dropped.
///
/// tensormem makes a device's primary context current before the driver calls that need one and leaves
/// it so; a C caller such as PyTorch keeps its own notion of the current device in that same
/// driver state, and freeing memory of device 1 while device 0 is current must not switch it.
#[derive(Debug)]
struct ContextGuard {
    /// The context current on entry (null where none was), or `None` if it could not be read (no
    /// driver: then nothing was changed either).
    saved: Option<sys::CUcontext>,
}

impl ContextGuard {
    /// Remembers the current context.
    #[inline]
    fn save() -> Self {
        Self {
            saved: current_context(),
        }
    }
}

/// `cuCtxGetCurrent`, or `None` where the driver cannot be asked (not loaded or not initialised).
#[inline]
fn current_context() -> Option<sys::CUcontext> {
    if !driver_loaded() {
        return None;
    }
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the driver library is loaded (checked above); `ctx` is a valid out-parameter.
    let result = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
    (result == sys::CUresult::CUDA_SUCCESS).then_some(ctx)
}

/// Whether `libcuda.so` was found: cudarc's dynamically loaded functions panic when it is missing.
#[inline]
fn driver_loaded() -> bool {
    use std::sync::OnceLock;
    static LOADED: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to open the library, it calls nothing in it.
    *LOADED.get_or_init(|| unsafe { sys::is_culib_present() })
}

impl Drop for ContextGuard {
    #[inline]
    fn drop(&mut self) {
        let Some(saved) = self.saved else { return };
        if current_context() != Some(saved) {
            // SAFETY: `saved` was the thread's current context on entry: a live context (contexts the
            // caller made current stay alive while current) or null, which unbinds.
            let result = unsafe { sys::cuCtxSetCurrent(saved) };
            if result != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(
                    ?result,
                    "could not restore the caller's current CUDA context"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::call;
    use crate::error::{last_error_string, Error};

    #[test]
    fn a_panic_is_stopped_and_kept_as_the_last_error() {
        let value = call("tensormem_test", 7, || -> crate::Result<i32> {
            panic!("boom at the boundary")
        });
        assert_eq!(value, 7);
        let error = last_error_string().expect("the panic was kept");
        assert!(error.contains("tensormem_test panicked"), "{error}");
        assert!(error.contains("boom at the boundary"), "{error}");
    }

    #[test]
    fn an_error_gives_the_failure_value_and_a_success_keeps_the_last_error() {
        let value = call("tensormem_test", -1, || {
            Err(Error::InvalidDevice { device: -3 })
        });
        assert_eq!(value, -1);
        assert!(last_error_string().unwrap().contains("device -3"));
        assert_eq!(call("tensormem_test", -1, || Ok(5)), 5);
        assert!(
            last_error_string().unwrap().contains("device -3"),
            "a successful call must not clear the last error"
        );
    }
}
