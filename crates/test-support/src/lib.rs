//! What the tensormem crates' integration tests share, written once (never published; the
//! crates name it as a dev-dependency):
//!
//! - [`child`]: a test of this binary run again as a child process (its role in an environment
//!   variable), killed if the test ends first, telling the parent how far it got in `@@` lines;
//! - [`harness`]: the `main` of a test binary without libtest that re-executes itself;
//! - [`gpu`]: a test without a CUDA device says why it did nothing, or fails under
//!   `TENSORMEM_REQUIRE_GPU=1`; the crate asks for the devices with its own API and hands the
//!   answer over, so this crate needs no CUDA crate;
//! - [`torch`] and [`python`]: the same for `python3` with PyTorch (`TENSORMEM_REQUIRE_TORCH=1`),
//!   and running `python3`;
//! - [`skip`]: skipping, or failing where the run asked for the prerequisite;
//! - [`hex`] and [`unhex`]: bytes as text, to cross to a child in its environment or a line.
//!
//! ```
//! use tensormem_test_support::{gpu, hex, unhex};
//!
//! // A GPU test: the crate probes with its own API (here a stand-in for
//! // `cuda::device_count()`); without a device the test says `skipped: ...` and passes, or fails
//! // under TENSORMEM_REQUIRE_GPU=1.
//! let probe: Result<u32, String> = Ok(2);
//! let Some(devices) = gpu::devices(probe) else {
//!     return;
//! };
//! assert_eq!(devices, 2);
//!
//! // A handle crosses to a child process as hex text.
//! assert_eq!(hex(&[0x00, 0xab]), "00ab");
//! assert_eq!(unhex("00ab"), [0x00, 0xab]);
//! ```

pub mod child;
pub mod fork;
pub mod gpu;
pub mod harness;
pub mod python;
pub mod skip;
pub mod torch;

/// `bytes` as lowercase hex, two digits a byte.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes `text` (hex, as [`hex`] writes it) stands for.
///
/// # Panics
///
/// `text` is not hex, or has an odd length.
pub fn unhex(text: &str) -> Vec<u8> {
    assert!(text.len().is_multiple_of(2), "odd-length hex: {text:?}");
    (0..text.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&text[i..i + 2], 16).unwrap_or_else(|e| panic!("{text:?}: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&bytes)), bytes);
        assert_eq!(hex(&[]), "");
    }

    #[test]
    #[should_panic(expected = "odd-length")]
    fn odd_hex_is_refused() {
        unhex("abc");
    }
}
