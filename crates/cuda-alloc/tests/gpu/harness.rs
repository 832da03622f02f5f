//! Finding the GPUs or skipping, and the lock that keeps GPU tests from running at the same time.

use std::sync::MutexGuard;

use tensormem_cuda_alloc::backend::cuda::{self, CudaBackend};
use tensormem_test_support::gpu as support;

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

/// Device 0, or `None` after printing why the test is skipped.
///
/// # Panics
///
/// If [`REQUIRE_GPU`](support::REQUIRE_GPU) is `1` and there is no driver or device.
pub(crate) fn gpu() -> Option<Gpus> {
    gpus(1)
}

/// Devices `0..count`, or `None` after printing why the test is skipped.
///
/// # Panics
///
/// If [`REQUIRE_GPU`](support::REQUIRE_GPU) is `1` and there is no driver or device at all (too
/// few devices for a multi-GPU test is a skip even then: it depends on the machine, not on the
/// build).
pub(crate) fn gpus(count: u32) -> Option<Gpus> {
    // Serialises the GPU tests of this executable (they measure device memory).
    let lock = support::lock();
    support::at_least(count, cuda::device_count())?;
    let devices = (0..count)
        .map(|i| CudaBackend::new(i).unwrap_or_else(|e| panic!("opening CUDA device {i}: {e}")))
        .collect();
    Some(Gpus {
        devices,
        _lock: lock,
    })
}

/// Bytes as "N MiB" for assertion messages.
pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
