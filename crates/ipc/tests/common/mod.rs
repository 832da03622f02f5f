//! Shared by the integration tests: handles cross to a child process as hex text (in its
//! environment or on a line of its stdin and stdout).

/// `bytes` as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes `text` (hex, as [`hex`] writes it) stands for.
///
/// # Panics
/// `text` is not hex.
pub(crate) fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}
