//! A second process for the two-process tests: this test binary again, running one test, its role
//! and handle given in its environment, its protocol lines (`@@...`) read from its stdout.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};

/// A child process, killed if the test ends first.
pub(crate) struct Peer(pub(crate) Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Peer {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Peer {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// This test binary again, running only `test`, with `vars` in its environment.
pub(crate) fn spawn(test: &str, vars: &[(&str, &str)]) -> (Peer, BufReader<ChildStdout>) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .envs(vars.iter().copied())
        .stdout(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (Peer(child), stdout)
}

/// The rest of the next line of the child's own protocol that starts with `@@prefix` (libtest
/// prints lines of its own too, and may print "test NAME ... " before it on the same line).
pub(crate) fn expect(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "child ended before printing {prefix}"
        );
        if let Some(at) = line.find(&format!("@@{prefix}")) {
            return line[at + 2 + prefix.len()..].trim().to_owned();
        }
    }
}

/// Kills the child (SIGKILL) and waits for it.
pub(crate) fn kill9(child: &mut Peer) {
    child.kill().unwrap();
    child.wait().unwrap();
}
