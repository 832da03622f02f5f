//! Stream ids are numbers anyone can write: the CUDA backend accepts only streams it made or was
//! handed (cudarc streams included), and keeps those the allocator used alive.

use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::{CachingAllocator, Device, DeviceError, Error, StreamId};

use crate::harness::gpu;

fn unknown(result: Result<impl std::fmt::Debug, Error>) -> bool {
    matches!(
        result,
        Err(Error::Device(DeviceError::UnknownStream { .. }))
    )
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn stream_ids_the_backend_does_not_know_are_refused() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = CachingAllocator::new(CudaBackend::new(0).unwrap());
    let bogus = StreamId(0xdead_0000);
    assert!(
        unknown(alloc.allocate(4096, bogus)),
        "allocate on a bogus stream"
    );
    let x = alloc.allocate(4096, StreamId::DEFAULT).unwrap();
    assert!(unknown(alloc.record_stream(&x, bogus)), "record_stream");
    assert!(
        unknown(alloc.record_stream_ptr(x.ptr(), bogus)),
        "record_stream_ptr"
    );
    let device = alloc.device();
    let event = device.create_event().unwrap();
    assert!(matches!(
        device.record_event(&event, bogus),
        Err(DeviceError::UnknownStream { .. })
    ));
    assert!(matches!(
        device.capture_status(bogus),
        Err(DeviceError::UnknownStream { .. })
    ));

    // A stream dropped before the allocator used it is unknown afterwards.
    let gone = device.create_stream().unwrap();
    let gone_id = gone.id();
    drop(gone);
    assert!(
        unknown(alloc.record_stream(&x, gone_id)),
        "a destroyed stream"
    );

    // A cudarc stream handed over is accepted, and kept alive after its owner drops it: freeing the
    // block records an event on it.
    let theirs = device.cudarc_context().new_stream().unwrap();
    let id = device.register_stream(&theirs).unwrap();
    assert_eq!(
        device.cudarc_stream(id).map(|s| s.cu_stream()),
        Some(theirs.cu_stream())
    );
    alloc.record_stream(&x, id).unwrap();
    drop(theirs);
    alloc.free(x).unwrap();
    // A stream made by the backend and used by the allocator stays alive too.
    let ours = device.create_stream().unwrap();
    let y = alloc.allocate(4096, ours.id()).unwrap();
    let ours_id = ours.id();
    drop(ours);
    alloc.free(y).unwrap();
    alloc
        .allocate(4096, ours_id)
        .map(|z| alloc.free(z))
        .unwrap()
        .unwrap();
    device.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
}
