//! Entry points for fuzzing the manager's wire protocol (`fuzz/` in the repository).
//!
//! Not part of the supported API (hidden from the docs, may change without notice): the protocol's
//! types stay private, and these functions drive their decoders the way the daemon and the client
//! do, on bytes instead of a socket.

use super::protocol::{Reply, Request};

/// Decodes `bytes` as the daemon reads a client's stream: one request frame after another until the
/// end of the input or the first malformed frame. Every request decoded must encode back to exactly
/// the bytes it was read from.
///
/// Returns how many requests were decoded.
///
/// # Panics
/// When a decoded request does not encode back to its bytes (a decoder bug: what fuzzing looks for).
#[must_use]
pub fn decode_requests(bytes: &[u8]) -> usize {
    let mut input = bytes;
    let mut decoded = 0;
    loop {
        let before = input;
        match Request::read_from(&mut input) {
            Ok(Some(request)) => {
                let consumed = &before[..before.len() - input.len()];
                let mut encoded = Vec::new();
                request
                    .write_to(&mut encoded)
                    .expect("a decoded request encodes");
                assert_eq!(
                    encoded, consumed,
                    "request {request:?} does not encode back to its frame"
                );
                decoded += 1;
            }
            Ok(None) | Err(_) => return decoded,
        }
    }
}

/// Decodes `bytes` as the client reads the daemon's replies, with the same checks as
/// [`decode_requests`].
///
/// Returns how many replies were decoded.
///
/// # Panics
/// When a decoded reply does not encode back to its bytes.
#[must_use]
pub fn decode_replies(bytes: &[u8]) -> usize {
    let mut input = bytes;
    let mut decoded = 0;
    while !input.is_empty() {
        let before = input;
        match Reply::read_from(&mut input) {
            Ok(reply) => {
                let consumed = &before[..before.len() - input.len()];
                let mut encoded = Vec::new();
                reply
                    .write_to(&mut encoded)
                    .expect("a decoded reply encodes");
                assert_eq!(
                    encoded, consumed,
                    "reply {reply:?} does not encode back to its frame"
                );
                decoded += 1;
            }
            Err(_) => return decoded,
        }
    }
    decoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_counted_until_the_first_bad_one() {
        // Status, Register "/a", then an unknown kind, then a Status that is never reached.
        let bytes = [6, 0, 0, 2, 2, 0, b'/', b'a', 0x42, 0, 0, 6, 0, 0];
        assert_eq!(decode_requests(&bytes), 2);
        // Registered, Released(true), then a Released with a bad flag.
        let bytes = [0x82, 0, 0, 0x84, 1, 0, 1, 0x84, 1, 0, 7];
        assert_eq!(decode_replies(&bytes), 2);
    }
}
