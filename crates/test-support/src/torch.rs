//! `python3` with PyTorch, for the interop tests: where torch does not import (or cannot use CUDA,
//! for the tests that need it), a test says `skipped: ...` and passes, unless [`REQUIRE_TORCH`] is
//! `1` (`cargo xtask test-gpu` and the bundle's `run.sh` set it where torch imports), which makes
//! it fail.

use crate::{python, skip};

/// Set to `1`, a missing PyTorch fails the interop tests instead of skipping them.
pub const REQUIRE_TORCH: &str = "TENSORMEM_REQUIRE_TORCH";

/// Imports torch (the check of [`python_with_torch`]).
const IMPORT: &str = "import torch";
/// Imports torch and asserts that it can use CUDA (the check of [`python_with_torch_cuda`]).
const IMPORT_CUDA: &str =
    "import torch; assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'";

/// Whether `python3` imports torch; when it does not, says why and returns `false`.
///
/// # Panics
///
/// If torch does not import and [`REQUIRE_TORCH`] is `1`.
#[track_caller]
pub fn python_with_torch() -> bool {
    available(IMPORT, "python3 cannot import torch")
}

/// Whether `python3` imports torch and torch can use CUDA; when not, says why and returns `false`.
///
/// # Panics
///
/// If it cannot and [`REQUIRE_TORCH`] is `1`.
#[track_caller]
pub fn python_with_torch_cuda() -> bool {
    available(IMPORT_CUDA, "python3 cannot use torch with CUDA")
}

/// Why `python3` cannot use torch with CUDA, or `None` if it can: for tests that check several
/// prerequisites and skip (or fail) once, naming the first one missing.
pub fn why_no_torch_cuda() -> Option<String> {
    python::probe(IMPORT_CUDA)
        .err()
        .map(|reason| format!("python3 cannot use torch with CUDA ({reason})"))
}

#[track_caller]
fn available(code: &str, what: &str) -> bool {
    match python::probe(code) {
        Ok(()) => true,
        Err(reason) => {
            skip::unless_required(&[REQUIRE_TORCH], &format!("{what} ({reason})"));
            false
        }
    }
}
