//! Two GPUs: peer access, copies between devices, virtual memory shared with a peer, one allocator per
//! device. Skipped on machines with one GPU.

use tensormem_cuda_alloc::backend::cuda::{self, CudaBackend};
use tensormem_cuda_alloc::{Device, DeviceAddress};

use crate::harness::gpus;

const MIB: usize = 1 << 20;

fn fill_and_check(dev: &CudaBackend, ptr: DeviceAddress, len: usize, value: u8) {
    let stream = dev.create_stream().unwrap();
    let mut back = vec![0u8; len];
    // SAFETY: `[ptr, ptr+len)` is memory the test owns and nothing else uses meanwhile.
    unsafe { stream.copy_to_host(&mut back, ptr).unwrap() };
    assert!(
        back.iter().all(|&b| b == value),
        "device {} does not hold the copied bytes",
        dev.ordinal()
    );
}

#[test]
#[ignore = "needs two CUDA GPUs (cargo xtask test-gpu runs it)"]
fn memory_is_copied_between_two_devices() {
    let Some(gpus) = gpus(2) else { return };
    let (d0, d1) = (&gpus.devices[0], &gpus.devices[1]);
    let src = d0.malloc(8 * MIB).unwrap();
    let dst = d1.malloc(8 * MIB).unwrap();
    let stream = d0.create_stream().unwrap();
    // SAFETY: both blocks were just allocated with these sizes; the stream is synchronised before reading.
    unsafe {
        stream.memset_d8(src, 0x5A, 8 * MIB).unwrap();
        stream.copy_peer(dst, d1, src, d0, 8 * MIB).unwrap();
    }
    stream.synchronize().unwrap();
    fill_and_check(d1, dst, 8 * MIB, 0x5A);
    // SAFETY: allocated above with these sizes; idle after the synchronize.
    unsafe {
        d0.free(src, 8 * MIB).unwrap();
        d1.free(dst, 8 * MIB).unwrap();
    }
}

#[test]
#[ignore = "needs two CUDA GPUs (cargo xtask test-gpu runs it)"]
fn peer_access_covers_virtual_memory_mapped_before_and_after_it_is_enabled() {
    let Some(gpus) = gpus(2) else { return };
    let (d0, d1) = (&gpus.devices[0], &gpus.devices[1]);
    if !cuda::can_access_peer(1, 0).unwrap() {
        eprintln!("skipped: device 1 cannot access device 0's memory (cuDeviceCanAccessPeer)");
        return;
    }
    let g = d0.vmm_granularity().unwrap();
    let base = d0.reserve_address_range(2 * g).unwrap();
    let before = d0.create_physical(g).unwrap();
    // SAFETY: in the reservation, unmapped, chunk-sized.
    unsafe { d0.map(base, g, &before).unwrap() };
    d1.enable_peer_access(d0).unwrap();
    d1.enable_peer_access(d0).unwrap(); // twice is fine
    let after = d0.create_physical(g).unwrap();
    // SAFETY: in the reservation, unmapped, chunk-sized.
    unsafe { d0.map(base.offset(g), g, &after).unwrap() };
    // A stream of device 1 fills both chunks of device 0 directly (peer access), device 0 reads them.
    let s1 = d1.create_stream().unwrap();
    // SAFETY: the whole range is mapped and accessible to device 1 now.
    unsafe { s1.memset_d8(base, 0x3C, 2 * g).unwrap() };
    s1.synchronize().unwrap();
    fill_and_check(d0, base, 2 * g, 0x3C);
    // SAFETY: exactly the mappings made above; all streams are idle.
    unsafe {
        d0.unmap(base.offset(g), g, after).unwrap();
        d0.unmap(base, g, before).unwrap();
        d0.release_address_range(base, 2 * g).unwrap();
    }
}

#[test]
#[ignore = "needs two CUDA GPUs (cargo xtask test-gpu runs it)"]
fn each_device_has_its_own_allocator_and_blocks_move_between_them() {
    use tensormem_cuda_alloc::config::AllocatorConfig;
    use tensormem_cuda_alloc::CachingAllocator;

    let Some(gpus) = gpus(2) else { return };
    drop(gpus.devices);
    let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let a0 = CachingAllocator::with_config(CudaBackend::new(0).unwrap(), expandable);
    let a1 = CachingAllocator::new(CudaBackend::new(1).unwrap());
    let (d0, d1) = (a0.device(), a1.device());
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());

    let x = a0.allocate(24 * MIB, s0.id()).unwrap();
    let y = a1.allocate(24 * MIB, s1.id()).unwrap();
    assert_eq!(
        a0.memory_stats().allocated_bytes.all.current,
        x.size() as i64
    );
    assert_eq!(
        a1.memory_stats().allocated_bytes.all.current,
        y.size() as i64
    );
    assert!(a0.reserved_bytes() > 0 && a1.reserved_bytes() > 0);

    // A copy from device 0's block to device 1's.
    // SAFETY: both are live 24 MiB allocations; `s0` is synchronised before they are read.
    unsafe {
        s0.memset_d8(x.ptr(), 0x42, 24 * MIB).unwrap();
        s0.copy_peer(y.ptr(), d1, x.ptr(), d0, 24 * MIB).unwrap();
    }
    s0.synchronize().unwrap();
    fill_and_check(d1, y.ptr(), 24 * MIB, 0x42);

    // With peer access, device 1 writes device 0's expandable segment directly.
    if cuda::can_access_peer(1, 0).unwrap() {
        d1.enable_peer_access(d0).unwrap();
        // SAFETY: `x` is live; nothing else uses it until `s1` is synchronised.
        unsafe { s1.memset_d8(x.ptr(), 0x24, 24 * MIB).unwrap() };
        s1.synchronize().unwrap();
        fill_and_check(d0, x.ptr(), 24 * MIB, 0x24);
    } else {
        eprintln!(
            "note: device 1 cannot access device 0 directly; the direct-write half was not run"
        );
    }

    a0.free(x).unwrap();
    a1.free(y).unwrap();
    a0.empty_cache().unwrap();
    a1.empty_cache().unwrap();
    assert_eq!(a0.reserved_bytes() + a1.reserved_bytes(), 0);
}
