//! A test run again as a child process: the child is this test binary running one test
//! ([`this_test`]), its role given in an environment variable of the crate's own; the test first
//! asks whether it is the child (for example with [`role`]) and if so plays its role, telling the
//! parent how far it got with [`report`] lines on stdout, which the parent reads with
//! [`next_report`] or [`expect`]. A [`Peer`] kills the child if the test ends first.
//!
//! ```no_run
//! use std::process::Stdio;
//!
//! use tensormem_test_support::child;
//!
//! const ROLE: &str = "MY_CRATE_TEST_ROLE";
//!
//! // A #[test] of the binary.
//! fn a_test_in_two_processes() {
//!     if let Some(role) = child::role(ROLE) {
//!         assert_eq!(role, "consumer");
//!         child::report("ready 42");
//!         child::hold(); // until the parent closes our stdin
//!         return;
//!     }
//!     let (mut peer, mut out) = child::spawn(
//!         child::this_test("a_test_in_two_processes")
//!             .env(ROLE, "consumer")
//!             .stdin(Stdio::piped()),
//!     );
//!     assert_eq!(child::expect(&mut out, "ready"), "42");
//!     drop(peer.stdin.take());
//!     assert!(peer.wait().unwrap().success());
//! }
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::ops::{Deref, DerefMut};
use std::process::{Child, ChildStdout, Command, Stdio};

/// What starts a child's [`report`] line (libtest's own lines share the child's stdout).
pub const MARK: &str = "@@";

/// Set in a child started by [`run`]: the test runs its child half ([`is_child`]).
pub const CHILD: &str = "TENSORMEM_TEST_CHILD";

/// This test binary, to run again with arguments of one's own (a binary with its own `main`, see
/// [`harness`](crate::harness)).
///
/// # Panics
///
/// The binary's path is not known.
pub fn this_binary() -> Command {
    Command::new(std::env::current_exe().expect("the test binary's path"))
}

/// This test binary running only `test` (`--exact`, ignored or not), in one thread, its output not
/// captured (so that [`report`] lines reach the parent).
pub fn this_test(test: &str) -> Command {
    let mut cmd = this_binary();
    cmd.args([
        "--exact",
        test,
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

/// The value of the role variable `var`: `Some` in a child, `None` in the parent.
pub fn role(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

/// Whether this process is a child started by [`run`].
pub fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Starts `cmd` with its stdout piped; returns the child (killed if the test ends first) and its
/// stdout, to read [`report`] lines from. Stdin and stderr are as `cmd` says (inherited unless
/// set).
///
/// # Panics
///
/// The child cannot be started.
pub fn spawn(cmd: &mut Command) -> (Peer, BufReader<ChildStdout>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .expect("the child process starts");
    let stdout = BufReader::new(child.stdout.take().expect("the child's stdout is piped"));
    (Peer(child), stdout)
}

/// Runs `test` of this binary (ignored or not) in a child process whose environment lacks the
/// variables `removed` and has [`CHILD`] and `vars`, and fails with the child's output unless its
/// test passed; the child's stderr is repeated on ours. For what is chosen once per process (the
/// allocator backend): each configuration needs a process.
///
/// # Panics
///
/// The child cannot be run, or its test did not pass.
#[track_caller]
pub fn run(test: &str, removed: &[&str], vars: &[(&str, &str)]) {
    let mut cmd = this_test(test);
    for var in removed {
        cmd.env_remove(var);
    }
    cmd.env(CHILD, "1").envs(vars.iter().copied());
    let out = cmd.output().expect("the child process runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child running {test} with {vars:?} failed:\n{stdout}\n{stderr}"
    );
    eprint!("{stderr}");
}

/// In a child: tells the parent `line` (read there by [`next_report`] or [`expect`]).
///
/// # Panics
///
/// Stdout cannot be written.
pub fn report(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{MARK}{line}").expect("stdout is writable");
    out.flush().expect("stdout is writable");
}

/// In a child: blocks until the parent closes our stdin (or kills us).
pub fn hold() {
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

/// The child's next [`report`] line, without the mark and the line end; lines libtest prints are
/// skipped (it may print `test NAME ... ` before a report on the same line).
///
/// # Panics
///
/// The child's stdout ended first.
#[track_caller]
pub fn next_report(out: &mut impl BufRead) -> String {
    after(out, MARK, || {
        "the child exited before its next report".to_owned()
    })
    .trim_end()
    .to_owned()
}

/// What follows `needle` on the child's next line holding it; lines without it are skipped.
///
/// # Panics
///
/// The child's stdout ended first (with `ended()` as the message).
#[track_caller]
fn after(out: &mut impl BufRead, needle: &str, ended: impl Fn() -> String) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let read = out
            .read_line(&mut line)
            .expect("the child's stdout is readable");
        assert!(read > 0, "{}", ended());
        if let Some(at) = line.find(needle) {
            return line[at + needle.len()..].to_owned();
        }
    }
}

/// The rest (trimmed) of the child's next [`report`] line that starts with `prefix`; reports that
/// start otherwise are skipped.
///
/// # Panics
///
/// The child's stdout ended first.
#[track_caller]
pub fn expect(out: &mut impl BufRead, prefix: &str) -> String {
    let needle = format!("{MARK}{prefix}");
    after(out, &needle, || {
        format!("the child ended before printing {needle}")
    })
    .trim()
    .to_owned()
}

/// A child process, killed (SIGKILL) and waited for if the test ends first; it is the
/// [`Child`] otherwise (`Deref`).
#[derive(Debug)]
pub struct Peer(pub Child);

impl Peer {
    /// Kills the child (SIGKILL) and waits for it.
    ///
    /// # Panics
    ///
    /// It cannot be killed or waited for (it was waited for already).
    #[track_caller]
    pub fn kill9(&mut self) {
        self.0.kill().expect("the child can be killed");
        self.0.wait().expect("the child can be waited for");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Deref for Peer {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for Peer {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_found_among_libtests_lines() {
        let mut out = "running 1 test\ntest t ... @@ready 42\n@@done\n".as_bytes();
        assert_eq!(next_report(&mut out), "ready 42");
        assert_eq!(next_report(&mut out), "done");
        let mut out = "@@other 1\ntest t ... @@handle ab01 \n".as_bytes();
        assert_eq!(expect(&mut out, "handle"), "ab01");
    }

    #[test]
    #[should_panic(expected = "before printing @@handle")]
    fn a_child_that_ends_first_fails_the_wait() {
        expect(&mut "test t ... ok\n".as_bytes(), "handle");
    }
}
