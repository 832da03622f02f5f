//! Shared helpers of the benchmarks.

pub mod sharing_harness;
