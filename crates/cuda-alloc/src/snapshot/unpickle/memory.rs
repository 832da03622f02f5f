//! What the pickle reader holds, counted allocation by allocation, and allocations that fail
//! as errors.
//!
//! Every heap block the reader makes (a container's element buffer, a string's bytes, the stack,
//! the memo, a dict's key index) is charged at its real size before it is allocated: the capacity
//! times the element's `size_of`, rounded up as the system allocator rounds a block, plus the
//! allocator's header. Growing a buffer charges the new block before the allocation and credits the
//! old one after it, so the figure bounds the peak, the moment both exist included. Blocks are
//! allocated with `try_reserve`, so a machine that cannot provide one gives
//! [`SnapshotError::OutOfMemory`] instead of aborting the process.

use std::collections::HashMap;
use std::mem::size_of;

use super::super::{SnapshotError, SnapshotResult};

/// Bytes charged for what the reader holds, against the caller's bound.
pub(super) struct Memory {
    /// Bytes held now.
    held: u64,
    /// The most bytes held at once.
    peak: u64,
    /// The caller's `max_memory_bytes`.
    limit: u64,
}

impl Memory {
    pub(super) fn new(limit: u64) -> Memory {
        Memory {
            held: 0,
            peak: 0,
            limit,
        }
    }

    /// Counts `bytes` about to be allocated.
    pub(super) fn charge(&mut self, bytes: usize) -> SnapshotResult<()> {
        let held = self.held.saturating_add(bytes as u64);
        if held > self.limit {
            return Err(SnapshotError::TooLarge {
                what: "reading the pickle holds",
                bound: self.limit,
                unit: "bytes",
                limit: "max_memory_bytes",
            });
        }
        self.held = held;
        self.peak = self.peak.max(held);
        Ok(())
    }

    /// Counts `bytes` freed.
    pub(super) fn credit(&mut self, bytes: usize) {
        self.held = self.held.saturating_sub(bytes as u64);
    }

    /// The most bytes held at once so far.
    pub(super) fn peak(&self) -> u64 {
        self.peak
    }
}

/// The size of the heap block that holds `bytes` bytes: glibc's `malloc` adds an 8-byte header,
/// rounds to 16 bytes and hands out 32 at least (other allocators round no coarser for the sizes
/// the reader asks for).
pub(super) const fn heap_block(bytes: usize) -> usize {
    if bytes == 0 {
        return 0;
    }
    let block = bytes.saturating_add(8 + 15) & !15;
    if block < 32 {
        32
    } else {
        block
    }
}

/// The heap block of a `Vec<T>` of `capacity`.
pub(super) const fn vec_block<T>(capacity: usize) -> usize {
    heap_block(capacity.saturating_mul(size_of::<T>()))
}

/// The heap block of a `HashMap<K, V>` with room for `items` entries, as hashbrown (std's map)
/// lays its table out: a power of two of buckets at most 7/8 full, each an entry and a control
/// byte, and a group of control bytes more.
pub(super) fn table_block<K, V>(items: usize) -> usize {
    if items == 0 {
        return 0;
    }
    let buckets = if items < 4 {
        4
    } else if items < 8 {
        8
    } else {
        (items.saturating_mul(8) / 7).next_power_of_two()
    };
    heap_block(
        buckets
            .saturating_mul(size_of::<(K, V)>() + 1)
            .saturating_add(16),
    )
}

/// The error for an allocation of `bytes` the system refused.
pub(super) fn out_of_memory(bytes: usize) -> SnapshotError {
    SnapshotError::OutOfMemory {
        bytes: bytes as u64,
    }
}

/// Makes room in `vec` for `additional` more elements, doubling as `Vec::reserve` does (from the
/// exact size asked for when empty).
pub(super) fn reserve<T>(
    memory: &mut Memory,
    vec: &mut Vec<T>,
    additional: usize,
) -> SnapshotResult<()> {
    let needed = vec.len().saturating_add(additional);
    if needed <= vec.capacity() {
        return Ok(());
    }
    // Doubling, but an empty buffer gets exactly what is asked: snapshots hold many small dicts.
    grow_to(memory, vec, needed.max(vec.capacity() * 2))
}

/// Makes room in `vec` for exactly `additional` more elements.
pub(super) fn reserve_exact<T>(
    memory: &mut Memory,
    vec: &mut Vec<T>,
    additional: usize,
) -> SnapshotResult<()> {
    let needed = vec.len().saturating_add(additional);
    if needed <= vec.capacity() {
        return Ok(());
    }
    grow_to(memory, vec, needed)
}

fn grow_to<T>(memory: &mut Memory, vec: &mut Vec<T>, capacity: usize) -> SnapshotResult<()> {
    let old = vec_block::<T>(vec.capacity());
    let new = vec_block::<T>(capacity);
    memory.charge(new)?;
    if vec.try_reserve_exact(capacity - vec.len()).is_err() {
        memory.credit(new);
        return Err(out_of_memory(capacity.saturating_mul(size_of::<T>())));
    }
    memory.credit(old);
    Ok(())
}

/// Makes room in `map` for one more entry, growing its table as hashbrown does.
pub(super) fn reserve_entry<K: Eq + std::hash::Hash, V>(
    memory: &mut Memory,
    map: &mut HashMap<K, V>,
) -> SnapshotResult<()> {
    reserve_entries(memory, map, 1)
}

/// Makes room in `map` for `additional` more entries.
pub(super) fn reserve_entries<K: Eq + std::hash::Hash, V>(
    memory: &mut Memory,
    map: &mut HashMap<K, V>,
    additional: usize,
) -> SnapshotResult<()> {
    let needed = map.len().saturating_add(additional);
    if needed <= map.capacity() {
        return Ok(());
    }
    // hashbrown grows to hold at least one more than its full capacity.
    let items = needed.max(map.capacity().saturating_add(1));
    let old = table_block::<K, V>(map.capacity());
    let new = table_block::<K, V>(items);
    memory.charge(new)?;
    if map.try_reserve(items - map.len()).is_err() {
        memory.credit(new);
        return Err(out_of_memory(new));
    }
    let actual = table_block::<K, V>(map.capacity());
    memory.credit(old);
    if actual > new {
        memory.charge(actual - new)?;
    } else {
        memory.credit(new - actual);
    }
    Ok(())
}

/// A copy of `text`, charged, allocated fallibly.
pub(super) fn string(memory: &mut Memory, text: &str) -> SnapshotResult<String> {
    memory.charge(heap_block(text.len()))?;
    let mut out = String::new();
    out.try_reserve_exact(text.len())
        .map_err(|_| out_of_memory(text.len()))?;
    out.push_str(text);
    Ok(out)
}

/// A copy of `bytes`, charged, allocated fallibly.
pub(super) fn bytes(memory: &mut Memory, bytes: &[u8]) -> SnapshotResult<Vec<u8>> {
    memory.charge(heap_block(bytes.len()))?;
    let mut out = Vec::new();
    out.try_reserve_exact(bytes.len())
        .map_err(|_| out_of_memory(bytes.len()))?;
    out.extend_from_slice(bytes);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_rounded_as_malloc_rounds_them() {
        assert_eq!(heap_block(0), 0);
        assert_eq!(heap_block(1), 32);
        assert_eq!(heap_block(24), 32);
        assert_eq!(heap_block(25), 48);
        assert_eq!(vec_block::<u64>(4), 48);
    }

    #[test]
    fn growth_charges_the_new_block_and_credits_the_old() {
        let mut memory = Memory::new(1 << 20);
        let mut vec: Vec<u64> = Vec::new();
        reserve(&mut memory, &mut vec, 3).unwrap();
        assert_eq!(vec.capacity(), 3);
        assert_eq!(memory.held, vec_block::<u64>(3) as u64);
        vec.extend([1, 2, 3]);
        reserve(&mut memory, &mut vec, 1).unwrap();
        assert_eq!(vec.capacity(), 6);
        assert_eq!(memory.held, vec_block::<u64>(6) as u64);
        assert_eq!(
            memory.peak,
            (vec_block::<u64>(3) + vec_block::<u64>(6)) as u64
        );
    }

    #[test]
    fn the_table_charge_follows_the_map_it_grows() {
        let mut memory = Memory::new(1 << 30);
        let mut map: HashMap<u64, u64> = HashMap::new();
        for i in 0..10_000 {
            reserve_entry(&mut memory, &mut map).unwrap();
            map.insert(i, i);
            assert_eq!(
                memory.held,
                table_block::<u64, u64>(map.capacity()) as u64,
                "at {i} entries"
            );
        }
    }

    #[test]
    fn a_charge_over_the_limit_is_refused_and_not_counted() {
        let mut memory = Memory::new(100);
        memory.charge(64).unwrap();
        let e = memory.charge(64).unwrap_err();
        assert!(
            matches!(
                e,
                SnapshotError::TooLarge {
                    limit: "max_memory_bytes",
                    bound: 100,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(memory.held, 64);
    }
}
