//! The pool's wire format, carried by a shared-memory [`channel`](crate::channel) between one
//! producer ([`PoolSender`](super::PoolSender)) and one consumer
//! ([`PoolReceiver`](crate::pool::PoolReceiver)), which the consumer creates over the
//! Unix socket it is given. Integers little-endian.
//!
//! Producer to consumer: messages of [`MESSAGE_LEN`] bytes, sent without their zero tail (the
//! header and the application data: [`ring_len`] bytes); a `NEW` message goes with the region's
//! fd ([`ChannelSender::send_with_fd`](crate::channel::ChannelSender::send_with_fd): the fd on
//! the socket, then the message on the ring), the others are ring messages only.
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `b"TMPL"` |
//! | 4..6 | version (1) |
//! | 6 | kind: 1 `NEW` (fd attached), 2 `KNOWN` (a region the consumer caches), 3 `FORGET` (drop the mapping of `id`) |
//! | 7 | flags: bit 0 `TRANSIENT` (a `NEW` region not to be cached: unmap when the lease goes) |
//! | 8..16 | region id |
//! | 16..24 | `len`: bytes the lease exposes |
//! | 24..32 | `map_len`: bytes of the region (`NEW`: what to map) |
//! | 32..34 | `user_len`: bytes of application data (at most [`MAX_POOL_USER_DATA`]) |
//! | 34..40 | zero |
//! | 40..40+user_len | application data; zero up to [`MESSAGE_LEN`] |
//!
//! Consumer to producer: ring messages of [`RECORD_LEN`] bytes, no fds: magic `b"TMRL"`, kind (u32: 1
//! `HELLO` with `a` = most regions the consumer caches and `b` = most bytes; 2 `RELEASE` with `a`
//! = region id), `a` (u64), `b` (u64).

use crate::channel::MAX_MESSAGE;
use crate::error::{Error, Result};
use crate::wire::{WireFormat, POOL_MAGIC};

/// Size of every producer-to-consumer message.
pub(crate) const MESSAGE_LEN: usize = 256;
pub(crate) const HEADER_LEN: usize = 40;
/// Most application bytes a pool message carries.
pub const MAX_POOL_USER_DATA: usize = MESSAGE_LEN - HEADER_LEN;
/// Size of every consumer-to-producer record.
pub(crate) const RECORD_LEN: usize = 24;
/// Slots of each of the connection's rings. A consumer's releases never fill its ring: the
/// producer keeps at most this many leases open on a connection.
pub(crate) const POOL_SLOTS: u32 = 256;

const _: () = assert!(MESSAGE_LEN <= MAX_MESSAGE);

/// Bytes of `message` that travel (the header and `user_len` bytes of application data).
pub(crate) fn ring_len(message: &[u8; MESSAGE_LEN]) -> usize {
    let user_len = usize::from(u16::from_le_bytes([message[32], message[33]]));
    HEADER_LEN + user_len.min(MAX_POOL_USER_DATA)
}

/// A message as it arrived (`len` bytes), padded back to [`MESSAGE_LEN`].
pub(crate) fn padded(bytes: &[u8]) -> Result<[u8; MESSAGE_LEN]> {
    if bytes.len() < HEADER_LEN || bytes.len() > MESSAGE_LEN {
        return Err(Error::Protocol {
            wire: WireFormat::Pool,
            problem: format!(
                "a pool message of {} bytes; they have {HEADER_LEN} to {MESSAGE_LEN}",
                bytes.len()
            ),
        });
    }
    let mut out = [0u8; MESSAGE_LEN];
    out[..bytes.len()].copy_from_slice(bytes);
    Ok(out)
}

/// A received message and the fd it carried, if any.
pub(crate) type Message = (Option<rustix::fd::OwnedFd>, [u8; MESSAGE_LEN]);

const RECORD_MAGIC: [u8; 4] = *b"TMRL";
const VERSION: u16 = 1;
const FLAG_TRANSIENT: u8 = 1;

/// What a producer-to-consumer message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    New,
    Known,
    Forget,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) transient: bool,
    pub(crate) id: u64,
    pub(crate) len: u64,
    pub(crate) map_len: u64,
    pub(crate) user_len: u16,
}

pub(crate) fn encode(header: &Header, user: &[u8]) -> Result<[u8; MESSAGE_LEN]> {
    if user.len() > MAX_POOL_USER_DATA {
        return Err(Error::Protocol {
            wire: WireFormat::Pool,
            problem: format!(
                "{} bytes of application data, at most {MAX_POOL_USER_DATA} fit in a pool message",
                user.len()
            ),
        });
    }
    let mut out = [0u8; MESSAGE_LEN];
    out[0..4].copy_from_slice(&POOL_MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6] = match header.kind {
        Kind::New => 1,
        Kind::Known => 2,
        Kind::Forget => 3,
    };
    out[7] = if header.transient { FLAG_TRANSIENT } else { 0 };
    out[8..16].copy_from_slice(&header.id.to_le_bytes());
    out[16..24].copy_from_slice(&header.len.to_le_bytes());
    out[24..32].copy_from_slice(&header.map_len.to_le_bytes());
    out[32..34].copy_from_slice(&(user.len() as u16).to_le_bytes());
    out[HEADER_LEN..HEADER_LEN + user.len()].copy_from_slice(user);
    Ok(out)
}

pub(crate) fn decode(b: &[u8; MESSAGE_LEN]) -> Result<Header> {
    let protocol = |problem: String| {
        Err(Error::Protocol {
            wire: WireFormat::Pool,
            problem,
        })
    };
    if b[0..4] != POOL_MAGIC {
        return Err(WireFormat::Pool.bad_magic(b));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return protocol(format!(
            "pool message version {version}, this end speaks {VERSION}"
        ));
    }
    let kind = match b[6] {
        1 => Kind::New,
        2 => Kind::Known,
        3 => Kind::Forget,
        other => return protocol(format!("unknown pool message kind {other}")),
    };
    if b[7] & !FLAG_TRANSIENT != 0 || b[34..40].iter().any(|&x| x != 0) {
        return protocol("unknown flags or non-zero reserved bytes in a pool message".into());
    }
    let header = Header {
        kind,
        transient: b[7] & FLAG_TRANSIENT != 0,
        id: u64_at(b, 8),
        len: u64_at(b, 16),
        map_len: u64_at(b, 24),
        user_len: u16::from_le_bytes([b[32], b[33]]),
    };
    if usize::from(header.user_len) > MAX_POOL_USER_DATA {
        return protocol(format!(
            "{} bytes of application data, at most {MAX_POOL_USER_DATA} fit",
            header.user_len
        ));
    }
    if kind != Kind::Forget && header.len == 0 {
        return protocol("a pool message for a region of 0 bytes".into());
    }
    if kind == Kind::New && header.len > header.map_len {
        return protocol(format!(
            "a lease of {} bytes on a region of {}",
            header.len, header.map_len
        ));
    }
    Ok(header)
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(w)
}

/// A consumer-to-producer record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Record {
    Hello { entries: u64, bytes: u64 },
    Release { id: u64 },
}

impl Record {
    pub(crate) fn encode(self) -> [u8; RECORD_LEN] {
        let (kind, a, b) = match self {
            Self::Hello { entries, bytes } => (1u32, entries, bytes),
            Self::Release { id } => (2u32, id, 0),
        };
        let mut out = [0u8; RECORD_LEN];
        out[0..4].copy_from_slice(&RECORD_MAGIC);
        out[4..8].copy_from_slice(&kind.to_le_bytes());
        out[8..16].copy_from_slice(&a.to_le_bytes());
        out[16..24].copy_from_slice(&b.to_le_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self> {
        if b.len() != RECORD_LEN || b[0..4] != RECORD_MAGIC {
            return Err(Error::Protocol {
                wire: WireFormat::Pool,
                problem: "a malformed record from the consumer".into(),
            });
        }
        let kind = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let (a, bb) = (u64_at(b, 8), u64_at(b, 16));
        match kind {
            1 => Ok(Self::Hello {
                entries: a,
                bytes: bb,
            }),
            2 => Ok(Self::Release { id: a }),
            other => Err(Error::Protocol {
                wire: WireFormat::Pool,
                problem: format!("unknown record kind {other} from the consumer"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_records_round_trip() {
        let header = Header {
            kind: Kind::New,
            transient: true,
            id: 7,
            len: 100,
            map_len: 4096,
            user_len: 3,
        };
        let bytes = encode(&header, b"abc").unwrap();
        assert_eq!(decode(&bytes).unwrap(), header);
        assert_eq!(&bytes[HEADER_LEN..HEADER_LEN + 3], b"abc");
        for record in [
            Record::Hello {
                entries: 3,
                bytes: 9,
            },
            Record::Release { id: 42 },
        ] {
            assert_eq!(Record::decode(&record.encode()).unwrap(), record);
        }
        let mut bad = bytes;
        bad[6] = 9;
        assert!(matches!(decode(&bad), Err(Error::Protocol { .. })));
        let mut lying = encode(
            &Header {
                len: 8192,
                ..header
            },
            &[],
        )
        .unwrap();
        assert!(matches!(decode(&lying), Err(Error::Protocol { .. })));
        lying[0] = b'X';
        assert!(matches!(decode(&lying), Err(Error::Protocol { .. })));
        assert!(encode(&header, &[0; MAX_POOL_USER_DATA + 1]).is_err());
    }
}
