//! All-reduce bus bandwidth on two GPUs of one host, on buffers from tensormem's allocator
//! registered with NCCL (`tensormem_nccl::Registration`) against buffers of an allocator that is
//! not registered, sizes 1 MiB to 1 GiB, in one run. Prints CSV rows
//! `size_bytes,unregistered_gbps,registered_gbps,ratio`. Bus bandwidth as nccl-tests reports it:
//! `2 (n - 1) / n * bytes / time`. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`).
//!
//! `nccl_pool_bench [--quick]` (NCCL's library on `LD_LIBRARY_PATH`; the bundle's run.sh sets it).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::nccl::{result, sys};
use tensormem_cuda_alloc::backend::cuda::{self, CudaBackend};
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Device, StreamId};
use tensormem_nccl::Registration;

const S: StreamId = StreamId::DEFAULT;

type Allocators = Vec<Arc<CachingAllocator<CudaBackend>>>;

fn all_reduce(
    devices: &[CudaBackend],
    comms: &[sys::ncclComm_t],
    buffers: &[Allocation],
    bytes: usize,
) {
    result::group_start().expect("ncclGroupStart");
    for ((device, &comm), buffer) in devices.iter().zip(comms).zip(buffers) {
        device.make_current().expect("context");
        // SAFETY: `buffer` holds `bytes` bytes on the communicator's device; the null stream is
        // the device's legacy default stream.
        unsafe {
            result::all_reduce(
                buffer.ptr().0 as *const c_void,
                buffer.ptr().0 as *mut c_void,
                bytes / 4,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                comm,
                std::ptr::null_mut(),
            )
        }
        .expect("ncclAllReduce");
    }
    result::group_end().expect("ncclGroupEnd");
}

fn sync(devices: &[CudaBackend]) {
    for device in devices {
        device.make_current().expect("context");
        Device::synchronize(device).expect("synchronize");
    }
}

/// Median bus bandwidth in GB/s of `iters` all-reduces of `bytes` on each allocator's buffer.
fn measure(
    devices: &[CudaBackend],
    comms: &[sys::ncclComm_t],
    allocators: &Allocators,
    bytes: usize,
    iters: usize,
) -> f64 {
    let buffers: Vec<Allocation> = allocators
        .iter()
        .map(|a| a.allocate(bytes, S).expect("allocate"))
        .collect();
    for _ in 0..3 {
        all_reduce(devices, comms, &buffers, bytes);
    }
    sync(devices);
    let mut rates = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        all_reduce(devices, comms, &buffers, bytes);
        sync(devices);
        let seconds = start.elapsed().as_secs_f64();
        rates.push(bytes as f64 / seconds / 1e9); // 2 (n - 1) / n = 1 for two ranks
    }
    for (a, b) in allocators.iter().zip(buffers) {
        a.free(b).expect("free");
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

fn comms() -> Vec<sys::ncclComm_t> {
    let mut comms = vec![std::ptr::null_mut(); 2];
    // SAFETY: `comms` has room for two communicators; devices 0 and 1 exist (checked by the caller).
    unsafe { result::comm_init_all(comms.as_mut_ptr(), 2, [0, 1].as_ptr()) }
        .expect("ncclCommInitAll");
    comms
}

fn main() {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let quick = std::env::args().any(|a| a == "--quick");
    match cuda::device_count() {
        Ok(n) if n >= 2 => {}
        other => {
            eprintln!("nccl_pool_bench: two GPUs needed ({other:?})");
            std::process::exit(2);
        }
    }
    let devices: Vec<CudaBackend> = (0..2)
        .map(|d| CudaBackend::new(d).expect("device"))
        .collect();
    let make = || -> Allocators {
        (0..2)
            .map(|d| Arc::new(CachingAllocator::new(CudaBackend::new(d).expect("device"))))
            .collect()
    };
    // Separate communicators, so that NCCL's own caches of registrations do not mix.
    let (plain_comms, registered_comms) = (comms(), comms());
    let (plain, registered) = (make(), make());
    // SAFETY: each communicator lives on its allocator's device and is destroyed after the
    // registrations are dropped (at the end of `main`).
    let registrations: Vec<Registration> = registered
        .iter()
        .zip(&registered_comms)
        .map(|(a, &c)| unsafe { Registration::new(a, c) }.expect("registration"))
        .collect();
    println!("size_bytes,unregistered_gbps,registered_gbps,ratio");
    let sizes: Vec<usize> = if quick {
        vec![1 << 20, 64 << 20]
    } else {
        (20..=30).step_by(2).map(|p| 1usize << p).collect()
    };
    for bytes in sizes {
        let iters = if bytes >= 256 << 20 { 10 } else { 30 };
        // Alternated, so that drift on the host hits both alike.
        let mut pairs = Vec::new();
        for _ in 0..3 {
            let p = measure(&devices, &plain_comms, &plain, bytes, iters);
            let r = measure(&devices, &registered_comms, &registered, bytes, iters);
            pairs.push((p, r));
        }
        pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (p, r) = pairs[1];
        println!("{bytes},{p:.2},{r:.2},{:.3}", r / p);
    }
    for r in &registrations {
        for error in r.errors() {
            eprintln!("nccl_pool_bench: {error}");
        }
    }
    drop(registrations);
    for comm in plain_comms.into_iter().chain(registered_comms) {
        // SAFETY: live communicators, no registration uses them any more.
        unsafe { result::comm_destroy(comm) }.expect("ncclCommDestroy");
    }
}
