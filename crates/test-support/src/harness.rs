//! The `main` of a test binary that re-executes itself as the other process of its tests (a
//! child's role is named in an environment variable), so it has no libtest (`harness = false` in
//! the crate's `Cargo.toml`): [`main`] lists and selects tests the way libtest does (`--list`,
//! name filters, `--exact`, `--skip NAME`) and reports in libtest's format. The parent starts a
//! child with [`child::this_binary`](crate::child::this_binary) and the role variable set.
//!
//! ```no_run
//! use tensormem_test_support::harness::{self, RoleResult, Test};
//!
//! const ROLE: &str = "MY_CRATE_TEST_ROLE";
//! const TESTS: &[Test] = &[("a_region_crosses_processes", a_region_crosses_processes)];
//!
//! fn main() {
//!     harness::main(ROLE, run_role, TESTS, None);
//! }
//!
//! fn a_region_crosses_processes() {
//!     let mut child = tensormem_test_support::child::this_binary()
//!         .env(ROLE, "consumer")
//!         .spawn()
//!         .unwrap();
//!     assert!(child.wait().unwrap().success());
//! }
//!
//! fn run_role(role: &str) -> RoleResult {
//!     match role {
//!         "consumer" => Ok(()),
//!         other => Err(format!("unknown role {other}").into()),
//!     }
//! }
//! ```

use std::time::Duration;

/// One test: its name and its body (a panic fails it).
pub type Test = (&'static str, fn());

/// What a child's role returns; an error makes the child exit with status 2.
pub type RoleResult = Result<(), Box<dyn std::error::Error>>;

/// Ends the whole run (exit status 3) if the tests have not finished after `after`: for tests
/// whose failure would be a wait that never ends.
#[derive(Debug)]
pub struct Watchdog {
    /// The test binary's name, for the message.
    pub binary: &'static str,
    /// How long the tests may take together.
    pub after: Duration,
}

/// Runs as the child in the role `role_var` names if it is set (and exits), else runs the
/// selected `tests` in turn and exits with status 1 if one failed.
pub fn main(
    role_var: &str,
    run_role: fn(&str) -> RoleResult,
    tests: &[Test],
    watchdog: Option<Watchdog>,
) {
    if let Ok(role) = std::env::var(role_var) {
        let code = match run_role(&role) {
            Ok(()) => 0,
            Err(err) => {
                eprintln!("child role {role} failed: {err}");
                2
            }
        };
        std::process::exit(code);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        for (name, _) in tests {
            println!("{name}: test");
        }
        return;
    }
    let exact = args.iter().any(|a| a == "--exact");
    // libtest's options that take a value: the value is not a filter.
    const WITH_VALUE: &[&str] = &["--test-threads", "--format", "--color", "--logfile", "-Z"];
    let mut filters: Vec<&str> = Vec::new();
    let mut skips: Vec<&str> = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if arg == "--skip" {
            skips.extend(iter.next().map(String::as_str));
        } else if WITH_VALUE.contains(&arg.as_str()) {
            iter.next();
        } else if !arg.starts_with('-') {
            filters.push(arg);
        }
    }
    let matches = |name: &str, pattern: &str| {
        if exact {
            name == pattern
        } else {
            name.contains(pattern)
        }
    };
    let selected = tests.iter().filter(|(name, _)| {
        (filters.is_empty() || filters.iter().any(|f| matches(name, f)))
            && !skips.iter().any(|s| matches(name, s))
    });
    if let Some(Watchdog { binary, after }) = watchdog {
        std::thread::spawn(move || {
            std::thread::sleep(after);
            eprintln!("{binary}: a test still runs after {after:?}: a wait did not end");
            std::process::exit(3);
        });
    }
    let mut failed = Vec::new();
    let mut passed = 0;
    for (name, test) in selected {
        match std::panic::catch_unwind(test) {
            Ok(()) => {
                passed += 1;
                println!("test {name} ... ok");
            }
            Err(_) => {
                failed.push(*name);
                println!("test {name} ... FAILED");
            }
        }
    }
    println!(
        "\ntest result: {}. {passed} passed; {} failed",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len()
    );
    if !failed.is_empty() {
        std::process::exit(1);
    }
}
