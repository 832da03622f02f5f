//! `alloc_profile`: one allocator pattern on the simulated device, `N` times, for instruction
//! counting (`valgrind --tool=callgrind`, `perf stat`). Run it with two counts and take the
//! difference to get the cost per iteration without the set-up:
//!
//! ```text
//! alloc_profile PATTERN API N [STREAM]
//!   PATTERN: hot512 | hot1m | hot64m | mixed     API: handle | raw
//!   STREAM: the stream id, hex (default 5000; e.g. 55d0c8a3b2c0 for a value like a CUstream handle)
//! ```
//!
//! `hot*`: allocate and free one block of that size `N` times (after one warm-up pair);
//! `mixed`: 256 live blocks of log-uniform sizes 2^9..2^25, `N` steps of free-one-then-allocate.
//! Prints nothing timed: timing is `alloc_patterns`' job.

use std::process::ExitCode;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, Result, StreamId};

/// The stream every pattern runs on unless the command line names another.
const STREAM: StreamId = StreamId(0x5000);

/// Allocate and free by handle or by pointer.
#[derive(Clone, Copy)]
enum Api {
    Handle,
    Raw,
}

/// A live block under either API.
enum Live {
    Handle(tensormem_cuda_alloc::Allocation),
    Raw(DeviceAddress),
}

fn alloc(a: &CachingAllocator<SimDevice>, api: Api, size: usize, stream: StreamId) -> Result<Live> {
    Ok(match api {
        Api::Handle => Live::Handle(a.allocate(size, stream)?),
        Api::Raw => Live::Raw(a.raw_alloc(size, stream)?),
    })
}

fn free(a: &CachingAllocator<SimDevice>, live: Live) -> Result<()> {
    match live {
        Live::Handle(h) => a.free(h),
        Live::Raw(p) => a.raw_free(p),
    }
}

/// A small xorshift generator (the sizes only need to be spread, not the harness's).
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn run(pattern: &str, api: Api, n: usize, stream: StreamId) -> std::result::Result<(), String> {
    let a = CachingAllocator::with_config(SimDevice::new(80 << 30), AllocatorConfig::default());
    let err = |e: tensormem_cuda_alloc::Error| e.to_string();
    let hot = |size: usize| -> std::result::Result<(), String> {
        free(&a, alloc(&a, api, size, stream).map_err(err)?).map_err(err)?;
        for _ in 0..n {
            let block = alloc(&a, api, std::hint::black_box(size), stream).map_err(err)?;
            free(&a, block).map_err(err)?;
        }
        Ok(())
    };
    match pattern {
        "hot512" => hot(512),
        "hot1m" => hot(1 << 20),
        "hot64m" => hot(64 << 20),
        "mixed" => {
            let mut rng = 0x2545_f491_4f6c_dd1d_u64;
            let size = |rng: &mut u64| 1usize << (9 + next(rng) % 17);
            let mut live = Vec::with_capacity(256);
            for _ in 0..256 {
                let s = size(&mut rng);
                live.push(alloc(&a, api, s, stream).map_err(err)?);
            }
            for _ in 0..n {
                let k = (next(&mut rng) % 256) as usize;
                let s = size(&mut rng);
                let block = alloc(&a, api, s, stream).map_err(err)?;
                free(&a, std::mem::replace(&mut live[k], block)).map_err(err)?;
            }
            Ok(())
        }
        other => Err(format!("unknown pattern {other:?}")),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: alloc_profile hot512|hot1m|hot64m|mixed handle|raw N [STREAM-HEX]";
    let (pattern, api, n, stream) = match args.as_slice() {
        [pattern, api, n] => (pattern, api, n, Some(STREAM)),
        [pattern, api, n, stream] => (
            pattern,
            api,
            n,
            u64::from_str_radix(stream, 16).ok().map(StreamId),
        ),
        _ => {
            eprintln!("{usage}");
            return ExitCode::FAILURE;
        }
    };
    let Some(stream) = stream else {
        eprintln!("{usage}");
        return ExitCode::FAILURE;
    };
    let api = match api.as_str() {
        "handle" => Api::Handle,
        "raw" => Api::Raw,
        _ => {
            eprintln!("{usage}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(n) = n.parse() else {
        eprintln!("{usage}");
        return ExitCode::FAILURE;
    };
    match run(pattern, api, n, stream) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("alloc_profile: {e}");
            ExitCode::FAILURE
        }
    }
}
