//! `python3`, for the tests that check tensormem against Python (pickle files, PyTorch): the one
//! on `PATH`.

use std::process::Command;

/// The Python the tests run, found on `PATH`.
pub const PYTHON: &str = "python3";

/// A command running [`PYTHON`], to add arguments to.
pub fn command() -> Command {
    Command::new(PYTHON)
}

/// Whether `python3 -c code` succeeds, or why not: the last line it wrote to stderr (a Python
/// exception's message), or why it could not be run.
///
/// # Errors
///
/// The code failed, or `python3` could not be run.
pub fn probe(code: &str) -> Result<(), String> {
    match command().args(["-c", code]).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_owned()),
        Err(e) => Err(format!("{PYTHON} could not be run: {e}")),
    }
}

/// For the tests that need `python3` (`#[ignore]`d, so that a machine without it reports them as
/// ignored, never as passed): fails the test where there is none.
///
/// # Panics
///
/// `python3` cannot be run.
#[track_caller]
pub fn require() {
    if let Err(err) = command().arg("--version").output() {
        panic!(
            "these tests need {PYTHON} on PATH ({err}); leave out --ignored where there is none"
        );
    }
}

/// Runs `python3 args...` and returns what it printed.
///
/// # Panics
///
/// `python3` cannot be run, fails (the panic shows its stderr), or prints other than UTF-8.
#[track_caller]
pub fn run(args: &[&str]) -> String {
    let out = command().args(args).output().expect("python3 runs");
    assert!(
        out.status.success(),
        "{PYTHON} {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("python3 printed UTF-8")
}
