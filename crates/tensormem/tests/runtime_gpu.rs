//! One home for the process's CUDA state, on a real GPU: whichever of the device API, CUDA
//! storages and the PyTorch plugin touches a device first, all of them use the allocator the
//! process runtime keeps for it, with every setting made through any of them. Each test runs in a
//! child process of its own (this binary again), where no device was opened yet.
#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tensormem::cuda;
// The variables the allocator configuration is read from: a child gets none but those it is given.
use tensormem::cuda_alloc::config::Backend;
use tensormem::cuda_alloc::config::ENV_VARS as CONFIG_VARS;
use tensormem::cuda_alloc::snapshot::TraceAction;
use tensormem::storage::{CudaContext, Storage};
use tensormem_test_support::{child, gpu};

const MIB: usize = 1 << 20;

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn under_cuda_malloc_async_cuda_storages_come_from_the_pool_and_are_not_shared() {
    const TEST: &str =
        "under_cuda_malloc_async_cuda_storages_come_from_the_pool_and_are_not_shared";
    if !child::is_child() {
        let Some(_) = gpu::devices(cuda::device_count()) else {
            return;
        };
        return child::run(
            TEST,
            &CONFIG_VARS,
            &[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
        );
    }
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    // The storage comes first: no device API call opened the device.
    let ctx = CudaContext::new(0).unwrap();
    assert!(
        ctx.caching_allocator().is_none(),
        "no caching allocator beside the pool"
    );
    assert_eq!(ctx.allocator().backend(), Backend::CudaMallocAsync);
    let pool = cuda::async_allocator(Some(0)).unwrap();
    let live = pool.live_allocations();
    let storage = Storage::new_cuda(&ctx, 3 * MIB).unwrap();
    assert_eq!(
        pool.live_allocations(),
        live + 1,
        "served by the device's pool"
    );
    storage.fill(7).unwrap();
    assert!(storage.to_vec().unwrap().iter().all(|&b| b == 7));
    assert!(
        cuda::memory_allocated(Some(0)).unwrap() >= 3 * MIB as u64,
        "the device API sees the storage's memory"
    );
    // PyTorch refuses IPC of this backend's memory; so does a storage.
    let refused = storage.share_cuda().unwrap_err().to_string();
    assert!(refused.contains("shareIpcHandle"), "{refused}");
    // Opening another process's memory is refused too (PyTorch's getIpcDevPtr).
    let handle = tensormem::ipc::IpcHandle::empty(0);
    let refused = Storage::new_shared_cuda(&ctx, &handle)
        .unwrap_err()
        .to_string();
    assert!(refused.contains("getIpcDevPtr"), "{refused}");
    drop(storage);
    ctx.synchronize().unwrap();
    assert_eq!(pool.live_allocations(), live);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn settings_history_and_observers_made_before_a_storage_opens_the_device_apply_to_it() {
    const TEST: &str =
        "settings_history_and_observers_made_before_a_storage_opens_the_device_apply_to_it";
    if !child::is_child() {
        let Some(_) = gpu::devices(cuda::device_count()) else {
            return;
        };
        return child::run(TEST, &CONFIG_VARS, &[]);
    }
    let Some(_) = gpu::devices(cuda::device_count()) else {
        return;
    };
    // Made through the device API before any user opened the device.
    cuda::set_allocator_settings("max_split_size_mb:64,garbage_collection_threshold:0.8").unwrap();
    cuda::record_memory_history(true, 10_000).unwrap();
    let ooms = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&ooms);
    cuda::attach_out_of_memory_observer(move |_| {
        seen.fetch_add(1, Ordering::Relaxed);
    })
    .unwrap();

    // A storage opens the device.
    let ctx = CudaContext::new(0).unwrap();
    let allocator = ctx.caching_allocator().expect("backend:native");
    assert!(
        std::ptr::eq(&**allocator, cuda::caching_allocator(Some(0)).unwrap()),
        "one allocator for the device"
    );
    let config = allocator.config();
    assert_eq!(config.max_split_size, 64 << 20, "the settings applied");
    let storage = Storage::new_cuda(&ctx, 5 * MIB).unwrap();
    let snapshot = cuda::memory_snapshot().unwrap();
    assert!(
        snapshot.device_traces[0]
            .iter()
            .any(|e| e.action == TraceAction::Alloc && e.size == 5 * MIB as u64),
        "the storage's allocation is in the recorded history"
    );
    let total = cuda::mem_get_info(Some(0)).unwrap().total;
    assert!(Storage::new_cuda(&ctx, 2 * total as usize).is_err());
    assert_eq!(
        ooms.load(Ordering::Relaxed),
        1,
        "the observer saw the storage's OOM"
    );
    drop(storage);
}
