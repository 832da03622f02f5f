//! The wire protocol between clients and the manager daemon.
//!
//! One Unix stream socket per client process. Every message is a frame:
//!
//! ```text
//! +--------+----------------+-------------------+
//! | kind   | length (u16 LE)| payload (length)  |
//! | 1 byte | 2 bytes        | at most 1024 bytes|
//! +--------+----------------+-------------------+
//! ```
//!
//! The client speaks first with `Hello`, then sends one request at a time and reads its reply
//! before sending the next. Names travel as UTF-8 bytes, without a terminating NUL.
//!
//! | kind | request            | payload                 | reply                      |
//! | ---- | ------------------ | ----------------------- | -------------------------- |
//! | 0x01 | `Hello`            | version u32, pid u32    | `Welcome` version u32, pid u32 |
//! | 0x02 | `Register` new     | name                    | `Registered`               |
//! | 0x03 | `Register` existing| name                    | `Registered` or `Refused`  |
//! | 0x04 | `Release`          | name                    | `Released` unlinked u8     |
//! | 0x05 | `Forget`           | name                    | `Forgotten`                |
//! | 0x06 | `Status`           | (none)                  | `Status` clients u32, names u32 |
//!
//! Replies use kinds 0x81 (`Welcome`), 0x82 (`Registered`), 0x84 (`Released`), 0x85
//! (`Forgotten`), 0x86 (`Status`) and 0xFF (`Refused`, payload: a UTF-8 message). Integers are
//! little-endian.

use std::io::{self, Read, Write};

/// The version spoken by this library; `Hello` and `Welcome` carry it, a mismatch ends the
/// connection.
pub(crate) const PROTOCOL_VERSION: u32 = 1;

/// Largest payload accepted; shared-memory names are at most 255 bytes, messages are short.
const MAX_PAYLOAD: usize = 1024;

/// What a client asks the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// First message of a connection.
    Hello {
        /// The client's protocol version.
        version: u32,
        /// The client's process id, for the daemon's log.
        pid: u32,
    },
    /// Become a holder of `name`. With `must_exist`, the daemon refuses names that no longer
    /// exist (a peer released them already); without, the client is about to create the object.
    Register { name: String, must_exist: bool },
    /// Stop holding `name`; the daemon unlinks it when this was the last holder.
    Release { name: String },
    /// The client unlinked `name` itself; the daemon drops it for every holder.
    Forget { name: String },
    /// How many clients and names the daemon tracks.
    Status,
}

/// What the daemon answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Answer to `Hello`.
    Welcome { version: u32, pid: u32 },
    /// Answer to `Register`.
    Registered,
    /// Answer to `Release`; `unlinked` says whether this release removed the object.
    Released { unlinked: bool },
    /// Answer to `Forget`.
    Forgotten,
    /// Answer to `Status`: connected clients (the asking one included) and held names.
    Status { clients: u32, names: u32 },
    /// The request was refused.
    Refused { message: String },
}

mod kind {
    pub(super) const HELLO: u8 = 0x01;
    pub(super) const REGISTER_NEW: u8 = 0x02;
    pub(super) const REGISTER_EXISTING: u8 = 0x03;
    pub(super) const RELEASE: u8 = 0x04;
    pub(super) const FORGET: u8 = 0x05;
    pub(super) const STATUS: u8 = 0x06;
    pub(super) const WELCOME: u8 = 0x81;
    pub(super) const REGISTERED: u8 = 0x82;
    pub(super) const RELEASED: u8 = 0x84;
    pub(super) const FORGOTTEN: u8 = 0x85;
    pub(super) const STATUS_REPLY: u8 = 0x86;
    pub(super) const REFUSED: u8 = 0xFF;
}

fn malformed(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Writes one frame with a single `write_all`.
fn write_frame(out: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    if payload.len() > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("payload of {} bytes exceeds {MAX_PAYLOAD}", payload.len()),
        ));
    }
    let mut frame = Vec::with_capacity(3 + payload.len());
    frame.push(kind);
    // The bound check above makes the length fit in u16.
    frame.extend_from_slice(&(payload.len() as u16).to_le_bytes());
    frame.extend_from_slice(payload);
    out.write_all(&frame)
}

/// Reads one frame; `Ok(None)` on end of stream before the first byte of a frame.
fn read_frame(input: &mut impl Read) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut header = [0u8; 3];
    let mut filled = 0;
    while filled < header.len() {
        match input.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = usize::from(u16::from_le_bytes([header[1], header[2]]));
    if len > MAX_PAYLOAD {
        return Err(malformed(format!(
            "frame of {len} bytes exceeds {MAX_PAYLOAD}"
        )));
    }
    let mut payload = vec![0u8; len];
    input.read_exact(&mut payload)?;
    Ok(Some((header[0], payload)))
}

fn two_u32(payload: &[u8], what: &str) -> io::Result<(u32, u32)> {
    match payload {
        [a0, a1, a2, a3, b0, b1, b2, b3] => Ok((
            u32::from_le_bytes([*a0, *a1, *a2, *a3]),
            u32::from_le_bytes([*b0, *b1, *b2, *b3]),
        )),
        _ => Err(malformed(format!(
            "{what} carries {} bytes, expected 8",
            payload.len()
        ))),
    }
}

fn text(payload: Vec<u8>, what: &str) -> io::Result<String> {
    String::from_utf8(payload).map_err(|_| malformed(format!("{what} is not UTF-8")))
}

fn pair(a: u32, b: u32) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&a.to_le_bytes());
    out[4..].copy_from_slice(&b.to_le_bytes());
    out
}

impl Request {
    /// Encodes and writes this request.
    pub(crate) fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        match self {
            Request::Hello { version, pid } => write_frame(out, kind::HELLO, &pair(*version, *pid)),
            Request::Register { name, must_exist } => {
                let k = if *must_exist {
                    kind::REGISTER_EXISTING
                } else {
                    kind::REGISTER_NEW
                };
                write_frame(out, k, name.as_bytes())
            }
            Request::Release { name } => write_frame(out, kind::RELEASE, name.as_bytes()),
            Request::Forget { name } => write_frame(out, kind::FORGET, name.as_bytes()),
            Request::Status => write_frame(out, kind::STATUS, &[]),
        }
    }

    /// Reads one request; `Ok(None)` when the client closed the connection between requests.
    pub(crate) fn read_from(input: &mut impl Read) -> io::Result<Option<Request>> {
        let Some((k, payload)) = read_frame(input)? else {
            return Ok(None);
        };
        let request = match k {
            kind::HELLO => {
                let (version, pid) = two_u32(&payload, "hello")?;
                Request::Hello { version, pid }
            }
            kind::REGISTER_NEW | kind::REGISTER_EXISTING => Request::Register {
                name: text(payload, "name")?,
                must_exist: k == kind::REGISTER_EXISTING,
            },
            kind::RELEASE => Request::Release {
                name: text(payload, "name")?,
            },
            kind::FORGET => Request::Forget {
                name: text(payload, "name")?,
            },
            kind::STATUS if payload.is_empty() => Request::Status,
            kind::STATUS => return Err(malformed("status carries an unexpected payload")),
            other => return Err(malformed(format!("unknown request kind {other:#04x}"))),
        };
        Ok(Some(request))
    }
}

impl Reply {
    /// Encodes and writes this reply.
    pub(crate) fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        match self {
            Reply::Welcome { version, pid } => {
                write_frame(out, kind::WELCOME, &pair(*version, *pid))
            }
            Reply::Registered => write_frame(out, kind::REGISTERED, &[]),
            Reply::Released { unlinked } => {
                write_frame(out, kind::RELEASED, &[u8::from(*unlinked)])
            }
            Reply::Forgotten => write_frame(out, kind::FORGOTTEN, &[]),
            Reply::Status { clients, names } => {
                write_frame(out, kind::STATUS_REPLY, &pair(*clients, *names))
            }
            Reply::Refused { message } => {
                // Keep within the frame limit on a char boundary.
                let mut end = message.len().min(MAX_PAYLOAD);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                write_frame(out, kind::REFUSED, &message.as_bytes()[..end])
            }
        }
    }

    /// Reads one reply; end of stream is an error here (a reply was expected).
    pub(crate) fn read_from(input: &mut impl Read) -> io::Result<Reply> {
        let Some((k, payload)) = read_frame(input)? else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the shm manager closed the connection",
            ));
        };
        let no_payload = |payload: &[u8], what: &str| {
            if payload.is_empty() {
                Ok(())
            } else {
                Err(malformed(format!("{what} carries an unexpected payload")))
            }
        };
        Ok(match k {
            kind::WELCOME => {
                let (version, pid) = two_u32(&payload, "welcome")?;
                Reply::Welcome { version, pid }
            }
            kind::REGISTERED => {
                no_payload(&payload, "registered")?;
                Reply::Registered
            }
            kind::RELEASED => match payload.as_slice() {
                [0] => Reply::Released { unlinked: false },
                [1] => Reply::Released { unlinked: true },
                _ => return Err(malformed("released carries a bad flag")),
            },
            kind::FORGOTTEN => {
                no_payload(&payload, "forgotten")?;
                Reply::Forgotten
            }
            kind::STATUS_REPLY => {
                let (clients, names) = two_u32(&payload, "status")?;
                Reply::Status { clients, names }
            }
            kind::REFUSED => Reply::Refused {
                message: text(payload, "refusal")?,
            },
            other => return Err(malformed(format!("unknown reply kind {other:#04x}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_request(request: Request) {
        let mut buf = Vec::new();
        request.write_to(&mut buf).unwrap();
        let mut input = buf.as_slice();
        assert_eq!(Request::read_from(&mut input).unwrap(), Some(request));
        assert!(input.is_empty());
        assert_eq!(Request::read_from(&mut input).unwrap(), None);
    }

    fn round_trip_reply(reply: Reply) {
        let mut buf = Vec::new();
        reply.write_to(&mut buf).unwrap();
        assert_eq!(Reply::read_from(&mut buf.as_slice()).unwrap(), reply);
    }

    #[test]
    fn requests_round_trip() {
        round_trip_request(Request::Hello {
            version: PROTOCOL_VERSION,
            pid: 4242,
        });
        for must_exist in [false, true] {
            round_trip_request(Request::Register {
                name: "/tensormem_1_ab_0".into(),
                must_exist,
            });
        }
        round_trip_request(Request::Release { name: "/x".into() });
        round_trip_request(Request::Forget { name: "/y".into() });
        round_trip_request(Request::Status);
    }

    #[test]
    fn replies_round_trip() {
        round_trip_reply(Reply::Welcome { version: 7, pid: 9 });
        round_trip_reply(Reply::Registered);
        round_trip_reply(Reply::Released { unlinked: true });
        round_trip_reply(Reply::Released { unlinked: false });
        round_trip_reply(Reply::Forgotten);
        round_trip_reply(Reply::Status {
            clients: 3,
            names: 12,
        });
        round_trip_reply(Reply::Refused {
            message: "no such object".into(),
        });
    }

    #[test]
    fn several_frames_in_one_stream_stay_apart() {
        let mut buf = Vec::new();
        Request::Release { name: "/a".into() }
            .write_to(&mut buf)
            .unwrap();
        Request::Forget { name: "/bb".into() }
            .write_to(&mut buf)
            .unwrap();
        let mut input = buf.as_slice();
        assert_eq!(
            Request::read_from(&mut input).unwrap(),
            Some(Request::Release { name: "/a".into() })
        );
        assert_eq!(
            Request::read_from(&mut input).unwrap(),
            Some(Request::Forget { name: "/bb".into() })
        );
    }

    #[test]
    fn truncated_frames_are_errors_not_end_of_stream() {
        let mut buf = Vec::new();
        Request::Release {
            name: "/abc".into(),
        }
        .write_to(&mut buf)
        .unwrap();
        for cut in 1..buf.len() {
            let err = Request::read_from(&mut &buf[..cut]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
    }

    #[test]
    fn malformed_frames_are_invalid_data() {
        let cases: [&[u8]; 5] = [
            &[0x42, 0, 0],                      // unknown kind
            &[kind::HELLO, 3, 0, 1, 2, 3],      // short hello
            &[kind::RELEASE, 2, 0, 0xff, 0xfe], // not UTF-8
            &[kind::RELEASE, 0xff, 0xff],       // over the size limit
            &[kind::REGISTERED, 1, 0, 0],       // reply kind where a request is expected
        ];
        for case in cases {
            let err = Request::read_from(&mut &case[..]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{case:?}");
        }
        let err = Reply::read_from(&mut &[kind::RELEASED, 1, 0, 7][..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let err = Reply::read_from(&mut &[][..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn oversized_payloads_are_refused_on_write() {
        let name = "x".repeat(MAX_PAYLOAD + 1);
        let err = Request::Release { name }
            .write_to(&mut Vec::new())
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        // Refusal messages are cut, not refused.
        let mut buf = Vec::new();
        Reply::Refused {
            message: "é".repeat(MAX_PAYLOAD),
        }
        .write_to(&mut buf)
        .unwrap();
        assert!(matches!(
            Reply::read_from(&mut buf.as_slice()).unwrap(),
            Reply::Refused { .. }
        ));
    }
}
