//! Stream shards: everything the allocator keeps for one stream, behind that stream's own lock.
//!
//! Blocks never move between streams (a block freed on stream S can only be reused on S), so the
//! pools, blocks and expandable segments of different streams are independent: each [`Shard`] has
//! its own mutex, and calls on different streams never contend. The [`StreamTable`] finds a stream's
//! shard without a lock: an append-only open-addressing table of write-once slots.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use super::fast::FastPath;
use crate::block::Arena;
use crate::device::{Device, StreamId};
use crate::expandable::ExpandableSegment;
use crate::pointer_index::PointerIndex;
use crate::pool::{Pool, PoolOwner};
use crate::pool_id::MempoolId;
use crate::stack::Stack;
use crate::stats::peaks::{FigureSet, Figures};

/// Index of the default small pool in every shard's pool table.
pub(crate) const SMALL_POOL: u16 = 0;
/// Index of the default large pool in every shard's pool table.
pub(crate) const LARGE_POOL: u16 = 1;

/// A multiplicative hasher for device addresses and stream handles (well-distributed `u64` keys).
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    #[inline]
    fn finish(&self) -> u64 {
        // hashbrown takes the bucket from the low bits and a tag from the top 7. A product's low
        // bits depend only on the key's low bits, which are zero for 512-byte-aligned addresses
        // (every key would land in one bucket group); folding the well-mixed middle bits down fixes
        // that and keeps the top bits.
        self.0 ^ (self.0 >> 29)
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the high and middle bits are well mixed (see `finish`).
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// `HashMap` keyed by addresses.
pub(crate) type AddrMap<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;

/// The state of one stream, guarded by its shard's lock.
#[derive(Debug)]
pub(crate) struct ShardState<D: Device> {
    /// Every block of the stream's segments.
    pub(crate) blocks: Arena,
    /// Pools: the default small and large pools at [`SMALL_POOL`] and [`LARGE_POOL`], then the parts
    /// of private pools this stream has used.
    pub(crate) pools: Vec<Pool>,
    /// Allocated blocks by address (for calls that name memory by pointer).
    pub(crate) allocated: PointerIndex,
    /// Expandable segments of this stream (`None`: released slot).
    pub(crate) segments: Vec<Option<ExpandableSegment<D>>>,
    /// Streams other than the allocation stream that used a block (`record_stream`), by block index
    /// (PyTorch's `Block::stream_uses`; most blocks have none, so they are kept out of the block).
    pub(crate) uses: AddrMap<Vec<StreamId>>,
    /// Streams recorded on a block while a graph capture was underway, by block index (PyTorch's
    /// `block_to_cudagraph_stream_uses`).
    pub(crate) capture_uses: AddrMap<Vec<StreamId>>,
    /// The allocation's call stack of blocks allocated while history kept stacks, by block index.
    pub(crate) stacks: AddrMap<Stack>,
    /// The freeing call's stack of blocks freed at context level `All` that wait for other streams.
    pub(crate) free_stacks: AddrMap<Stack>,
    /// The stack that made each segment (not expandable ones), by its address, while history kept
    /// stacks (snapshot segments' `frames`).
    pub(crate) segment_stacks: AddrMap<Stack>,
    /// The fast path's state (parked block, memo; see `allocator/fast`): opaque here, settled by
    /// [`settle`](Self::settle).
    pub(crate) fast: FastPath,
}

impl<D: Device> ShardState<D> {
    fn new(small_clock: Arc<AtomicU64>, large_clock: Arc<AtomicU64>, fast_path: bool) -> Self {
        ShardState {
            blocks: Arena::default(),
            pools: vec![
                Pool::new(true, PoolOwner::Default, small_clock),
                Pool::new(false, PoolOwner::Default, large_clock),
            ],
            allocated: PointerIndex::default(),
            segments: Vec::new(),
            uses: AddrMap::default(),
            capture_uses: AddrMap::default(),
            stacks: AddrMap::default(),
            free_stacks: AddrMap::default(),
            segment_stacks: AddrMap::default(),
            fast: FastPath::new(fast_path),
        }
    }

    /// Carries out a deferred merge, if any (see `allocator/fast`): the state becomes what the
    /// free of the parked block would have made it. `figures`: the shard's, whose record of the
    /// parked free is applied too.
    #[inline(always)]
    pub(crate) fn settle(&mut self, figures: &Figures) {
        self.fast.settle(&mut self.blocks, &mut self.pools, figures);
    }

    /// The index of this stream's part of private pool `id` for the given size class, if it exists.
    pub(crate) fn private_pool(&self, id: MempoolId, small: bool) -> Option<u16> {
        self.pools
            .iter()
            .position(|p| p.owner == PoolOwner::Private(id) && p.small == small)
            .map(|i| i as u16)
    }

    /// The index of this stream's part of private pool `id`, made by `make` if new; `None` if `make`
    /// says the pool no longer exists.
    pub(crate) fn private_pool_or_insert(
        &mut self,
        id: MempoolId,
        small: bool,
        make: impl FnOnce() -> Option<Pool>,
    ) -> Option<u16> {
        if let Some(index) = self.private_pool(id, small) {
            return Some(index);
        }
        let mut pool = make()?;
        if let Some(slot) = self
            .pools
            .iter()
            .position(|p| p.owner == PoolOwner::Released)
        {
            pool.free.continue_versions_of(&self.pools[slot].free);
            self.pools[slot] = pool;
            return Some(slot as u16);
        }
        self.pools.push(pool);
        Some(u16::try_from(self.pools.len() - 1).expect("fewer than 65536 pools per stream"))
    }
}

/// A stream shard's lock: taken once per allocator call, almost always by the one thread that uses
/// the stream, which then holds it without a locked instruction (see [`crate::biased_lock`]).
pub(crate) type ShardLock<T> = crate::biased_lock::BiasedLock<T>;

/// Access to a [`ShardLock`]'s value; releases the lock when dropped.
pub(crate) type ShardGuard<'a, T> = crate::biased_lock::BiasedGuard<'a, T>;

/// One stream's shard.
#[derive(Debug)]
pub(crate) struct Shard<D: Device> {
    /// The stream.
    pub(crate) stream: StreamId,
    /// The shard's index in creation order (what allocation handles name).
    pub(crate) index: u32,
    /// Statistics of this stream's blocks (see [`crate::stats::peaks`]).
    pub(crate) figures: CachePadded<Figures>,
    /// Everything else, under the shard's lock.
    pub(crate) state: CachePadded<ShardLock<ShardState<D>>>,
}

impl<D: Device> Shard<D> {
    /// Takes the shard's lock with a deferred merge settled (see `allocator/fast`): how every
    /// path but the allocation path reads or changes the shard's blocks.
    #[inline]
    pub(crate) fn lock_settled(&self) -> ShardGuard<'_, ShardState<D>> {
        let mut st = self.state.lock();
        st.settle(&self.figures);
        st
    }
}

/// Stream -> shard, without locks on lookup.
#[derive(Debug)]
pub(crate) struct StreamTable<D: Device> {
    /// Open-addressing slots: `(stream, shard index)`, written once.
    slots: Box<[OnceLock<(StreamId, u32)>]>,
    /// Shards by index, written once, in creation order.
    shards: Box<[OnceLock<Shard<D>>]>,
    /// Number of shards made.
    count: AtomicUsize,
    /// Serialises insertions; holds the shard indices sorted by stream (the fixed visiting order).
    sorted: Mutex<Vec<u32>>,
}

impl<D: Device> StreamTable<D> {
    /// A table for up to `capacity` streams.
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        StreamTable {
            slots: (0..(capacity * 2).next_power_of_two())
                .map(|_| OnceLock::new())
                .collect(),
            shards: (0..capacity).map(|_| OnceLock::new()).collect(),
            count: AtomicUsize::new(0),
            sorted: Mutex::new(Vec::new()),
        }
    }

    /// How many streams the table can hold.
    pub(crate) fn capacity(&self) -> usize {
        self.shards.len()
    }

    #[inline]
    fn probe(&self, stream: StreamId) -> impl Iterator<Item = &OnceLock<(StreamId, u32)>> {
        let mask = self.slots.len() - 1;
        let start = Self::home(stream) & mask;
        (0..self.slots.len()).map(move |i| &self.slots[(start + i) & mask])
    }

    /// Where the probe for `stream` starts, before masking.
    #[inline]
    fn home(stream: StreamId) -> usize {
        (stream.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize
    }

    /// The shard of `stream`, if it has one.
    #[inline]
    pub(crate) fn get(&self, stream: StreamId) -> Option<&Shard<D>> {
        // The probe of `probe` as a plain loop (the iterator cost ~10 instructions per call on the
        // hot path). It ends: at most half the slots are ever filled, so an empty one is met.
        let mask = self.slots.len() - 1;
        let mut at = Self::home(stream) & mask;
        loop {
            match self.slots[at].get() {
                Some(&(s, index)) if s == stream => return self.by_index(index),
                Some(_) => {
                    std::hint::cold_path();
                    at = (at + 1) & mask;
                }
                None => {
                    std::hint::cold_path();
                    return None;
                }
            }
        }
    }

    /// The shard of `stream`, made (with `make`) if it has none. `None` when the table is full.
    pub(crate) fn get_or_insert(
        &self,
        stream: StreamId,
        make: impl FnOnce() -> (Arc<AtomicU64>, Arc<AtomicU64>, bool),
    ) -> Option<&Shard<D>> {
        if let Some(shard) = self.get(stream) {
            return Some(shard);
        }
        let mut sorted = self.sorted.lock();
        if let Some(shard) = self.get(stream) {
            return Some(shard);
        }
        let index = self.count.load(Ordering::Relaxed);
        if index >= self.shards.len() {
            return None;
        }
        let (small, large, fast_path) = make();
        let shard = Shard {
            stream,
            index: index as u32,
            figures: CachePadded::new(Figures::new(index as u32)),
            state: CachePadded::new(ShardLock::new(ShardState::new(small, large, fast_path))),
        };
        // Publish the shard before the slot that points to it, and the count after both.
        let _ = self.shards[index].set(shard);
        let slot = self
            .probe(stream)
            .find(|slot| slot.get().is_none())
            .expect("the slot array is twice the shard capacity");
        let _ = slot.set((stream, index as u32));
        self.count.store(index + 1, Ordering::Release);
        let at = sorted
            .binary_search_by_key(&stream, |&i| {
                self.shards[i as usize].get().map_or(stream, |s| s.stream)
            })
            .unwrap_or_else(|at| at);
        sorted.insert(at, index as u32);
        self.by_index(index as u32)
    }

    /// The shard with the given index.
    #[inline]
    pub(crate) fn by_index(&self, index: u32) -> Option<&Shard<D>> {
        match self.shards.get(index as usize).and_then(OnceLock::get) {
            Some(shard) => Some(shard),
            None => {
                std::hint::cold_path();
                None
            }
        }
    }

    /// Every shard, in creation order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Shard<D>> {
        let count = self.count.load(Ordering::Acquire);
        self.shards[..count].iter().filter_map(OnceLock::get)
    }

    /// Every shard, sorted by stream (the order device-wide passes visit and lock them).
    pub(crate) fn in_stream_order(&self) -> Vec<&Shard<D>> {
        let sorted = self.sorted.lock();
        sorted.iter().filter_map(|&i| self.by_index(i)).collect()
    }
}

impl<D: Device> FigureSet for StreamTable<D> {
    fn for_each_figures(&self, f: &mut dyn FnMut(&Figures)) {
        for shard in self.iter() {
            f(&shard.figures);
        }
    }

    fn figures(&self, index: u32) -> Option<&Figures> {
        self.by_index(index).map(|shard| &*shard.figures)
    }
}
