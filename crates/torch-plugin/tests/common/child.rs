//! One test of this binary run again in a child process with an allocator configuration of its own:
//! the allocator backend is chosen once per process, so each configuration needs a process.

use std::process::Command;

// The variables the allocator configuration is read from; the child gets none but those it is given.
use tensormem_cuda_alloc::config::ENV_VARS as CONFIG_VARS;

/// Set in the child: the test runs its child half.
const ROLE: &str = "TENSORMEM_TEST_BACKEND_CHILD";

/// Whether this process is a child started by [`run`].
pub(crate) fn is_child() -> bool {
    std::env::var_os(ROLE).is_some()
}

/// Runs `test` of this binary (ignored or not) in a child process whose allocator configuration is
/// `vars` alone, and fails with the child's output unless its test passed.
pub(crate) fn run(test: &str, vars: &[(&str, &str)]) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        test,
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    for var in CONFIG_VARS {
        cmd.env_remove(var);
    }
    cmd.env(ROLE, "1").envs(vars.iter().copied());
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child running {test} with {vars:?} failed:\n{stdout}\n{stderr}"
    );
    eprint!("{stderr}");
}
