//! Dropping an allocator on a real GPU gives the device its memory back (`cuMemGetInfo`), plain and
//! expandable segments alike, and keeps no error.

use std::sync::Arc;

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, Device};

use crate::harness::{gpu, mib};

const MIB: usize = 1 << 20;
/// What the driver may keep for itself meanwhile (stream and event bookkeeping).
const SLACK: u64 = 64 << 20;

fn drop_returns_memory(config: &str) {
    let Some(gpus) = gpu() else { return };
    let probe = gpus.first();
    probe.synchronize().unwrap();
    let before = probe.mem_info().unwrap().free;

    let device = Arc::new(CudaBackend::new(0).unwrap());
    let alloc =
        CachingAllocator::with_config(Arc::clone(&device), AllocatorConfig::parse(config).unwrap());
    let stream = device.create_stream().unwrap();
    let mut live = Vec::new();
    for size in [512, 3000, 600_000, 3 * MIB, 12 * MIB, 256 * MIB, 300 * MIB] {
        live.push(alloc.allocate(size, stream.id()).unwrap());
        let cached = alloc.allocate(size, stream.id()).unwrap();
        alloc.free(cached).unwrap();
    }
    let reserved = alloc.reserved_bytes();
    assert!(reserved >= (556 * MIB) as u64, "reserved {}", mib(reserved));
    let during = probe.mem_info().unwrap().free;
    assert!(
        before.saturating_sub(during) + SLACK >= reserved,
        "the device lost {} while {} were reserved",
        mib(before.saturating_sub(during)),
        mib(reserved)
    );

    drop(live); // Handles left unfreed on purpose: they go back with the allocator.
    drop(alloc);
    device.check_err().expect("no error met while dropping");
    let after = probe.mem_info().unwrap().free;
    assert!(
        after + SLACK >= before,
        "after dropping the allocator the device has {} free, {} before (config {config:?})",
        mib(after),
        mib(before)
    );
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn dropping_an_allocator_returns_its_segments_to_the_device() {
    drop_returns_memory("");
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn dropping_an_allocator_returns_its_expandable_segments_to_the_device() {
    drop_returns_memory("expandable_segments:True");
}
