//! Replays every input kept in `fuzz/regressions/<target>/` through its target's check, so that
//! inputs that found bugs (and the seeds the fuzzers start from) are re-run by `cargo test`.

use std::path::{Path, PathBuf};

use tensormem_fuzz_checks::TARGETS;

fn regressions() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions")
}

#[test]
fn every_kept_input_passes_its_check() {
    let root = regressions();
    for &(target, check) in TARGETS {
        let dir = root.join(target);
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|path| path.is_file())
            .collect();
        inputs.sort();
        assert!(
            !inputs.is_empty(),
            "no inputs kept for {target} in {}",
            dir.display()
        );
        for input in inputs {
            let data = std::fs::read(&input).expect("a readable input");
            let outcome = std::panic::catch_unwind(|| check(&data));
            assert!(
                outcome.is_ok(),
                "{target}: {} fails its check",
                input.display()
            );
        }
    }
}

#[test]
fn every_regression_directory_is_a_target() {
    for entry in std::fs::read_dir(regressions()).expect("fuzz/regressions exists") {
        let name = entry.expect("a directory entry").file_name();
        let name = name.to_string_lossy();
        assert!(
            name == "README.md" || TARGETS.iter().any(|&(target, _)| target == name),
            "fuzz/regressions/{name} is not a fuzz target's directory"
        );
    }
}

/// `alloc_ops` on pseudo-random inputs (a fixed generator, so every run is the same): the model,
/// the invariant walk and the fast path against the plain path, beyond the saved corpus.
#[test]
fn alloc_ops_on_generated_inputs() {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    for _ in 0..40 {
        let data: Vec<u8> = (0..1024)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        tensormem_fuzz_checks::alloc_ops::check(&data);
    }
}
