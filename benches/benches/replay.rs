//! Trace replay speed: the recorded PyTorch traces (`traces/`, or `$TENSORMEM_TRACES_DIR`) replayed
//! through a fresh allocator on the simulated device, in trace events per second.
//!
//! - `replay/<trace>`: one whole replay under the recorded configuration, as `tensormem replay`
//!   runs it first (allocator set-up, every event, the timeline, the final statistics; without the
//!   comparison with the record).
//! - `replay_what_if/gpt2_train/<config>`: the GPT-2 trace under other configurations.
//!
//! Throughput is in trace events (all of them, segment events included), the figure the CLI prints.

use std::path::PathBuf;

use criterion::{BenchmarkId, Criterion, Throughput};
use tensormem_cuda_alloc::snapshot::Snapshot;
use tensormem_replay::{Replay, RunOptions};

fn traces_dir() -> PathBuf {
    std::env::var_os("TENSORMEM_TRACES_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces"),
        PathBuf::from,
    )
}

fn load(name: &str) -> Replay {
    let path = traces_dir().join(format!("{name}.pickle"));
    let snapshot = Snapshot::read_file(&path)
        .unwrap_or_else(|e| panic!("cannot read the trace {}: {e}", path.display()));
    Replay::new(&snapshot).expect("the trace replays")
}

fn recorded(c: &mut Criterion) {
    let mut group = c.benchmark_group("replay");
    for name in [
        "gpt2_train",
        "gpt2_train__expandable_segments-True",
        "multistream",
    ] {
        let replay = load(name);
        let options = RunOptions::new(replay.recorded_config().clone());
        group.throughput(Throughput::Elements(replay.events()));
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| replay.run(&options).expect("replay"));
        });
    }
    group.finish();
}

fn what_if(c: &mut Criterion) {
    let replay = load("gpt2_train");
    let mut group = c.benchmark_group("replay_what_if/gpt2_train");
    group.throughput(Throughput::Elements(replay.events()));
    for config in [
        "expandable_segments:True",
        "max_split_size_mb:64",
        "roundup_power2_divisions:4",
    ] {
        let options = RunOptions::new(replay.what_if_config(config).expect("valid config"));
        group.bench_function(BenchmarkId::from_parameter(config), |b| {
            b.iter(|| replay.run(&options).expect("replay"));
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    recorded(&mut criterion);
    what_if(&mut criterion);
    criterion.final_summary();
}
