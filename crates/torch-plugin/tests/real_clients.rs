//! Ordinary PyTorch programs run natively and on tensormem (`tests/python/real_clients.py`), each in fresh
//! processes, with tensormem installed as PyTorch's whole `CUDAAllocator` (the C++ layer, compiled here
//! against the installed PyTorch): outputs equal, and peak reserved bytes and device allocations equal
//! where the workload is deterministic.
//!
//! Needs a GPU and `python3` with torch and torchvision: the tests are `#[ignore]`d, and
//! `cargo xtask test-gpu` and the bundle's `run.sh` run them with `--include-ignored`. Run elsewhere,
//! each says why it did nothing, unless `TENSORMEM_REQUIRE_TORCH=1` / `TENSORMEM_REQUIRE_GPU=1`.

mod common;

use common::{library, prerequisites_met, scripts};
use tensormem_test_support::python;

fn real_client(workload: &str) {
    real_clients(&[workload], &[]);
}

/// Runs `workloads` through `real_clients.py` with `args` before them; each must PASS or SKIP.
fn real_clients(workloads: &[&str], args: &[&str]) {
    if !prerequisites_met() {
        return;
    }
    let out = python::command()
        .arg(scripts().join("real_clients.py"))
        .arg("--lib")
        .arg(library())
        .args(args)
        .args(workloads)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    let verdict = |workload: &str, word: &str| {
        stdout
            .lines()
            .any(|line| line.starts_with(&format!("{word} {workload}")))
    };
    for workload in workloads {
        if verdict(workload, "SKIP") {
            eprintln!("skipped: {workload}");
            continue;
        }
        assert!(
            out.status.success() && verdict(workload, "PASS"),
            "real_clients.py {args:?} {workload} ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_cnn_with_amp_and_grad_scaler() {
    real_client("cnn_amp");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_transformer_with_variable_lengths_and_checkpointing() {
    real_client("transformer_varlen");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn torch_compile_reduce_overhead_inference() {
    real_client("compile_infer");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn torch_compile_reduce_overhead_training() {
    real_client("compile_train");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_mem_pool_with_use_mem_pool() {
    real_client("mempool");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn mem_pools_with_no_split_and_use_on_oom_under_a_memory_fraction() {
    real_client("mempool_options");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_mem_pool_with_its_own_pluggable_allocator() {
    real_client("mempool_own_allocator");
}

/// `torch.OutOfMemoryError` is caught and the program goes on; its message has PyTorch's words on
/// tensormem too (figures aside: sizes, the GPU's number, process ids).
#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn an_out_of_memory_error_is_caught_and_recovered_from() {
    real_client("oom");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn side_stream_copies_from_pinned_memory_with_record_stream() {
    real_client("streams");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn cuda_tensors_travel_to_a_native_process_and_back() {
    real_client("ipc");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn expandable_segment_tensors_travel_to_a_native_process_and_back() {
    real_client("ipc_expandable");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn memory_stats_and_snapshots_through_pytorch() {
    real_client("stats_snapshot");
}

/// Allocator settings changed through `torch._C._accelerator_setAllocatorSettings` and through
/// `torch.cuda.memory._set_allocator_settings` reach tensormem: the snapshot's `allocator_settings`
/// show the new values after each, as PyTorch's do on its own allocator.
#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn allocator_settings_changed_at_run_time_through_each_entry_point() {
    real_client("allocator_settings");
}

#[test]
#[ignore = "needs two CUDA GPUs and python3 with torch (cargo xtask test-gpu runs it)"]
fn ddp_over_nccl_on_two_gpus() {
    real_client("ddp");
}

#[test]
#[ignore = "needs two CUDA GPUs and python3 with torch (cargo xtask test-gpu runs it)"]
fn ddp_with_nccl_registering_the_allocators_segments() {
    real_client("ddp_register");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn a_graph_captured_into_a_mem_pool_replays_after_the_pool_sleeps_and_wakes() {
    real_client("sleep_wake");
}

#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn tagged_regions_sleep_together_weights_kept_cache_discarded() {
    real_client("regions");
}

/// Each program on PyTorch's `cudaMallocAsync` backend and on tensormem's (`AsyncAllocator` through the
/// C++ layer): equal outputs, and where PyTorch's backend refuses part of a program (memory history,
/// `MemPool`, the graph trees' pool checks), the same refusal, word for word. Not among them: `ipc`,
/// which PyTorch's backend refuses in `torch.multiprocessing`'s feeder thread, so that the program
/// waits for a tensor that never comes.
#[test]
#[ignore = "needs a CUDA GPU and python3 with torch (cargo xtask test-gpu runs it)"]
fn ordinary_programs_on_the_cuda_malloc_async_backend() {
    real_clients(
        &[
            "cnn_amp",
            "transformer_varlen",
            "streams",
            "oom",
            "stats_snapshot",
            "mempool",
            "compile_infer",
        ],
        &["--conf", "backend:cudaMallocAsync", "--timeout", "240"],
    );
}
