//! Which test executables hold GPU tests, and running them on this machine.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The integration-test targets that hold GPU or PyTorch tests: (package, test target). Those tests are
/// `#[ignore]`d (a plain `cargo test` reports them as ignored) and run here with [`INCLUDE_IGNORED`].
/// Each checks for a driver and device (or for torch) itself and skips with a message on stderr when
/// there is none, unless [`REQUIRE_GPU`] (or [`REQUIRE_TORCH`]) is set.
pub(crate) const GPU_TEST_TARGETS: &[(&str, &str)] = &[
    ("tensormem-shm", "torch_interop"),
    ("tensormem-cuda-alloc", "gpu"),
    ("tensormem-cuda-alloc", "async_gpu"),
    ("tensormem-cuda-alloc", "memory_viz"),
    ("tensormem-cuda-alloc", "config_vs_pytorch"),
    ("tensormem", "gpu"),
    ("tensormem-ipc", "gpu"),
    ("tensormem", "storage_gpu"),
    ("tensormem", "storage_gpu_sharing"),
    ("tensormem", "mem_pool_gpu"),
    ("tensormem", "runtime_gpu"),
    ("tensormem-storage", "torch_interop"),
    ("tensormem-torch", "gpu"),
    ("tensormem-torch", "torch_client"),
    ("tensormem-torch", "real_clients"),
    ("tensormem-torch", "weights"),
    ("tensormem-torch", "nccl_weights"),
    ("tensormem-torch", "native_abi"),
    ("tensormem-nccl", "gpu"),
    ("tensormem-nccl", "weights_gpu"),
];

/// Examples that run on a GPU as checks: (package, example). Each skips with a message when there is
/// no driver or device, unless [`REQUIRE_GPU`] is set, and exits non-zero when something is wrong.
pub(crate) const GPU_EXAMPLES: &[(&str, &str)] = &[("tensormem-cuda-alloc", "cudarc_kernel")];

/// The test harness flag that runs the `#[ignore]`d GPU and PyTorch tests beside the others.
pub(crate) const INCLUDE_IGNORED: &str = "--include-ignored";

/// Set to `1`, a GPU test fails instead of skipping when no driver or device is found.
pub(crate) const REQUIRE_GPU: &str = "TENSORMEM_REQUIRE_GPU";

/// Set to `1`, the PyTorch interop checks fail instead of skipping when `python3 -c 'import torch'` fails.
pub(crate) const REQUIRE_TORCH: &str = "TENSORMEM_REQUIRE_TORCH";

/// The workspace root (the parent of this crate's folder).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The cargo that runs this task (`$CARGO`), or `cargo` from the `PATH`.
pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Whether `python3 -c 'import torch'` works here.
pub(crate) fn torch_available() -> bool {
    Command::new("python3")
        .args(["-c", "import torch"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs every GPU test target in release mode on this machine's GPUs, one test at a time (they measure
/// device memory, so they must not run beside each other).
pub(crate) fn run_here() -> Result<()> {
    let torch = torch_available();
    if torch {
        eprintln!("xtask: python3 has torch: the PyTorch interop checks run too");
    } else {
        eprintln!(
            "xtask: python3 -c 'import torch' failed: the PyTorch interop checks will be skipped"
        );
    }
    let mut failed = Vec::new();
    for &(package, test) in GPU_TEST_TARGETS {
        eprintln!("xtask: cargo test --release -p {package} --test {test}");
        let mut cmd = cargo();
        cmd.args([
            "test",
            "--release",
            "-p",
            package,
            "--test",
            test,
            "--",
            INCLUDE_IGNORED,
            "--test-threads=1",
        ])
        .env(REQUIRE_GPU, "1");
        if torch {
            cmd.env(REQUIRE_TORCH, "1");
        }
        let status = cmd
            .status()
            .with_context(|| format!("could not run cargo for {package}"))?;
        if !status.success() {
            failed.push(format!("{package} --test {test}"));
        }
    }
    for &(package, example) in GPU_EXAMPLES {
        eprintln!("xtask: cargo run --release -p {package} --example {example}");
        let status = cargo()
            .args(["run", "--release", "-p", package, "--example", example])
            .env(REQUIRE_GPU, "1")
            .status()
            .with_context(|| format!("could not run cargo for {package}"))?;
        if !status.success() {
            failed.push(format!("{package} --example {example}"));
        }
    }
    if !failed.is_empty() {
        bail!("GPU tests failed in: {}", failed.join(", "));
    }
    eprintln!("xtask: all GPU tests passed");
    Ok(())
}
