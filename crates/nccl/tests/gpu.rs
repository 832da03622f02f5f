//! Two GPUs of one host, one process: an allocator per device registered with that device's NCCL
//! communicator, an all-reduce on buffers from the allocators, results checked; segments made
//! later are registered and released ones deregistered. `#[ignore]`d (the bundle's run.sh runs it
//! with `--include-ignored`); without two devices or without NCCL it says `skipped: ...`, and
//! fails instead with `TENSORMEM_REQUIRE_GPU=1`. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::nccl::{result, sys};
use tensormem_cuda_alloc::backend::cuda::{check, CudaBackend};
use tensormem_cuda_alloc::{CachingAllocator, Device, DeviceAddress, StreamId};
use tensormem_nccl::Registration;

mod common;
use common::two_gpus_and_nccl;

const S: StreamId = StreamId::DEFAULT;
const MIB: usize = 1 << 20;

fn fill_f32(device: &CudaBackend, ptr: DeviceAddress, value: f32, count: usize) {
    device.make_current().unwrap();
    // SAFETY: `ptr` is an allocation of at least `count` f32s on this device's context.
    check("cuMemsetD32", unsafe {
        cu::cuMemsetD32_v2(ptr.0, value.to_bits(), count)
    })
    .unwrap();
}

fn read_f32(device: &CudaBackend, ptr: DeviceAddress, count: usize) -> Vec<f32> {
    device.make_current().unwrap();
    let mut out = vec![0f32; count];
    // SAFETY: `out` has room for `count` f32s; `ptr` holds at least that many.
    check("cuMemcpyDtoH", unsafe {
        cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr.0, count * 4)
    })
    .unwrap();
    out
}

fn comms() -> Vec<sys::ncclComm_t> {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let mut comms = vec![std::ptr::null_mut(); 2];
    // SAFETY: `comms` has room for two communicators; devices 0 and 1 exist (checked).
    unsafe { result::comm_init_all(comms.as_mut_ptr(), 2, [0, 1].as_ptr()) }.unwrap();
    comms
}

/// One all-reduce (sum, in place) of `count` f32s at each device's `ptr`.
fn all_reduce(
    devices: &[CudaBackend],
    comms: &[sys::ncclComm_t],
    ptrs: &[DeviceAddress],
    count: usize,
) {
    result::group_start().unwrap();
    for ((device, &comm), ptr) in devices.iter().zip(comms).zip(ptrs) {
        device.make_current().unwrap();
        // SAFETY: `ptr` holds `count` f32s on the communicator's device; the null stream is the
        // device's legacy default stream.
        unsafe {
            result::all_reduce(
                ptr.0 as *const c_void,
                ptr.0 as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                comm,
                std::ptr::null_mut(),
            )
        }
        .unwrap();
    }
    result::group_end().unwrap();
    for device in devices {
        device.make_current().unwrap();
        Device::synchronize(device).unwrap();
    }
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL (cargo xtask test-gpu runs it)"]
fn an_all_reduce_on_registered_pool_buffers_is_right_and_segments_follow_the_allocator() {
    if !two_gpus_and_nccl() {
        return;
    }
    let comms = comms();
    let devices: Vec<CudaBackend> = (0..2).map(|d| CudaBackend::new(d).unwrap()).collect();
    let allocators: Vec<Arc<CachingAllocator<CudaBackend>>> = (0..2)
        .map(|d| Arc::new(CachingAllocator::new(CudaBackend::new(d).unwrap())))
        .collect();
    // One segment exists before the registration, one is made after it.
    let early: Vec<_> = allocators
        .iter()
        .map(|a| a.allocate(3 * MIB, S).unwrap())
        .collect();
    // SAFETY: each communicator lives on its allocator's device and is destroyed at the end, after
    // the registrations are dropped.
    let registrations: Vec<Registration> = allocators
        .iter()
        .zip(&comms)
        .map(|(a, &c)| unsafe { Registration::new(a, c) }.unwrap())
        .collect();
    for (r, e) in registrations.iter().zip(&early) {
        assert!(
            r.ranges()
                .iter()
                .any(|&(addr, size)| addr <= e.ptr().0 && e.ptr().0 < addr + size),
            "the existing segment is registered: {:?}",
            r.ranges()
        );
    }
    let count = 16 * MIB / 4;
    let buffers: Vec<_> = allocators
        .iter()
        .map(|a| a.allocate(count * 4, S).unwrap())
        .collect();
    for (rank, (device, buffer)) in devices.iter().zip(&buffers).enumerate() {
        fill_f32(device, buffer.ptr(), rank as f32 + 1.0, count);
    }
    for (r, b) in registrations.iter().zip(&buffers) {
        assert!(
            r.ranges()
                .iter()
                .any(|&(addr, size)| addr <= b.ptr().0
                    && b.ptr().0 + (count as u64 * 4) <= addr + size),
            "a new segment is registered as it is made"
        );
    }
    let ptrs: Vec<DeviceAddress> = buffers.iter().map(|b| b.ptr()).collect();
    all_reduce(&devices, &comms, &ptrs, count);
    for (device, ptr) in devices.iter().zip(&ptrs) {
        let out = read_f32(device, *ptr, count);
        assert!(out.iter().all(|&v| v == 3.0), "1 + 2 on every element");
    }
    // Freed and the cache emptied: the segments are deregistered before they are released.
    for (a, (b, e)) in allocators.iter().zip(buffers.into_iter().zip(early)) {
        a.free(b).unwrap();
        a.free(e).unwrap();
        a.empty_cache().unwrap();
    }
    for r in &registrations {
        assert_eq!(
            r.ranges(),
            Vec::<(u64, u64)>::new(),
            "nothing left registered"
        );
        assert_eq!(r.errors(), Vec::new(), "NCCL accepted every call");
    }
    drop(registrations);
    for comm in comms {
        // SAFETY: the communicator is live and no registration uses it any more.
        unsafe { result::comm_destroy(comm) }.unwrap();
    }
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL (cargo xtask test-gpu runs it)"]
fn expandable_segments_are_registered_as_they_grow() {
    if !two_gpus_and_nccl() {
        return;
    }
    let comms = comms();
    let devices: Vec<CudaBackend> = (0..2).map(|d| CudaBackend::new(d).unwrap()).collect();
    let config =
        tensormem_cuda_alloc::config::AllocatorConfig::parse("expandable_segments:True").unwrap();
    let allocators: Vec<Arc<CachingAllocator<CudaBackend>>> = (0..2)
        .map(|d| {
            Arc::new(CachingAllocator::with_config(
                CudaBackend::new(d).unwrap(),
                config.clone(),
            ))
        })
        .collect();
    // SAFETY: as in the test above.
    let registrations: Vec<Registration> = allocators
        .iter()
        .zip(&comms)
        .map(|(a, &c)| unsafe { Registration::new(a, c) }.unwrap())
        .collect();
    let count = 48 * MIB / 4;
    let buffers: Vec<_> = allocators
        .iter()
        .map(|a| a.allocate(count * 4, S).unwrap())
        .collect();
    for (rank, (device, buffer)) in devices.iter().zip(&buffers).enumerate() {
        fill_f32(device, buffer.ptr(), 10.0 * (rank as f32 + 1.0), count);
    }
    let ptrs: Vec<DeviceAddress> = buffers.iter().map(|b| b.ptr()).collect();
    all_reduce(&devices, &comms, &ptrs, count);
    for (device, ptr) in devices.iter().zip(&ptrs) {
        assert!(read_f32(device, *ptr, count).iter().all(|&v| v == 30.0));
    }
    for (a, b) in allocators.iter().zip(buffers) {
        a.free(b).unwrap();
        a.empty_cache().unwrap();
    }
    for r in &registrations {
        assert!(
            r.ranges().is_empty(),
            "unmapped chunks are deregistered: {:?}",
            r.ranges()
        );
        assert_eq!(r.errors(), Vec::new());
    }
    drop(registrations);
    for comm in comms {
        // SAFETY: as above.
        unsafe { result::comm_destroy(comm) }.unwrap();
    }
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL (cargo xtask test-gpu runs it)"]
fn a_pool_backed_by_nccl_registers_only_its_own_segments() {
    use tensormem_cuda_alloc::{MempoolId, PoolOptions};
    use tensormem_nccl::NcclPoolAllocator;
    if !two_gpus_and_nccl() {
        return;
    }
    let comms = comms();
    let devices: Vec<CudaBackend> = (0..2).map(|d| CudaBackend::new(d).unwrap()).collect();
    let allocators: Vec<Arc<CachingAllocator<CudaBackend>>> = (0..2)
        .map(|d| Arc::new(CachingAllocator::new(CudaBackend::new(d).unwrap())))
        .collect();
    let pool = MempoolId(0, 7);
    let mut pool_allocators = Vec::new();
    for (d, (a, &comm)) in allocators.iter().zip(&comms).enumerate() {
        // SAFETY: `comm` lives on device `d` and is destroyed after the allocators are dropped.
        let nccl = unsafe { NcclPoolAllocator::new(d as u32, comm) }.unwrap();
        a.create_pool(
            pool,
            PoolOptions {
                allocator: Some(nccl.clone()),
                ..PoolOptions::default()
            },
        )
        .unwrap();
        pool_allocators.push(nccl);
    }
    let count = 8 * MIB / 4;
    let mut buffers = Vec::new();
    let mut outside = Vec::new();
    for (a, nccl) in allocators.iter().zip(&pool_allocators) {
        a.begin_allocate_to_pool(pool, |_| true).unwrap();
        let b = a.allocate(count * 4, S).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        // As `torch.cuda.use_mem_pool` does: beginning to allocate to the pool took a use.
        a.release_pool(pool).unwrap();
        let o = a.allocate(count * 4, S).unwrap();
        let ranges = nccl.ranges();
        assert!(
            ranges
                .iter()
                .any(|&(addr, size)| addr <= b.ptr().0 && b.ptr().0 < addr + size),
            "the pool's segment is registered"
        );
        assert!(
            !ranges
                .iter()
                .any(|&(addr, size)| addr <= o.ptr().0 && o.ptr().0 < addr + size),
            "memory outside the pool is not"
        );
        buffers.push(b);
        outside.push(o);
    }
    for (rank, (device, buffer)) in devices.iter().zip(&buffers).enumerate() {
        fill_f32(device, buffer.ptr(), 0.5 + rank as f32, count);
    }
    let ptrs: Vec<DeviceAddress> = buffers.iter().map(|b| b.ptr()).collect();
    all_reduce(&devices, &comms, &ptrs, count);
    for (device, ptr) in devices.iter().zip(&ptrs) {
        assert!(read_f32(device, *ptr, count).iter().all(|&v| v == 2.0));
    }
    for ((a, b), o) in allocators.iter().zip(buffers).zip(outside) {
        a.free(b).unwrap();
        a.free(o).unwrap();
        a.release_pool(pool).unwrap();
        a.empty_cache().unwrap();
    }
    for nccl in &pool_allocators {
        assert!(
            nccl.ranges().is_empty(),
            "the pool's segments were deregistered and freed"
        );
        assert_eq!(nccl.errors(), Vec::new());
    }
    drop(allocators);
    drop(pool_allocators);
    for comm in comms {
        // SAFETY: as above.
        unsafe { result::comm_destroy(comm) }.unwrap();
    }
}
