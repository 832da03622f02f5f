//! Shared helpers of the benchmarks.

pub mod layouts;
pub mod sharing_harness;
