//! The trace built into the binary: `tensormem replay` with no file replays it.
//!
//! It is the repository's `traces/gpt2_train.pickle` (GPT-2 training, 6 layers, batch 8 x 512, bf16
//! autocast, AdamW, 4 steps, recorded with PyTorch 2.11 on an NVIDIA H200), with the
//! `torch.cuda.memory_stats()` PyTorch reported after the run. The crate carries a gzip-compressed
//! copy in `data/` (so that `cargo package` and a build from crates.io have it); a test checks the
//! copy against `traces/` when the repository is there. After re-recording, refresh it with
//! `gzip -9 -n -c traces/gpt2_train.pickle > crates/cli/data/gpt2_train.pickle.gz` and
//! `cp traces/gpt2_train.stats.json crates/cli/data/`.

use tensormem_cuda_alloc::snapshot::{Snapshot, SnapshotResult};
use tensormem_replay::ExpectedStats;

/// How the built-in trace is named in output.
pub(crate) const NAME: &str = "built-in gpt2_train";

/// How its statistics are named in output.
pub(crate) const STATS_NAME: &str = "gpt2_train.stats.json";

const TRACE_GZ: &[u8] = include_bytes!("../data/gpt2_train.pickle.gz");
const STATS_JSON: &str = include_str!("../data/gpt2_train.stats.json");

/// The built-in trace.
pub(crate) fn gpt2_train() -> SnapshotResult<Snapshot> {
    Snapshot::from_pickle_bytes(TRACE_GZ)
}

/// PyTorch's statistics after the built-in trace's run.
pub(crate) fn gpt2_train_stats() -> tensormem_replay::Result<ExpectedStats> {
    ExpectedStats::from_json(STATS_JSON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_trace_reads() {
        let snapshot = gpt2_train().unwrap();
        assert_eq!(snapshot.event_count(), 9679);
        let stats = gpt2_train_stats().unwrap();
        assert_eq!(stats.figures["num_device_alloc"], 76);
        assert!(TRACE_GZ.len() < 400_000, "{} bytes", TRACE_GZ.len());
    }

    /// The crate's copy is the repository's trace (checked where the repository is, skipped in a
    /// packaged crate).
    #[test]
    fn the_built_in_trace_is_the_repositorys() {
        let traces = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
        let (Ok(pickle), Ok(stats)) = (
            std::fs::read(traces.join("gpt2_train.pickle")),
            std::fs::read_to_string(traces.join("gpt2_train.stats.json")),
        ) else {
            eprintln!("no traces/ beside the crate: nothing to compare");
            return;
        };
        let from_repository = Snapshot::from_pickle_bytes(&pickle).unwrap();
        assert_eq!(gpt2_train().unwrap(), from_repository);
        assert_eq!(STATS_JSON, stats);
    }
}
