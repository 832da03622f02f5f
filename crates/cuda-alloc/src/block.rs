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

/// One block: 64 bytes, naturally aligned (a 64-byte alignment, one cache line per block, measured
/// paired against it, did not pay; see docs/allocator-internals.md, "Arena of blocks").
///
/// Invariants (checked by the allocator's `check_invariants`):
/// - `prev`/`next` are `NIL` or indices of live blocks of the same segment with
///   `blocks[prev].addr + blocks[prev].size == addr` and `addr + size == blocks[next].addr`;
/// - a free, mapped block is in exactly its pool's free set; a free unmapped block is in its pool's
///   unmapped set; an allocated or pending block is in neither;
/// - `mapped` is `true` unless the block belongs to an expandable segment (`expandable != NIL`);
/// - `used_elsewhere` is set exactly when the shard's stream-use table has an entry for the block.
#[derive(Debug, Clone)]
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

    /// The block `index` names, or, for an index past the arena (such as `NIL`), the last one: a
    /// read without a branch on `NIL`, for a caller that masks the answer off when `index` is
    /// `NIL`. A free asks about both neighbours before it branches on either, so that their two
    /// reads (random slots, often cache misses) overlap instead of waiting one for the other.
    ///
    /// # Panics
    /// When the arena is empty.
    #[inline(always)]
    pub(crate) fn clamped(&self, index: u32) -> &Block {
        &self.slots[(index as usize).min(self.slots.len() - 1)]
    }

    /// Splits the first `size` bytes of block `index` off as a new block linked before it (free,
    /// mapped, of the same pool and segment, with [`Block::new`]'s other fields); `index` keeps the
    /// rest. Returns the new block's index. The chain still tiles the segment.
    #[inline(always)]
    pub(crate) fn split_front(&mut self, index: u32, size: u64) -> u32 {
        let r = &self[index];
        debug_assert!(size < r.size, "a split leaves both parts non-empty");
        let prev = r.prev;
        let mut head = Block::new(r.addr, size, r.pool);
        head.expandable = r.expandable;
        head.prev = prev;
        head.next = index;
        let head = self.insert(head);
        if prev != NIL {
            self[prev].next = head;
        }
        let r = &mut self[index];
        r.prev = head;
        r.addr += size;
        r.size -= size;
        head
    }

    /// Splits the last `size` bytes of block `index` off as a new block linked after it (free,
    /// mapped, of the same pool and segment, with [`Block::new`]'s other fields); `index` keeps the
    /// front. Returns the new block's index. The chain still tiles the segment.
    #[inline]
    pub(crate) fn split_back(&mut self, index: u32, size: u64) -> u32 {
        let b = &self[index];
        debug_assert!(size < b.size, "a split leaves both parts non-empty");
        let next = b.next;
        let mut tail = Block::new(b.end() - size, size, b.pool);
        tail.expandable = b.expandable;
        tail.prev = index;
        tail.next = next;
        let tail = self.insert(tail);
        if next != NIL {
            self[next].prev = tail;
        }
        let b = &mut self[index];
        b.next = tail;
        b.size -= size;
        tail
    }

    /// Merges block `index`'s next neighbour into it: `index` grows over it, and the neighbour is
    /// unlinked and leaves the arena. Returns the neighbour's `(size, addr)` (its free-set key).
    #[inline(always)]
    pub(crate) fn absorb_next(&mut self, index: u32) -> (u64, u64) {
        let next = self[index].next;
        debug_assert!(next != NIL, "block {index} has no next neighbour");
        let (size, addr) = self.unlink(next);
        self[index].size += size;
        (size, addr)
    }

    /// Merges block `index`'s previous neighbour into it: `index` grows down over it (its address
    /// becomes the neighbour's), and the neighbour is unlinked and leaves the arena. Returns the
    /// neighbour's `(size, addr)` (its free-set key).
    #[inline(always)]
    pub(crate) fn absorb_prev(&mut self, index: u32) -> (u64, u64) {
        let prev = self[index].prev;
        debug_assert!(prev != NIL, "block {index} has no previous neighbour");
        let (size, addr) = self.unlink(prev);
        let b = &mut self[index];
        b.addr = addr;
        b.size += size;
        (size, addr)
    }

    /// Takes block `index` out of its chain (its neighbours linked to each other) and out of the
    /// arena. Returns its `(size, addr)`. The caller makes a neighbour cover its bytes, or the
    /// block was a whole segment.
    #[inline(always)]
    pub(crate) fn unlink(&mut self, index: u32) -> (u64, u64) {
        let b = &self[index];
        let (size, addr, prev, next) = (b.size, b.addr, b.prev, b.next);
        if prev != NIL {
            self[prev].next = next;
        }
        if next != NIL {
            self[next].prev = prev;
        }
        self.remove(index);
        (size, addr)
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
    }

    /// An index past the arena (`NIL`) reads the last slot.
    #[test]
    fn a_clamped_read_of_nil_is_the_last_block() {
        let mut arena = Arena::default();
        arena.insert(Block::new(0, 512, 0));
        let last = arena.insert(Block::new(512, 512, 0));
        assert_eq!(arena.clamped(NIL).addr, 512);
        assert_eq!(arena.clamped(last).addr, 512);
        assert_eq!(arena.clamped(0).addr, 0);
    }

    /// The list operations keep the chain tiling the segment.
    #[test]
    fn splits_and_merges_keep_the_chain() {
        let mut arena = Arena::default();
        let whole = arena.insert(Block::new(0, 4096, 0));
        let head = arena.split_front(whole, 512);
        let tail = arena.split_back(whole, 1024);
        let addrs = |a: &Arena| {
            let mut at = head;
            let mut out = Vec::new();
            while at != NIL {
                out.push((a[at].addr, a[at].size));
                at = a[at].next;
            }
            out
        };
        assert_eq!(addrs(&arena), [(0, 512), (512, 2560), (3072, 1024)]);
        assert_eq!(arena[tail].prev, whole);
        assert_eq!(arena.absorb_next(whole), (1024, 3072));
        assert_eq!(arena.absorb_prev(whole), (512, 0));
        assert_eq!((arena[whole].addr, arena[whole].size), (0, 4096));
        assert_eq!((arena[whole].prev, arena[whole].next), (NIL, NIL));
        assert!(!arena.is_live(head) && !arena.is_live(tail));
    }
}
