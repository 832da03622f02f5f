//! Reading a pickle of plain Python data into a [`PyValue`], without recursion and without trusting the
//! input.
//!
//! A pickle is a program for a small stack machine (Python's `pickletools` documents the opcodes). This
//! reader runs the opcodes that build plain data (protocols 0 to 5) and refuses those that would create
//! objects of classes (`GLOBAL`, `REDUCE`, `BUILD`, ...), which a memory snapshot never holds. Shared
//! references (the memo) are supported the way Python's pickler uses them: it refers to a container again
//! only once the container is complete, so a reference copies the value, and a pickle that changes a
//! container after referring to it again (which would make the copies differ) is refused. Nesting depth,
//! the total size that references and `DUP` can expand to, and the number of values built (the caller's
//! `max_values`) are bounded, so a hostile file gets an error, not a stack overflow or an exhausted
//! heap. Memory stays proportional to the values built: a stack item is 48 bytes (its rarely used
//! parts, memo bookkeeping and dict key indexes, live in a box only containers that need them get).

use std::collections::HashMap;

mod opcodes;

use self::opcodes::{malformed, raw_unicode_escape, Decoder, Op, HIGHEST_PROTOCOL};
use super::pyvalue::{PyValue, MAX_DEPTH};
use super::{SnapshotError, SnapshotResult};

/// A value on the machine's stack. Kept small (48 bytes): a pickle of many small values puts them
/// all on the stack at once.
struct Item {
    value: PyValue,
    /// Nesting depth of `value` (at most [`MAX_DEPTH`]).
    depth: u32,
    /// Referenced more than once (fetched from the memo, or fetched from it while still here): the
    /// copies must stay equal, so it must not be modified.
    shared: bool,
    /// Memo and dict bookkeeping, for the few containers that have any.
    extra: Option<Box<ItemExtra>>,
}

/// The parts of an [`Item`] that only some containers need.
#[derive(Default)]
struct ItemExtra {
    /// Memo slots waiting for this (mutable, still being filled) container to be complete.
    pending_memo: Vec<usize>,
    /// For a large dict: where each string or integer key sits.
    key_index: Option<HashMap<KeyIndex, usize>>,
}

impl Item {
    fn new(value: PyValue, depth: u32) -> Item {
        Item {
            value,
            depth,
            shared: false,
            extra: None,
        }
    }

    fn extra(&mut self) -> &mut ItemExtra {
        self.extra.get_or_insert_with(Box::default)
    }

    fn waits_for(&self, slot: usize) -> bool {
        self.extra
            .as_ref()
            .is_some_and(|extra| extra.pending_memo.contains(&slot))
    }

    fn take_pending_memo(&mut self) -> Vec<usize> {
        self.extra
            .as_mut()
            .map(|extra| std::mem::take(&mut extra.pending_memo))
            .unwrap_or_default()
    }
}

/// A memo slot.
enum Memo {
    /// Holds a complete value and its depth.
    Ready(PyValue, u32),
    /// Bound to a container still being filled on the stack.
    Pending,
}

/// The memo: values stored under slot numbers for later `GET`s.
///
/// Slot numbers index vectors directly. Python's pickler numbers slots 0, 1, 2, ... so a slot number
/// beyond the data's length marks a pickle no pickler wrote, and is refused before anything is sized by it.
struct MemoTable {
    /// Values of the slots some `GET` reads (only those are kept), by slot.
    slots: Vec<Option<Memo>>,
    /// Which slots some `GET` reads.
    referenced: Vec<bool>,
    /// Which slots were ever set; `MEMOIZE` numbers its slot by their count.
    assigned: Vec<bool>,
    assigned_count: usize,
    /// Slot numbers must stay below this.
    limit: usize,
}

impl MemoTable {
    fn index(&self, at: usize, slot: u64) -> SnapshotResult<usize> {
        usize::try_from(slot)
            .ok()
            .filter(|&i| i < self.limit)
            .ok_or_else(|| SnapshotError::UnsupportedPickle {
                offset: at,
                reason: format!("memo slot {slot} is beyond what a file of this size can use"),
            })
    }

    /// Records that `slot` is set; returns whether any `GET` reads it.
    fn assign(&mut self, at: usize, slot: u64) -> SnapshotResult<Option<usize>> {
        let i = self.index(at, slot)?;
        if i >= self.assigned.len() {
            self.assigned.resize(i + 1, false);
        }
        if !std::mem::replace(&mut self.assigned[i], true) {
            self.assigned_count += 1;
        }
        Ok(self
            .referenced
            .get(i)
            .copied()
            .unwrap_or(false)
            .then_some(i))
    }

    fn get(&self, i: usize) -> Option<&Memo> {
        self.slots.get(i).and_then(Option::as_ref)
    }

    fn set(&mut self, i: usize, memo: Memo) {
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(memo);
    }
}

/// The pickle machine.
struct Machine {
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: MemoTable,
    /// How many more values memo references may copy.
    copy_budget: usize,
    /// How many more values may be built (the caller's `max_values`, less those built so far).
    values_left: u64,
    /// The caller's `max_values`, for the error.
    max_values: u64,
}

/// Refuses data whose first opcode shows it is not a pickle at all (`/dev/zero`, a binary), judged
/// on its first bytes alone so that the rest need not be read; anything else passes.
pub(crate) fn check_start(head: &[u8]) -> SnapshotResult<()> {
    if head.is_empty() {
        return Ok(());
    }
    match (Decoder { data: head, pos: 0 }).next() {
        Err(e) => match not_a_pickle_at_start(head, e) {
            e @ SnapshotError::NotPickle { .. } => Err(e),
            _ => Ok(()),
        },
        Ok(_) => Ok(()),
    }
}

/// Runs the pickle in `data` and returns the value it builds, building at most `max_values` values
/// (see `ReadLimits::max_values` for how they count).
pub(crate) fn unpickle(data: &[u8], max_values: u64) -> SnapshotResult<PyValue> {
    if data.is_empty() {
        return Err(SnapshotError::NotPickle {
            reason: "the file is empty".into(),
        });
    }
    let limit = data.len() + 1;
    let referenced =
        referenced_memo_slots(data, limit).map_err(|e| not_a_pickle_at_start(data, e))?;
    let mut machine = Machine {
        stack: Vec::new(),
        marks: Vec::new(),
        memo: MemoTable {
            slots: Vec::new(),
            referenced,
            assigned: Vec::new(),
            assigned_count: 0,
            limit,
        },
        copy_budget: data.len().saturating_mul(4).saturating_add(1 << 20),
        values_left: max_values,
        max_values,
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

/// First pass: which memo slots are ever read (so that only those are kept), as flags by slot.
fn referenced_memo_slots(data: &[u8], limit: usize) -> SnapshotResult<Vec<bool>> {
    let mut decoder = Decoder { data, pos: 0 };
    let mut slots = Vec::new();
    loop {
        match decoder.next()? {
            (_, Op::Stop) => return Ok(slots),
            (at, Op::Get(slot)) => {
                let i = usize::try_from(slot)
                    .ok()
                    .filter(|&i| i < limit)
                    .ok_or_else(|| SnapshotError::UnsupportedPickle {
                        offset: at,
                        reason: format!(
                            "memo slot {slot} is beyond what a file of this size can use"
                        ),
                    })?;
                if i >= slots.len() {
                    slots.resize(i + 1, false);
                }
                slots[i] = true;
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

    /// Pushes a new value, counting it against the values budget.
    fn push(&mut self, value: PyValue) -> SnapshotResult<()> {
        self.build(value_cost(&value))?;
        self.stack.push(Item::new(value, 0));
        Ok(())
    }

    /// Counts `cost` new values against the caller's `max_values`.
    fn build(&mut self, cost: usize) -> SnapshotResult<()> {
        self.values_left =
            self.values_left
                .checked_sub(cost as u64)
                .ok_or(SnapshotError::TooLarge {
                    what: "the pickle builds",
                    bound: self.max_values,
                    unit: "values",
                    limit: "max_values",
                })?;
        Ok(())
    }

    /// Removes the top item, completing its pending memo slots.
    fn pop(&mut self, at: usize, what: &str) -> SnapshotResult<Item> {
        let item = self.stack.pop().ok_or_else(|| Self::underflow(at, what))?;
        self.complete(at, item)
    }

    fn complete(&mut self, at: usize, mut item: Item) -> SnapshotResult<Item> {
        for slot in item.take_pending_memo() {
            self.charge(at, &item.value)?;
            self.memo
                .set(slot, Memo::Ready(item.value.clone(), item.depth));
        }
        Ok(item)
    }

    /// Charges a copy of `value` to the copy budget: copies are how shared references and `DUP` could
    /// make a small file expand into an enormous value.
    fn charge(&mut self, at: usize, value: &PyValue) -> SnapshotResult<()> {
        self.spend(at, count_values(value, self.copy_budget))
    }

    fn spend(&mut self, at: usize, cost: usize) -> SnapshotResult<()> {
        self.build(cost)?;
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
                if !values.len().is_multiple_of(2) {
                    return Err(malformed(
                        at,
                        format!("{what} with an odd number of keys and values"),
                    ));
                }
                let index = if dict.len() + values.len() / 2 > INDEX_DICTS_FROM {
                    &mut target.extra.get_or_insert_with(Box::default).key_index
                } else {
                    &mut None
                };
                let mut pairs = values.into_iter();
                while let (Some(key), Some(value)) = (pairs.next(), pairs.next()) {
                    set_item(dict, index, key, value);
                }
            }
            (other, _) => {
                return Err(malformed(at, format!("{what} on a {}", other.type_name())));
            }
        }
        Ok(())
    }

    fn memoize(&mut self, at: usize, slot: u64) -> SnapshotResult<()> {
        let Some(slot) = self.memo.assign(at, slot)? else {
            return Ok(());
        };
        let top = self
            .stack
            .last_mut()
            .ok_or_else(|| Self::underflow(at, "PUT"))?;
        if matches!(
            top.value,
            PyValue::List(_) | PyValue::Dict(_) | PyValue::Set(_)
        ) && !top.shared
        {
            top.extra().pending_memo.push(slot);
            self.memo.set(slot, Memo::Pending);
        } else {
            let (value, depth) = (top.value.clone(), top.depth);
            self.charge(at, &value)?;
            self.memo.set(slot, Memo::Ready(value, depth));
        }
        Ok(())
    }

    fn get(&mut self, at: usize, slot: u64) -> SnapshotResult<()> {
        let slot = self.memo.index(at, slot)?;
        match self.memo.get(slot) {
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
        if let Some(Memo::Ready(value, depth)) = self.memo.get(slot) {
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
    fn freeze_pending(&mut self, at: usize, slot: usize) -> SnapshotResult<()> {
        let Some(index) = self.stack.iter().rposition(|item| item.waits_for(slot)) else {
            return Err(malformed(
                at,
                format!("GET of memo slot {slot}, whose value was dropped"),
            ));
        };
        let cost = count_values(&self.stack[index].value, self.copy_budget);
        self.spend(at, cost)?;
        let item = &mut self.stack[index];
        item.shared = true;
        if let Some(extra) = item.extra.as_mut() {
            extra.pending_memo.retain(|&s| s != slot);
        }
        let frozen = Memo::Ready(item.value.clone(), item.depth);
        self.memo.set(slot, frozen);
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
            Op::None => self.push(PyValue::None)?,
            Op::Bool(b) => self.push(PyValue::Bool(b))?,
            Op::Int(i) => self.push(PyValue::Int(i))?,
            Op::Float(x) => self.push(PyValue::Float(x))?,
            Op::Text(bytes) => {
                let text = std::str::from_utf8(bytes)
                    .map_err(|_| malformed(at, "string is not valid UTF-8".into()))?;
                self.push(PyValue::Str(text.to_owned()))?;
            }
            Op::EscapedText(bytes) => {
                let text = raw_unicode_escape(bytes, at)?;
                self.push(PyValue::Str(text))?;
            }
            Op::LegacyString(bytes) => self.push(match std::str::from_utf8(bytes) {
                Ok(text) => PyValue::Str(text.to_owned()),
                Err(_) => PyValue::Bytes(bytes.to_vec()),
            })?,
            Op::Bytes(bytes) => self.push(PyValue::Bytes(bytes.to_vec()))?,
            Op::EmptyList => self.push(PyValue::List(Vec::new()))?,
            Op::EmptyDict => self.push(PyValue::Dict(Vec::new()))?,
            Op::EmptyTuple => self.push(PyValue::Tuple(Vec::new()))?,
            Op::EmptySet => self.push(PyValue::Set(Vec::new()))?,
            Op::List | Op::Tuple | Op::FrozenSet | Op::Dict => {
                let items = self.pop_to_mark(at, "a container opcode")?;
                let item = match op {
                    Op::List => Self::container(at, items, PyValue::List)?,
                    Op::Tuple => Self::container(at, items, PyValue::Tuple)?,
                    Op::FrozenSet => Self::container(at, items, PyValue::FrozenSet)?,
                    _ => {
                        self.build(1)?;
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
                let slot = self.memo.assigned_count as u64;
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

fn check_depth(at: usize, depth: u32) -> SnapshotResult<()> {
    if depth as usize > MAX_DEPTH {
        return Err(SnapshotError::UnsupportedPickle {
            offset: at,
            reason: format!("values nest more than {MAX_DEPTH} levels deep"),
        });
    }
    Ok(())
}

/// What one value costs against the budgets, without its children: one, and for strings and bytes
/// one more per 32 bytes of content (a copy of a long string costs memory as many values do).
fn value_cost(value: &PyValue) -> usize {
    match value {
        PyValue::Str(s) => 1 + s.len() / CONTENT_PER_VALUE,
        PyValue::Bytes(b) => 1 + b.len() / CONTENT_PER_VALUE,
        _ => 1,
    }
}

/// Bytes of string content that count as one more value.
const CONTENT_PER_VALUE: usize = 32;

/// The cost of `value` and everything in it (iteratively, see [`value_cost`]), counting no further
/// than `limit + 1`.
fn count_values(value: &PyValue, limit: usize) -> usize {
    if !matches!(
        value,
        PyValue::List(_)
            | PyValue::Tuple(_)
            | PyValue::Dict(_)
            | PyValue::Set(_)
            | PyValue::FrozenSet(_)
    ) {
        return value_cost(value);
    }
    let mut count = 0;
    let mut pending = vec![value];
    while let Some(v) = pending.pop() {
        count += value_cost(v);
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

// A pickle of many small values holds them all on the stack at once: keep an item small.
const _: () = assert!(std::mem::size_of::<Item>() <= 48);
