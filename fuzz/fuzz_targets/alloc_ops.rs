//! Fuzz target `alloc_ops`: see `tensormem_fuzz_checks::alloc_ops::check`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensormem_fuzz_checks::alloc_ops::check(data));
