//! The caching allocator under cudarc: one CUDA context and one set of streams, cudarc's.
//!
//! Allocates a buffer from the cache, fills it with a kernel (PTX source, no NVRTC or toolkit
//! needed), copies it back, checks it, frees it to the cache, allocates again (served from the
//! cache, no new device allocation) and prints the allocator's statistics.
//!
//! ```sh
//! cargo run -p tensormem-cuda-alloc --example cudarc_kernel
//! ```
//!
//! Without a CUDA driver or device it prints why and exits successfully, unless
//! `TENSORMEM_REQUIRE_GPU=1` (then it fails).

use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use tensormem_cuda_alloc::backend::cuda::{self, CudaBackend};
use tensormem_cuda_alloc::CachingAllocator;

const PTX: &str = include_str!("fill.ptx");
const N: u32 = 1 << 20;

fn main() -> ExitCode {
    if let Err(reason) = cuda::init().and_then(|()| match cuda::device_count()? {
        0 => Err(tensormem_cuda_alloc::DeviceError::Unsupported {
            what: "a machine without CUDA devices",
        }),
        _ => Ok(()),
    }) {
        if std::env::var("TENSORMEM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("cudarc_kernel: TENSORMEM_REQUIRE_GPU=1 but there is no usable CUDA device: {reason}");
            return ExitCode::FAILURE;
        }
        eprintln!("skipped: no CUDA driver/device ({reason})");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cudarc_kernel: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // One context (the primary one) and cudarc streams, shared by cudarc and the allocator.
    let ctx = CudaContext::new(0)?;
    let alloc = Arc::new(CachingAllocator::from_env(CudaBackend::from_context(
        Arc::clone(&ctx),
    )?)?);
    let stream = ctx.new_stream()?;
    let fill = ctx.load_module(Ptx::from_src(PTX))?.load_function("fill")?;

    let mut buf = alloc.alloc_zeros::<u32>(N as usize, &stream)?;
    let mut launch = stream.launch_builder(&fill);
    launch.arg(&mut buf).arg(&N);
    // SAFETY: `fill(u32* out, u32 n)` writes `out[i]` for `i < n`, and `buf` holds `N` u32s.
    unsafe { launch.launch(LaunchConfig::for_num_elems(N)) }?;
    let host = stream.clone_dtoh(&buf)?;
    let wrong = (0..N).filter(|&i| host[i as usize] != 3 * i + 7).count();
    if wrong != 0 {
        return Err(format!("{wrong} of {N} values are wrong (first: {:?})", &host[..4]).into());
    }
    println!("filled {N} u32 with a kernel and read them back: all correct");

    let first = buf.allocation().ptr();
    drop(buf); // back to the cache, stream-ordered
    let again = alloc.alloc_zeros::<u32>(N as usize, &stream)?;
    let reused = again.allocation().ptr() == first;
    println!("second allocation served from the cache: {reused}");
    drop(again);
    stream.synchronize()?;

    let stats = alloc.memory_stats().to_flat();
    for key in [
        "allocation.all.allocated",
        "num_device_alloc",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
    ] {
        println!("{key} = {}", stats[key]);
    }
    if !reused || stats["num_device_alloc"] != 1 {
        return Err("the second allocation did not come from the cache".into());
    }
    alloc.device().check_err()?;
    Ok(())
}
