//! Splitting a pickle into opcodes (the format `pickletools` documents), with their arguments decoded
//! and every length checked against the data.

use super::super::{SnapshotError, SnapshotResult};

/// Newest pickle protocol understood.
pub(super) const HIGHEST_PROTOCOL: u8 = 5;

/// One decoded opcode.
pub(super) enum Op<'a> {
    Proto(u8),
    Frame,
    Stop,
    Mark,
    Pop,
    PopMark,
    Dup,
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    /// UTF-8 text (`BINUNICODE` and friends).
    Text(&'a [u8]),
    /// Text in raw-unicode-escape form (`UNICODE`, protocol 0).
    EscapedText(&'a [u8]),
    /// A Python 2 `str` (`BINSTRING`, `SHORT_BINSTRING`): text when it is UTF-8, else bytes.
    LegacyString(&'a [u8]),
    Bytes(&'a [u8]),
    EmptyList,
    EmptyDict,
    EmptyTuple,
    EmptySet,
    /// Build a list / dict / tuple / frozenset from the items since the last mark.
    List,
    Dict,
    Tuple,
    FrozenSet,
    /// Build a tuple from the top 1, 2 or 3 items.
    TupleN(usize),
    Append,
    Appends,
    SetItem,
    SetItems,
    AddItems,
    Put(u64),
    Memoize,
    Get(u64),
    /// An opcode that creates or refers to objects of classes, with what it names.
    Object(&'static str, String),
}

/// Splits the input into opcodes.
pub(super) struct Decoder<'a> {
    pub(super) data: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Decoder<'a> {
    fn truncated(&self) -> SnapshotError {
        SnapshotError::Pickle {
            offset: self.data.len(),
            reason: "the data ends before the pickle's STOP opcode (truncated file?)".into(),
        }
    }

    fn take(&mut self, n: usize) -> SnapshotResult<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| self.truncated())?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn fixed<const N: usize>(&mut self) -> SnapshotResult<[u8; N]> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn length(&mut self, width: usize) -> SnapshotResult<usize> {
        let mut raw = [0u8; 8];
        raw[..width].copy_from_slice(self.take(width)?);
        usize::try_from(u64::from_le_bytes(raw)).map_err(|_| self.truncated())
    }

    fn counted(&mut self, width: usize) -> SnapshotResult<&'a [u8]> {
        let len = self.length(width)?;
        self.take(len)
    }

    /// A newline-terminated argument (protocol 0), without the newline.
    fn line(&mut self) -> SnapshotResult<&'a [u8]> {
        let rest = &self.data[self.pos..];
        let len = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.truncated())?;
        self.pos += len + 1;
        Ok(&rest[..len])
    }

    fn line_text(&mut self, what: &str, at: usize) -> SnapshotResult<&'a str> {
        let line = self.line()?;
        std::str::from_utf8(line)
            .map_err(|_| malformed(at, format!("{what} argument is not ASCII")))
    }

    fn decimal(&mut self, what: &str, at: usize) -> SnapshotResult<i128> {
        let text = self.line_text(what, at)?;
        let digits = text.strip_suffix('L').unwrap_or(text);
        digits.parse().map_err(|_| {
            malformed(
                at,
                format!("{what} argument {text:?} is not an integer that fits in 128 bits"),
            )
        })
    }

    /// The next opcode and the offset it starts at.
    pub(super) fn next(&mut self) -> SnapshotResult<(usize, Op<'a>)> {
        let at = self.pos;
        let [code] = self.fixed::<1>()?;
        let op = match code {
            0x80 => Op::Proto(self.fixed::<1>()?[0]),
            0x95 => {
                self.take(8)?;
                Op::Frame
            }
            b'.' => Op::Stop,
            b'(' => Op::Mark,
            b'0' => Op::Pop,
            b'1' => Op::PopMark,
            b'2' => Op::Dup,
            b'N' => Op::None,
            0x88 => Op::Bool(true),
            0x89 => Op::Bool(false),
            b'I' => match self.line_text("INT", at)? {
                "01" => Op::Bool(true),
                "00" => Op::Bool(false),
                text => Op::Int(text.parse().map_err(|_| malformed(at, format!("INT argument {text:?} is not an integer")))?),
            },
            b'L' => Op::Int(self.decimal("LONG", at)?),
            b'J' => Op::Int(i32::from_le_bytes(self.fixed()?).into()),
            b'K' => Op::Int(self.fixed::<1>()?[0].into()),
            b'M' => Op::Int(u16::from_le_bytes(self.fixed()?).into()),
            0x8a => Op::Int(long_from_bytes(self.counted(1)?, at)?),
            0x8b => Op::Int(long_from_bytes(self.counted(4)?, at)?),
            b'F' => {
                let text = self.line_text("FLOAT", at)?;
                Op::Float(text.parse().map_err(|_| malformed(at, format!("FLOAT argument {text:?} is not a number")))?)
            }
            b'G' => Op::Float(f64::from_be_bytes(self.fixed()?)),
            b'X' => Op::Text(self.counted(4)?),
            0x8c => Op::Text(self.counted(1)?),
            0x8d => Op::Text(self.counted(8)?),
            b'V' => Op::EscapedText(self.line()?),
            b'T' => Op::LegacyString(self.counted(4)?),
            b'U' => Op::LegacyString(self.counted(1)?),
            b'B' => Op::Bytes(self.counted(4)?),
            b'C' => Op::Bytes(self.counted(1)?),
            0x8e | 0x96 => Op::Bytes(self.counted(8)?),
            b']' => Op::EmptyList,
            b'}' => Op::EmptyDict,
            b')' => Op::EmptyTuple,
            0x8f => Op::EmptySet,
            b'l' => Op::List,
            b'd' => Op::Dict,
            b't' => Op::Tuple,
            0x91 => Op::FrozenSet,
            0x85 => Op::TupleN(1),
            0x86 => Op::TupleN(2),
            0x87 => Op::TupleN(3),
            b'a' => Op::Append,
            b'e' => Op::Appends,
            b's' => Op::SetItem,
            b'u' => Op::SetItems,
            0x90 => Op::AddItems,
            b'p' => Op::Put(self.decimal("PUT", at)?.try_into().unwrap_or(u64::MAX)),
            b'q' => Op::Put(self.fixed::<1>()?[0].into()),
            b'r' => Op::Put(u32::from_le_bytes(self.fixed()?).into()),
            0x94 => Op::Memoize,
            b'g' => Op::Get(self.decimal("GET", at)?.try_into().unwrap_or(u64::MAX)),
            b'h' => Op::Get(self.fixed::<1>()?[0].into()),
            b'j' => Op::Get(u32::from_le_bytes(self.fixed()?).into()),
            b'c' | b'i' => {
                let module = String::from_utf8_lossy(self.line()?).into_owned();
                let name = String::from_utf8_lossy(self.line()?).into_owned();
                Op::Object(if code == b'c' { "GLOBAL" } else { "INST" }, format!("{module}.{name}"))
            }
            b'S' => {
                return Err(SnapshotError::UnsupportedPickle {
                    offset: at,
                    reason: "protocol-0 byte strings (STRING) are not supported; write the pickle with protocol 2 \
                             or later"
                        .into(),
                })
            }
            other => match object_opcode(other) {
                Some(name) => Op::Object(name, String::new()),
                None => return Err(malformed(at, format!("unknown opcode 0x{other:02x}"))),
            },
        };
        Ok((at, op))
    }
}

/// Names of the opcodes that deal in objects of classes, which this reader refuses.
fn object_opcode(code: u8) -> Option<&'static str> {
    Some(match code {
        b'R' => "REDUCE",
        b'b' => "BUILD",
        b'o' => "OBJ",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

pub(super) fn malformed(offset: usize, reason: String) -> SnapshotError {
    SnapshotError::Pickle { offset, reason }
}

/// A little-endian two's complement integer (`LONG1`, `LONG4`).
fn long_from_bytes(bytes: &[u8], at: usize) -> SnapshotResult<i128> {
    if bytes.len() > 16 {
        return Err(malformed(
            at,
            format!("integer of {} bytes is wider than 128 bits", bytes.len()),
        ));
    }
    let Some(&last) = bytes.last() else {
        return Ok(0);
    };
    let mut raw = if last & 0x80 != 0 {
        [0xff; 16]
    } else {
        [0; 16]
    };
    raw[..bytes.len()].copy_from_slice(bytes);
    Ok(i128::from_le_bytes(raw))
}

/// Decodes Python's raw-unicode-escape: Latin-1 bytes, except `\uXXXX` and `\UXXXXXXXX`, into a
/// string of `capacity` bytes (twice the input's length holds any decoding), allocated fallibly.
pub(super) fn raw_unicode_escape(
    bytes: &[u8],
    at: usize,
    capacity: usize,
) -> SnapshotResult<String> {
    let mut out = String::new();
    out.try_reserve_exact(capacity)
        .map_err(|_| SnapshotError::OutOfMemory {
            bytes: capacity as u64,
        })?;
    let mut i = 0;
    while i < bytes.len() {
        let width = match (bytes[i], bytes.get(i + 1)) {
            (b'\\', Some(b'u')) => 4,
            (b'\\', Some(b'U')) => 8,
            (b, _) => {
                out.push(char::from(b));
                i += 1;
                continue;
            }
        };
        let hex = bytes
            .get(i + 2..i + 2 + width)
            .and_then(|h| std::str::from_utf8(h).ok());
        let ch = hex
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .and_then(char::from_u32);
        out.push(ch.ok_or_else(|| malformed(at, "bad \\u escape in UNICODE argument".into()))?);
        i += 2 + width;
    }
    Ok(out)
}
