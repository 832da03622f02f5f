//! Finding the GPUs or skipping, and the lock that keeps GPU tests from running at the same time.

use std::sync::{Mutex, MutexGuard, PoisonError};

use tensormem_cuda_alloc::backend::cuda::{self, CudaBackend};

/// Set to `1`, a missing driver or device fails the tests instead of skipping them.
pub(crate) const REQUIRE_GPU: &str = "TENSORMEM_REQUIRE_GPU";

/// Serialises the GPU tests of this executable (they measure device memory).
static GPU_LOCK: Mutex<()> = Mutex::new(());

/// The GPUs a test runs on, and the lock held while it runs.
pub(crate) struct Gpus {
    /// Devices 0, 1, ... as many as the test asked for.
    pub(crate) devices: Vec<CudaBackend>,
    _lock: MutexGuard<'static, ()>,
}

impl Gpus {
    /// Device 0.
    pub(crate) fn first(&self) -> &CudaBackend {
        &self.devices[0]
    }
}

/// Whether the environment asks for missing GPUs to fail the tests.
pub(crate) fn gpu_required() -> bool {
    std::env::var(REQUIRE_GPU).is_ok_and(|v| v == "1")
}

/// Device 0, or `None` after printing why the test is skipped.
///
/// # Panics
///
/// If `TENSORMEM_REQUIRE_GPU=1` and there is no driver or device.
pub(crate) fn gpu() -> Option<Gpus> {
    gpus(1)
}

/// Devices `0..count`, or `None` after printing why the test is skipped.
///
/// # Panics
///
/// If `TENSORMEM_REQUIRE_GPU=1` and there is no driver or device at all (too few devices for a multi-GPU
/// test is a skip even then: it depends on the machine, not on the build).
pub(crate) fn gpus(count: u32) -> Option<Gpus> {
    let lock = GPU_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
    let found = match cuda::device_count() {
        Ok(0) => return no_gpu("the driver reports 0 devices"),
        Ok(found) => found,
        Err(err) => return no_gpu(&err.to_string()),
    };
    if found < count {
        eprintln!("skipped: this test needs {count} CUDA devices, this machine has {found}");
        return None;
    }
    let devices = (0..count)
        .map(|i| CudaBackend::new(i).unwrap_or_else(|e| panic!("opening CUDA device {i}: {e}")))
        .collect();
    Some(Gpus {
        devices,
        _lock: lock,
    })
}

fn no_gpu(reason: &str) -> Option<Gpus> {
    assert!(
        !gpu_required(),
        "{REQUIRE_GPU}=1 but there is no usable CUDA device: {reason}"
    );
    eprintln!("skipped: no CUDA driver/device ({reason})");
    None
}

/// Bytes as "N MiB" for assertion messages.
pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
