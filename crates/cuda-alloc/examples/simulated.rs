//! The caching allocator on the simulated device: no GPU, no CUDA. Allocates and frees as a
//! training step would, reads the statistics PyTorch's `torch.cuda.memory_stats()` names, and
//! writes a snapshot PyTorch's `_memory_viz` opens.
//!
//! `cargo run -p tensormem-cuda-alloc --example simulated [OUT.pickle]`

use std::process::ExitCode;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("simulated: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let config = AllocatorConfig::parse("max_split_size_mb:64,garbage_collection_threshold:0.8")?;
    let allocator = CachingAllocator::with_config(SimDevice::new(8 << 30), config);
    allocator.record_history(true, 10_000);
    let stream = StreamId::DEFAULT;
    for step in 0..3 {
        // Activations of odd sizes, freed in reverse; the second step reuses the first's cache.
        let mut live = Vec::new();
        for layer in 0..12usize {
            let bytes = (layer + 1) * 3 * (1 << 20) + 1000;
            live.push(allocator.allocate_owned(bytes, stream)?);
        }
        drop(live);
        let stats = allocator.memory_stats();
        println!(
            "step {step}: reserved {} B, peak allocated {} B, device allocations {}",
            stats.reserved_bytes.all.current,
            stats.allocated_bytes.all.peak,
            stats.num_device_alloc
        );
    }
    allocator.empty_cache()?;
    assert_eq!(allocator.memory_stats().reserved_bytes.all.current, 0);
    if let Some(out) = std::env::args().nth(1) {
        allocator.snapshot().write_pickle_file(&out)?;
        println!("snapshot written to {out} (open it at https://pytorch.org/memory_viz)");
    }
    Ok(())
}
