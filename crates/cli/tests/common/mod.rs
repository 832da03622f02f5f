//! What the command-line tests share: the built binary run as a user runs it, its output read
//! back, and the traces of the repository.

#![allow(dead_code)] // each test file uses its part

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the built `tensormem` with `args` (no `TENSORMEM_LOG` from the environment).
pub(crate) fn tensormem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensormem"))
        .args(args)
        .env_remove("TENSORMEM_LOG")
        .output()
        .expect("the tensormem binary runs")
}

/// The run's standard output.
pub(crate) fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8")
}

/// The run's standard error.
pub(crate) fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).expect("stderr is UTF-8")
}

/// The path of the repository's trace `name`.
pub(crate) fn trace(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces")
        .join(name)
        .display()
        .to_string()
}

/// Runs `tensormem` with `args`, which must succeed, and parses its stdout as one JSON document.
pub(crate) fn json(args: &[&str]) -> serde_json::Value {
    let output = tensormem(args);
    assert!(output.status.success(), "{}", stderr(&output));
    serde_json::from_str(&stdout(&output)).expect("stdout is one JSON document")
}
