//! Tests that run again as a child process ([`tensormem_test_support::child`]): the child is this
//! test binary run on one test with [`ROLE`] and [`ARG`] set; each such test first asks [`role`]
//! whether it is a child and if so plays its role, telling the parent how far it got with
//! `report` lines.

use std::io::BufReader;
use std::process::{ChildStdout, Stdio};

use tensormem_test_support::child::{self, Peer};

/// The child's role (unset in the parent).
pub const ROLE: &str = "TENSORMEM_STORAGE_TEST_ROLE";
/// The role's argument (a socket path, a name...).
pub const ARG: &str = "TENSORMEM_STORAGE_TEST_ARG";

/// The role this process plays and its argument, if it is a child.
pub fn role() -> Option<(String, String)> {
    Some((child::role(ROLE)?, child::role(ARG).unwrap_or_default()))
}

/// Runs `test` of this binary again as a child in `role` with `arg`; its stdin and stdout are
/// piped (close the stdin to end a child that `hold`s).
pub fn spawn(test: &str, role: &str, arg: &str) -> (Peer, BufReader<ChildStdout>) {
    child::spawn(
        child::this_test(test)
            .env(ROLE, role)
            .env(ARG, arg)
            .stdin(Stdio::piped()),
    )
}
