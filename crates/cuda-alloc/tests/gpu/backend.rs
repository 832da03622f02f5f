//! The CUDA backend alone: real memory, events, virtual memory, errors.

use std::sync::mpsc;
use std::time::Duration;

use tensormem_cuda_alloc::backend::cuda::{self, BackendStream, CudaBackend};
use tensormem_cuda_alloc::{CaptureStatus, Device, DeviceError, StreamId};

use crate::harness::gpu;

const MIB: usize = 1 << 20;

/// Fills `[ptr, ptr+len)` with a pattern from the host, reads it back, checks it.
fn write_and_read_back(
    stream: &BackendStream,
    ptr: tensormem_cuda_alloc::DeviceAddress,
    len: usize,
    seed: u8,
) {
    let pattern: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let mut back = vec![0u8; len];
    // SAFETY: `ptr` is `len` bytes of device memory the test owns and nothing else uses.
    unsafe {
        stream.copy_from_host(ptr, &pattern).unwrap();
        stream.copy_to_host(&mut back, ptr).unwrap();
    }
    assert!(
        back == pattern,
        "device memory at {ptr} did not hold what was written"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn malloc_returns_real_aligned_memory_and_free_returns_it() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let stream = dev.create_stream().unwrap();
    let before = dev.mem_info().unwrap();
    let ptr = dev.malloc(64 * MIB).unwrap();
    assert_eq!(ptr.addr() % 512, 0, "{ptr} is not 512-byte aligned");
    let during = dev.mem_info().unwrap();
    assert!(
        during.free + (64 * MIB) as u64 <= before.free + (2 * MIB) as u64,
        "64 MiB allocated but free memory went from {} to {}",
        before.free,
        during.free
    );
    write_and_read_back(&stream, ptr, 64 * MIB, 7);
    // A device-side fill, read back.
    let mut back = vec![0u8; MIB];
    // SAFETY: the first MiB of the allocation is ours.
    unsafe {
        stream.memset_d8(ptr, 0xAB, MIB).unwrap();
        stream.copy_to_host(&mut back, ptr).unwrap();
    }
    assert!(
        back.iter().all(|&b| b == 0xAB),
        "cuMemsetD8 did not fill the block"
    );
    // SAFETY: allocated above with this size, idle (the stream was synchronised by the copy).
    unsafe { dev.free(ptr, 64 * MIB).unwrap() };
    assert_eq!(dev.index(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn an_impossible_malloc_is_out_of_memory_and_the_device_still_works() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let total = dev.mem_info().unwrap().total as usize;
    match dev.malloc(total * 2) {
        Err(DeviceError::OutOfMemory { bytes }) => assert_eq!(bytes, (total * 2) as u64),
        other => panic!("allocating twice the device's memory gave {other:?}, not OutOfMemory"),
    }
    let ptr = dev.malloc(MIB).unwrap();
    // SAFETY: allocated above with this size and unused.
    unsafe { dev.free(ptr, MIB).unwrap() };
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn events_complete_only_after_the_work_before_them() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let stream = dev.create_stream().unwrap();
    let event = dev.create_event().unwrap();
    assert!(
        dev.query_event(&event).unwrap(),
        "a new event counts as complete"
    );
    let (release, wait) = mpsc::channel::<()>();
    // SAFETY: the host function only waits on a channel; it makes no CUDA call.
    unsafe {
        stream
            .launch_host_fn(move || {
                let _ = wait.recv_timeout(Duration::from_secs(60));
            })
            .unwrap();
    }
    dev.record_event(&event, stream.id()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !dev.query_event(&event).unwrap(),
        "the event completed while the stream was held busy"
    );
    assert!(!stream.is_idle().unwrap());
    release.send(()).unwrap();
    dev.synchronize_event(&event).unwrap();
    assert!(dev.query_event(&event).unwrap());
    assert!(stream.is_idle().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn the_default_stream_and_device_synchronize_work() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let event = dev.create_event().unwrap();
    dev.record_event(&event, StreamId::DEFAULT).unwrap();
    dev.synchronize().unwrap();
    assert!(dev.query_event(&event).unwrap());
    assert_eq!(
        dev.capture_status(StreamId::DEFAULT).unwrap(),
        CaptureStatus::None
    );
    let stream = dev.create_stream().unwrap();
    assert_eq!(
        dev.capture_status(stream.id()).unwrap(),
        CaptureStatus::None
    );
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn virtual_memory_maps_chunks_contiguously_and_unmaps_them() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let granularity = dev.vmm_granularity().unwrap();
    assert!(
        granularity.is_power_of_two() && granularity >= 4096,
        "granularity {granularity}"
    );
    // The chunks below are made GPUDirect RDMA capable where the device says it supports that on
    // mapped memory (H100 and H200 do): asking never fails on a device with virtual memory.
    let rdma = dev.expandable_memory_rdma_capable().unwrap();
    println!("expandable segments' memory RDMA capable: {rdma}");
    let stream = dev.create_stream().unwrap();
    let reserved = 8 * granularity;
    let base = dev.reserve_address_range(reserved).unwrap();
    assert_eq!(base.addr() % granularity as u64, 0);
    let free_before = dev.mem_info().unwrap().free;
    let first = dev.create_physical(granularity).unwrap();
    let second = dev.create_physical(granularity).unwrap();
    // SAFETY: both ranges lie in the reservation, are unmapped, and match the chunk sizes.
    unsafe {
        dev.map(base, granularity, &first).unwrap();
        dev.map(base.offset(granularity), granularity, &second)
            .unwrap();
    }
    let free_mapped = dev.mem_info().unwrap().free;
    assert!(free_mapped + 2 * granularity as u64 <= free_before + granularity as u64);
    // One write across the boundary of the two chunks: the range is contiguous device memory.
    write_and_read_back(&stream, base, 2 * granularity, 3);
    // SAFETY: exactly where each chunk was mapped; the stream is idle (the copy synchronised).
    unsafe {
        dev.unmap(base.offset(granularity), granularity, second)
            .unwrap();
        dev.unmap(base, granularity, first).unwrap();
        dev.release_address_range(base, reserved).unwrap();
    }
    let free_after = dev.mem_info().unwrap().free;
    assert!(
        free_after + granularity as u64 >= free_before,
        "unmapping gave back {} of {}",
        free_after as i64 - free_mapped as i64,
        2 * granularity
    );
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn physical_memory_past_capacity_is_out_of_memory() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let granularity = dev.vmm_granularity().unwrap();
    let total = dev.mem_info().unwrap().total as usize;
    // Chunks of 1 GiB (a multiple of the granularity) until the device runs out, as expandable segments
    // would grow: the failure must be the typed out-of-memory error.
    let chunk = (1 << 30) / granularity * granularity;
    let mut chunks = Vec::new();
    let outcome = loop {
        match dev.create_physical(chunk) {
            Ok(c) => chunks.push(c),
            Err(err) => break err,
        }
        assert!(
            chunks.len() * chunk <= total + chunk,
            "created more physical memory than the device has"
        );
    };
    assert!(
        matches!(outcome, DeviceError::OutOfMemory { .. }),
        "running out gave {outcome:?}"
    );
    assert!(!chunks.is_empty());
    drop(chunks);
    // Released on drop: the memory is back.
    let again = dev.create_physical(chunk).unwrap();
    drop(again);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn interprocess_events_export_a_handle_and_plain_ones_refuse() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let ipc = dev.create_interprocess_event().unwrap();
    assert!(ipc.is_interprocess());
    let handle = ipc.ipc_handle().unwrap();
    assert!(
        handle.iter().any(|&b| b != 0),
        "the exported handle is all zeros"
    );
    let plain = dev.create_event().unwrap();
    assert!(matches!(
        plain.ipc_handle(),
        Err(DeviceError::Unsupported { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn properties_and_errors_carry_the_drivers_facts() {
    let Some(gpus) = gpu() else { return };
    let dev = gpus.first();
    let props = dev.properties().unwrap();
    assert!(!props.name.is_empty());
    assert!(
        props.major >= 3 && props.multi_processor_count > 0,
        "{props:?}"
    );
    assert_eq!(props.total_memory, dev.mem_info().unwrap().total);
    let uuid = props.uuid.to_string();
    assert_eq!(uuid.len(), 36, "{uuid}");
    assert_eq!(uuid.matches('-').count(), 4, "{uuid}");
    assert!(props
        .to_string()
        .starts_with("_CudaDeviceProperties(name='"));
    assert!(
        !cuda::can_access_peer(0, 0).unwrap(),
        "a device is not its own peer"
    );

    let count = cuda::device_count().unwrap();
    match CudaBackend::new(count) {
        Err(DeviceError::Driver { code, message, .. }) => {
            assert_eq!(code, 101, "CUDA_ERROR_INVALID_DEVICE");
            assert!(
                message.contains(&format!("no CUDA device {count}")),
                "{message}"
            );
        }
        other => panic!("opening device {count} of {count} gave {other:?}"),
    }
    // A driver error names the call, the code and the driver's name for it: physical chunks must be a
    // multiple of the granularity.
    let granularity = dev.vmm_granularity().unwrap();
    match dev.create_physical(granularity + 512) {
        Err(
            err @ DeviceError::Driver {
                call: "cuMemCreate",
                code: 1,
                ..
            },
        ) => {
            assert!(
                err.to_string().contains("CUDA_ERROR_INVALID_VALUE"),
                "{err}"
            );
        }
        other => panic!("a chunk of granularity + 512 bytes gave {other:?}"),
    }
}
