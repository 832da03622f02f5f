//! Blocks: the pieces segments are cut into, kept in a per-stream arena and named by index.
//!
//! A segment (one device allocation, or one expandable segment's reserved range) is a chain of blocks
//! that tile it exactly: `prev`/`next` link the neighbours in address order. A block is either
//! allocated (handed out), active but waiting for other streams to finish with it (freed with events
//! pending), or free (in its pool's free set, or in the unmapped set of an expandable segment).
//!
//! Blocks live in an [`Arena`] owned by their stream's shard and are named by `u32` index, so splitting
//! and merging reuse slots instead of allocating memory, and a block never moves between streams.

use crate::device::StreamId;

/// The "no block" index (a sentinel instead of `Option<u32>`, to keep [`Block`] small).
pub(crate) const NIL: u32 = u32::MAX;

/// One block. Invariants (checked by the allocator's `check_invariants`):
/// - `prev`/`next` are `NIL` or indices of live blocks of the same segment with
///   `blocks[prev].addr + blocks[prev].size == addr` and `addr + size == blocks[next].addr`;
/// - a free, mapped block is in exactly its pool's free set; a free unmapped block is in its pool's
///   unmapped set; an allocated or pending block is in neither;
/// - `mapped` is `true` unless the block belongs to an expandable segment (`expandable != NIL`).
#[derive(Debug, Clone)]
pub(crate) struct Block {
    /// Device address of the first byte.
    pub(crate) addr: u64,
    /// Size in bytes (a multiple of 512).
    pub(crate) size: u64,
    /// The size the caller asked for when the block was last handed out.
    pub(crate) requested: u64,
    /// The block before this one in its segment, or [`NIL`].
    pub(crate) prev: u32,
    /// The block after this one in its segment, or [`NIL`].
    pub(crate) next: u32,
    /// Index of the owning pool in the shard's pool table.
    pub(crate) pool: u16,
    /// Handed out to a caller.
    pub(crate) allocated: bool,
    /// Backed by physical memory (always true outside expandable segments).
    pub(crate) mapped: bool,
    /// Events recorded on other streams that must complete before the block is free.
    pub(crate) event_count: u32,
    /// Incremented each time the block is handed out; lets an allocation handle detect a stale block.
    pub(crate) generation: u32,
    /// Index of the expandable segment in the shard's table, or [`NIL`].
    pub(crate) expandable: u32,
    /// The pool's garbage-collection clock when the block entered the free set.
    pub(crate) gc_count_base: u64,
    /// Streams other than the allocation stream that used the block (`record_stream`).
    pub(crate) stream_uses: Vec<StreamId>,
}

impl Block {
    /// A new, free, mapped block of a segment of its own.
    pub(crate) fn new(addr: u64, size: u64, pool: u16) -> Self {
        Block {
            addr,
            size,
            requested: 0,
            prev: NIL,
            next: NIL,
            pool,
            allocated: false,
            mapped: true,
            event_count: 0,
            generation: 0,
            expandable: NIL,
            gc_count_base: 0,
            stream_uses: Vec::new(),
        }
    }

    /// Whether the block is one of several in its segment.
    #[inline]
    pub(crate) fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }

    /// Whether the block is in use: allocated, or freed with uses on other streams outstanding.
    #[inline]
    pub(crate) fn is_active(&self) -> bool {
        self.allocated || self.event_count > 0 || !self.stream_uses.is_empty()
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
    live: Vec<bool>,
    vacant: Vec<u32>,
}

impl Arena {
    /// Stores a block and returns its index.
    #[inline]
    pub(crate) fn insert(&mut self, block: Block) -> u32 {
        if let Some(index) = self.vacant.pop() {
            let generation = self.slots[index as usize].generation;
            self.slots[index as usize] = Block {
                generation,
                ..block
            };
            self.live[index as usize] = true;
            index
        } else {
            let index = u32::try_from(self.slots.len()).expect("fewer than 2^32 blocks per stream");
            self.slots.push(block);
            self.live.push(true);
            index
        }
    }

    /// Frees a slot. The block's generation survives in the slot so handles to it stay detectably
    /// stale.
    #[inline]
    pub(crate) fn remove(&mut self, index: u32) {
        debug_assert!(self.live[index as usize], "block {index} removed twice");
        let slot = &mut self.slots[index as usize];
        slot.stream_uses = Vec::new();
        slot.generation = slot.generation.wrapping_add(1);
        self.live[index as usize] = false;
        self.vacant.push(index);
    }

    /// Whether `index` names a live block.
    #[inline]
    pub(crate) fn is_live(&self, index: u32) -> bool {
        self.live.get(index as usize).copied().unwrap_or(false)
    }

    /// Live blocks with their indices.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Block)> {
        self.slots
            .iter()
            .zip(&self.live)
            .enumerate()
            .filter(|(_, (_, &live))| live)
            .map(|(i, (b, _))| (i as u32, b))
    }
}

impl std::ops::Index<u32> for Arena {
    type Output = Block;
    #[inline]
    fn index(&self, index: u32) -> &Block {
        debug_assert!(self.live[index as usize], "block {index} is not live");
        &self.slots[index as usize]
    }
}

impl std::ops::IndexMut<u32> for Arena {
    #[inline]
    fn index_mut(&mut self, index: u32) -> &mut Block {
        debug_assert!(self.live[index as usize], "block {index} is not live");
        &mut self.slots[index as usize]
    }
}
