//! `tensormem_torch.weights` between processes (`tests/python/weights_check.py`): a producer publishes
//! several layouts (a small GPT-2-like fp32 state dict, a few hundred bf16 tensors, views of one fused
//! storage with a transposed parameter, a `torch.cuda.MemPool`'s tensors), spawned consumers install
//! three versions into their own tensors with each method (`foreach`, `batched`) and compare every
//! byte; wrong layouts are refused before anything is written; a consumer killed while subscribed
//! stops holding the producer back; a producer that closes ends its consumers' waits. Once with both
//! sides on PyTorch's own allocator, once on tensormem's (`--plugin`).
//!
//! Needs a GPU and `python3` with torch: the tests are `#[ignore]`d, and `cargo xtask test-gpu` and
//! the bundle's `run.sh` run them with `--include-ignored`. Run elsewhere, each says why it did
//! nothing, unless `TENSORMEM_REQUIRE_TORCH=1` / `TENSORMEM_REQUIRE_GPU=1`.

mod common;

use common::{library, prerequisites_met, scripts};
use tensormem_test_support::python;

/// Runs `weights_check.py` with `args`: every check must PASS or SKIP, at least one PASS.
fn weights_check(args: &[&str]) {
    if !prerequisites_met() {
        return;
    }
    let out = python::command()
        .arg(scripts().join("weights_check.py"))
        .arg("--lib")
        .arg(library())
        .args(args)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    for line in stdout.lines().filter(|l| l.starts_with("SKIP ")) {
        eprintln!("skipped: {line}");
    }
    let failed: Vec<&str> = stdout.lines().filter(|l| l.starts_with("FAIL ")).collect();
    let passed = stdout.lines().filter(|l| l.starts_with("PASS ")).count();
    let mut stderr_tail: Vec<&str> = stderr.lines().rev().take(120).collect();
    stderr_tail.reverse();
    assert!(
        out.status.success() && failed.is_empty() && passed > 0,
        "weights_check.py {args:?} ({}, {passed} passed):\n{}\n{stdout}\n{}",
        out.status,
        failed.join("\n"),
        stderr_tail.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn weights_move_between_processes_on_pytorchs_allocator() {
    weights_check(&[]);
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn weights_move_between_processes_on_tensormems_allocator() {
    weights_check(&["--plugin"]);
}
