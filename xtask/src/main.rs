//! Project tasks, run as `cargo xtask <task>` (the alias is in `.cargo/config.toml`).
//!
//! - `cargo xtask test-gpu`: runs every GPU test of the workspace on this machine's GPUs, with
//!   `TENSORMEM_REQUIRE_GPU=1` so that a missing driver or device fails instead of skipping, and with
//!   `TENSORMEM_REQUIRE_TORCH=1` when `python3 -c 'import torch'` works, so that the PyTorch interop checks
//!   run too.
//! - `cargo xtask test-gpu --bundle DIR`: builds the same test executables (release, no debug info,
//!   stripped) and the benchmark binaries (`alloc_patterns`, `shm_bench`, `shm_pool_bench`,
//!   `shm_loader_bench`) into `DIR` with a `run.sh`, for GPU hosts that have no
//!   Rust toolchain. `bash DIR/run.sh` there runs them all and exits non-zero if any failed.

mod bundle;
mod gpu_tests;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The command line of `cargo xtask`.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "tensormem project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

/// The tasks.
#[derive(Debug, Subcommand)]
enum Task {
    /// Run all GPU tests here (failing where no GPU is found), or build them into a bundle to run on a
    /// GPU host without a Rust toolchain.
    TestGpu {
        /// Build the GPU test executables, the benchmark binaries and a `run.sh` into this folder instead of
        /// running them.
        #[arg(long, value_name = "DIR")]
        bundle: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.task {
        Task::TestGpu { bundle: None } => gpu_tests::run_here(),
        Task::TestGpu { bundle: Some(dir) } => bundle::build(&dir),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}
