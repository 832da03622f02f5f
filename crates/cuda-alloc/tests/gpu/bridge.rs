//! The cudarc bridge: `CachedSlice` from the caching allocator under cudarc's context and streams,
//! with cudarc's copies and kernels, freed to the cache on drop, stream uses recorded.

use std::sync::Arc;

use cudarc::driver::{CudaContext, DeviceSlice, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::CachingAllocator;

use crate::harness::gpu;

const PTX: &str = include_str!("../../examples/fill.ptx");

fn setup() -> Option<(
    Arc<CudaContext>,
    Arc<CachingAllocator<CudaBackend>>,
    crate::harness::Gpus,
)> {
    let gpus = gpu()?;
    let ctx = CudaContext::new(0).unwrap();
    let device = CudaBackend::from_context(Arc::clone(&ctx)).unwrap();
    Some((ctx, Arc::new(CachingAllocator::new(device)), gpus))
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn cached_slices_take_cudarc_copies_and_go_back_to_the_cache() {
    let Some((ctx, alloc, _gpus)) = setup() else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let host: Vec<u32> = (0..1_000_000).map(|i| i * 7).collect();
    let mut buf = alloc.alloc_zeros::<u32>(host.len(), &stream).unwrap();
    assert_eq!(buf.len(), host.len());
    assert_eq!(buf.stream().cu_stream(), stream.cu_stream());
    assert!(stream.clone_dtoh(&buf).unwrap().iter().all(|&v| v == 0));
    stream.memcpy_htod(&host, &mut buf).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
    let stats = alloc.memory_stats();
    assert_eq!(stats.allocation.all.current, 1);
    let first = buf.allocation().ptr();

    drop(buf);
    let stats = alloc.memory_stats();
    assert_eq!(stats.allocation.all.current, 0, "dropping frees");
    assert!(stats.reserved_bytes.all.current > 0, "to the cache");
    let again = alloc.alloc_zeros::<u32>(host.len(), &stream).unwrap();
    assert_eq!(again.allocation().ptr(), first, "served from the cache");
    assert_eq!(alloc.memory_stats().num_device_alloc, 1);

    // A copy on another registered stream is recorded: the block waits for that stream's event.
    let other = ctx.new_stream().unwrap();
    alloc.device().register_stream(&other).unwrap();
    let mut copy = alloc.alloc_zeros::<u32>(host.len(), &other).unwrap();
    other.memcpy_dtod(&again, &mut copy).unwrap();
    drop(again);
    let stats = alloc.memory_stats();
    assert_eq!(stats.allocation.all.current, 1, "only `copy` is allocated");
    assert_eq!(
        stats.active.all.current, 2,
        "the source waits for the copy's stream"
    );
    other.synchronize().unwrap();
    let next = alloc.alloc_zeros::<u32>(16, &stream).unwrap();
    assert_eq!(
        alloc.memory_stats().active.all.current,
        2,
        "event processed: reusable"
    );
    assert_eq!(other.clone_dtoh(&copy).unwrap(), vec![0; host.len()]);
    drop((copy, next));
    ctx.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes(), 0);
    alloc.device().check_err().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn cached_slices_are_kernel_arguments() {
    let Some((ctx, alloc, _gpus)) = setup() else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let fill = ctx
        .load_module(Ptx::from_src(PTX))
        .unwrap()
        .load_function("fill")
        .unwrap();
    let n: u32 = 300_001;
    let mut buf = alloc.alloc_zeros::<u32>(n as usize, &stream).unwrap();
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut buf).arg(&n);
    // SAFETY: `fill(u32* out, u32 n)` writes `out[i]` for `i < n`; `buf` holds `n` u32s.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    let back = stream.clone_dtoh(&buf).unwrap();
    assert!((0..n).all(|i| back[i as usize] == 3 * i + 7));

    // A kernel on another stream, declared with record_stream, holds the memory back.
    let other = ctx.new_stream().unwrap();
    let mut launch = other.launch_builder(&fill);
    launch.arg(&buf).arg(&n);
    // SAFETY: as above.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    buf.record_stream(&other).unwrap();
    drop(buf);
    assert_eq!(
        alloc.memory_stats().active.all.current,
        1,
        "pending on `other`"
    );
    ctx.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    alloc.device().check_err().unwrap();
}
