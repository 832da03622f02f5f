//! Shared by the tests that need PyTorch: whether `python3` can use torch with CUDA.

use std::process::Command;

/// Whether `python3` can use torch with CUDA; says why not otherwise.
pub(crate) fn torch_cuda() -> bool {
    let ok = Command::new("python3")
        .args([
            "-c",
            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        ])
        .output()
        .is_ok_and(|out| out.status.success());
    if !ok {
        assert!(
            std::env::var("TENSORMEM_REQUIRE_TORCH").as_deref() != Ok("1"),
            "TENSORMEM_REQUIRE_TORCH=1 but python3 cannot use torch with CUDA"
        );
        eprintln!("skipped: python3 with a CUDA-enabled torch is not available here");
    }
    ok
}
