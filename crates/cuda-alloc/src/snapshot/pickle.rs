//! Writing a [`PyValue`] as a pickle (protocol 4) that Python's `pickle.load` reads back into the same
//! plain data.
//!
//! Layout as Python's own pickler writes it: containers are created empty and filled in batches of 1000
//! (`MARK ... APPENDS` / `SETITEMS`), tuples of up to three items use `TUPLE1..3`, and each distinct string
//! is written once and then referred to through the memo (`MEMOIZE` / `BINGET`), which keeps the dict
//! keys repeated in every trace entry from bloating the file.

use std::collections::HashMap;
use std::io::Write;

use super::pyvalue::{PyValue, MAX_DEPTH};
use super::{SnapshotError, SnapshotResult};

/// Items per `APPENDS` / `SETITEMS` / `ADDITEMS` batch (Python's `_BATCHSIZE`).
const BATCH: usize = 1000;

/// Writes `value` as a protocol-4 pickle.
pub(crate) fn write_pickle<W: Write>(writer: W, value: &PyValue) -> SnapshotResult<()> {
    if value.depth() > MAX_DEPTH {
        return Err(SnapshotError::Invalid {
            path: String::new(),
            reason: format!("values nest more than {MAX_DEPTH} levels deep"),
        });
    }
    let mut pickler = Pickler {
        out: std::io::BufWriter::new(writer),
        strings: HashMap::new(),
        memo_len: 0,
    };
    pickler.bytes(&[0x80, 4])?;
    pickler.value(value)?;
    pickler.bytes(b".")?;
    pickler.out.flush().map_err(SnapshotError::write)?;
    Ok(())
}

struct Pickler<'v, W: Write> {
    out: std::io::BufWriter<W>,
    /// Memo slot of each string written so far.
    strings: HashMap<&'v str, u32>,
    /// Memo slots used.
    memo_len: u32,
}

impl<'v, W: Write> Pickler<'v, W> {
    fn bytes(&mut self, bytes: &[u8]) -> SnapshotResult<()> {
        self.out.write_all(bytes).map_err(SnapshotError::write)
    }

    fn counted(&mut self, short: u8, long: u8, huge: u8, payload: &[u8]) -> SnapshotResult<()> {
        match (u8::try_from(payload.len()), u32::try_from(payload.len())) {
            (Ok(n), _) => self.bytes(&[short, n])?,
            (_, Ok(n)) => {
                self.bytes(&[long])?;
                self.bytes(&n.to_le_bytes())?;
            }
            _ => {
                self.bytes(&[huge])?;
                self.bytes(&(payload.len() as u64).to_le_bytes())?;
            }
        }
        self.bytes(payload)
    }

    fn int(&mut self, i: i128) -> SnapshotResult<()> {
        if let Ok(small) = u8::try_from(i) {
            self.bytes(&[b'K', small])
        } else if let Ok(medium) = u16::try_from(i) {
            self.bytes(b"M")?;
            self.bytes(&medium.to_le_bytes())
        } else if let Ok(word) = i32::try_from(i) {
            self.bytes(b"J")?;
            self.bytes(&word.to_le_bytes())
        } else {
            // LONG1: the shortest little-endian two's complement form.
            let raw = i.to_le_bytes();
            let mut len = raw.len();
            while len > 1 {
                let top = raw[len - 1];
                let sign_of_next = raw[len - 2] & 0x80;
                if (top == 0 && sign_of_next == 0) || (top == 0xff && sign_of_next != 0) {
                    len -= 1;
                } else {
                    break;
                }
            }
            self.bytes(&[0x8a, len as u8])?;
            self.bytes(&raw[..len])
        }
    }

    fn string(&mut self, s: &'v str) -> SnapshotResult<()> {
        if let Some(&slot) = self.strings.get(s) {
            return match u8::try_from(slot) {
                Ok(slot) => self.bytes(&[b'h', slot]),
                Err(_) => {
                    self.bytes(b"j")?;
                    self.bytes(&slot.to_le_bytes())
                }
            };
        }
        self.counted(0x8c, b'X', 0x8d, s.as_bytes())?;
        if let Some(next) = self.memo_len.checked_add(1) {
            self.bytes(&[0x94])?;
            self.strings.insert(s, self.memo_len);
            self.memo_len = next;
        }
        Ok(())
    }

    /// `MARK item... opcode` in batches after an empty container.
    fn batches<T>(
        &mut self,
        items: &'v [T],
        opcode: u8,
        mut each: impl FnMut(&mut Self, &'v T) -> SnapshotResult<()>,
    ) -> SnapshotResult<()> {
        for batch in items.chunks(BATCH) {
            self.bytes(b"(")?;
            for item in batch {
                each(self, item)?;
            }
            self.bytes(&[opcode])?;
        }
        Ok(())
    }

    fn value(&mut self, value: &'v PyValue) -> SnapshotResult<()> {
        match value {
            PyValue::None => self.bytes(b"N"),
            PyValue::Bool(b) => self.bytes(&[if *b { 0x88 } else { 0x89 }]),
            PyValue::Int(i) => self.int(*i),
            PyValue::Float(x) => {
                self.bytes(b"G")?;
                self.bytes(&x.to_be_bytes())
            }
            PyValue::Str(s) => self.string(s),
            PyValue::Bytes(b) => self.counted(b'C', b'B', 0x8e, b),
            PyValue::Tuple(items) if items.len() <= 3 => {
                for item in items {
                    self.value(item)?;
                }
                self.bytes(&[[b')', 0x85, 0x86, 0x87][items.len()]])
            }
            PyValue::Tuple(items) => {
                self.bytes(b"(")?;
                for item in items {
                    self.value(item)?;
                }
                self.bytes(b"t")
            }
            PyValue::List(items) => {
                self.bytes(b"]")?;
                self.batches(items, b'e', |p, item| p.value(item))
            }
            PyValue::Dict(items) => {
                self.bytes(b"}")?;
                self.batches(items, b'u', |p, (k, v)| {
                    p.value(k)?;
                    p.value(v)
                })
            }
            PyValue::Set(items) => {
                self.bytes(&[0x8f])?;
                self.batches(items, 0x90, |p, item| p.value(item))
            }
            PyValue::FrozenSet(items) => {
                self.bytes(b"(")?;
                for item in items {
                    self.value(item)?;
                }
                self.bytes(&[0x91])
            }
        }
    }
}
