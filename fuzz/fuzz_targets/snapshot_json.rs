//! Fuzz target `snapshot_json`: see `tensormem_fuzz_checks::snapshot::json`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensormem_fuzz_checks::snapshot::json(data));
