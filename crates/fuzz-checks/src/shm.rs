//! The shared-memory wire formats: the region message header, the refcount header, the manager
//! daemon's protocol.

use tensormem_shm::manager::fuzzing;
use tensormem_shm::transfer::{RegionHeader, HEADER_LEN, MAX_USER_DATA};
use tensormem_shm::{RefcountHeader, REFCOUNT_HEADER_LEN};

/// Decodes `data` as a region message header and as a refcount header. A header that decodes must
/// be valid and encode back to the bytes it came from.
///
/// # Panics
/// When a decoder panics, accepts a header it should refuse, or does not round trip.
pub fn header(data: &[u8]) {
    if let Ok(header) = RegionHeader::decode(data) {
        assert!(header.len > 0, "a region of 0 bytes was accepted");
        assert!(
            usize::from(header.user_len) <= MAX_USER_DATA,
            "user_len {} accepted",
            header.user_len
        );
        assert_eq!(
            header.encode().as_slice(),
            &data[..HEADER_LEN],
            "header {header:?} does not encode back to its bytes"
        );
    } else {
        assert!(
            data.len() < HEADER_LEN || data[..4] != *b"TMSR" || {
                // A refused header with the magic: at least one field must be out of range.
                let b = &data[..HEADER_LEN];
                let version = u16::from_le_bytes([b[4], b[5]]);
                let flags = u16::from_le_bytes([b[6], b[7]]);
                let user_len = usize::from(u16::from_le_bytes([b[24], b[25]]));
                let len = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
                version != 1
                    || flags & !1 != 0
                    || b[26..].iter().any(|&x| x != 0)
                    || user_len > MAX_USER_DATA
                    || len == 0
            },
            "a valid header was refused: {:?}",
            &data[..HEADER_LEN]
        );
    }
    match RefcountHeader::decode(data) {
        Ok(header) => {
            assert!(data.len() >= REFCOUNT_HEADER_LEN);
            assert_eq!(
                header.encode()[..4],
                data[..4],
                "refcount does not round trip"
            );
        }
        Err(_) => assert!(
            data.len() < REFCOUNT_HEADER_LEN,
            "a long enough header was refused"
        ),
    }
}

/// Decodes `data` as the manager daemon's request stream and as its reply stream (the decoders
/// check that every decoded frame encodes back to its bytes).
///
/// # Panics
/// When a decoder panics or a decoded frame does not round trip.
pub fn manager_protocol(data: &[u8]) {
    let requests = fuzzing::decode_requests(data);
    let replies = fuzzing::decode_replies(data);
    // Every frame is at least 3 bytes.
    assert!(requests * 3 <= data.len() && replies * 3 <= data.len());
}
