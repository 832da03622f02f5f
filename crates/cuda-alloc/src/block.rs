//! Blocks: the pieces segments are cut into, kept in a per-stream arena and named by index.
//!
//! A segment (one device allocation, or one expandable segment's reserved range) is a chain of blocks
//! that tile it exactly: `prev`/`next` link the neighbours in address order. A block is either
//! allocated (handed out), active but waiting for other streams to finish with it (freed with events
//! pending), or free (in its pool's free set, or in the unmapped set of an expandable segment).
//!
//! Blocks live in an [`Arena`] owned by their stream's shard and are named by `u32` index, so splitting
//! and merging reuse slots instead of allocating memory, and a block never moves between streams.

/// The "no block" index (a sentinel instead of `Option<u32>`, to keep [`Block`] small).
pub(crate) const NIL: u32 = u32::MAX;

/// One block: 64 bytes, aligned to 64, so one cache line. (Unaligned, as a `Vec`'s 16-byte-aligned
/// buffer placed it, three blocks in four spanned two lines; a free reads the freed block and both
/// neighbours at random slots. Aligned: the mixed pattern's L1 misses 13% fewer with a 48 KiB L1,
/// 16% fewer with 24 KiB, in `cachegrind`; see docs/allocator-performance.md, change 46.)
///
/// Invariants (checked by the allocator's `check_invariants`):
/// - `prev`/`next` are `NIL` or indices of live blocks of the same segment with
///   `blocks[prev].addr + blocks[prev].size == addr` and `addr + size == blocks[next].addr`;
/// - a free, mapped block is in exactly its pool's free set; a free unmapped block is in its pool's
///   unmapped set; an allocated or pending block is in neither;
/// - `mapped` is `true` unless the block belongs to an expandable segment (`expandable != NIL`);
/// - `used_elsewhere` is set exactly when the shard's stream-use table has an entry for the block.
#[derive(Debug, Clone)]
#[repr(align(64))]
pub(crate) struct Block {
    /// Device address of the first byte.
    pub(crate) addr: u64,
    /// Size in bytes (a multiple of 512).
    pub(crate) size: u64,
    /// The size the caller asked for when the block was last handed out.
    pub(crate) requested: u64,
    /// The pool's garbage-collection clock when the block entered the free set.
    pub(crate) gc_count_base: u64,
    /// The block before this one in its segment, or [`NIL`].
    pub(crate) prev: u32,
    /// The block after this one in its segment, or [`NIL`].
    pub(crate) next: u32,
    /// Incremented each time the slot is handed out or freed; lets an allocation handle detect a
    /// stale block.
    pub(crate) generation: u32,
    /// Index of the expandable segment in the shard's table, or [`NIL`].
    pub(crate) expandable: u32,
    /// Events recorded on other streams that must complete before the block is free.
    pub(crate) event_count: u32,
    /// Index of the owning pool in the shard's pool table.
    pub(crate) pool: u16,
    /// Handed out to a caller.
    pub(crate) allocated: bool,
    /// Backed by physical memory (always true outside expandable segments).
    pub(crate) mapped: bool,
    /// Other streams used the block (`record_stream`); they are listed in the shard's stream-use
    /// table.
    pub(crate) used_elsewhere: bool,
    /// The slot holds a block (false: on the arena's free list).
    live: bool,
}

impl Block {
    /// A new, free, mapped block of a segment of its own.
    #[inline]
    pub(crate) fn new(addr: u64, size: u64, pool: u16) -> Self {
        Block {
            addr,
            size,
            requested: 0,
            gc_count_base: 0,
            prev: NIL,
            next: NIL,
            generation: 0,
            expandable: NIL,
            event_count: 0,
            pool,
            allocated: false,
            mapped: true,
            used_elsewhere: false,
            live: true,
        }
    }

    /// Whether the block is one of several in its segment. (`NIL` has every bit set, so the two
    /// links' intersection is `NIL` only if both are: one comparison, no branch on either link.)
    #[inline]
    pub(crate) fn is_split(&self) -> bool {
        self.prev & self.next != NIL
    }

    /// Whether the block is in use: allocated, or freed with uses on other streams outstanding.
    /// (The three conditions combined without short-circuits: one branch at the caller instead of
    /// three hard-to-predict ones when the block is a random neighbour.)
    #[inline]
    pub(crate) fn is_active(&self) -> bool {
        self.allocated | (self.event_count > 0) | self.used_elsewhere
    }

    /// Whether the block belongs to an expandable segment.
    #[inline]
    pub(crate) fn is_expandable(&self) -> bool {
        self.expandable != NIL
    }

    /// The address one past the block.
    #[inline]
    pub(crate) fn end(&self) -> u64 {
        self.addr + self.size
    }
}

/// Slots of blocks, reused through a free list.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    slots: Vec<Block>,
    vacant: Vec<u32>,
}

impl Arena {
    /// Stores a block and returns its index.
    #[inline]
    pub(crate) fn insert(&mut self, block: Block) -> u32 {
        if let Some(index) = self.vacant.pop() {
            let slot = &mut self.slots[index as usize];
            let generation = slot.generation;
            *slot = Block {
                generation,
                ..block
            };
            index
        } else {
            let index = u32::try_from(self.slots.len()).expect("fewer than 2^32 blocks per stream");
            self.slots.push(block);
            index
        }
    }

    /// Frees a slot. The block's generation survives in the slot so handles to it stay detectably
    /// stale.
    #[inline]
    pub(crate) fn remove(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        debug_assert!(slot.live, "block {index} removed twice");
        slot.generation = slot.generation.wrapping_add(1);
        slot.live = false;
        self.vacant.push(index);
    }

    /// Whether `index` names a live block.
    #[inline]
    pub(crate) fn is_live(&self, index: u32) -> bool {
        self.slots.get(index as usize).is_some_and(|b| b.live)
    }

    /// Whether `index` names a block that is not in use and whose `mapped` is `mapped`: a neighbour
    /// a free merges with. `NIL` (no neighbour) is not one. No branch on `NIL`: the slot read is
    /// clamped into the arena (its fields do not matter when the answer is masked off), so a free can
    /// ask about both neighbours before it branches on either, and their two reads (random slots,
    /// often cache misses) overlap instead of waiting one for the other.
    #[inline(always)]
    pub(crate) fn is_free_neighbour(&self, index: u32, mapped: bool) -> bool {
        let last = self.slots.len().saturating_sub(1);
        let Some(b) = self.slots.get((index as usize).min(last)) else {
            return false;
        };
        (index != NIL) & !b.is_active() & (b.mapped == mapped)
    }

    /// Live blocks with their indices.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, b)| b.live)
            .map(|(i, b)| (i as u32, b))
    }
}

impl std::ops::Index<u32> for Arena {
    type Output = Block;
    #[inline]
    fn index(&self, index: u32) -> &Block {
        let block = &self.slots[index as usize];
        debug_assert!(block.live, "block {index} is not live");
        block
    }
}

impl std::ops::IndexMut<u32> for Arena {
    #[inline]
    fn index_mut(&mut self, index: u32) -> &mut Block {
        let block = &mut self.slots[index as usize];
        debug_assert!(block.live, "block {index} is not live");
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Block>(), 64);
        assert_eq!(std::mem::align_of::<Block>(), 64);
        let arena: Vec<Block> = (0..3).map(|i| Block::new(i * 512, 512, 0)).collect();
        assert!(arena.iter().all(|b| std::ptr::from_ref(b).addr() % 64 == 0));
    }

    /// The neighbour test reads a clamped slot without a branch on `NIL`: `NIL` must still never be
    /// a free neighbour, even where the slot it is clamped to holds one.
    #[test]
    fn only_free_blocks_mapped_alike_are_free_neighbours() {
        let mut arena = Arena::default();
        assert!(!arena.is_free_neighbour(NIL, true), "an empty arena");
        let free = arena.insert(Block::new(0, 512, 0));
        let mut allocated = Block::new(512, 512, 0);
        allocated.allocated = true;
        let allocated = arena.insert(allocated);
        let mut unmapped = Block::new(1024, 512, 0);
        unmapped.mapped = false;
        let unmapped = arena.insert(unmapped);
        let last = arena.insert(Block::new(1536, 512, 0));
        assert!(arena.is_free_neighbour(free, true));
        assert!(arena.is_free_neighbour(last, true));
        assert!(!arena.is_free_neighbour(allocated, true));
        assert!(!arena.is_free_neighbour(unmapped, true));
        assert!(arena.is_free_neighbour(unmapped, false));
        assert!(!arena.is_free_neighbour(free, false));
        // `NIL` clamps to the last slot, a free mapped block.
        assert!(!arena.is_free_neighbour(NIL, true));
    }
}
