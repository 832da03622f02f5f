//! The replay engine on the recorded PyTorch traces (`traces/`, or `$TENSORMEM_TRACES_DIR`): under the
//! recorded configuration every figure of PyTorch's `memory_stats()` must come out exactly; under
//! other configurations the replay must run to the end.

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::snapshot::{Snapshot, TraceAction, TraceEntry};
use tensormem_cuda_alloc::{CachingAllocator, StreamId, DEFAULT_STREAM_CAPACITY};
use tensormem_replay::{ExpectedStats, Replay, RunOptions};

mod common;

use common::load_trace;

const TRACES: [&str; 29] = [
    "gpt2_train",
    "gpt2_train__expandable_segments-True",
    "multistream",
    "oom_pressure",
    "cudagraph_train",
    "two_gpu",
    "varlen_pressure__per_process_memory_fraction-0.019",
    "mempool",
    "varlen_pressure__per_process_memory_fraction-0.025_garbage_collection_threshold-0.6",
    "mempool2",
    "compile_ro_shapes",
    "compile_train_ro",
    "compile_train_ro__expandable_segments-True",
    "graph_expandable__expandable_segments-True",
    "graph_shared_pool",
    "mempool_loop",
    "record_stream_multi",
    "mempool_expandable__expandable_segments-True",
    "varlen_pressure2__fraction-0.004",
    "oom_expandable__fraction-0.004_expandable_segments-True",
    "oom_max_split__fraction-0.005_max_split_size_mb-32",
    "compile_ro",
    "compile_ro_keep",
    "compile_ro_keep_mix",
    "compile_ro_keep__expandable_segments-True",
    "compile_ro__expandable_segments-True",
    "oom_gc__fraction-0.004_garbage_collection_threshold-0.6",
    "mempool_empty_cache",
    "oom_mempool_use_on_oom__fraction-0.004",
];

/// Every figure the allocator tracks that PyTorch's `memory_stats()` reports for all pools.
fn tracked_keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "num_device_alloc",
        "num_device_free",
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
    ]
    .map(String::from)
    .to_vec();
    for stat in [
        "reserved_bytes",
        "allocated_bytes",
        "requested_bytes",
        "active",
        "active_bytes",
        "allocation",
        "segment",
        "inactive_split",
        "inactive_split_bytes",
    ] {
        for field in ["current", "peak", "allocated", "freed"] {
            keys.push(format!("{stat}.all.{field}"));
        }
    }
    keys
}

fn exact(name: &str) {
    let (snapshot, expected) = load_trace(name);
    let replay = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(expected.clone());
    let run = replay.run_recorded().unwrap();
    let ours = run.flat_stats();
    // Figures the trace only bounds (the replay reports them as assumptions): at most PyTorch's.
    let undetermined: Vec<&tensormem_replay::StatMismatch> = run.devices[0]
        .check
        .as_ref()
        .and_then(|c| c.stats.as_ref())
        .map(|s| s.undetermined.iter().collect())
        .unwrap_or_default();
    let mut wrong = Vec::new();
    for key in tracked_keys() {
        let want = *expected
            .figures
            .get(&key)
            .unwrap_or_else(|| panic!("{name}.stats.json lacks {key}"));
        let have = *ours
            .get(&key)
            .unwrap_or_else(|| panic!("the replay lacks {key}"));
        let bounded = undetermined.iter().any(|u| u.key == key) && have < want;
        if have != want && !bounded {
            wrong.push(format!("{key}: replay {have}, PyTorch {want}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: {}\nfirst divergence: {:?}",
        wrong.join("; "),
        run.devices[0].check.as_ref().map(|c| &c.divergence)
    );
    for device in &run.devices {
        let figures = expected.for_device(device.device).unwrap_or_else(|| {
            panic!(
                "{name}.stats.json has no figures for device {}",
                device.device
            )
        });
        exact_device(name, device, figures);
    }
    assert_eq!(run.matches_record(), Some(true));
    assert_eq!(run.events, snapshot.event_count() as u64);
}

/// One device of a recorded run against its `memory_stats(d)`.
fn exact_device(name: &str, device: &tensormem_replay::DeviceRun, expected: &ExpectedStats) {
    let check = device.check.as_ref().expect("recorded runs are checked");
    // Every allocation landed where PyTorch put it, with the same bytes reserved.
    assert_eq!(check.divergence, None, "{name}");
    assert_eq!(
        check.allocations,
        expected.figures["allocation.all.allocated"] as u64
    );
    // The final segments equal the snapshot's, block for block.
    let segments = check.segments.as_ref().unwrap();
    assert!(segments.recorded > 0);
    assert!(
        segments.mismatches.is_empty(),
        "{name}: {:?}",
        segments.mismatches
    );
    // Every other figure of the stats file that the replay has matches too.
    let stats = check.stats.as_ref().unwrap();
    assert!(stats.compared >= tracked_keys().len());
    assert!(
        stats.mismatches.is_empty(),
        "{name} device {}: {:?}",
        device.device,
        stats.mismatches
    );
    // New segments were all placed at the recorded addresses.
    assert_eq!(device.addresses.invented, 0, "{name}");
    assert!(device.addresses.recorded > 0);
    // The requests PyTorch could not serve were refused here too, and no others.
    assert_eq!(
        device.refused as i64, expected.figures["num_ooms"],
        "{name}"
    );
}

#[test]
fn gpt2_train_replays_exactly() {
    exact("gpt2_train");
}

#[test]
fn gpt2_train_expandable_segments_replays_exactly() {
    exact("gpt2_train__expandable_segments-True");
}

#[test]
fn multistream_replays_exactly() {
    exact("multistream");
}

/// A real PyTorch run on a nearly full GPU (`traces/record_oom_pressure.py`): 23 retries, 10 OOMs,
/// 51 segments released by the OOM path and by `empty_cache`, all reproduced.
#[test]
fn oom_pressure_replays_exactly() {
    let (_, expected) = load_trace("oom_pressure");
    assert!(expected.figures["num_ooms"] > 0 && expected.figures["num_alloc_retries"] > 0);
    assert!(expected.figures["num_device_free"] > 0);
    exact("oom_pressure");
}

/// A training step captured as a CUDA graph (its own stream, a private pool), replayed, the graph
/// destroyed, then eager allocations: the private pool's allocations are inferred and replayed in a
/// private pool.
#[test]
fn cudagraph_train_replays_exactly() {
    exact("cudagraph_train");
    let (snapshot, _) = load_trace("cudagraph_train");
    let replay = Replay::new(&snapshot).unwrap();
    let attribution = replay.pool_attribution(0).unwrap();
    assert!(attribution.has_private());
    assert!(attribution.undecided.is_empty());
}

/// Two devices, one allocator each, each checked against its own `memory_stats(d)`.
#[test]
fn two_gpu_replays_exactly_per_device() {
    let (_, expected) = load_trace("two_gpu");
    assert_eq!(expected.devices.len(), 2);
    exact("two_gpu");
}

/// A memory fraction with out-of-memory errors: the allowed bytes are inferred from the recorded
/// decisions, with no flag.
#[test]
fn varlen_pressure_under_a_fraction_replays_exactly_with_no_flag() {
    let name = "varlen_pressure__per_process_memory_fraction-0.019";
    let (snapshot, expected) = load_trace(name);
    assert!(expected.figures["num_ooms"] > 0);
    exact(name);
    let replay = Replay::new(&snapshot).unwrap();
    let inference = replay.capacity_inference(0).unwrap();
    assert!(inference.consistent);
    assert!(inference.oom_bounds > 0);
    let upper = inference.upper.unwrap();
    assert!(inference.lower <= upper);
    let allowed = (0.019 * replay.default_capacity(0) as f64) as u64;
    assert!((inference.lower..=upper).contains(&allowed), "{allowed}");
}

/// `torch.cuda.use_mem_pool` around every third allocation on the one stream the program uses: the
/// pool's allocations are told from the default pool's by the segments they land in.
#[test]
fn mempool_replays_exactly() {
    exact("mempool");
    let (snapshot, _) = load_trace("mempool");
    let replay = Replay::new(&snapshot).unwrap();
    let attribution = replay.pool_attribution(0).unwrap();
    let pooled: u64 = attribution
        .pools
        .iter()
        .filter(|p| !p.pool.is_default())
        .map(|p| p.allocations)
        .sum();
    // Every third of the 400 allocations.
    assert_eq!(pooled, 134);
    assert!(attribution.undecided.is_empty());
}

/// A memory fraction with garbage collection: OOMs bound the allowed bytes, releases do not.
#[test]
fn varlen_pressure_with_garbage_collection_replays_exactly_with_no_flag() {
    exact("varlen_pressure__per_process_memory_fraction-0.025_garbage_collection_threshold-0.6");
}

/// Out-of-memory errors caught by the program under `torch.cuda.set_per_process_memory_fraction()`,
/// which the snapshot's settings do not record: the `oom` events the device had room for imply the
/// fraction, and every failed request fails in the replay too.
#[test]
fn caught_ooms_under_a_fraction_set_in_the_program_replay_exactly_with_no_flag() {
    for name in [
        "varlen_pressure2__fraction-0.004",
        "oom_expandable__fraction-0.004_expandable_segments-True",
        "oom_max_split__fraction-0.005_max_split_size_mb-32",
        // With garbage collection: its releases do not synchronize, so a block freed right
        // before them was free at once.
        "oom_gc__fraction-0.004_garbage_collection_threshold-0.6",
    ] {
        exact(name);
        let (snapshot, _) = load_trace(name);
        let replay = Replay::new(&snapshot).unwrap();
        let inference = replay.capacity_inference(0).unwrap();
        assert!(inference.fraction_implied, "{name}");
        assert!(inference.consistent, "{name}");
    }
}

/// Two `MemPool`s on one stream beside eager allocations, with `empty_cache()` between phases and
/// one pool deleted in the middle: a segment whose assumed pool makes the trace allocate into a
/// released pool, or a segment made the default pools' by a contradiction that a default
/// allocation then skips, had its pool wrong, and the inference tries again.
#[test]
fn mempools_with_empty_cache_between_phases_replay_exactly() {
    exact("mempool_empty_cache");
}

/// Two `MemPool`s on one stream beside eager allocations, both destroyed at the end, one still
/// holding tensors: the segments one run of releases frees belong to as few pools as the record
/// allows (one `empty_cache` of each, one synchronization each).
#[test]
fn mempools_destroyed_together_replay_exactly() {
    exact("mempool2");
    let (snapshot, expected) = load_trace("mempool2");
    let run = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(expected.clone())
        .run_recorded()
        .unwrap();
    assert_eq!(
        run.flat_stats()["num_sync_all_streams"],
        expected.figures["num_sync_all_streams"]
    );
}

/// Inductor's CUDA graph trees (`torch.compile(mode="reduce-overhead")`), inference over five batch
/// sizes and training: the graph tree's private pool is inferred; the `empty_cache` of every capture
/// that released nothing is reported as an assumption.
#[test]
fn cuda_graph_trees_replay_exactly() {
    exact("compile_ro_shapes");
    exact("compile_train_ro");
}

/// Expandable segments inside private pools (a `torch.cuda.graph` capture, graph trees): the pools
/// map segments of their own, with no `segment.*` figures, as PyTorch 2.11 does.
/// Graph trees that record a graph on a new path after replaying others restore their pool to a
/// checkpoint first (`setCheckpointPoolState`): the trace shows only the blocks the restore cuts,
/// and the replay restores the pool through the allocator's checkpoint API.
#[test]
fn checkpoint_restores_of_cuda_graph_trees_replay_exactly() {
    for (name, restores) in [
        ("compile_ro", 3),
        ("compile_ro_keep_mix", 1),
        // The pool's expandable segments are checkpointed where they are mapped.
        ("compile_ro__expandable_segments-True", 3),
    ] {
        exact(name);
        let (snapshot, _) = load_trace(name);
        let run = Replay::new(&snapshot).unwrap().run_recorded().unwrap();
        assert_eq!(
            run.devices[0].restores,
            tensormem_replay::RestoreCount {
                applied: restores,
                not_applied: 0
            },
            "{name}"
        );
    }
    // Graph trees that keep outputs alive across calls without restoring replay exactly too.
    exact("compile_ro_keep");
    // Optimizer steps cut segments of the default pools much as a restore cuts a graph tree's:
    // with no private pool, nothing is a restore.
    for name in ["gpt2_train", "gpt2_train__expandable_segments-True"] {
        let (snapshot, _) = load_trace(name);
        let run = Replay::new(&snapshot).unwrap().run_recorded().unwrap();
        assert_eq!(
            run.devices[0].restores,
            tensormem_replay::RestoreCount::default(),
            "{name}"
        );
    }
    exact("compile_ro_keep__expandable_segments-True");
}

#[test]
fn expandable_segments_in_private_pools_replay_exactly() {
    exact("graph_expandable__expandable_segments-True");
    exact("compile_train_ro__expandable_segments-True");
}

#[test]
fn timeline_peaks_are_the_statistics_peaks() {
    let (snapshot, _) = load_trace("gpt2_train");
    let replay = Replay::new(&snapshot).unwrap();
    let run = replay.run_recorded().unwrap();
    let stats = run.flat_stats();
    let points = &run.devices[0].timeline.points;
    assert!(
        points.len() > 100 && points.len() <= 1001,
        "{}",
        points.len()
    );
    let max =
        |f: fn(&tensormem_replay::TimelinePoint) -> u64| points.iter().map(f).max().unwrap() as i64;
    assert_eq!(max(|p| p.allocated), stats["allocated_bytes.all.peak"]);
    assert_eq!(max(|p| p.reserved), stats["reserved_bytes.all.peak"]);
    assert_eq!(max(|p| p.requested), stats["requested_bytes.all.peak"]);
    assert!(points.windows(2).all(|w| w[0].event < w[1].event));
}

#[test]
fn what_if_runs_complete_under_other_configurations() {
    for name in TRACES {
        let (snapshot, _) = load_trace(name);
        let replay = Replay::new(&snapshot).unwrap();
        let recorded = replay.run_recorded().unwrap().flat_stats();
        for config in [
            "expandable_segments:True",
            "expandable_segments:False",
            "max_split_size_mb:64",
            "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
            "roundup_power2_divisions:4",
        ] {
            let run = replay
                .run_with(config)
                .unwrap_or_else(|e| panic!("{name} under {config}: {e}"));
            let stats = run.flat_stats();
            assert_eq!(run.matches_record(), None);
            if recorded["num_ooms"] > 0 {
                // On a full device another configuration fails other requests: every request of the
                // trace was still made, and each either succeeded or ran out of memory.
                let attempts = snapshot
                    .trace(0)
                    .iter()
                    .filter(|e| matches!(e.action, TraceAction::Alloc | TraceAction::Oom))
                    .count() as i64;
                assert_eq!(
                    stats["allocation.all.allocated"] + stats["num_ooms"],
                    attempts,
                    "{name} under {config}"
                );
                assert!(stats["reserved_bytes.all.peak"] >= stats["allocated_bytes.all.peak"]);
                continue;
            }
            // Every allocation of the trace was made and every free given back.
            assert_eq!(
                stats["allocation.all.allocated"], recorded["allocation.all.allocated"],
                "{name} under {config}"
            );
            assert_eq!(stats["num_ooms"], 0, "{name} under {config}");
            assert_eq!(
                stats["requested_bytes.all.peak"], recorded["requested_bytes.all.peak"],
                "{name} under {config}: callers asked for the same bytes"
            );
            assert!(stats["reserved_bytes.all.peak"] >= stats["allocated_bytes.all.peak"]);
        }
    }
}

#[test]
fn the_recorded_configuration_applied_again_changes_nothing() {
    let (snapshot, _) = load_trace("gpt2_train__expandable_segments-True");
    let replay = Replay::new(&snapshot).unwrap();
    let recorded = replay.run_recorded().unwrap();
    let same = replay.run_with("expandable_segments:True").unwrap();
    assert_eq!(recorded.flat_stats(), same.flat_stats());
    assert_eq!(same.devices[0].addresses.invented, 0);
}

/// A what-if answer against the real run: the default `gpt2_train` replayed under
/// `expandable_segments:True` gives every figure PyTorch reported for the same workload run under
/// that setting (the program asked for the same sizes in the same order in both runs).
#[test]
fn a_what_if_answer_is_the_real_run_under_that_configuration() {
    let (snapshot, _) = load_trace("gpt2_train");
    let (_, real) = load_trace("gpt2_train__expandable_segments-True");
    let replay = Replay::new(&snapshot).unwrap();
    let answer = replay
        .run_with("expandable_segments:True")
        .unwrap()
        .flat_stats();
    let mut compared = 0;
    for (key, &value) in &real.figures {
        // The setting itself, not a decision.
        if key == "max_split_size" {
            continue;
        }
        if let Some(&replayed) = answer.get(key) {
            assert_eq!(replayed, value, "{key}");
            compared += 1;
        }
    }
    assert!(compared >= 40, "{compared} figures compared");
}

#[test]
fn expandable_segments_cut_fragmentation_of_the_gpt2_trace() {
    let (snapshot, _) = load_trace("gpt2_train");
    let replay = Replay::new(&snapshot).unwrap();
    let native = replay.run_recorded().unwrap().flat_stats();
    let expandable = replay
        .run_with("expandable_segments:True")
        .unwrap()
        .flat_stats();
    assert!(expandable["reserved_bytes.all.peak"] < native["reserved_bytes.all.peak"]);
    assert_eq!(expandable["inactive_split_bytes.all.peak"], 0);
}

#[test]
fn a_small_device_runs_out_of_memory_and_the_replay_goes_on() {
    let (snapshot, _) = load_trace("gpt2_train");
    let replay = Replay::new(&snapshot).unwrap();
    let mut options = RunOptions::new(replay.recorded_config().clone());
    options.capacity = Some(4 << 30);
    let run = replay.run(&options).unwrap();
    let stats = run.flat_stats();
    assert!(run.refused() > 0);
    assert_eq!(stats["num_ooms"], run.refused() as i64);
    assert!(stats["num_alloc_retries"] > 0);
    assert!(stats["reserved_bytes.all.peak"] <= 4 << 30);
    // The allocations it could make were all freed again or are still live, none lost.
    assert_eq!(
        stats["allocation.all.allocated"] + run.refused() as i64,
        3203
    );
}

#[test]
fn bad_what_if_configurations_are_reported() {
    let (snapshot, _) = load_trace("multistream");
    let replay = Replay::new(&snapshot).unwrap();
    let error = replay.run_with("max_split_size_mb:banana").unwrap_err();
    let message = error.to_string();
    assert!(message.contains("max_split_size_mb:banana"), "{message}");
}

#[test]
fn a_snapshot_without_events_is_refused() {
    let (mut snapshot, _) = load_trace("multistream");
    snapshot.device_traces.clear();
    assert!(Replay::new(&snapshot)
        .unwrap_err()
        .to_string()
        .contains("_record_memory_history"));
}

/// A trace written by tensormem's own allocator, with out-of-memory errors, allocations that
/// succeed after releasing the cache, cross-stream frees (some completed by the out-of-memory
/// sequence's synchronization) and an `empty_cache`, replays exactly: same statistics, same
/// segments, and the replaying allocator's own trace is the original one, event for event.
#[test]
fn tensormem_traces_replay_exactly_too() {
    let capacity = 96 << 20;
    let allocator = CachingAllocator::new(SimDevice::new(capacity));
    allocator.record_history(true, 1 << 20);
    let (s0, s1) = (StreamId(0), StreamId(7));
    let mut live = Vec::new();
    for i in 0..400usize {
        let size = [700, 300 << 10, 3 << 20, 9 << 20, 24 << 20][i % 5] + i * 512;
        let stream = if i % 3 == 0 { s1 } else { s0 };
        match allocator.allocate(size, stream) {
            Ok(a) => live.push(a),
            Err(tensormem_cuda_alloc::Error::OutOfMemory(_)) => {}
            Err(e) => panic!("{e}"),
        }
        if i % 4 == 3 && !live.is_empty() {
            let a = live.swap_remove(i % live.len());
            if i % 8 == 3 {
                // Used on the other stream too: its free completes once that stream's work does.
                let other = if a.stream() == s0 { s1 } else { s0 };
                allocator.record_stream(&a, other).unwrap();
            }
            allocator.free(a).unwrap();
        }
        if i % 16 == 15 {
            allocator.device().complete_all_work();
        }
        if i == 200 {
            // Everything back, then the cache emptied (`torch.cuda.empty_cache()`).
            for a in live.drain(..) {
                allocator.free(a).unwrap();
            }
            allocator.device().complete_all_work();
            allocator.empty_cache().unwrap();
        }
    }
    let original = allocator.memory_stats();
    assert!(
        original.num_ooms > 0,
        "the workload should run out of memory"
    );
    assert!(original.num_alloc_retries > original.num_ooms);
    let snapshot = allocator.snapshot();
    let expected = ExpectedStats::from_figures(original.to_flat());
    let replay = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(expected);
    let without_notes = |trace: &[TraceEntry]| -> Vec<(String, u64, u64, u64)> {
        trace
            .iter()
            .filter(|e| e.action != TraceAction::Snapshot)
            .map(|e| (e.action.to_string(), e.addr, e.size, e.stream))
            .collect()
    };
    // With the device's size given, and with the size the trace's `oom` events imply.
    for device_size in [Some(capacity), None] {
        let mut options = RunOptions::new(replay.recorded_config().clone());
        options.check = true;
        options.capacity = device_size;
        options.record_history = true;
        options.snapshot = true;
        let run = replay.run(&options).unwrap();
        let check = run.devices[0].check.as_ref().unwrap();
        assert_eq!(check.divergence, None, "{device_size:?}");
        assert_eq!(check.stats.as_ref().unwrap().mismatches, Vec::new());
        assert_eq!(
            check.segments.as_ref().unwrap().mismatches,
            Vec::<String>::new()
        );
        assert_eq!(run.devices[0].stats, original);
        let replayed = run.snapshot().unwrap();
        assert_eq!(
            without_notes(replayed.trace(0)),
            without_notes(snapshot.trace(0))
        );
    }
}

/// Two devices in one snapshot: one allocator each, each exact on its own trace.
#[test]
fn every_device_of_a_snapshot_is_replayed_with_its_own_allocator() {
    let (gpt2, _) = load_trace("gpt2_train");
    let (multi, _) = load_trace("multistream");
    let mut both = gpt2.clone();
    both.device_traces.push(multi.trace(0).to_vec());
    both.segments
        .extend(multi.segments.iter().cloned().map(|mut s| {
            s.device = 1;
            s
        }));
    let replay = Replay::new(&both).unwrap();
    assert_eq!(replay.devices(), vec![0, 1]);
    let run = replay.run_recorded().unwrap();
    assert_eq!(run.matches_record(), Some(true));
    let alone = |s: &Snapshot| Replay::new(s).unwrap().run_recorded().unwrap().flat_stats();
    let (a, b) = (alone(&gpt2), alone(&multi));
    let sum = run.total_stats();
    assert_eq!(run.flat_stats(), a, "the top level is device 0's");
    for key in [
        "reserved_bytes.all.peak",
        "allocation.all.allocated",
        "num_device_alloc",
    ] {
        assert_eq!(sum[key], a[key] + b[key], "{key}");
    }
    assert_eq!(
        run.devices[1].stats.to_flat()["reserved_bytes.all.peak"],
        b["reserved_bytes.all.peak"]
    );
    assert_eq!(run.events, both.event_count() as u64);
}

/// A trace whose beginning was lost (the ring buffer's `max_entries` was too small) still replays
/// to the end: frees of blocks it never saw allocated are skipped and counted, and the check says
/// the result is not PyTorch's.
#[test]
fn a_trace_that_starts_mid_run_replays_to_the_end() {
    let (mut snapshot, _) = load_trace("gpt2_train");
    snapshot.device_traces[0].drain(..2000);
    let replay = Replay::new(&snapshot).unwrap();
    let run = replay.run_recorded().unwrap();
    let device = &run.devices[0];
    assert!(device.unmatched_frees > 0);
    assert_eq!(run.matches_record(), Some(false));
    let check = device.check.as_ref().unwrap();
    assert!(check.divergence.is_some());
    let stats = run.flat_stats();
    assert!(stats["allocation.all.current"] >= 0);
    assert!(stats["allocated_bytes.all.current"] >= 0);
}

/// A run that was short of memory without running out (allocations that succeeded only after the
/// cache was released) replays exactly without being told the device's size: the releases bound
/// it.
#[test]
fn cache_releases_tell_the_device_size() {
    let allocator = CachingAllocator::new(SimDevice::new(64 << 20));
    allocator.record_history(true, 1 << 16);
    let stream = StreamId(0);
    for round in 0..6usize {
        // Fill the device with segments of one size, free them (cached), then ask for another size:
        // the device refuses the new segment until the cache is released.
        let size = [12 << 20, 40 << 20, 6 << 20, 30 << 20, 500 << 10, 18 << 20][round];
        let count = (44 << 20) / size.max(8 << 20);
        let blocks: Vec<_> = (0..count.max(1))
            .map(|_| allocator.allocate(size, stream).unwrap())
            .collect();
        for block in blocks {
            allocator.free(block).unwrap();
        }
    }
    let original = allocator.memory_stats();
    assert!(original.num_alloc_retries > 0);
    assert_eq!(original.num_ooms, 0);
    let snapshot = allocator.snapshot();
    let replay = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(ExpectedStats::from_figures(original.to_flat()));
    let capacity = replay.default_capacity(0);
    assert!((64 << 20..128 << 20).contains(&capacity), "{capacity}");
    let run = replay.run_recorded().unwrap();
    let check = run.devices[0].check.as_ref().unwrap();
    assert_eq!(check.divergence, None);
    assert_eq!(check.stats.as_ref().unwrap().mismatches, Vec::new());
    assert_eq!(run.devices[0].stats, original);
}

/// A trace whose allocations use more distinct streams than an allocator serves by default (one
/// each, some used on a second stream before their free, some requests refused for lack of memory
/// on streams that never allocate) replays exactly.
#[test]
fn a_trace_on_more_streams_than_the_default_capacity_replays_exactly() {
    let streams = DEFAULT_STREAM_CAPACITY as u64 + 76;
    let capacity = (2 << 20) * (streams + 64);
    let allocator = CachingAllocator::with_stream_capacity(
        SimDevice::new(capacity),
        tensormem_cuda_alloc::config::AllocatorConfig::default(),
        2 * streams as usize + 16,
    );
    allocator.record_history(true, 1 << 20);
    let mut live = Vec::new();
    for i in 0..streams {
        let a = allocator
            .allocate(512 + (i as usize % 7) * 512, StreamId(i + 1))
            .unwrap();
        if i % 3 == 0 {
            // Used on another stream too: its free completes once that stream's work does.
            allocator
                .record_stream(&a, StreamId(streams + i + 1))
                .unwrap();
        }
        live.push(a);
        if i % 2 == 1 {
            allocator.free(live.swap_remove(0)).unwrap();
        }
        if i % 250 == 249 {
            // A request larger than the device, on a stream of its own.
            let oom = allocator.allocate(capacity as usize * 2, StreamId(3 * streams + i));
            assert!(matches!(
                oom,
                Err(tensormem_cuda_alloc::Error::OutOfMemory(_))
            ));
            allocator.device().complete_all_work();
        }
    }
    for a in live {
        allocator.free(a).unwrap();
    }
    let original = allocator.memory_stats();
    let snapshot = allocator.snapshot();
    let replay = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(ExpectedStats::from_figures(original.to_flat()));
    let mut options = RunOptions::new(replay.recorded_config().clone());
    options.check = true;
    options.capacity = Some(capacity);
    let run = replay.run(&options).unwrap();
    let check = run.devices[0].check.as_ref().unwrap();
    assert_eq!(check.divergence, None);
    assert_eq!(check.stats.as_ref().unwrap().mismatches, Vec::new());
    assert_eq!(run.devices[0].stats, original);
}

/// A `MemPool(use_on_oom=True)` beside default requests under a memory fraction: the pool's
/// segments are known by the run of releases that frees them alone at the end (idle default
/// segments stay), default requests that took the pool's free blocks land as requests into the
/// pool would, requests the default pools' cache could have served failed in the pool, and the
/// failures the trace leaves open are placed by the recorded `num_alloc_retries`.
#[test]
fn a_use_on_oom_pool_replays_exactly() {
    let name = "oom_mempool_use_on_oom__fraction-0.004";
    exact(name);
    let (snapshot, expected) = load_trace(name);
    let replay = Replay::new(&snapshot)
        .unwrap()
        .with_expected_stats(expected);
    let attribution = replay.pool_attribution(0).unwrap();
    let private: Vec<_> = attribution
        .pools
        .iter()
        .filter(|p| !p.pool.is_default())
        .collect();
    assert_eq!(private.len(), 1, "{attribution:?}");
    assert_eq!(private[0].segments, 6, "{attribution:?}");
    assert!(
        attribution.private_ooms > attribution.ooms_from_stats,
        "{attribution:?}"
    );
    assert!(attribution.ooms_from_stats > 0, "{attribution:?}");
}
