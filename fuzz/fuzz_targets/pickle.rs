//! Fuzz target `pickle`: see `tensormem_fuzz_checks::snapshot::pickle`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensormem_fuzz_checks::snapshot::pickle(data));
