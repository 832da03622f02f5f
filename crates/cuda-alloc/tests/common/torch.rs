//! `python3` with torch, for the PyTorch interop tests: whether torch imports (skipping, saying so,
//! when it does not, unless `TENSORMEM_REQUIRE_TORCH=1`), and running python3.
#![allow(dead_code, unreachable_pub)]

use std::process::Command;

/// Set to `1`, a missing torch fails the interop tests instead of skipping them (`cargo xtask
/// test-gpu` and the bundle's `run.sh` set it where torch imports).
pub const REQUIRE_TORCH: &str = "TENSORMEM_REQUIRE_TORCH";

/// Whether `python3` imports torch. When it does not, says why on stderr and returns `false`, or
/// panics under `TENSORMEM_REQUIRE_TORCH=1`.
pub fn torch_imports() -> bool {
    let reason = match Command::new("python3")
        .args(["-c", "import torch"])
        .output()
    {
        Ok(out) if out.status.success() => return true,
        Ok(out) => String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_owned(),
        Err(e) => format!("python3 could not be run: {e}"),
    };
    assert!(
        std::env::var(REQUIRE_TORCH).as_deref() != Ok("1"),
        "{REQUIRE_TORCH}=1 but `python3 -c 'import torch'` failed: {reason}"
    );
    eprintln!("skipped: python3 cannot import torch ({reason})");
    false
}

/// Runs `python3 args...`, returns stdout; panics with stderr when it fails.
pub fn python(args: &[&str]) -> String {
    let out = Command::new("python3")
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "python3 {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("python3 printed UTF-8")
}
