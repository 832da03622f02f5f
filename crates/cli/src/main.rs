//! The `tensormem` command.
#![deny(unsafe_code)]

fn main() {}
