//! loom models of the pointer index under concurrent frees by pointer. Run with
//! `RUSTFLAGS="--cfg loom"` (see `docs/reliability.md`).
//!
//! The allocator's locks are `parking_lot`'s, which loom cannot schedule, so the model replays the
//! allocator's protocol around the real [`PointerIndex`] with loom's primitives:
//!
//! - each stream shard's blocks and its index sit behind the shard's lock;
//! - the index is built lazily by the first pointer-based call: under the maintenance lock and every
//!   shard lock it is rebuilt from the allocated blocks, then the (relaxed) "index on" flag is set,
//!   still under every shard lock (`enable_pointer_index` / `build_pointer_index`);
//! - an allocation marks its block allocated and, if the flag reads true under the shard lock,
//!   inserts it (`alloc_found_block`); a free by handle forgets it likewise (`free`);
//! - a free by pointer enables the index, takes the shard lock, and frees only what it removes from
//!   the index (`raw_free` / `take_indexed`).
//!
//! What must hold in every interleaving: a free by pointer frees an allocated block at that address
//! and nothing else, so two racing frees of one pointer free it once (plus once more only if the
//! memory was handed out again in between); and once the threads are done, every shard's index holds
//! exactly its allocated blocks.

use loom::sync::atomic::{AtomicBool, Ordering::Relaxed};
use loom::sync::{Arc, Mutex};
use loom::thread;

use super::PointerIndex;

/// A block: its address and whether it is allocated.
#[derive(Clone, Copy, Debug)]
struct Block {
    addr: u64,
    allocated: bool,
}

#[derive(Debug, Default)]
struct ShardState {
    blocks: Vec<Block>,
    index: PointerIndex,
}

/// The parts of the allocator the protocol touches.
#[derive(Debug)]
struct Allocator {
    index_on: AtomicBool,
    maintenance: Mutex<()>,
    shards: [Mutex<ShardState>; 2],
}

impl Allocator {
    /// Two shards whose blocks are `blocks[i]`, all allocated by handle, the index off.
    fn new(blocks: [&[u64]; 2]) -> Self {
        let shard = |addrs: &[u64]| {
            Mutex::new(ShardState {
                blocks: addrs
                    .iter()
                    .map(|&addr| Block {
                        addr,
                        allocated: true,
                    })
                    .collect(),
                index: PointerIndex::default(),
            })
        };
        Allocator {
            index_on: AtomicBool::new(false),
            maintenance: Mutex::new(()),
            shards: [shard(blocks[0]), shard(blocks[1])],
        }
    }

    fn enable_index(&self) {
        if self.index_on.load(Relaxed) {
            return;
        }
        let _pass = self.maintenance.lock().unwrap();
        let mut locks: Vec<_> = self.shards.iter().map(|s| s.lock().unwrap()).collect();
        for st in &mut locks {
            let st = &mut **st;
            st.index.clear();
            for (i, b) in st.blocks.iter().enumerate() {
                if b.allocated {
                    st.index.insert(b.addr, i as u32);
                }
            }
        }
        self.index_on.store(true, Relaxed);
    }

    /// Hands out block `block` of shard `shard` again if it is free; whether it did.
    fn reallocate(&self, shard: usize, block: usize) -> bool {
        let mut st = self.shards[shard].lock().unwrap();
        if st.blocks[block].allocated {
            return false;
        }
        st.blocks[block].allocated = true;
        if self.index_on.load(Relaxed) {
            let addr = st.blocks[block].addr;
            st.index.insert(addr, block as u32);
        }
        true
    }

    /// Frees block `block` of shard `shard` by its handle (which the caller holds, so it is live).
    fn free_handle(&self, shard: usize, block: usize) {
        let mut st = self.shards[shard].lock().unwrap();
        assert!(
            st.blocks[block].allocated,
            "a live handle's block is allocated"
        );
        if self.index_on.load(Relaxed) {
            let addr = st.blocks[block].addr;
            st.index.forget(addr);
        }
        st.blocks[block].allocated = false;
    }

    /// Frees by pointer; whether something was freed.
    fn raw_free(&self, shard: usize, addr: u64) -> bool {
        self.enable_index();
        let mut st = self.shards[shard].lock().unwrap();
        let Some(i) = st.index.remove(&addr) else {
            return false;
        };
        let b = &mut st.blocks[i as usize];
        assert!(
            b.allocated && b.addr == addr,
            "freed {b:?} for pointer {addr:#x}"
        );
        b.allocated = false;
        true
    }

    /// Every shard's index holds exactly its allocated blocks.
    fn check_indices(&self) {
        assert!(self.index_on.load(Relaxed));
        for shard in &self.shards {
            let st = shard.lock().unwrap();
            let allocated = st.blocks.iter().filter(|b| b.allocated).count();
            assert_eq!(st.index.len(), allocated, "index size");
            for (i, b) in st.blocks.iter().enumerate() {
                let found = st.index.get(&b.addr).copied();
                assert_eq!(
                    found,
                    b.allocated.then_some(i as u32),
                    "index entry of {b:?}"
                );
            }
        }
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(f);
}

/// Two threads free the same pointer while a third hands its memory out again when it can.
#[test]
fn double_raw_free_racing_reuse() {
    model(|| {
        let a = Arc::new(Allocator::new([&[0x1000, 0x2000], &[]]));
        let frees: Vec<_> = (0..2)
            .map(|_| {
                let a = Arc::clone(&a);
                thread::spawn(move || a.raw_free(0, 0x1000))
            })
            .collect();
        let reused = a.reallocate(0, 0);
        let freed = frees
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|&ok| ok)
            .count();
        let allocated = a.shards[0].lock().unwrap().blocks[0].allocated;
        // Handed out 1 + reused times, freed `freed` times, allocated now or not.
        assert_eq!(
            1 + usize::from(reused),
            freed + usize::from(allocated),
            "freed {freed} times, reused: {reused}, allocated at the end: {allocated}"
        );
        assert!(freed >= 1, "the live pointer was not freed");
        a.check_indices();
    });
}

/// The index is built while another shard allocates and a handle is freed: no block is missed or
/// left behind.
#[test]
fn building_the_index_races_with_allocations_and_frees() {
    model(|| {
        let a = Arc::new(Allocator::new([&[0x1000, 0x2000], &[0x9000]]));
        // Shard 1's block is free at first, to be handed out while the index is being built.
        a.shards[1].lock().unwrap().blocks[0].allocated = false;
        let allocator = {
            let a = Arc::clone(&a);
            thread::spawn(move || assert!(a.reallocate(1, 0)))
        };
        let freer = {
            let a = Arc::clone(&a);
            thread::spawn(move || a.free_handle(0, 1))
        };
        assert!(a.raw_free(0, 0x1000), "a live pointer frees");
        allocator.join().unwrap();
        freer.join().unwrap();
        a.check_indices();
        assert!(
            a.raw_free(1, 0x9000),
            "the block allocated meanwhile is indexed"
        );
        assert!(!a.raw_free(0, 0x2000), "the block freed by handle is not");
    });
}
