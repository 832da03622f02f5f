//! Fuzz target `shm_header`: see `tensormem_fuzz_checks::shm::header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensormem_fuzz_checks::shm::header(data));
