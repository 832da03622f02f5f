//! PyTorch as a real client of the plugin: GPT-2 training and a CUDA-graph training run go to the end
//! on tensormem's allocator with the losses of PyTorch's native allocator (`tests/python/torch_client.py`),
//! and both peak reserved figures are printed; a `torch.cuda.MemPool` on the plugin, PyTorch's allocator
//! staying current, takes its segments from tensormem; memory freed while a busy side stream still reads
//! it (`Tensor.record_stream`) is not reused too early.
//!
//! Needs a GPU and `python3` with torch (and `transformers` for GPT-2): the tests are `#[ignore]`d, and
//! `cargo xtask test-gpu` and the bundle's `run.sh` run them with `--include-ignored`. Run where torch
//! does not import or there is no GPU, each says why it did nothing, unless `TENSORMEM_REQUIRE_TORCH=1` /
//! `TENSORMEM_REQUIRE_GPU=1` (which they set). The library is `$TENSORMEM_TORCH_LIB`, else the one
//! cargo built beside this test; the scripts are in `$TENSORMEM_TORCH_PYTHON`, else the crate's
//! `tests/python/`.

mod common;

use common::{library, prerequisites_met, scripts};
use tensormem_test_support::python;

fn run_client(workload: &str) {
    if !prerequisites_met() {
        return;
    }
    let lib = library();
    let out = python::command()
        .arg(scripts().join("torch_client.py"))
        .arg("--lib")
        .arg(&lib)
        .arg(workload)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "torch_client.py {workload} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("PASS {workload}")),
        "no verdict for {workload}:\n{stdout}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn gpt2_train_on_tensormem_has_the_native_losses() {
    run_client("gpt2_train");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn cudagraph_train_on_tensormem_has_the_native_losses() {
    run_client("cudagraph_train");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_mem_pool_takes_its_segments_from_tensormem() {
    run_client("mempool");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn record_stream_keeps_memory_from_early_reuse() {
    run_client("record_stream");
}
