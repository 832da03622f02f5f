//! Reading a pickle of plain Python data into a [`PyValue`], without recursion and without trusting the
//! input.
//!
//! A pickle is a program for a small stack machine (Python's `pickletools` documents the opcodes). This
//! reader runs the opcodes that build plain data (protocols 0 to 5) and refuses those that would create
//! objects of classes (`GLOBAL`, `REDUCE`, `BUILD`, ...), which a memory snapshot never holds. Shared
//! references (the memo) are supported the way Python's pickler uses them: a container is complete
//! before it is referenced again. Nesting depth and the total size that memo references can expand to
//! are bounded, so a hostile file gets an error, not a stack overflow or an exhausted heap.

use std::collections::{HashMap, HashSet};

use super::pyvalue::{PyValue, MAX_DEPTH};
use super::{SnapshotError, SnapshotResult};

/// Newest pickle protocol understood.
const HIGHEST_PROTOCOL: u8 = 5;

/// One decoded opcode.
enum Op<'a> {
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
struct Decoder<'a> {
    data: &'a [u8],
    pos: usize,
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
    fn next(&mut self) -> SnapshotResult<(usize, Op<'a>)> {
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

fn malformed(offset: usize, reason: String) -> SnapshotError {
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

/// Decodes Python's raw-unicode-escape: Latin-1 bytes, except `\uXXXX` and `\UXXXXXXXX`.
fn raw_unicode_escape(bytes: &[u8], at: usize) -> SnapshotResult<String> {
    let mut out = String::with_capacity(bytes.len());
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

/// A value on the machine's stack.
struct Item {
    value: PyValue,
    /// Nesting depth of `value`.
    depth: usize,
    /// Memo slots waiting for this (mutable, still being filled) container to be complete.
    pending_memo: Vec<u64>,
    /// Referenced more than once (fetched from the memo, or fetched from it while still here): the
    /// copies must stay equal, so it must not be modified.
    shared: bool,
    /// For a large dict: where each string or integer key sits.
    key_index: Option<HashMap<KeyIndex, usize>>,
}

impl Item {
    fn new(value: PyValue, depth: usize) -> Item {
        Item {
            value,
            depth,
            pending_memo: Vec::new(),
            shared: false,
            key_index: None,
        }
    }
}

/// A memo slot.
enum Memo {
    /// Holds a complete value and its depth.
    Ready(PyValue, usize),
    /// Bound to a container still being filled on the stack.
    Pending,
}

/// The pickle machine.
struct Machine {
    stack: Vec<Item>,
    marks: Vec<usize>,
    /// Memo slots that some GET refers to (only those are kept).
    referenced: HashSet<u64>,
    memo: HashMap<u64, Memo>,
    /// Every memo slot ever assigned (`MEMOIZE` numbers slots by their count).
    assigned: HashSet<u64>,
    /// How many more values memo references may copy.
    copy_budget: usize,
}

/// Runs the pickle in `data` and returns the value it builds.
pub(crate) fn unpickle(data: &[u8]) -> SnapshotResult<PyValue> {
    if data.is_empty() {
        return Err(SnapshotError::NotPickle {
            reason: "the file is empty".into(),
        });
    }
    let referenced = referenced_memo_slots(data).map_err(|e| not_a_pickle_at_start(data, e))?;
    let mut machine = Machine {
        stack: Vec::new(),
        marks: Vec::new(),
        referenced,
        memo: HashMap::new(),
        assigned: HashSet::new(),
        copy_budget: data.len().saturating_mul(4).saturating_add(1 << 20),
    };
    let mut decoder = Decoder { data, pos: 0 };
    loop {
        let (at, op) = decoder.next()?;
        if let Some(value) = machine.step(at, op)? {
            if decoder.pos < data.len() {
                tracing::debug!(
                    trailing = data.len() - decoder.pos,
                    "bytes after the pickle's STOP ignored"
                );
            }
            return Ok(value);
        }
    }
}

/// First pass: which memo slots are ever read (so that only those are kept).
fn referenced_memo_slots(data: &[u8]) -> SnapshotResult<HashSet<u64>> {
    let mut decoder = Decoder { data, pos: 0 };
    let mut slots = HashSet::new();
    loop {
        match decoder.next()? {
            (_, Op::Stop) => return Ok(slots),
            (_, Op::Get(slot)) => {
                slots.insert(slot);
            }
            _ => {}
        }
    }
}

/// An error at the very first opcode means the file is not a pickle at all.
fn not_a_pickle_at_start(data: &[u8], error: SnapshotError) -> SnapshotError {
    match error {
        SnapshotError::Pickle { offset: 0, .. } if data[0] != 0x80 => {
            let head: Vec<String> = data.iter().take(8).map(|b| format!("{b:02x}")).collect();
            SnapshotError::NotPickle {
                reason: format!("it starts with bytes {}", head.join(" ")),
            }
        }
        other => other,
    }
}

impl Machine {
    fn underflow(at: usize, what: &str) -> SnapshotError {
        malformed(at, format!("{what} with too few values on the stack"))
    }

    fn push(&mut self, value: PyValue) {
        self.stack.push(Item::new(value, 0));
    }

    /// Removes the top item, completing its pending memo slots.
    fn pop(&mut self, at: usize, what: &str) -> SnapshotResult<Item> {
        let item = self.stack.pop().ok_or_else(|| Self::underflow(at, what))?;
        self.complete(at, item)
    }

    fn complete(&mut self, at: usize, mut item: Item) -> SnapshotResult<Item> {
        for slot in std::mem::take(&mut item.pending_memo) {
            self.charge(at, &item.value)?;
            self.memo
                .insert(slot, Memo::Ready(item.value.clone(), item.depth));
        }
        Ok(item)
    }

    /// Charges a copy of `value` to the copy budget: copies are how shared references and `DUP` could
    /// make a small file expand into an enormous value.
    fn charge(&mut self, at: usize, value: &PyValue) -> SnapshotResult<()> {
        self.spend(at, count_values(value, self.copy_budget))
    }

    fn spend(&mut self, at: usize, cost: usize) -> SnapshotResult<()> {
        self.copy_budget =
            self.copy_budget
                .checked_sub(cost)
                .ok_or_else(|| SnapshotError::UnsupportedPickle {
                    offset: at,
                    reason: "shared references expand to far more values than the file holds"
                        .into(),
                })?;
        Ok(())
    }

    /// Removes the items above the last mark, and the mark.
    fn pop_to_mark(&mut self, at: usize, what: &str) -> SnapshotResult<Vec<Item>> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| malformed(at, format!("{what} without a MARK")))?;
        if mark > self.stack.len() {
            return Err(malformed(
                at,
                format!("{what}: the MARK's values were already removed"),
            ));
        }
        let items: Vec<Item> = self.stack.drain(mark..).collect();
        items
            .into_iter()
            .map(|item| self.complete(at, item))
            .collect()
    }

    /// Packs completed items into a new container item.
    fn container(
        at: usize,
        items: Vec<Item>,
        build: impl FnOnce(Vec<PyValue>) -> PyValue,
    ) -> SnapshotResult<Item> {
        let depth = items.iter().map(|i| i.depth + 1).max().unwrap_or(1);
        check_depth(at, depth)?;
        Ok(Item::new(
            build(items.into_iter().map(|i| i.value).collect()),
            depth,
        ))
    }

    /// Adds `items` to the container now on top of the stack.
    fn extend_top(&mut self, at: usize, what: &str, items: Vec<Item>) -> SnapshotResult<()> {
        let target = self
            .stack
            .last_mut()
            .ok_or_else(|| Self::underflow(at, what))?;
        if target.shared {
            return Err(SnapshotError::UnsupportedPickle {
                offset: at,
                reason: format!("{what} modifies an object that is referenced more than once"),
            });
        }
        let depth = items.iter().map(|i| i.depth + 1).max().unwrap_or(0);
        target.depth = target.depth.max(depth);
        check_depth(at, target.depth)?;
        let values = items.into_iter().map(|i| i.value);
        match (&mut target.value, what) {
            (PyValue::List(list), "APPEND" | "APPENDS") => list.extend(values),
            (PyValue::Set(set), "ADDITEMS") => set.extend(values),
            (PyValue::Dict(dict), "SETITEM" | "SETITEMS") => {
                let values: Vec<PyValue> = values.collect();
                if values.len() % 2 != 0 {
                    return Err(malformed(
                        at,
                        format!("{what} with an odd number of keys and values"),
                    ));
                }
                let mut pairs = values.into_iter();
                while let (Some(key), Some(value)) = (pairs.next(), pairs.next()) {
                    set_item(dict, &mut target.key_index, key, value);
                }
            }
            (other, _) => {
                return Err(malformed(at, format!("{what} on a {}", other.type_name())));
            }
        }
        Ok(())
    }

    fn memoize(&mut self, at: usize, slot: u64) -> SnapshotResult<()> {
        self.assigned.insert(slot);
        if !self.referenced.contains(&slot) {
            return Ok(());
        }
        let top = self
            .stack
            .last_mut()
            .ok_or_else(|| Self::underflow(at, "PUT"))?;
        if matches!(
            top.value,
            PyValue::List(_) | PyValue::Dict(_) | PyValue::Set(_)
        ) && !top.shared
        {
            top.pending_memo.push(slot);
            self.memo.insert(slot, Memo::Pending);
        } else {
            let (value, depth) = (top.value.clone(), top.depth);
            self.charge(at, &value)?;
            self.memo.insert(slot, Memo::Ready(value, depth));
        }
        Ok(())
    }

    fn get(&mut self, at: usize, slot: u64) -> SnapshotResult<()> {
        match self.memo.get(&slot) {
            Some(Memo::Ready(value, _)) => {
                let cost = count_values(value, self.copy_budget);
                self.spend(at, cost)?;
            }
            Some(Memo::Pending) => self.freeze_pending(at, slot)?,
            None => {
                return Err(malformed(
                    at,
                    format!("GET of memo slot {slot}, which was never set"),
                ))
            }
        }
        if let Some(Memo::Ready(value, depth)) = self.memo.get(&slot) {
            let mut item = Item::new(value.clone(), *depth);
            item.shared = !matches!(
                value,
                PyValue::Str(_) | PyValue::Int(_) | PyValue::Float(_) | PyValue::Bool(_)
            );
            self.stack.push(item);
        }
        Ok(())
    }

    /// A container still on the stack is referenced again. Python's pickler does this only once the
    /// container is complete (it then waits on the stack for its parent), so its value is taken as final
    /// now, and any later change to it is refused.
    fn freeze_pending(&mut self, at: usize, slot: u64) -> SnapshotResult<()> {
        let Some(index) = self
            .stack
            .iter()
            .rposition(|item| item.pending_memo.contains(&slot))
        else {
            return Err(malformed(
                at,
                format!("GET of memo slot {slot}, whose value was dropped"),
            ));
        };
        let cost = count_values(&self.stack[index].value, self.copy_budget);
        self.spend(at, cost)?;
        let item = &mut self.stack[index];
        item.shared = true;
        item.pending_memo.retain(|&s| s != slot);
        let frozen = Memo::Ready(item.value.clone(), item.depth);
        self.memo.insert(slot, frozen);
        Ok(())
    }

    /// Runs one opcode; returns the pickle's value at `STOP`.
    fn step(&mut self, at: usize, op: Op<'_>) -> SnapshotResult<Option<PyValue>> {
        match op {
            Op::Proto(version) if version > HIGHEST_PROTOCOL => {
                return Err(SnapshotError::UnsupportedPickle {
                    offset: at,
                    reason: format!("pickle protocol {version} is newer than {HIGHEST_PROTOCOL}"),
                })
            }
            Op::Proto(_) | Op::Frame => {}
            Op::Stop => return Ok(Some(self.pop(at, "STOP")?.value)),
            Op::Mark => self.marks.push(self.stack.len()),
            Op::Pop => {
                if self.marks.last() == Some(&self.stack.len()) {
                    self.pop_to_mark(at, "POP")?;
                } else {
                    self.pop(at, "POP")?;
                }
            }
            Op::PopMark => {
                self.pop_to_mark(at, "POP_MARK")?;
            }
            Op::Dup => {
                let top = self
                    .stack
                    .last()
                    .ok_or_else(|| Self::underflow(at, "DUP"))?;
                if matches!(
                    top.value,
                    PyValue::List(_) | PyValue::Dict(_) | PyValue::Set(_)
                ) {
                    return Err(SnapshotError::UnsupportedPickle {
                        offset: at,
                        reason: "DUP of a mutable container".into(),
                    });
                }
                let (value, depth) = (top.value.clone(), top.depth);
                self.charge(at, &value)?;
                self.stack.push(Item::new(value, depth));
            }
            Op::None => self.push(PyValue::None),
            Op::Bool(b) => self.push(PyValue::Bool(b)),
            Op::Int(i) => self.push(PyValue::Int(i)),
            Op::Float(x) => self.push(PyValue::Float(x)),
            Op::Text(bytes) => {
                let text = std::str::from_utf8(bytes)
                    .map_err(|_| malformed(at, "string is not valid UTF-8".into()))?;
                self.push(PyValue::Str(text.to_owned()));
            }
            Op::EscapedText(bytes) => {
                let text = raw_unicode_escape(bytes, at)?;
                self.push(PyValue::Str(text));
            }
            Op::LegacyString(bytes) => self.push(match std::str::from_utf8(bytes) {
                Ok(text) => PyValue::Str(text.to_owned()),
                Err(_) => PyValue::Bytes(bytes.to_vec()),
            }),
            Op::Bytes(bytes) => self.push(PyValue::Bytes(bytes.to_vec())),
            Op::EmptyList => self.push(PyValue::List(Vec::new())),
            Op::EmptyDict => self.push(PyValue::Dict(Vec::new())),
            Op::EmptyTuple => self.push(PyValue::Tuple(Vec::new())),
            Op::EmptySet => self.push(PyValue::Set(Vec::new())),
            Op::List | Op::Tuple | Op::FrozenSet | Op::Dict => {
                let items = self.pop_to_mark(at, "a container opcode")?;
                let item = match op {
                    Op::List => Self::container(at, items, PyValue::List)?,
                    Op::Tuple => Self::container(at, items, PyValue::Tuple)?,
                    Op::FrozenSet => Self::container(at, items, PyValue::FrozenSet)?,
                    _ => {
                        self.stack.push(Item::new(PyValue::Dict(Vec::new()), 1));
                        self.extend_top(at, "SETITEMS", items)?;
                        return Ok(None);
                    }
                };
                self.stack.push(item);
            }
            Op::TupleN(n) => {
                if self.stack.len() < n {
                    return Err(Self::underflow(at, "TUPLE1/2/3"));
                }
                let items: Vec<Item> = self.stack.drain(self.stack.len() - n..).collect();
                let items = items
                    .into_iter()
                    .map(|item| self.complete(at, item))
                    .collect::<SnapshotResult<_>>()?;
                let item = Self::container(at, items, PyValue::Tuple)?;
                self.stack.push(item);
            }
            Op::Append => {
                let item = self.pop(at, "APPEND")?;
                self.extend_top(at, "APPEND", vec![item])?;
            }
            Op::SetItem => {
                let value = self.pop(at, "SETITEM")?;
                let key = self.pop(at, "SETITEM")?;
                self.extend_top(at, "SETITEM", vec![key, value])?;
            }
            Op::Appends | Op::SetItems | Op::AddItems => {
                let name = match op {
                    Op::Appends => "APPENDS",
                    Op::SetItems => "SETITEMS",
                    _ => "ADDITEMS",
                };
                let items = self.pop_to_mark(at, name)?;
                self.extend_top(at, name, items)?;
            }
            Op::Put(slot) => self.memoize(at, slot)?,
            Op::Memoize => {
                let slot = self.assigned.len() as u64;
                self.memoize(at, slot)?;
            }
            Op::Get(slot) => self.get(at, slot)?,
            Op::Object(opcode, name) => {
                let named = if name.is_empty() {
                    String::new()
                } else {
                    format!(" {name}")
                };
                return Err(SnapshotError::UnsupportedPickle {
                    offset: at,
                    reason: format!(
                        "the pickle holds Python objects ({opcode}{named}); a memory snapshot holds only dicts, \
                         lists, numbers and strings"
                    ),
                });
            }
        }
        Ok(None)
    }
}

fn check_depth(at: usize, depth: usize) -> SnapshotResult<()> {
    if depth > MAX_DEPTH {
        return Err(SnapshotError::UnsupportedPickle {
            offset: at,
            reason: format!("values nest more than {MAX_DEPTH} levels deep"),
        });
    }
    Ok(())
}

/// Number of values in `value`, itself included (iteratively), counting no further than `limit + 1`.
fn count_values(value: &PyValue, limit: usize) -> usize {
    let mut count = 0;
    let mut pending = vec![value];
    while let Some(v) = pending.pop() {
        count += 1;
        if count > limit {
            break;
        }
        pending.extend(v.children());
    }
    count
}

/// A hashable form of the dict keys a snapshot uses (strings and integers); other keys are compared one
/// by one.
#[derive(PartialEq, Eq, Hash)]
enum KeyIndex {
    Str(String),
    Int(i128),
}

impl KeyIndex {
    fn of(key: &PyValue) -> Option<KeyIndex> {
        match key {
            PyValue::Str(s) => Some(KeyIndex::Str(s.clone())),
            PyValue::Int(i) => Some(KeyIndex::Int(*i)),
            _ => None,
        }
    }
}

/// Dicts with more entries than this get a hash index for their string and integer keys.
const INDEX_DICTS_FROM: usize = 16;

/// `dict[key] = value`: replaces the value of an equal key, else appends. Large dicts keep `index`.
fn set_item(
    dict: &mut Vec<(PyValue, PyValue)>,
    index: &mut Option<HashMap<KeyIndex, usize>>,
    key: PyValue,
    value: PyValue,
) {
    if index.is_none() && dict.len() >= INDEX_DICTS_FROM {
        let built = dict
            .iter()
            .enumerate()
            .filter_map(|(i, (k, _))| KeyIndex::of(k).map(|k| (k, i)))
            .collect();
        *index = Some(built);
    }
    let existing = match (index.as_mut(), KeyIndex::of(&key)) {
        (Some(index), Some(hashed)) => {
            let next = dict.len();
            let slot = *index.entry(hashed).or_insert(next);
            (slot < next).then_some(slot)
        }
        _ => dict.iter().position(|(k, _)| *k == key),
    };
    match existing {
        Some(slot) => dict[slot].1 = value,
        None => dict.push((key, value)),
    }
}
