//! Embeds the default trace of `tensormem replay`: the repository's `traces/gpt2_train.pickle`
//! (gzip-compressed into `OUT_DIR`) and the `memory_stats()` PyTorch reported beside it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let traces = manifest.join("../../traces");
    let trace = traces.join("gpt2_train.pickle");
    let stats = traces.join("gpt2_train.stats.json");
    for path in [&trace, &stats] {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    compress(&trace, &out.join("gpt2_train.pickle.gz"));
    std::fs::copy(&stats, out.join("gpt2_train.stats.json")).unwrap_or_else(|e| {
        panic!(
            "cannot copy {} (the default replay trace's statistics): {e}",
            stats.display()
        )
    });
}

fn compress(from: &Path, to: &Path) {
    let data = std::fs::read(from).unwrap_or_else(|e| {
        panic!(
            "cannot read {} (the trace `tensormem replay` embeds; it is part of the repository): {e}",
            from.display()
        )
    });
    let file = File::create(to).unwrap_or_else(|e| panic!("cannot create {}: {e}", to.display()));
    let mut encoder =
        flate2::write::GzEncoder::new(BufWriter::new(file), flate2::Compression::best());
    encoder
        .write_all(&data)
        .and_then(|()| encoder.finish())
        .and_then(|mut w| w.flush())
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", to.display()));
}
