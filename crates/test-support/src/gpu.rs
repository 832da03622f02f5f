//! Finding the CUDA devices or skipping. The crate asks for the device count with its own API
//! (`cuda::device_count()`, `CudaBackend`'s, cudarc's) and hands the answer to [`devices`] or
//! [`at_least`]: this crate needs no CUDA crate. Without a driver or a device a test says
//! `skipped: no CUDA driver/device (REASON)` and passes, unless [`REQUIRE_GPU`] is `1`
//! (`cargo xtask test-gpu` and the bundle's `run.sh` set it), which makes it fail.

use std::fmt::Display;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::skip;

/// Set to `1`, a missing driver or device fails the GPU tests instead of skipping them.
pub const REQUIRE_GPU: &str = "TENSORMEM_REQUIRE_GPU";

/// Serialises the GPU tests of one test binary (each binary has its own): they measure device
/// memory, and some of the state they use is process-wide.
static LOCK: Mutex<()> = Mutex::new(());

/// The lock that keeps this binary's GPU tests from running at the same time, held until the
/// guard is dropped. A test that panicked while holding it does not poison it for the others.
pub fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The number of devices `probe` found, or why there is none: the driver's error, or
/// `the driver reports 0 devices`.
///
/// # Errors
///
/// No driver (`probe` failed) or no device.
pub fn count<E: Display>(probe: Result<u32, E>) -> Result<u32, String> {
    match probe {
        Ok(0) => Err("the driver reports 0 devices".to_owned()),
        Ok(found) => Ok(found),
        Err(err) => Err(err.to_string()),
    }
}

/// The number of devices `probe` found, or `None` after saying why the test is skipped.
///
/// # Panics
///
/// If [`REQUIRE_GPU`] is `1` and there is no driver or device.
#[track_caller]
pub fn devices<E: Display>(probe: Result<u32, E>) -> Option<u32> {
    at_least(1, probe)
}

/// The number of devices `probe` found if there are at least `needed`, or `None` after saying why
/// the test is skipped. Fewer devices than `needed`, but some, is a skip even under
/// [`REQUIRE_GPU`]: it depends on the machine, not on the build.
///
/// # Panics
///
/// If [`REQUIRE_GPU`] is `1` and there is no driver or device at all.
#[track_caller]
pub fn at_least<E: Display>(needed: u32, probe: Result<u32, E>) -> Option<u32> {
    match count(probe) {
        Ok(found) if found >= needed => Some(found),
        Ok(found) => {
            eprintln!("skipped: this test needs {needed} CUDA devices, this machine has {found}");
            None
        }
        Err(reason) => {
            skip(&reason);
            None
        }
    }
}

/// Says `skipped: no CUDA driver/device ({reason})`.
///
/// # Panics
///
/// If [`REQUIRE_GPU`] is `1`.
#[track_caller]
pub fn skip(reason: &str) {
    skip::unless_required(&[REQUIRE_GPU], &format!("no CUDA driver/device ({reason})"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_reasons() {
        assert_eq!(count(Ok::<u32, String>(2)), Ok(2));
        assert_eq!(
            count(Ok::<u32, String>(0)),
            Err("the driver reports 0 devices".to_owned())
        );
        assert_eq!(
            count(Err::<u32, _>("no driver")),
            Err("no driver".to_owned())
        );
        assert_eq!(at_least(2, Ok::<u32, String>(1)), None);
        assert_eq!(at_least(2, Ok::<u32, String>(3)), Some(3));
    }
}
