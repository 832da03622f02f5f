//! The checks behind tensormem's fuzz targets (`fuzz/` in the repository), as plain functions.
//!
//! Each function takes the fuzzer's bytes, feeds them to one of tensormem's decoders or drives the
//! allocator with them, and panics when something is wrong: a decoder that panics or accepts input
//! it cannot give back, an allocator that accepts a pointer it should refuse or whose state stops
//! adding up. A typed error for bad input is the expected outcome and passes.
//!
//! The fuzz targets call these functions under libFuzzer; `tests/regressions.rs` calls them on every
//! file kept in `fuzz/regressions/<target>/`, so inputs that once found a bug are re-run by
//! `cargo test`.
//!
//! ```
//! // Any bytes are a valid input: they decode to a (possibly empty) sequence of operations.
//! tensormem_fuzz_checks::alloc_ops::check(&[0x00, 0x10, 0x03, 0x05, 0x03, 0x00, 0x03, 0x00]);
//! // Not a pickle: a typed error, so the check passes.
//! tensormem_fuzz_checks::snapshot::pickle(b"not a pickle");
//! ```

pub mod alloc_ops;
pub mod config;
pub mod shm;
pub mod snapshot;

/// A fuzz target: its name (the directory under `fuzz/regressions/`) and its check.
pub type Target = (&'static str, fn(&[u8]));

/// Every fuzz target, by name.
pub const TARGETS: &[Target] = &[
    ("pickle", snapshot::pickle),
    ("snapshot_json", snapshot::json),
    ("alloc_conf", config::check),
    ("shm_header", shm::header),
    ("manager_protocol", shm::manager_protocol),
    ("alloc_ops", alloc_ops::check),
];
