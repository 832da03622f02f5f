//! Shared by the GPU tests: finding a device, or saying why the test is skipped.

use tensormem::cuda;

/// The number of devices, or `None` after saying why the test is skipped; with
/// `TENSORMEM_REQUIRE_GPU=1` (`cargo xtask test-gpu`, the bundle's `run.sh`) no device is a
/// failure instead.
pub(crate) fn gpus() -> Option<u32> {
    let reason = match cuda::device_count() {
        Ok(n) if n > 0 => return Some(n),
        Ok(_) => "the driver reports 0 devices".to_owned(),
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var("TENSORMEM_REQUIRE_GPU").as_deref() != Ok("1"),
        "TENSORMEM_REQUIRE_GPU=1 but there is no usable CUDA device: {reason}"
    );
    eprintln!("skipped: no CUDA driver/device ({reason})");
    None
}
