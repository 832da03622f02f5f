//! Writes the seed inputs of the fuzz targets into `fuzz/regressions/<target>/seed-*`: small valid
//! inputs the fuzzers start from (they are replayed by `cargo test` like every kept input).
//!
//! `cargo run -p tensormem-fuzz-checks --example make_seeds`

use std::path::Path;
use std::process::ExitCode;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};
use tensormem_shm::transfer::RegionHeader;
use tensormem_shm::RefcountHeader;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("make_seeds: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions");
    let write = |target: &str, name: &str, data: &[u8]| -> std::io::Result<()> {
        std::fs::write(root.join(target).join(format!("seed-{name}")), data)
    };

    // A small snapshot: two streams, a split segment, a pending record_stream, a short trace.
    let alloc = CachingAllocator::new(SimDevice::with_fixed_addresses(0, 1 << 30));
    alloc.record_history(true, 64);
    let a = alloc.allocate(3000, StreamId(0))?;
    let b = alloc.allocate(5 << 20, StreamId(7))?;
    alloc.record_stream(&a, StreamId(7))?;
    let c = alloc.allocate(700, StreamId(0))?;
    alloc.free(a)?;
    alloc.record_annotation("step");
    let snapshot = alloc.snapshot();
    let mut pickle = Vec::new();
    snapshot.write_pickle(&mut pickle)?;
    write("pickle", "small.pickle", &pickle)?;
    let mut gz = Vec::new();
    snapshot.write_pickle_gz(&mut gz)?;
    write("pickle", "small.pickle.gz", &gz)?;
    let mut json = Vec::new();
    snapshot.write_json(&mut json)?;
    write("snapshot_json", "small.json", &json)?;
    alloc.free(b)?;
    alloc.free(c)?;

    for (name, conf) in [
        ("defaults", ""),
        (
            "all-keys",
            "backend:native,max_split_size_mb:40,max_non_split_rounding_mb:512,\
             roundup_power2_divisions:[256:2,512:4,>:8],garbage_collection_threshold:0.6,\
             expandable_segments:True,release_lock_on_cudamalloc:True,\
             pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
        ),
        ("divisions", "roundup_power2_divisions:4"),
        (
            "more-keys",
            "per_process_memory_fraction:0.5,pinned_use_background_threads:True,throw_on_cudamalloc_oom:True",
        ),
    ] {
        write("alloc_conf", name, conf.as_bytes())?;
    }

    let header = RegionHeader {
        len: 4096,
        offset: 64,
        read_only: true,
        user_len: 12,
    };
    let mut message = header.encode().to_vec();
    message.extend_from_slice(&RefcountHeader { refcount: 2 }.encode()[..32]);
    write("shm_header", "region-and-refcount", &message)?;

    // Hello, Register new "/torch_1_2_3", Register existing, Release, Forget, Status; then replies.
    let mut frames = vec![0x01, 8, 0, 1, 0, 0, 0, 0x39, 0x30, 0, 0];
    for kind in [0x02u8, 0x03, 0x04, 0x05] {
        frames.extend_from_slice(&[kind, 12, 0]);
        frames.extend_from_slice(b"/torch_1_2_3");
    }
    frames.extend_from_slice(&[0x06, 0, 0]);
    write("manager_protocol", "requests", &frames)?;
    let mut replies = vec![
        0x81, 8, 0, 1, 0, 0, 0, 0x39, 0x30, 0, 0, 0x82, 0, 0, 0x84, 1, 0, 1,
    ];
    replies.extend_from_slice(&[0x85, 0, 0, 0x86, 8, 0, 2, 0, 0, 0, 5, 0, 0, 0, 0xFF, 2, 0]);
    replies.extend_from_slice(b"no");
    write("manager_protocol", "replies", &replies)?;

    // Operation sequences: the bytes decode through `arbitrary`, so any bytes do; these are a few
    // fixed patterns (counting up, all ones, a repeated short cycle).
    write("alloc_ops", "counting", &(0..=255u8).collect::<Vec<_>>())?;
    write("alloc_ops", "ones", &[0xFF; 128])?;
    write(
        "alloc_ops",
        "cycle",
        &[0, 1, 0, 2, 3, 0, 3, 0, 5, 1, 3, 4].repeat(16),
    )?;
    Ok(())
}
