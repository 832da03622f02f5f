//! The pinned host caching allocator on a real GPU: blocks are page-locked (`cuMemHostAlloc`, and
//! heap + `cuMemHostRegister` with pages touched by several threads), copies to and from the device
//! work, and a block a stream still reads is not reused until that stream's work completes.

use std::sync::mpsc;

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::Device;

use crate::harness::gpu;

const MIB: usize = 1 << 20;

/// Whether the driver knows `ptr` as page-locked memory (only pinned memory has a device alias).
fn is_pinned(ptr: *const u8) -> bool {
    let mut alias = 0;
    // SAFETY: `alias` is a valid out-parameter; the driver only looks `ptr` up.
    let result = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut alias, ptr as *mut _, 0) };
    result == sys::CUresult::CUDA_SUCCESS
}

fn round_trip(host: &HostCachingAllocator<CudaBackend>, size: usize) {
    let device = host.device();
    let stream = device.create_stream().unwrap();
    let mut buffer = host.allocate(size).unwrap();
    assert!(is_pinned(buffer.as_ptr()), "the block is page-locked");
    for (i, b) in buffer.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let on_device = device.malloc(size).unwrap();
    let mut back = host.allocate(size).unwrap();
    // SAFETY: `on_device` is a fresh allocation of `size` bytes used only here; both copies
    // synchronize before returning.
    unsafe {
        stream.copy_from_host(on_device, buffer.as_slice()).unwrap();
        stream.copy_to_host(back.as_mut_slice(), on_device).unwrap();
        device.free(on_device, size).unwrap();
    }
    assert_eq!(back.as_slice(), buffer.as_slice());
    host.free(buffer).unwrap();
    host.free(back).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn pinned_blocks_from_host_alloc_and_from_registration_copy_both_ways() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let device = CudaBackend::new(0).unwrap();
    let source = CudaPinnedSource::host_alloc(&device);
    let host = HostCachingAllocator::new(device, source);
    round_trip(&host, 3 * MIB);
    host.empty_cache().unwrap();
    assert_eq!(host.stats().allocated_bytes.current, 0);

    let config =
        AllocatorConfig::parse("pinned_use_cuda_host_register:True,pinned_num_register_threads:4")
            .unwrap();
    let device = CudaBackend::new(0).unwrap();
    let source = CudaPinnedSource::from_config(&device, &config);
    let host = HostCachingAllocator::new(device, source);
    round_trip(&host, 9 * MIB);
    round_trip(&host, 4096);
    host.empty_cache().unwrap();
    let flat = host.stats().to_flat();
    assert_eq!(flat["allocations.current"], 0);
    assert_eq!(flat["num_host_alloc"], flat["num_host_free"]);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_block_a_stream_still_reads_is_not_reused_until_it_completes() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let device = CudaBackend::new(0).unwrap();
    let source = CudaPinnedSource::host_alloc(&device);
    let host = HostCachingAllocator::new(device, source);
    let stream = host.device().create_stream().unwrap();
    let (open, gate) = mpsc::channel::<()>();
    // SAFETY: the host function makes no CUDA call; it waits for the test to open the gate.
    unsafe {
        stream
            .launch_host_fn(move || {
                let _ = gate.recv();
            })
            .unwrap();
    }
    let a = host.allocate(MIB).unwrap();
    let first = a.as_ptr();
    host.record_stream(&a, stream.id()).unwrap();
    host.free(a).unwrap(); // its event waits behind the held host function
    let b = host.allocate(MIB).unwrap();
    assert_ne!(
        b.as_ptr(),
        first,
        "reused while the stream may still read it"
    );
    open.send(()).unwrap();
    stream.synchronize().unwrap();
    let c = host.allocate(MIB).unwrap();
    assert_eq!(c.as_ptr(), first, "reused once the stream completed");
    host.free(b).unwrap();
    host.free(c).unwrap();
    host.empty_cache().unwrap();
}
