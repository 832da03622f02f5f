//! Tests that run again as a child process: the child is this test binary run on one test
//! (`--exact NAME`) with [`ROLE`] set; each such test first asks [`role`] whether it is a child
//! and if so plays its role, telling the parent how far it got with [`report`] lines on stdout.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};

/// The child's role (unset in the parent).
pub const ROLE: &str = "TENSORMEM_STORAGE_TEST_ROLE";
/// The role's argument (a socket path, a name...).
pub const ARG: &str = "TENSORMEM_STORAGE_TEST_ARG";
/// What starts a [`report`] line (libtest's own output shares the child's stdout).
const MARK: &str = "@@";

/// The role this process plays and its argument, if it is a child.
pub fn role() -> Option<(String, String)> {
    Some((
        std::env::var(ROLE).ok()?,
        std::env::var(ARG).unwrap_or_default(),
    ))
}

/// In a child: tells the parent `line` (read there by [`next_report`]).
pub fn report(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{MARK}{line}").unwrap();
    out.flush().unwrap();
}

/// In a child: blocks until the parent closes our stdin (or kills us).
pub fn hold() {
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
}

/// Runs `test` of this binary again as a child in `role` with `arg`; its stdin and stdout are
/// piped (close the stdin to end a child that [`hold`]s).
pub fn spawn(test: &str, role: &str, arg: &str) -> (Child, BufReader<ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(ARG, arg)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (child, stdout)
}

/// The next [`report`] line of a child.
pub fn next_report(out: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child exited early"
        );
        // libtest prints "test NAME ... " before the test runs, on the same line.
        if let Some(at) = line.find(MARK) {
            return line[at + MARK.len()..].trim_end().to_owned();
        }
    }
}
