//! `pinned_patterns`: tensormem's pinned host caching allocator measured the way
//! `benches/anchors/torch_pinned_bench.py` measures PyTorch's, printing the same CSV rows
//! (`pattern,bytes,value,unit`) so the two can be set side by side from one call on the GPU host:
//!
//! ```text
//! pinned_patterns                 # cuMemHostAlloc blocks (PyTorch's default)
//! pinned_patterns --register 8    # heap + cuMemHostRegister, pages touched by 8 threads
//! ```
//!
//! | pattern | what |
//! | --- | --- |
//! | `pinned_first_alloc` | the first (uncached) allocation of 4 KiB, 1 MiB, 64 MiB, µs |
//! | `pinned_cached_pair` | a cached allocate + free pair, median of 5 runs of 2000 (200 for 64 MiB), µs |
//! | `h2d_copy_pinned`, `h2d_copy_pageable` | a 256 MiB host-to-device copy and synchronize, median of 5, GB/s |

use std::process::ExitCode;
use std::time::Instant;

use tensormem_cuda_alloc::backend::cuda::{CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::Device;

const SIZES: [usize; 3] = [4096, 1 << 20, 64 << 20];
const COPY_BYTES: usize = 256 << 20;

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn run(register: Option<usize>) -> Result<(), String> {
    let device = CudaBackend::new(0).map_err(|e| format!("opening CUDA device 0: {e}"))?;
    let source = match register {
        Some(threads) => CudaPinnedSource::host_register(&device, threads),
        None => CudaPinnedSource::host_alloc(&device),
    };
    let host = HostCachingAllocator::new(device, source);
    let fail = |what: &str, e: tensormem_cuda_alloc::Error| format!("{what}: {e}");
    println!("pattern,bytes,value,unit");
    for n in SIZES {
        let started = Instant::now();
        let first = host.allocate(n).map_err(|e| fail("allocating", e))?;
        let first_us = started.elapsed().as_secs_f64() * 1e6;
        host.free(first).map_err(|e| fail("freeing", e))?;
        let reps = if n <= 1 << 20 { 2000 } else { 200 };
        let mut samples = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            for _ in 0..reps {
                let buffer = host.allocate(n).map_err(|e| fail("allocating", e))?;
                host.free(buffer).map_err(|e| fail("freeing", e))?;
            }
            samples.push(started.elapsed().as_secs_f64() / f64::from(reps));
        }
        println!("pinned_first_alloc,{n},{first_us:.1},us");
        println!("pinned_cached_pair,{n},{:.2},us", median(samples) * 1e6);
    }
    let device = host.device();
    let stream = device
        .create_stream()
        .map_err(|e| format!("creating a stream: {e}"))?;
    let on_device = device
        .malloc(COPY_BYTES)
        .map_err(|e| format!("allocating device memory: {e}"))?;
    let mut pinned = host
        .allocate(COPY_BYTES)
        .map_err(|e| fail("allocating", e))?;
    pinned.as_mut_slice().fill(1);
    let pageable = vec![1u8; COPY_BYTES];
    for (kind, src) in [("pinned", pinned.as_slice()), ("pageable", &pageable[..])] {
        let mut samples = Vec::new();
        for round in 0..6 {
            let started = Instant::now();
            // SAFETY: `on_device` is a live allocation of COPY_BYTES used only here; the copy
            // synchronizes before returning.
            unsafe { stream.copy_from_host(on_device, src) }
                .map_err(|e| format!("copying: {e}"))?;
            if round > 0 {
                samples.push(started.elapsed().as_secs_f64()); // the first is the warm-up
            }
        }
        println!(
            "h2d_copy_{kind},{COPY_BYTES},{:.1},GB/s",
            COPY_BYTES as f64 / median(samples) / 1e9
        );
    }
    host.free(pinned).map_err(|e| fail("freeing", e))?;
    // SAFETY: allocated above, idle (every copy synchronized).
    unsafe { device.free(on_device, COPY_BYTES) }.map_err(|e| format!("freeing: {e}"))?;
    let stats = host.stats().to_flat();
    println!(
        "host_stats,num_host_alloc={},allocations.peak={},allocated_bytes.peak={},,",
        stats["num_host_alloc"], stats["allocations.peak"], stats["allocated_bytes.peak"]
    );
    host.empty_cache()
        .map_err(|e| fail("emptying the cache", e))
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let register = match (args.next().as_deref(), args.next()) {
        (None, _) => None,
        (Some("--register"), Some(n)) => match n.parse() {
            Ok(threads) if threads > 0 => Some(threads),
            _ => {
                eprintln!("pinned_patterns: --register {n}: not a positive thread count");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: pinned_patterns [--register THREADS]");
            return ExitCode::from(2);
        }
    };
    match run(register) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pinned_patterns: {message}");
            ExitCode::FAILURE
        }
    }
}
