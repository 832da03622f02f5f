//! Skipping a test whose prerequisite (a GPU, PyTorch) is missing here, visibly: it says
//! `skipped: REASON` on stderr and passes, unless the run set one of the prerequisite's
//! `TENSORMEM_REQUIRE_*` variables to `1` (`cargo xtask test-gpu` and the bundle's `run.sh` do
//! where the prerequisite is meant to be there), which makes it fail instead.

/// Whether the environment variable `var` is `1`: the run asks for a missing prerequisite to fail
/// the tests instead of skipping them.
pub fn required(var: &str) -> bool {
    std::env::var(var).as_deref() == Ok("1")
}

/// Says `skipped: {reason}` on stderr; the test then returns without doing anything.
///
/// # Panics
///
/// With `{var}=1 but {reason}` if one of `vars` is [`required`].
#[track_caller]
pub fn unless_required(vars: &[&str], reason: &str) {
    for var in vars {
        assert!(!required(var), "{var}=1 but {reason}");
    }
    eprintln!("skipped: {reason}");
}
