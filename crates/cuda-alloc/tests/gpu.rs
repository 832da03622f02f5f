//! Tests on a real GPU: the CUDA backend, and the caching allocator on top of it.
//!
//! Every test is `#[ignore]`d, so a plain `cargo test` lists it as ignored; `cargo xtask test-gpu` and the
//! bundle's `run.sh` run them with `--include-ignored`. A test run without a CUDA driver and device prints
//! `skipped: no CUDA driver/device (...)` on stderr and passes, unless `TENSORMEM_REQUIRE_GPU=1` (what
//! `cargo xtask test-gpu` and `run.sh` set), which makes it fail. Tests that need two GPUs skip on a
//! machine with one, even then.
//!
//! The tests hold one process-wide lock while they run: they measure device memory, so two of them must
//! not allocate at the same time.
#![cfg(feature = "cuda")]

#[path = "gpu/allocator.rs"]
mod allocator;
#[path = "gpu/backend.rs"]
mod backend;
#[path = "gpu/bridge.rs"]
mod bridge;
#[path = "gpu/capture.rs"]
mod capture;
#[path = "gpu/harness.rs"]
mod harness;
#[cfg(feature = "snapshot-io")]
#[path = "gpu/interop.rs"]
mod interop;
#[path = "gpu/multi_gpu.rs"]
mod multi_gpu;
#[path = "gpu/pinned.rs"]
mod pinned;
#[path = "gpu/sleep.rs"]
mod sleep;
#[path = "gpu/streams.rs"]
mod streams;
#[path = "gpu/teardown.rs"]
mod teardown;
