//! `host_probe`: what kind of core a benchmark runs on, in four numbers, for reading allocator timings
//! taken on a shared (virtual) machine. No hardware counters needed.
//!
//! ```text
//! host_probe
//!   clock_ghz            a chain of dependent multiplies (3 cycles each): the core's clock
//!   adds_per_cycle       six independent add chains: how many instructions retire per cycle
//!                        (about 4 on an idle Golden Cove core; less when an SMT sibling is busy)
//!   load_ns_<size>       a random pointer chase through that working set: load latency
//!   coin_toss_branch_ns  a loop whose branch follows random bits, against one that alternates:
//!                        the extra time per iteration, about half a misprediction
//!
//! host_probe --quick     the first two figures only, over a tenth of the iterations (a fraction
//!                        of a second: one line per CPU under `taskset -c N`)
//! ```
//!
//! The allocator's hot paths retire about four instructions a cycle, so they slow with
//! `adds_per_cycle`; code that waits on memory slows with `load_ns_*` instead. Compare two hosts'
//! figures before comparing allocator timings taken on them: timings of the same build scale with
//! these figures. x86-64 only (the chains are inline assembly).

use std::hint::black_box;
use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

/// Iterations of the clock and throughput loops.
const ITERS: u64 = 100_000_000;

/// Iterations of the clock and throughput loops with `--quick`.
const QUICK_ITERS: u64 = ITERS / 10;

/// Working-set sizes of the pointer chase, bytes.
const CHASE_SIZES: [usize; 6] = [16 << 10, 40 << 10, 256 << 10, 1536 << 10, 8 << 20, 64 << 20];

/// Loads per pointer chase.
const CHASE_LOADS: usize = 20_000_000;

#[cfg(target_arch = "x86_64")]
fn clock_ghz(iters: u64) -> f64 {
    let mut x: u64 = 1;
    let start = Instant::now();
    for _ in 0..iters {
        // SAFETY: four register-only multiplies; no memory, stack or flags the compiler relies on.
        unsafe {
            std::arch::asm!(
                "imul {x}, {x}, 3",
                "imul {x}, {x}, 3",
                "imul {x}, {x}, 3",
                "imul {x}, {x}, 3",
                x = inout(reg) x,
                options(nomem, nostack),
            );
        }
    }
    black_box(x);
    // Four multiplies of three cycles each per iteration.
    12.0 * iters as f64 / start.elapsed().as_nanos() as f64
}

#[cfg(target_arch = "x86_64")]
fn adds_per_ns(iters: u64) -> f64 {
    let (mut a, mut b, mut c, mut d, mut e, mut f) = (1u64, 2u64, 3u64, 4u64, 5u64, 6u64);
    let step: u64 = black_box(7);
    let start = Instant::now();
    for _ in 0..iters {
        // SAFETY: twelve register-only adds; no memory or stack.
        unsafe {
            std::arch::asm!(
                "add {a}, {s}", "add {b}, {s}", "add {c}, {s}",
                "add {d}, {s}", "add {e}, {s}", "add {f}, {s}",
                "add {a}, {s}", "add {b}, {s}", "add {c}, {s}",
                "add {d}, {s}", "add {e}, {s}", "add {f}, {s}",
                a = inout(reg) a, b = inout(reg) b, c = inout(reg) c,
                d = inout(reg) d, e = inout(reg) e, f = inout(reg) f,
                s = in(reg) step,
                options(nomem, nostack),
            );
        }
    }
    black_box((a, b, c, d, e, f));
    12.0 * iters as f64 / start.elapsed().as_nanos() as f64
}

/// Nanoseconds per load of a random cyclic pointer chase through `bytes` (one load per 64-byte line).
fn chase_ns(bytes: usize) -> f64 {
    const STRIDE: usize = 8; // u64 slots per cache line
    let lines = bytes / 64;
    let mut order: Vec<usize> = (0..lines).collect();
    // A fixed xorshift shuffle: the same cycle on every host.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..lines).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    let mut next = vec![0usize; lines * STRIDE];
    for i in 0..lines {
        next[order[i] * STRIDE] = order[(i + 1) % lines] * STRIDE;
    }
    let mut at = 0;
    for _ in 0..2 * lines {
        at = next[at];
    }
    let start = Instant::now();
    for _ in 0..CHASE_LOADS {
        at = black_box(next[at]);
    }
    let ns = start.elapsed().as_nanos() as f64 / CHASE_LOADS as f64;
    black_box(at);
    ns
}

/// Nanoseconds per iteration of a two-way branch following `bits`.
fn branch_loop_ns(bits: &[bool]) -> f64 {
    const ROUNDS: usize = 200;
    let mut acc = 0u64;
    let start = Instant::now();
    for _ in 0..ROUNDS {
        for (i, &bit) in bits.iter().enumerate() {
            // `black_box` on each arm keeps them apart: a select would have no branch to mispredict.
            if black_box(bit) {
                acc = black_box(acc.wrapping_add(i as u64 * 3));
            } else {
                acc = black_box(acc ^ i as u64);
            }
        }
    }
    black_box(acc);
    start.elapsed().as_nanos() as f64 / (ROUNDS * bits.len()) as f64
}

/// Prints the probe's figures.
fn probe() -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    #[cfg(target_arch = "x86_64")]
    {
        let iters = if quick { QUICK_ITERS } else { ITERS };
        writeln!(out, "clock_ghz {:.2}", clock_ghz(iters))?;
        writeln!(
            out,
            "adds_per_cycle {:.2}",
            adds_per_ns(iters) / clock_ghz(iters)
        )?;
    }
    #[cfg(not(target_arch = "x86_64"))]
    writeln!(out, "clock_ghz n/a (x86-64 only)")?;
    if quick {
        return Ok(());
    }
    for bytes in CHASE_SIZES {
        writeln!(out, "load_ns_{}KiB {:.2}", bytes >> 10, chase_ns(bytes))?;
    }
    let n = 1 << 16;
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let random: Vec<bool> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state & 1 == 1
        })
        .collect();
    let alternating: Vec<bool> = (0..n).map(|i| i % 2 == 1).collect();
    writeln!(
        out,
        "coin_toss_branch_ns {:.2}",
        branch_loop_ns(&random) - branch_loop_ns(&alternating)
    )
}

/// Runs the probe. A reader that stops early (`host_probe | head -2`) ends it quietly, not with a
/// panic on the closed pipe.
fn main() -> ExitCode {
    match probe() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("host_probe: writing the figures: {e}");
            ExitCode::FAILURE
        }
    }
}
