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
//! `max_values`) are bounded, and every heap block the reader makes is counted at its size against the
//! caller's `max_memory_bytes` before it is allocated, fallibly ([`memory`]), so a hostile file gets an
//! error, not a stack overflow, an exhausted heap or an abort. A stack item is 48 bytes (its rarely
//! used parts, memo bookkeeping and dict key indexes, live in a box only containers that need them
//! get).

use std::collections::HashMap;
use std::collections::TryReserveError;

mod memory;
mod opcodes;

use self::memory::{
    heap_block, out_of_memory, reserve, reserve_entries, reserve_entry, reserve_exact, vec_block,
    Memory,
};
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

/// The [`ItemExtra`] of `extra`, made (and charged) when missing.
fn extra_of<'e>(
    memory: &mut Memory,
    extra: &'e mut Option<Box<ItemExtra>>,
) -> SnapshotResult<&'e mut ItemExtra> {
    if extra.is_none() {
        memory.charge(heap_block(std::mem::size_of::<ItemExtra>()))?;
    }
    Ok(extra.get_or_insert_with(Box::default))
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
    fn assign(
        &mut self,
        memory: &mut Memory,
        at: usize,
        slot: u64,
    ) -> SnapshotResult<Option<usize>> {
        let i = self.index(at, slot)?;
        if i >= self.assigned.len() {
            let more = i + 1 - self.assigned.len();
            reserve(memory, &mut self.assigned, more)?;
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

    fn set(&mut self, memory: &mut Memory, i: usize, memo: Memo) -> SnapshotResult<()> {
        if i >= self.slots.len() {
            let more = i + 1 - self.slots.len();
            reserve(memory, &mut self.slots, more)?;
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(memo);
        Ok(())
    }
}

/// What reading may still take: values, copies and bytes.
struct Budget {
    /// How many more values memo references may copy.
    copy_budget: usize,
    /// How many more values may be built (the caller's `max_values`, less those built so far).
    values_left: u64,
    /// The caller's `max_values`, for the error.
    max_values: u64,
    /// The bytes the reader holds, against the caller's `max_memory_bytes`.
    memory: Memory,
}

impl Budget {
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

    /// Counts `cost` copied values against the values and the copy budget: copies are how shared
    /// references and `DUP` could make a small file expand into an enormous value.
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

    /// A copy of `value`, its values and bytes counted before it is made.
    fn copy(&mut self, at: usize, value: &PyValue) -> SnapshotResult<PyValue> {
        let mut cost = CopyCost::default();
        cost.add(value, self.copy_budget);
        self.spend(at, cost.values)?;
        self.memory.charge(cost.bytes)?;
        try_clone(value).map_err(|_| out_of_memory(cost.bytes))
    }
}

/// The pickle machine.
struct Machine {
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: MemoTable,
    budget: Budget,
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
/// (see `ReadLimits::max_values` for how they count) and holding at most `max_memory_bytes` (see
/// `ReadLimits::max_memory_bytes`).
pub(crate) fn unpickle(
    data: &[u8],
    max_values: u64,
    max_memory_bytes: u64,
) -> SnapshotResult<PyValue> {
    if data.is_empty() {
        return Err(SnapshotError::NotPickle {
            reason: "the file is empty".into(),
        });
    }
    let limit = data.len() + 1;
    let mut memory = Memory::new(max_memory_bytes);
    let referenced = referenced_memo_slots(&mut memory, data, limit)
        .map_err(|e| not_a_pickle_at_start(data, e))?;
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
        budget: Budget {
            copy_budget: data.len().saturating_mul(4).saturating_add(1 << 20),
            values_left: max_values,
            max_values,
            memory,
        },
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
            tracing::debug!(peak_bytes = machine.budget.memory.peak(), "pickle read");
            return Ok(value);
        }
    }
}

/// First pass: which memo slots are ever read (so that only those are kept), as flags by slot.
fn referenced_memo_slots(
    memory: &mut Memory,
    data: &[u8],
    limit: usize,
) -> SnapshotResult<Vec<bool>> {
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
                    let more = i + 1 - slots.len();
                    reserve(memory, &mut slots, more)?;
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
        self.budget.build(value_cost(&value))?;
        self.push_item(Item::new(value, 0))
    }

    /// Pushes an item whose value was counted already.
    fn push_item(&mut self, item: Item) -> SnapshotResult<()> {
        reserve(&mut self.budget.memory, &mut self.stack, 1)?;
        self.stack.push(item);
        Ok(())
    }

    /// Removes the top item, completing its pending memo slots.
    fn pop(&mut self, at: usize, what: &str) -> SnapshotResult<Item> {
        let top = self
            .stack
            .len()
            .checked_sub(1)
            .ok_or_else(|| Self::underflow(at, what))?;
        self.complete(at, top)?;
        Ok(self
            .stack
            .pop()
            .expect("the stack holds the item just completed"))
    }

    /// Completes the pending memo slots of the item at `index`: it is final now.
    fn complete(&mut self, at: usize, index: usize) -> SnapshotResult<()> {
        for slot in self.stack[index].take_pending_memo() {
            let item = &self.stack[index];
            let value = self.budget.copy(at, &item.value)?;
            let memo = Memo::Ready(value, item.depth);
            self.memo.set(&mut self.budget.memory, slot, memo)?;
        }
        Ok(())
    }

    /// Closes the last mark: completes the items above it and returns where they start.
    fn close_mark(&mut self, at: usize, what: &str) -> SnapshotResult<usize> {
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
        for index in mark..self.stack.len() {
            self.complete(at, index)?;
        }
        Ok(mark)
    }

    /// Replaces the (completed) items from `from` on with a new container item holding their
    /// values.
    fn container(
        &mut self,
        at: usize,
        from: usize,
        build: impl FnOnce(Vec<PyValue>) -> PyValue,
    ) -> SnapshotResult<()> {
        let items = &self.stack[from..];
        let depth = items.iter().map(|i| i.depth + 1).max().unwrap_or(1);
        check_depth(at, depth)?;
        let mut values = Vec::new();
        reserve_exact(&mut self.budget.memory, &mut values, items.len())?;
        values.extend(self.stack.drain(from..).map(|i| i.value));
        self.push_item(Item::new(build(values), depth))
    }

    /// Moves the (completed) items from `from` on into the container just below them.
    fn extend_top(&mut self, at: usize, what: &str, from: usize) -> SnapshotResult<()> {
        let target = from
            .checked_sub(1)
            .ok_or_else(|| Self::underflow(at, what))?;
        if self.stack[target].shared {
            return Err(SnapshotError::UnsupportedPickle {
                offset: at,
                reason: format!("{what} modifies an object that is referenced more than once"),
            });
        }
        let depth = self.stack[from..]
            .iter()
            .map(|i| i.depth + 1)
            .max()
            .unwrap_or(0);
        let item = &mut self.stack[target];
        item.depth = item.depth.max(depth);
        check_depth(at, item.depth)?;
        // The container leaves its slot while the items above it are drained into it.
        let mut value = std::mem::replace(&mut item.value, PyValue::None);
        let mut extra = item.extra.take();
        let result = self.fill(at, what, from, &mut value, &mut extra);
        let item = &mut self.stack[target];
        item.value = value;
        item.extra = extra;
        result
    }

    fn fill(
        &mut self,
        at: usize,
        what: &str,
        from: usize,
        target: &mut PyValue,
        extra: &mut Option<Box<ItemExtra>>,
    ) -> SnapshotResult<()> {
        let memory = &mut self.budget.memory;
        let count = self.stack.len() - from;
        match (target, what) {
            (PyValue::List(list), "APPEND" | "APPENDS") | (PyValue::Set(list), "ADDITEMS") => {
                reserve(memory, list, count)?;
                list.extend(self.stack.drain(from..).map(|i| i.value));
            }
            (PyValue::Dict(dict), "SETITEM" | "SETITEMS") => {
                if !count.is_multiple_of(2) {
                    return Err(malformed(
                        at,
                        format!("{what} with an odd number of keys and values"),
                    ));
                }
                reserve(memory, dict, count / 2)?;
                let mut no_index = None;
                let index = if dict.len() + count / 2 > INDEX_DICTS_FROM {
                    &mut extra_of(memory, extra)?.key_index
                } else {
                    &mut no_index
                };
                let mut pairs = self.stack.drain(from..).map(|i| i.value);
                while let (Some(key), Some(value)) = (pairs.next(), pairs.next()) {
                    set_item(memory, dict, index, key, value)?;
                }
            }
            (other, _) => {
                return Err(malformed(at, format!("{what} on a {}", other.type_name())));
            }
        }
        Ok(())
    }

    fn memoize(&mut self, at: usize, slot: u64) -> SnapshotResult<()> {
        let Some(slot) = self.memo.assign(&mut self.budget.memory, at, slot)? else {
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
            let memory = &mut self.budget.memory;
            let pending = &mut extra_of(memory, &mut top.extra)?.pending_memo;
            reserve(memory, pending, 1)?;
            pending.push(slot);
            self.memo.set(memory, slot, Memo::Pending)?;
        } else {
            let value = self.budget.copy(at, &top.value)?;
            let memo = Memo::Ready(value, top.depth);
            self.memo.set(&mut self.budget.memory, slot, memo)?;
        }
        Ok(())
    }

    fn get(&mut self, at: usize, slot: u64) -> SnapshotResult<()> {
        let slot = self.memo.index(at, slot)?;
        if let Some(Memo::Pending) = self.memo.get(slot) {
            self.freeze_pending(at, slot)?;
        }
        let Some(Memo::Ready(value, depth)) = self.memo.get(slot) else {
            return Err(malformed(
                at,
                format!("GET of memo slot {slot}, which was never set"),
            ));
        };
        let mut item = Item::new(self.budget.copy(at, value)?, *depth);
        item.shared = !matches!(
            item.value,
            PyValue::Str(_) | PyValue::Int(_) | PyValue::Float(_) | PyValue::Bool(_)
        );
        self.push_item(item)
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
        let item = &mut self.stack[index];
        item.shared = true;
        if let Some(extra) = item.extra.as_mut() {
            extra.pending_memo.retain(|&s| s != slot);
        }
        let frozen = Memo::Ready(self.budget.copy(at, &item.value)?, item.depth);
        self.memo.set(&mut self.budget.memory, slot, frozen)
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
            Op::Mark => {
                reserve(&mut self.budget.memory, &mut self.marks, 1)?;
                self.marks.push(self.stack.len());
            }
            Op::Pop => {
                if self.marks.last() == Some(&self.stack.len()) {
                    self.close_mark(at, "POP")?;
                } else {
                    self.pop(at, "POP")?;
                }
            }
            Op::PopMark => {
                let mark = self.close_mark(at, "POP_MARK")?;
                self.stack.truncate(mark);
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
                let item = Item::new(self.budget.copy(at, &top.value)?, top.depth);
                self.push_item(item)?;
            }
            Op::None => self.push(PyValue::None)?,
            Op::Bool(b) => self.push(PyValue::Bool(b))?,
            Op::Int(i) => self.push(PyValue::Int(i))?,
            Op::Float(x) => self.push(PyValue::Float(x))?,
            Op::Text(bytes) => {
                let text = std::str::from_utf8(bytes)
                    .map_err(|_| malformed(at, "string is not valid UTF-8".into()))?;
                let text = memory::string(&mut self.budget.memory, text)?;
                self.push(PyValue::Str(text))?;
            }
            Op::EscapedText(bytes) => {
                // At most two bytes of UTF-8 for each byte of the escaped form.
                let capacity = bytes.len().saturating_mul(2);
                self.budget.memory.charge(heap_block(capacity))?;
                let text = raw_unicode_escape(bytes, at, capacity)?;
                self.push(PyValue::Str(text))?;
            }
            Op::LegacyString(bytes) => {
                let memory = &mut self.budget.memory;
                let value = match std::str::from_utf8(bytes) {
                    Ok(text) => PyValue::Str(memory::string(memory, text)?),
                    Err(_) => PyValue::Bytes(memory::bytes(memory, bytes)?),
                };
                self.push(value)?;
            }
            Op::Bytes(bytes) => {
                let bytes = memory::bytes(&mut self.budget.memory, bytes)?;
                self.push(PyValue::Bytes(bytes))?;
            }
            Op::EmptyList => self.push(PyValue::List(Vec::new()))?,
            Op::EmptyDict => self.push(PyValue::Dict(Vec::new()))?,
            Op::EmptyTuple => self.push(PyValue::Tuple(Vec::new()))?,
            Op::EmptySet => self.push(PyValue::Set(Vec::new()))?,
            Op::List | Op::Tuple | Op::FrozenSet | Op::Dict => {
                let mark = self.close_mark(at, "a container opcode")?;
                match op {
                    Op::List => self.container(at, mark, PyValue::List)?,
                    Op::Tuple => self.container(at, mark, PyValue::Tuple)?,
                    Op::FrozenSet => self.container(at, mark, PyValue::FrozenSet)?,
                    _ => {
                        // The dict goes below its keys and values, which then move into it.
                        self.budget.build(1)?;
                        reserve(&mut self.budget.memory, &mut self.stack, 1)?;
                        self.stack
                            .insert(mark, Item::new(PyValue::Dict(Vec::new()), 1));
                        self.extend_top(at, "SETITEMS", mark + 1)?;
                    }
                }
            }
            Op::TupleN(n) => {
                let from = self
                    .stack
                    .len()
                    .checked_sub(n)
                    .ok_or_else(|| Self::underflow(at, "TUPLE1/2/3"))?;
                for index in from..self.stack.len() {
                    self.complete(at, index)?;
                }
                self.container(at, from, PyValue::Tuple)?;
            }
            Op::Append => {
                let from = self.completed_top(at, 1, "APPEND")?;
                self.extend_top(at, "APPEND", from)?;
            }
            Op::SetItem => {
                let from = self.completed_top(at, 2, "SETITEM")?;
                self.extend_top(at, "SETITEM", from)?;
            }
            Op::Appends | Op::SetItems | Op::AddItems => {
                let name = match op {
                    Op::Appends => "APPENDS",
                    Op::SetItems => "SETITEMS",
                    _ => "ADDITEMS",
                };
                let mark = self.close_mark(at, name)?;
                self.extend_top(at, name, mark)?;
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

    /// Completes the top `n` items (and the container below them must exist); returns where they
    /// start.
    fn completed_top(&mut self, at: usize, n: usize, what: &str) -> SnapshotResult<usize> {
        let from = self
            .stack
            .len()
            .checked_sub(n + 1)
            .ok_or_else(|| Self::underflow(at, what))?
            + 1;
        for index in from..self.stack.len() {
            self.complete(at, index)?;
        }
        Ok(from)
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

/// What copying a value costs: values (see [`value_cost`]) and the bytes of the copy's heap blocks.
#[derive(Default)]
struct CopyCost {
    values: usize,
    bytes: usize,
}

impl CopyCost {
    /// Adds the cost of a copy of `value` and everything in it, counting no further than `limit + 1`
    /// values. Iterative: the frames are the path to the value being counted.
    fn add(&mut self, value: &PyValue, limit: usize) {
        self.add_one(value);
        let mut frames = vec![(value, 0usize)];
        while let Some(frame) = frames.last_mut() {
            if self.values > limit {
                return;
            }
            let Some(next) = child(frame.0, frame.1) else {
                frames.pop();
                continue;
            };
            frame.1 += 1;
            self.add_one(next);
            if is_container(next) {
                frames.push((next, 0));
            }
        }
    }

    /// Adds the cost of `value` without its children.
    fn add_one(&mut self, value: &PyValue) {
        self.values += value_cost(value);
        self.bytes += match value {
            PyValue::Str(s) => heap_block(s.len()),
            PyValue::Bytes(b) => heap_block(b.len()),
            PyValue::List(v) | PyValue::Tuple(v) | PyValue::Set(v) | PyValue::FrozenSet(v) => {
                vec_block::<PyValue>(v.len())
            }
            PyValue::Dict(items) => vec_block::<(PyValue, PyValue)>(items.len()),
            _ => 0,
        };
    }
}

fn is_container(value: &PyValue) -> bool {
    matches!(
        value,
        PyValue::List(_)
            | PyValue::Tuple(_)
            | PyValue::Dict(_)
            | PyValue::Set(_)
            | PyValue::FrozenSet(_)
    )
}

/// Child `i` of a container (a dict's keys and values alternate), `None` past the last.
fn child(value: &PyValue, i: usize) -> Option<&PyValue> {
    match value {
        PyValue::List(v) | PyValue::Tuple(v) | PyValue::Set(v) | PyValue::FrozenSet(v) => v.get(i),
        PyValue::Dict(items) => items
            .get(i / 2)
            .map(|(k, v)| if i.is_multiple_of(2) { k } else { v }),
        _ => None,
    }
}

/// A container's copy being filled by [`try_clone`].
enum Filling {
    Values(Vec<PyValue>),
    /// A dict's entries, and the key waiting for its value.
    Entries(Vec<(PyValue, PyValue)>, Option<PyValue>),
}

impl Filling {
    /// An empty copy of the container `value` with room for all its children, or `None` for a
    /// value that is not a container.
    fn of(value: &PyValue) -> Result<Option<Filling>, TryReserveError> {
        Ok(Some(match value {
            PyValue::List(v) | PyValue::Tuple(v) | PyValue::Set(v) | PyValue::FrozenSet(v) => {
                let mut out = Vec::new();
                out.try_reserve_exact(v.len())?;
                Filling::Values(out)
            }
            PyValue::Dict(items) => {
                let mut out = Vec::new();
                out.try_reserve_exact(items.len())?;
                Filling::Entries(out, None)
            }
            _ => return Ok(None),
        }))
    }

    fn push(&mut self, value: PyValue) {
        match self {
            Filling::Values(out) => out.push(value),
            Filling::Entries(out, key) => match key.take() {
                Some(k) => out.push((k, value)),
                None => *key = Some(value),
            },
        }
    }

    /// The finished copy of the container `like`.
    fn finish(self, like: &PyValue) -> PyValue {
        match (self, like) {
            (Filling::Values(v), PyValue::Tuple(_)) => PyValue::Tuple(v),
            (Filling::Values(v), PyValue::Set(_)) => PyValue::Set(v),
            (Filling::Values(v), PyValue::FrozenSet(_)) => PyValue::FrozenSet(v),
            (Filling::Values(v), _) => PyValue::List(v),
            (Filling::Entries(entries, _), _) => PyValue::Dict(entries),
        }
    }
}

/// A copy of a value that is not a container, allocated fallibly.
fn try_clone_leaf(value: &PyValue) -> Result<PyValue, TryReserveError> {
    Ok(match value {
        PyValue::Str(s) => {
            let mut out = String::new();
            out.try_reserve_exact(s.len())?;
            out.push_str(s);
            PyValue::Str(out)
        }
        PyValue::Bytes(b) => {
            let mut out = Vec::new();
            out.try_reserve_exact(b.len())?;
            out.extend_from_slice(b);
            PyValue::Bytes(out)
        }
        other => other.clone(),
    })
}

/// A copy of `value` whose heap blocks are allocated fallibly (each exactly as large as
/// [`CopyCost`] counts it). Iterative: the frames are the path to the value being copied.
fn try_clone(value: &PyValue) -> Result<PyValue, TryReserveError> {
    let Some(root) = Filling::of(value)? else {
        return try_clone_leaf(value);
    };
    let mut frames = vec![(value, 0usize, root)];
    loop {
        let frame = frames.last_mut().expect("the root's frame is popped last");
        if let Some(next) = child(frame.0, frame.1) {
            frame.1 += 1;
            match Filling::of(next)? {
                Some(filling) => frames.push((next, 0, filling)),
                None => frame.2.push(try_clone_leaf(next)?),
            }
            continue;
        }
        let (like, _, filling) = frames.pop().expect("a frame was just looked at");
        let done = filling.finish(like);
        match frames.last_mut() {
            Some(parent) => parent.2.push(done),
            None => return Ok(done),
        }
    }
}

/// A hashable form of the dict keys a snapshot uses (strings and integers); other keys are compared one
/// by one.
#[derive(PartialEq, Eq, Hash)]
enum KeyIndex {
    Str(String),
    Int(i128),
}

impl KeyIndex {
    /// The index form of `key` (a copy of a string, charged), if it has one.
    fn of(memory: &mut Memory, key: &PyValue) -> SnapshotResult<Option<KeyIndex>> {
        Ok(match key {
            PyValue::Str(s) => Some(KeyIndex::Str(memory::string(memory, s)?)),
            PyValue::Int(i) => Some(KeyIndex::Int(*i)),
            _ => None,
        })
    }

    /// The bytes of the key's own heap block.
    fn block(&self) -> usize {
        match self {
            KeyIndex::Str(s) => heap_block(s.len()),
            KeyIndex::Int(_) => 0,
        }
    }
}

/// Dicts with more entries than this get a hash index for their string and integer keys.
const INDEX_DICTS_FROM: usize = 16;

/// `dict[key] = value`: replaces the value of an equal key, else appends. Large dicts keep `index`.
fn set_item(
    memory: &mut Memory,
    dict: &mut Vec<(PyValue, PyValue)>,
    index: &mut Option<HashMap<KeyIndex, usize>>,
    key: PyValue,
    value: PyValue,
) -> SnapshotResult<()> {
    if index.is_none() && dict.len() >= INDEX_DICTS_FROM {
        let mut built = HashMap::new();
        reserve_entries(memory, &mut built, dict.len())?;
        for (i, (k, _)) in dict.iter().enumerate() {
            if let Some(k) = KeyIndex::of(memory, k)? {
                built.insert(k, i);
            }
        }
        *index = Some(built);
    }
    let existing = match index.as_mut() {
        Some(index) => match KeyIndex::of(memory, &key)? {
            Some(hashed) => {
                reserve_entry(memory, index)?;
                let next = dict.len();
                let block = hashed.block();
                let slot = *index.entry(hashed).or_insert(next);
                if slot < next {
                    // The key was there: its copy was dropped.
                    memory.credit(block);
                }
                (slot < next).then_some(slot)
            }
            None => dict.iter().position(|(k, _)| *k == key),
        },
        None => dict.iter().position(|(k, _)| *k == key),
    };
    match existing {
        Some(slot) => dict[slot].1 = value,
        None => {
            reserve(memory, dict, 1)?;
            dict.push((key, value));
        }
    }
    Ok(())
}

// A pickle of many small values holds them all on the stack at once: keep an item small.
const _: () = assert!(std::mem::size_of::<Item>() <= 48);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fallible_copy_equals_the_value_and_costs_what_its_blocks_take() {
        let leaf = PyValue::Str("x".repeat(100));
        let inner = PyValue::Dict(vec![
            (PyValue::from("a"), PyValue::Int(1)),
            (
                PyValue::Int(2),
                PyValue::Tuple(vec![leaf.clone(), PyValue::None]),
            ),
        ]);
        let value = PyValue::List(vec![inner.clone(), PyValue::Set(vec![]), inner]);
        assert_eq!(try_clone(&value).unwrap(), value);
        let mut cost = CopyCost::default();
        cost.add(&value, usize::MAX);
        let one_inner = vec_block::<(PyValue, PyValue)>(2)
            + heap_block(1)
            + vec_block::<PyValue>(2)
            + heap_block(100);
        assert_eq!(cost.bytes, vec_block::<PyValue>(3) + 2 * one_inner);
        // list, set, and per dict: the dict, 2 keys, 2 values, the tuple's 2 values (the string
        // counting one more per 32 bytes).
        assert_eq!(cost.values, 2 + 2 * (1 + 4 + 2 + 3));
    }

    #[test]
    fn counting_a_copy_stops_past_the_limit() {
        let value = PyValue::List(vec![PyValue::None; 1000]);
        let mut cost = CopyCost::default();
        cost.add(&value, 10);
        assert_eq!(cost.values, 11);
    }
}
