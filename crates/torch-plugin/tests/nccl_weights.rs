//! `tensormem_torch.nccl_weights` between two processes on two GPUs
//! (`tests/python/nccl_weights_check.py`): rank 0 sends a GPT-2-small-sized fp32 state dict (148
//! tensors, 498 MB) twice, rank 1 (its tensors allocated in reverse order) compares every tensor
//! with the values of each version; a layout that lacks a tensor and has one of another size is
//! refused on both ranks, rank 1's error naming both. NCCL's id travels through a
//! `torch.distributed.FileStore`.
//!
//! Needs two GPUs and `python3` with torch: the test is `#[ignore]`d, and `cargo xtask test-gpu`
//! and the bundle's `run.sh` run it with `--include-ignored`. Run elsewhere, it says why it did
//! nothing (the script skips with fewer than two GPUs), unless `TENSORMEM_REQUIRE_TORCH=1` /
//! `TENSORMEM_REQUIRE_GPU=1` where there is no GPU or no PyTorch at all.

mod common;

use common::{library, prerequisites_met, scripts};
use tensormem_test_support::python;

#[test]
#[ignore = "needs two CUDA GPUs and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_gpt2_state_dict_moves_between_two_processes_through_nccl() {
    if !prerequisites_met() {
        return;
    }
    let out = python::command()
        .arg(scripts().join("nccl_weights_check.py"))
        .arg("--lib")
        .arg(library())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    if let Some(skip) = stdout.lines().find(|l| l.starts_with("SKIP ")) {
        eprintln!("skipped: {skip}");
        return;
    }
    let passed = stdout.lines().filter(|l| l.starts_with("PASS ")).count();
    let mut stderr_tail: Vec<&str> = stderr.lines().rev().take(120).collect();
    stderr_tail.reverse();
    assert!(
        out.status.success() && passed == 2 && !stdout.contains("FAIL "),
        "nccl_weights_check.py ({}, {passed} passed):\n{stdout}\n{}",
        out.status,
        stderr_tail.join("\n")
    );
}
