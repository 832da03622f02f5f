//! Two GPUs: peer access, copies between devices, virtual memory shared with a peer, one allocator per
//! device. Skipped on machines with one GPU.

use tensormem_cuda_alloc::backend::cuda::{self, CudaDevice};
use tensormem_cuda_alloc::{Device, DevicePtr};

use crate::harness::gpus;

const MIB: usize = 1 << 20;

fn fill_and_check(dev: &CudaDevice, ptr: DevicePtr, len: usize, value: u8) {
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
