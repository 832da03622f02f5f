//! The index from an allocated block's address to its arena index, for freeing by raw pointer.
//!
//! A general hash map costs ~65 instructions per insert or remove here (hashing, tag groups,
//! tombstones). Keys are block addresses, always multiples of 512 bytes, so a dedicated table does
//! less: open addressing with linear probing over `(address, index)` pairs, the home slot taken from
//! the top bits of `(address >> 9) * φ·2^64` (Fibonacci hashing: spreads both consecutive 512-byte
//! blocks and widely spaced segments), at most a quarter full, and removal by backward shift, so
//! there are no tombstones and a lookup stops at the first empty slot. (Half full, the probe loops'
//! branches mispredicted often enough with 256 live blocks to cost 12 ns per operation.)

/// The key of an empty slot. Block addresses are multiples of 512, so never this.
const EMPTY: u64 = u64::MAX;

/// Slots a table starts with when its first key arrives.
const MIN_SLOTS: usize = 16;

/// Fibonacci hashing's multiplier (2^64 divided by the golden ratio, made odd).
const FIBONACCI: u64 = 0x9e37_79b9_7f4a_7c15;

#[derive(Clone, Copy, Debug)]
struct Slot {
    addr: u64,
    index: u32,
}

const VACANT: Slot = Slot {
    addr: EMPTY,
    index: 0,
};

/// Addresses of allocated blocks to their arena indices. Invariant: `slots` is empty or a power of
/// two long and at most a quarter full; every key sits in the run of occupied slots that starts at its
/// home slot (no empty slot between its home and it).
#[derive(Debug, Default)]
pub(crate) struct PointerIndex {
    slots: Vec<Slot>,
    len: usize,
    /// `64 - log2(slots.len())`: the product's top bits are the home slot.
    shift: u32,
}

impl PointerIndex {
    /// Number of addresses held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline(always)]
    fn home(&self, addr: u64) -> usize {
        ((addr >> 9).wrapping_mul(FIBONACCI) >> self.shift) as usize
    }

    /// The slot holding `addr`, if any.
    #[inline(always)]
    fn find(&self, addr: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            let key = self.slots[i].addr;
            // Empty first: `EMPTY` is also a value a caller can pass (a hostile or corrupt pointer),
            // and an empty slot must never match it.
            if key == EMPTY {
                return None;
            }
            if key == addr {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Maps `addr` to `index`, replacing any earlier mapping.
    #[inline]
    pub(crate) fn insert(&mut self, addr: u64, index: u32) {
        debug_assert_ne!(addr, EMPTY, "not a block address");
        if (self.len + 1) * 4 > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            let slot = &mut self.slots[i];
            if slot.addr == EMPTY {
                *slot = Slot { addr, index };
                self.len += 1;
                return;
            }
            if slot.addr == addr {
                slot.index = index;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// The arena index of `addr`, if held.
    #[inline]
    pub(crate) fn get(&self, addr: &u64) -> Option<&u32> {
        self.find(*addr).map(|i| &self.slots[i].index)
    }

    /// Removes `addr`, returning its arena index, if held. Always inlined: as a call, a fifth of it
    /// was saving registers.
    #[inline(always)]
    pub(crate) fn remove(&mut self, addr: &u64) -> Option<u32> {
        let mut hole = self.find(*addr)?;
        let index = self.slots[hole].index;
        let mask = self.mask();
        // Backward shift: pull later entries of the run into the hole when the hole lies on their
        // probe path (between their home and where they sit), so no lookup meets an early gap.
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let slot = self.slots[i];
            if slot.addr == EMPTY {
                break;
            }
            let from_home = i.wrapping_sub(self.home(slot.addr)) & mask;
            let from_hole = i.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.slots[hole] = slot;
                hole = i;
            }
        }
        self.slots[hole] = VACANT;
        self.len -= 1;
        Some(index)
    }

    /// Removes `addr` if held, out of line: for callers that seldom have the index on (freeing by
    /// handle), where an inlined [`remove`](Self::remove) made every call save more registers.
    #[inline(never)]
    pub(crate) fn forget(&mut self, addr: u64) {
        self.remove(&addr);
    }

    /// Forgets every address, keeping the room.
    pub(crate) fn clear(&mut self) {
        self.slots.fill(VACANT);
        self.len = 0;
    }

    /// Doubles the table (or creates it) and re-places every key.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let new_len = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![VACANT; new_len]);
        self.shift = 64 - new_len.trailing_zeros();
        self.len = 0;
        for slot in old.into_iter().filter(|s| s.addr != EMPTY) {
            self.insert(slot.addr, slot.index);
        }
    }
}

#[cfg(all(test, loom))]
mod loom_models;

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn empty_index_finds_nothing() {
        let mut index = PointerIndex::default();
        assert_eq!(index.get(&512), None);
        assert_eq!(index.remove(&512), None);
        assert_eq!(index.len(), 0);
    }

    #[test]
    fn the_empty_key_is_never_found() {
        let mut index = PointerIndex::default();
        index.insert(1024, 7);
        assert_eq!(index.get(&EMPTY), None);
        assert_eq!(index.remove(&EMPTY), None);
        assert_eq!(index.len(), 1);
        assert_eq!(index.get(&1024), Some(&7));
    }

    #[test]
    fn insert_replaces_and_clear_forgets() {
        let mut index = PointerIndex::default();
        index.insert(1024, 1);
        index.insert(1024, 2);
        assert_eq!(index.len(), 1);
        assert_eq!(index.get(&1024), Some(&2));
        index.insert(2048, 3);
        index.forget(1024);
        assert_eq!(index.get(&1024), None);
        assert_eq!(index.get(&2048), Some(&3));
        index.clear();
        assert_eq!(index.get(&1024), None);
        assert_eq!(index.len(), 0);
    }

    proptest! {
        /// Any sequence of inserts and removes of 512-byte-aligned addresses (dense runs and
        /// widely spaced ones, so runs collide and wrap) agrees with a `HashMap`.
        #[test]
        fn agrees_with_a_hash_map(
            ops in proptest::collection::vec((any::<bool>(), 0u64..4, 0u64..64, any::<u32>()), 1..600)
        ) {
            let mut index = PointerIndex::default();
            let mut model = HashMap::new();
            for (insert, region, block, value) in ops {
                let addr = (region << 32) + block * 512;
                if insert {
                    index.insert(addr, value);
                    model.insert(addr, value);
                } else {
                    prop_assert_eq!(index.remove(&addr), model.remove(&addr));
                }
                prop_assert_eq!(index.len(), model.len());
            }
            for region in 0u64..4 {
                for block in 0u64..64 {
                    let addr = (region << 32) + block * 512;
                    prop_assert_eq!(index.get(&addr), model.get(&addr));
                }
            }
        }
    }
}
