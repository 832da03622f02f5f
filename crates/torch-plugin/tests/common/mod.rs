//! What the PyTorch real-client tests share: finding the library and the scripts, and skipping
//! visibly where there is no GPU or no PyTorch.

use std::path::{Path, PathBuf};

use tensormem_test_support::gpu::{self, REQUIRE_GPU};
use tensormem_test_support::skip;
use tensormem_test_support::torch::{self, REQUIRE_TORCH};

const LIB: &str = "libtensormem_torch.so";

/// Why the test cannot run here, or `None` if it can.
fn missing_prerequisite() -> Option<String> {
    if let Err(reason) = gpu::count(tensormem::cuda::device_count()) {
        return Some(format!("no CUDA device ({reason})"));
    }
    torch::why_no_torch_cuda()
}

pub(crate) fn library() -> PathBuf {
    if let Some(path) = std::env::var_os("TENSORMEM_TORCH_LIB") {
        return PathBuf::from(path);
    }
    // Integration tests run from target/<profile>/deps, where cargo also puts the cdylib.
    let exe = std::env::current_exe().expect("the test's path");
    let deps = exe.parent().expect("the test's folder");
    [deps.join(LIB), deps.join("..").join(LIB)]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{LIB} not found beside {}: build it with cargo build -p tensormem-torch, or set TENSORMEM_TORCH_LIB", deps.display()))
}

pub(crate) fn scripts() -> PathBuf {
    std::env::var_os("TENSORMEM_TORCH_PYTHON").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python"),
        PathBuf::from,
    )
}

/// Skips (printing why) unless a GPU and PyTorch are here; fails instead where the run asked for them
/// (`TENSORMEM_REQUIRE_TORCH=1` / `TENSORMEM_REQUIRE_GPU=1`). Returns whether to run.
pub(crate) fn prerequisites_met() -> bool {
    let Some(reason) = missing_prerequisite() else {
        return true;
    };
    skip::unless_required(&[REQUIRE_TORCH, REQUIRE_GPU], &reason);
    false
}
