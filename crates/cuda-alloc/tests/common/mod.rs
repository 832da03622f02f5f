//! Helpers shared by the allocator's integration tests.
#![allow(dead_code, unreachable_pub)]

use std::ffi::OsString;

use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::stats::MemoryStats;
use tensormem_cuda_alloc::{CachingAllocator, StreamId};

pub const KIB: usize = 1 << 10;
pub const MIB: usize = 1 << 20;
pub const GIB: usize = 1 << 30;
pub const S0: StreamId = StreamId(0);
pub const S1: StreamId = StreamId(0x1000);
pub const S2: StreamId = StreamId(0x2000);

/// An allocator with default settings on a simulated device of `capacity` bytes.
pub fn sim(capacity: usize) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::new(capacity as u64))
}

/// An allocator with the given configuration string.
pub fn sim_with(config: &str, capacity: usize) -> CachingAllocator<SimDevice> {
    CachingAllocator::with_config(
        SimDevice::new(capacity as u64),
        AllocatorConfig::parse(config).expect("valid config"),
    )
}

/// Statistics after checking the invariants.
pub fn checked(alloc: &CachingAllocator<SimDevice>) -> MemoryStats {
    alloc.check_invariants().expect("invariants hold");
    alloc.memory_stats()
}

/// An environment for `from_env_with`-style lookups holding exactly `vars`.
pub fn env<'a>(
    vars: &'a [(&'static str, &'a str)],
) -> impl FnMut(&'static str) -> Option<OsString> + 'a {
    move |name| {
        vars.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| OsString::from(v))
    }
}
