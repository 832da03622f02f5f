//! Programs that change the allocator while they run: `torch.cuda.set_per_process_memory_fraction`
//! called again mid-run, lower and then higher, or higher and then lower. The trace records no
//! such call; the replay infers from the recorded decisions where the limit changed and what it
//! allowed, and reproduces the run exactly.
//!
//! The traces are tensormem's own (its allocator records PyTorch's events), on a simulated device,
//! with `pool_id` removed as PyTorch 2.11 writes them.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, StreamId};
use tensormem_replay::{ExpectedStats, Replay};

mod common;

use common::{assert_exact, recorded, recording, xorshift, TOTAL};

const S: StreamId = StreamId(0);
const MIB: usize = 1 << 20;

/// Limits the allocator to `bytes` of the device, as `set_per_process_memory_fraction` does.
fn limit(allocator: &CachingAllocator<SimDevice>, bytes: usize) {
    allocator
        .set_memory_fraction(bytes as f64 / TOTAL as f64)
        .unwrap();
}

/// Allocates `size` bytes until the allocator refuses one (at most `most`): the allocations made.
fn until_refused(
    allocator: &CachingAllocator<SimDevice>,
    size: usize,
    most: usize,
) -> Vec<Allocation> {
    let mut kept = Vec::new();
    for _ in 0..most {
        match allocator.allocate(size, S) {
            Ok(a) => kept.push(a),
            Err(_) => break,
        }
    }
    kept
}

/// The limits the replay inferred for device 0: (first event, bytes allowed).
fn phases(replay: &Replay) -> Vec<(usize, u64)> {
    replay
        .capacity_inference(0)
        .unwrap()
        .phases
        .iter()
        .map(|p| (p.from_event, p.allowed))
        .collect()
}

/// The configurations each program is recorded under.
const CONFIGS: [&str; 4] = [
    "",
    "expandable_segments:True",
    "garbage_collection_threshold:0.6",
    "max_split_size_mb:40,roundup_power2_divisions:4",
];

/// A limit of 64 MiB with out-of-memory errors the program catches, then 300 MiB, reaching well
/// past the first limit: no single limit explains both parts.
#[test]
fn a_fraction_lowered_then_raised_is_found_where_it_changed() {
    for config in CONFIGS {
        lowered_then_raised(config);
    }
}

fn lowered_then_raised(config: &str) {
    let allocator = recording(config);
    limit(&allocator, 64 * MIB);
    let mut first = until_refused(&allocator, 20 * MIB, 10);
    assert_eq!(first.len(), 3);
    allocator.free(first.remove(0)).unwrap();
    let small = allocator.allocate(6 * MIB, S).unwrap();
    assert!(allocator.allocate(30 * MIB, S).is_err());
    limit(&allocator, 300 * MIB);
    let second = until_refused(&allocator, 20 * MIB, 10);
    assert_eq!(second.len(), 10);
    for a in first.into_iter().chain(second).chain([small]) {
        allocator.free(a).unwrap();
    }
    let big = allocator.allocate(50 * MIB, S).unwrap();
    allocator.free(big).unwrap();

    let (snapshot, expected) = recorded(&allocator);
    let replay = assert_exact(&snapshot, expected);
    let inferred = phases(&replay);
    assert_eq!(inferred.len(), 2, "{config}: {inferred:?}");
    assert!(inferred[0].1 < 80 << 20 && inferred[0].1 >= 60 << 20);
    assert!(inferred[1].1 >= 220 << 20);
    let inference = replay.capacity_inference(0).unwrap();
    assert!(inference.consistent, "{inference:?}");
}

/// A limit of 300 MiB reached, everything freed, then 100 MiB: the next segments release the
/// cache first (the limit is below what is reserved) and the program runs out at 100 MiB, and
/// again after it freed what it had.
#[test]
fn a_fraction_raised_then_lowered_is_found_where_it_changed() {
    for config in CONFIGS {
        raised_then_lowered(config);
    }
}

fn raised_then_lowered(config: &str) {
    // With expandable segments the cache left by the first part serves the second without a new
    // mapping, and the first refusal is explained by either limit: one phase fits.
    let expandable = config.contains("expandable");
    let allocator = recording(config);
    limit(&allocator, 300 * MIB);
    let first = until_refused(&allocator, 20 * MIB, 12);
    assert_eq!(first.len(), 12);
    for a in first {
        allocator.free(a).unwrap();
    }
    limit(&allocator, 100 * MIB);
    let second = until_refused(&allocator, 30 * MIB, 10);
    assert_eq!(second.len(), if expandable { 8 } else { 3 }, "{config}");
    for a in second {
        allocator.free(a).unwrap();
    }
    let again = until_refused(&allocator, 30 * MIB, 10);
    assert_eq!(again.len(), if expandable { 8 } else { 3 }, "{config}");
    for a in again {
        allocator.free(a).unwrap();
    }

    let (snapshot, expected) = recorded(&allocator);
    let replay = assert_exact(&snapshot, expected);
    let inferred = phases(&replay);
    if expandable {
        assert!(inferred.is_empty(), "{config}: {inferred:?}");
        return;
    }
    assert_eq!(inferred.len(), 2, "{config}: {inferred:?}");
    assert!(
        inferred[1].1 >= 90 << 20 && inferred[1].1 < 130 << 20,
        "{config}: {inferred:?}"
    );
}

/// One limit for the whole run, with out-of-memory errors: one phase, as before.
#[test]
fn a_fraction_set_once_is_one_phase() {
    let allocator = recording("");
    limit(&allocator, 64 * MIB);
    let kept = until_refused(&allocator, 20 * MIB, 10);
    assert_eq!(kept.len(), 3);
    for a in kept {
        allocator.free(a).unwrap();
    }
    let (snapshot, expected) = recorded(&allocator);
    let replay = assert_exact(&snapshot, expected);
    assert!(phases(&replay).len() <= 1);
}

/// Under garbage collection, `empty_cache()` followed by a new segment: the program's release, not
/// the collector's (which would have released less).
#[test]
fn empty_cache_under_garbage_collection_is_the_programs() {
    let allocator = recording("garbage_collection_threshold:0.6");
    limit(&allocator, 100 * MIB);
    let first = until_refused(&allocator, 30 * MIB, 10);
    assert_eq!(first.len(), 3);
    for a in first {
        allocator.free(a).unwrap();
    }
    allocator.empty_cache().unwrap();
    let second = until_refused(&allocator, 35 * MIB, 10);
    assert_eq!(second.len(), 2);
    for a in second {
        allocator.free(a).unwrap();
    }
    let (snapshot, expected) = recorded(&allocator);
    assert_exact(&snapshot, expected);
}

/// Replays `snapshot` and returns the settings phases the replay found: (first event, the
/// configuration's canonical string).
fn settings_phases(snapshot: &Snapshot, expected: ExpectedStats) -> Vec<(usize, String)> {
    let replay = assert_exact(snapshot, expected);
    replay
        .settings_inference(0)
        .unwrap()
        .phases
        .iter()
        .map(|p| (p.from_event, p.config.to_string()))
        .collect()
}

/// Allocates and frees, in a fixed order, blocks of sizes rounding and splitting decide
/// differently: large blocks freed and then asked for in smaller pieces, and odd sizes.
fn churn(allocator: &CachingAllocator<SimDevice>, seed: u64) {
    let mut next = xorshift(seed);
    let mut live: Vec<Allocation> = Vec::new();
    for _ in 0..200 {
        if live.len() > 12 || (!live.is_empty() && next().is_multiple_of(3)) {
            let i = (next() % live.len() as u64) as usize;
            allocator.free(live.swap_remove(i)).unwrap();
        } else {
            let size = match next() % 4 {
                0 => (next() % 900 + 1) as usize * 1000,
                1 => (next() % 60 + 1) as usize * MIB + 12_345,
                2 => (next() % 8 + 1) as usize * 5 * MIB,
                _ => (next() % 200 + 2) as usize * MIB,
            };
            live.push(allocator.allocate(size, S).unwrap());
        }
    }
    for a in live {
        allocator.free(a).unwrap();
    }
}

/// A program that started under one set of settings and set others halfway (the first departs
/// from the recorded ones): the replay finds the earlier settings and where they changed.
#[test]
fn settings_changed_while_the_program_ran_are_found() {
    let cases = [
        // (settings at start, settings set halfway)
        ("", "max_split_size_mb:64"),
        ("max_split_size_mb:100", ""),
        ("", "roundup_power2_divisions:4"),
        ("roundup_power2_divisions:8", "max_split_size_mb:200"),
        ("", "expandable_segments:True"),
    ];
    for (start, then) in cases {
        let allocator = recording(start);
        churn(&allocator, 7);
        allocator.apply_settings(then).unwrap();
        churn(&allocator, 11);
        let (snapshot, expected) = recorded(&allocator);
        let found = settings_phases(&snapshot, expected);
        let want_start = AllocatorConfig::parse(start).unwrap().to_string();
        let want_then = AllocatorConfig::parse(then).unwrap().to_string();
        assert_eq!(found.len(), 2, "{start:?} then {then:?}: {found:?}");
        assert_eq!(found[0], (0, want_start), "{start:?} then {then:?}");
        assert_eq!(found[1].1, want_then, "{start:?} then {then:?}");
    }
}

/// A program that set other settings twice or three times while it ran: the replay finds each
/// stretch's settings and where it began.
#[test]
fn settings_changed_several_times_are_found() {
    let cases: [(&str, &[&str], u64); 4] = [
        // (settings at start, settings set one after the other, seed)
        (
            "",
            &["roundup_power2_divisions:4", "max_split_size_mb:64"],
            7,
        ),
        (
            "",
            &["roundup_power2_divisions:4", "max_split_size_mb:64"],
            5,
        ),
        (
            "max_split_size_mb:100",
            &["roundup_power2_divisions:8", "max_split_size_mb:40"],
            9,
        ),
        (
            "",
            &[
                "roundup_power2_divisions:2",
                "roundup_power2_divisions:8",
                "max_split_size_mb:200",
            ],
            11,
        ),
    ];
    for (start, thens, seed) in cases {
        let allocator = recording(start);
        churn(&allocator, seed);
        for (k, then) in thens.iter().enumerate() {
            allocator.apply_settings(then).unwrap();
            churn(&allocator, seed + 4 + k as u64);
        }
        let (snapshot, expected) = recorded(&allocator);
        let found = settings_phases(&snapshot, expected);
        assert!(
            found.len() > thens.len(),
            "{start:?} then {thens:?}: {found:?}"
        );
        let want_start = AllocatorConfig::parse(start).unwrap().to_string();
        assert_eq!(found[0], (0, want_start), "{start:?} then {thens:?}");
        assert!(
            found.windows(2).all(|w| w[0].0 < w[1].0),
            "each stretch after the last: {found:?}"
        );
    }
}

/// A program made with one `max_split_size_mb` that set another before any block was as large as
/// either: no allocation tells, but the `max_split_size` figure (kept from the allocator's
/// creation) does; the replay is exact.
#[test]
fn a_split_limit_changed_where_no_allocation_tells_is_found_from_the_figures() {
    let allocator = recording("");
    churn(&allocator, 7);
    allocator.apply_settings("max_split_size_mb:300").unwrap();
    churn(&allocator, 11);
    let (snapshot, expected) = recorded(&allocator);
    let found = settings_phases(&snapshot, expected);
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0].1, AllocatorConfig::default().to_string());
    assert_eq!(
        found[1].1,
        AllocatorConfig::parse("max_split_size_mb:300")
            .unwrap()
            .to_string()
    );
}

/// Random allocations of up to `max_mib` MiB with random lifetimes, every refusal caught and the
/// live blocks dropped (a program that catches `torch.OutOfMemoryError`).
fn oom_loop(
    allocator: &CachingAllocator<SimDevice>,
    seed: u64,
    max_mib: u64,
    live: &mut Vec<Allocation>,
) {
    let mut next = xorshift(seed);
    for _ in 0..150 {
        let size = ((next() % max_mib) + 1) as usize * MIB - (next() % 4096) as usize;
        match allocator.allocate(size, S) {
            Ok(a) => live.push(a),
            Err(_) => {
                for a in live.drain(..) {
                    allocator.free(a).unwrap();
                }
            }
        }
        if live.len() > 12 || (!live.is_empty() && next() % 10 < 3) {
            let i = (next() % live.len() as u64) as usize;
            allocator.free(live.swap_remove(i)).unwrap();
        }
    }
}

/// Garbage collection under a memory fraction with its threshold changed (or turned on) mid-run,
/// out-of-memory errors caught: several earlier thresholds explain the allocations about as far,
/// and the statistics (retries, synchronizations) tell which one was in force.
/// A program that catches its out-of-memory errors under a limit of `mib` MiB, made under
/// `config`: two stretches of [`oom_loop`] from `seed`, `between` done between them (settings or
/// the limit changed), every block freed at the end. Its snapshot and statistics.
fn caught_ooms(
    config: &str,
    mib: usize,
    seed: u64,
    between: impl FnOnce(&CachingAllocator<SimDevice>),
) -> (Snapshot, ExpectedStats) {
    let allocator = recording(config);
    limit(&allocator, mib * MIB);
    let mut live = Vec::new();
    oom_loop(&allocator, seed, 48, &mut live);
    between(&allocator);
    oom_loop(&allocator, seed + 100, 48, &mut live);
    for a in live {
        allocator.free(a).unwrap();
    }
    recorded(&allocator)
}

#[test]
fn a_garbage_collection_threshold_changed_while_the_program_ran_is_found() {
    for (start, then, seed) in [
        (
            "garbage_collection_threshold:0.6",
            "garbage_collection_threshold:0.9",
            45,
        ),
        (
            "garbage_collection_threshold:0.9",
            "garbage_collection_threshold:0.5",
            8,
        ),
        // Turned on mid-run: the releases before bound the limit as retries, not collections.
        ("", "garbage_collection_threshold:0.7", 3),
        ("", "garbage_collection_threshold:0.7", 5),
        ("", "garbage_collection_threshold:0.7", 11),
    ] {
        let (snapshot, expected) = caught_ooms(start, 96, seed, |a| {
            a.apply_settings(then).unwrap();
        });
        let found = settings_phases(&snapshot, expected);
        assert_eq!(found.len(), 2, "{start} then {then}: {found:?}");
        let threshold = |text: &str| {
            AllocatorConfig::parse(text)
                .unwrap()
                .garbage_collection_threshold
        };
        assert_eq!(
            AllocatorConfig::parse(&found[0].1)
                .unwrap()
                .garbage_collection_threshold,
            threshold(start),
            "{start} then {then}: {found:?}"
        );
    }
}

/// Rounding or the split limit changed mid-run under a memory fraction, out-of-memory errors
/// caught: under the final settings the early allocations look like a private pool's, and the
/// pools invented for them must not hide the settings that were in force.
#[test]
fn a_rounding_or_split_change_under_a_fraction_with_caught_ooms_is_found() {
    for then in ["max_split_size_mb:40", "roundup_power2_divisions:4"] {
        for seed in [3, 8, 45] {
            let (snapshot, expected) = caught_ooms("", 96, seed, |a| {
                a.apply_settings(then).unwrap();
            });
            let found = settings_phases(&snapshot, expected);
            let settings = |text: &str| {
                let config = AllocatorConfig::parse(text).unwrap();
                (config.max_split_size, config.roundup_power2_divisions)
            };
            let found: Vec<_> = found.iter().map(|(_, text)| settings(text)).collect();
            assert_eq!(found, [settings(""), settings(then)], "{then}, seed {seed}");
        }
    }
}

/// Garbage collection turned off, or the split limit dropped while rounding was turned on, under
/// a memory fraction with out-of-memory errors caught: whether a free completed right before a
/// release run depends on the settings in force then (a collection or a release of oversize
/// blocks does not synchronize), so the trace is read under each stretch's settings.
#[test]
fn frees_are_read_under_the_settings_in_force_when_they_changed() {
    let cases: [(&str, &str, u64); 6] = [
        ("garbage_collection_threshold:0.6", "", 3),
        // Turned off where no allocation tells: the retries and synchronizations do.
        ("garbage_collection_threshold:0.6", "", 5),
        ("garbage_collection_threshold:0.6", "", 11),
        ("garbage_collection_threshold:0.6", "", 45),
        ("max_split_size_mb:40", "roundup_power2_divisions:2", 3),
        ("max_split_size_mb:40", "roundup_power2_divisions:2", 8),
    ];
    for (start, then, seed) in cases {
        let (snapshot, expected) = caught_ooms(start, 96, seed, |a| {
            a.apply_settings(then).unwrap();
        });
        let found = settings_phases(&snapshot, expected);
        let settings = |text: &str| {
            let config = AllocatorConfig::parse(text).unwrap();
            (
                config.max_split_size,
                config.roundup_power2_divisions,
                config.garbage_collection_threshold > 0.0,
            )
        };
        // Several thresholds can explain every decision and figure (the replay is exact): the
        // collection being on or off is what the record decides.
        let found: Vec<_> = found.iter().map(|(_, text)| settings(text)).collect();
        assert_eq!(
            found,
            [settings(start), settings(then)],
            "{start} then {then}, seed {seed}"
        );
    }
}

/// Garbage collection under a memory fraction the trace implies (the snapshot does not record
/// it), out-of-memory errors caught: the decisions bound the bytes allowed to an interval, and
/// where in it they lie decides when the collector acts; the statistics tell.
#[test]
fn garbage_collection_under_an_implied_fraction_is_exact() {
    for seed in [9, 21] {
        let (snapshot, expected) =
            caught_ooms("garbage_collection_threshold:0.7", 96, seed, |_| {});
        assert_exact(&snapshot, expected);
    }
}

/// Under expandable segments a mapping is checked against the limit as the request's segment
/// size and then maps whole chunks, so the bytes reserved after it may pass the limit: they do not
/// bound it from below. A limit raised mid-run is found where the program raised it.
#[test]
fn a_limit_raised_under_expandable_segments_is_found() {
    for seed in [5, 9, 11] {
        let (snapshot, expected) = caught_ooms("expandable_segments:True", 64, seed, |a| {
            limit(a, 128 * MIB);
        });
        let replay = assert_exact(&snapshot, expected);
        assert_eq!(
            phases(&replay).len(),
            2,
            "seed {seed}: {:?}",
            phases(&replay)
        );
    }
}

/// Expandable segments under a memory fraction whose reservations come and go: a reservation made
/// where an earlier one was released (the driver reuses address space) says nothing of the earlier
/// one's size, so the device's memory is bounded only by ranges in use at the same time.
#[test]
fn reservations_made_after_others_were_released_do_not_bound_the_device() {
    for seed in [7, 9] {
        let (snapshot, expected) = caught_ooms(
            "expandable_segments:True,max_split_size_mb:40",
            96,
            seed,
            |_| {},
        );
        assert_exact(&snapshot, expected);
    }
}

/// Rounding turned off and a split limit set at once: an allocation made under the wrong
/// rounding right after the switch can land where the record has it, so a switch placed a little
/// late looks too early; the points before the first event the earlier settings cannot explain
/// are tried one by one.
#[test]
fn a_switch_whose_first_allocations_do_not_tell_is_found() {
    let allocator = recording("roundup_power2_divisions:4");
    let mut next = xorshift(21);
    let mut live: Vec<Allocation> = Vec::new();
    for stretch in 0..2 {
        if stretch == 1 {
            allocator.apply_settings("max_split_size_mb:64").unwrap();
        }
        for _ in 0..150 {
            let size = ((next() % 48) + 1) as usize * MIB - (next() % 4096) as usize;
            live.push(allocator.allocate(size, S).unwrap());
            if live.len() > 12 || next() % 10 < 3 {
                let i = (next() % live.len() as u64) as usize;
                allocator.free(live.swap_remove(i)).unwrap();
            }
        }
    }
    for a in live {
        allocator.free(a).unwrap();
    }
    let (snapshot, expected) = recorded(&allocator);
    let found = settings_phases(&snapshot, expected);
    assert_eq!(found.len(), 2, "{found:?}");
}

/// Expandable segments with a split limit under a memory fraction, out-of-memory errors caught,
/// the settings never changed: a request below the split limit may not take an oversize free
/// block, so the allocator checks the limit (with the request's segment size) and releases the
/// cache before it takes the free mapped end of a segment, mapping nothing. Such a release is the
/// allocator's retry, not `empty_cache()`, and the replay counts it as the record does.
#[test]
fn a_release_before_a_request_that_maps_nothing_is_the_allocators_retry() {
    let allocator = recording("expandable_segments:True,max_split_size_mb:40");
    limit(&allocator, 256 * MIB);
    let mut next = xorshift(2 * 7919);
    let mut live = Vec::new();
    for _ in 0..197 {
        let r = next();
        let size = ((r % 48) as usize + 1) * MIB - (r >> 20) as usize % 4096;
        match allocator.allocate(size, S) {
            Ok(a) => live.push(a),
            Err(_) => {
                for a in live.drain(..) {
                    allocator.free(a).unwrap();
                }
            }
        }
        if live.len() > 10 || (!live.is_empty() && next() % 10 < 3) {
            let i = (next() as usize) % live.len();
            allocator.free(live.swap_remove(i)).unwrap();
        }
    }
    for a in live {
        allocator.free(a).unwrap();
    }
    let (snapshot, expected) = recorded(&allocator);
    assert!(expected.figures["num_alloc_retries"] > expected.figures["num_ooms"]);
    assert_exact(&snapshot, expected);
}
