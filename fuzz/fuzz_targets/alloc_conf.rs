//! Fuzz target `alloc_conf`: see `tensormem_fuzz_checks::config::check`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensormem_fuzz_checks::config::check(data));
