//! Fuzz target `manager_protocol`: see `tensormem_fuzz_checks::shm::manager_protocol`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tensormem_fuzz_checks::shm::manager_protocol(data));
