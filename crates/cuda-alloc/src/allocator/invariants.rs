//! The full-state invariant walk run by tests after every operation.

use std::collections::HashSet;
use std::sync::atomic::Ordering::Relaxed;

use super::{policy, CachingAllocator, Locked};
use crate::block::NIL;
use crate::device::Device;
use crate::pool::PoolOwner;
use crate::stats::peaks::{self, Kind, FIGURES, OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS};

/// A broken invariant found by [`CachingAllocator::check_invariants`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allocator invariant violated: {0}")]
pub struct InvariantViolation(pub String);

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(InvariantViolation(format!($($fmt)+)));
        }
    };
}

impl<D: Device> CachingAllocator<D> {
    /// Walks the whole state and checks that it is consistent: blocks tile their segments exactly,
    /// neighbour links agree, free sets are sorted views of exactly the free blocks, no two free
    /// neighbours are left unmerged, pointer lookups find exactly the allocated blocks, and every
    /// statistic's current value equals what the blocks add up to. A block the fast path parked is
    /// walked as it is, not settled first: it must be free and in no set, its free next neighbour
    /// (if any) in its pool's set, its previous neighbour in use, and the statistics must read as
    /// the merge would make them. Meant for tests (it takes every
    /// lock and visits every block). It may run while another thread's device allocation is under
    /// way without its stream's lock (`release_lock_on_cudamalloc`): the bytes of such allocations
    /// are allowed for.
    ///
    /// # Errors
    /// The first violation found.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let (_guard, locks) = self.lock_all_unsettled();
        let mut reserved_total = 0u64;
        for locked in &locks {
            reserved_total += check_shard(locked, self.settings.oversize_limit())?;
        }
        // Segments a call is allocating without its shard's lock (`release_lock_on_cudamalloc`)
        // are counted already but in no shard yet.
        let counted = self.counters.reserved.load(Relaxed);
        let reserving = self.counters.reserving.load(Relaxed);
        ensure!(
            counted == reserved_total + reserving,
            "reserved counter {counted} but segments add up to {reserved_total} and device \
             allocations under way to {reserving}"
        );
        // Every pool in the sleep book exists (one that ended left it), and each segment that
        // slept is, where it still exists, where the book says.
        let sleeping = self.sleeping_pools();
        {
            let private = self.private.lock();
            for (pool, _) in &sleeping {
                ensure!(
                    private.contains_key(pool),
                    "pool {pool} is in the sleep book but no longer exists"
                );
            }
        }
        for (pool, segments) in &sleeping {
            for slept in segments {
                for locked in &locks {
                    for (slot, segment) in locked.st.segments.iter().enumerate() {
                        let Some(segment) = segment else { continue };
                        ensure!(
                            segment.id() != slept.id
                                || (locked.shard.index == slept.shard && slot == slept.slot),
                            "segment #{} of sleeping pool {pool} is at slot {slot} of shard {}, not where the \
                             sleep book says",
                            slept.id,
                            locked.shard.index
                        );
                    }
                }
            }
        }
        self.check_uncached().map_err(InvariantViolation)?;
        let pending = self.events.lock().outstanding();
        ensure!(
            pending == self.pending.load(Relaxed),
            "pending counter {} but {pending} events outstanding",
            self.pending.load(Relaxed)
        );
        Ok(())
    }
}

/// Checks one shard; returns the bytes it has reserved from the device. `max_split` is the limit the
/// oversize counts were kept against (`None`: several, and they are not checked).
fn check_shard<D: Device>(
    locked: &Locked<'_, D>,
    max_split: Option<usize>,
) -> Result<u64, InvariantViolation> {
    let st = &locked.st;
    // Call stacks of memory history belong to blocks in use (allocated, or freed and waiting for
    // other streams); a free block keeps none.
    for (name, table) in [("stack", &st.stacks), ("free stack", &st.free_stacks)] {
        for &key in table.keys() {
            let index = u32::try_from(key).unwrap_or(u32::MAX);
            ensure!(
                st.blocks.is_live(index) && st.blocks[index].is_active(),
                "a {name} is kept for block {key}, which is not in use"
            );
        }
    }
    for &addr in st.segment_stacks.keys() {
        ensure!(
            st.blocks
                .iter()
                .any(|(_, b)| b.addr == addr && b.prev == NIL && !b.is_expandable()),
            "a segment stack is kept for {addr:#x}, which starts no segment"
        );
    }
    let stream = locked.shard.stream;
    let blocks = &st.blocks;
    // The parked block and its free next neighbour (`NIL` if none): the state is defined as the
    // one with them merged (`allocator/fast`).
    let (parked, parked_next) = st.fast.parked_pair().unwrap_or((NIL, NIL));
    let mut expected = [0i64; FIGURES];
    let mut in_sets = HashSet::new();
    for (p, pool) in st.pools.iter().enumerate() {
        if pool.owner == PoolOwner::Released {
            ensure!(
                pool.free.is_empty() && pool.unmapped.is_empty(),
                "released pool {p} has blocks"
            );
        }
        for (size, addr, index) in pool.free.iter() {
            ensure!(
                blocks.is_live(index),
                "stream {stream}: free set names dead block {index}"
            );
            let b = &blocks[index];
            ensure!(
                (b.size, b.addr) == (size, addr),
                "stream {stream}: free set key ({size}, {addr:#x}) for block ({}, {:#x})",
                b.size,
                b.addr
            );
            ensure!(
                b.pool as usize == p,
                "stream {stream}: block {addr:#x} in the wrong pool"
            );
            ensure!(
                !b.is_active() && b.mapped,
                "stream {stream}: free set holds an active or unmapped block at {addr:#x}"
            );
            ensure!(
                in_sets.insert(index),
                "stream {stream}: block {addr:#x} in two sets"
            );
        }
        for (&addr, &index) in &pool.unmapped {
            ensure!(
                blocks.is_live(index),
                "stream {stream}: unmapped set names dead block"
            );
            let b = &blocks[index];
            ensure!(
                b.addr == addr && !b.mapped && b.is_expandable(),
                "stream {stream}: bad unmapped block {addr:#x}"
            );
            ensure!(
                in_sets.insert(index),
                "stream {stream}: block {addr:#x} in two sets"
            );
        }
    }
    if parked != NIL {
        check_parked(locked, parked, parked_next, &in_sets)?;
    }
    let mut reserved = 0u64;
    let mut allocated_seen = 0usize;
    for (index, b) in blocks.iter() {
        let small = st.pools[b.pool as usize].small;
        let free = !b.is_active();
        ensure!(
            free == (in_sets.contains(&index) || index == parked),
            "stream {stream}: block {:#x} free={free} but in a set={}",
            b.addr,
            in_sets.contains(&index)
        );
        ensure!(
            b.mapped || b.is_expandable(),
            "stream {stream}: unmapped non-expandable block"
        );
        if b.prev != NIL {
            ensure!(blocks.is_live(b.prev), "stream {stream}: dead prev");
            let p = &blocks[b.prev];
            ensure!(
                p.next == index && p.end() == b.addr,
                "stream {stream}: prev of {:#x} disagrees",
                b.addr
            );
            ensure!(
                p.pool == b.pool && p.expandable == b.expandable,
                "stream {stream}: neighbours differ in pool"
            );
            ensure!(
                !(free && policy::may_merge(p, b.mapped))
                    || (b.prev == parked && index == parked_next),
                "stream {stream}: free neighbours {:#x} and {:#x} not merged",
                p.addr,
                b.addr
            );
        }
        if b.next != NIL {
            ensure!(blocks.is_live(b.next), "stream {stream}: dead next");
            let n = &blocks[b.next];
            ensure!(
                n.prev == index && b.end() == n.addr,
                "stream {stream}: next of {:#x} disagrees",
                b.addr
            );
        }
        if b.allocated {
            allocated_seen += 1;
            ensure!(
                !locked.a.pointer_index_on() || st.allocated.get(&b.addr) == Some(&index),
                "stream {stream}: allocated block {:#x} not found by pointer",
                b.addr
            );
            add(&mut expected, Kind::Allocation, small, 1);
            add(&mut expected, Kind::AllocatedBytes, small, b.size);
            if max_split.is_some_and(|m| b.size as usize >= m) {
                expected[OVERSIZE_ALLOCATIONS] += 1;
            }
        }
        // The parked pair counts as the merged block: the next neighbour's bytes in the parked one.
        let (size, split) = if index == parked && parked_next != NIL {
            let n = &blocks[parked_next];
            (b.size + n.size, b.prev != NIL || n.next != NIL)
        } else {
            (b.size, b.is_split())
        };
        if index == parked_next {
            // Counted with the parked block.
        } else if b.is_active() {
            add(&mut expected, Kind::Active, small, 1);
            add(&mut expected, Kind::ActiveBytes, small, b.size);
            add(&mut expected, Kind::RequestedBytes, small, b.requested);
        } else if split && !b.is_expandable() {
            add(&mut expected, Kind::InactiveSplit, small, 1);
            add(&mut expected, Kind::InactiveSplitBytes, small, size);
        }
        if b.mapped {
            reserved += b.size;
            add(&mut expected, Kind::ReservedBytes, small, b.size);
        }
        if b.prev == NIL && !b.is_expandable() {
            add(&mut expected, Kind::Segment, small, 1);
            let mut size = 0;
            let mut at = index;
            while at != NIL {
                size += blocks[at].size;
                at = blocks[at].next;
            }
            if max_split.is_some_and(|m| size as usize >= m) {
                expected[OVERSIZE_SEGMENTS] += 1;
            }
            let route = locked.a.routes.read().get(&b.addr).copied();
            ensure!(
                route.is_some_and(|r| r.end == b.addr + size && r.shard == locked.shard.index),
                "stream {stream}: segment {:#x} ({size} bytes) has no matching route",
                b.addr
            );
        }
    }
    let indexed = if locked.a.pointer_index_on() {
        allocated_seen
    } else {
        0
    };
    ensure!(
        indexed == st.allocated.len(),
        "stream {stream}: {} pointers mapped but {allocated_seen} blocks allocated",
        st.allocated.len()
    );
    for (slot, segment) in st.segments.iter().enumerate() {
        let Some(segment) = segment else { continue };
        let mut covered = 0u64;
        let mut mapped = 0u64;
        let mut small = None;
        for (_, b) in blocks.iter().filter(|(_, b)| b.expandable == slot as u32) {
            small = Some(st.pools[b.pool as usize].small);
            covered += b.size;
            if b.mapped {
                mapped += b.size;
            }
            ensure!(
                b.addr >= segment.base() && b.end() <= segment.base() + segment.size(),
                "stream {stream}: block {:#x} outside its expandable segment",
                b.addr
            );
        }
        ensure!(
            covered == segment.size(),
            "stream {stream}: expandable segment not tiled"
        );
        ensure!(
            mapped == segment.mapped_bytes(),
            "stream {stream}: mapped blocks {mapped} but {} bytes of chunks mapped",
            segment.mapped_bytes()
        );
        // The chunks of a sleeping pool left the reserved statistic when they were released.
        let asleep = segment.asleep_bytes();
        if asleep > 0 {
            expected[peaks::all(Kind::ReservedBytes)] -= asleep as i64;
            expected[peaks::pool(Kind::ReservedBytes, small.unwrap_or(false))] -= asleep as i64;
        }
    }
    for (f, &value) in expected.iter().enumerate() {
        if max_split.is_none() && (f == OVERSIZE_ALLOCATIONS || f == OVERSIZE_SEGMENTS) {
            continue;
        }
        let have = locked.shard.figures.current(f);
        ensure!(
            have == value,
            "stream {stream}: figure {f} is {have}, blocks add up to {value}"
        );
    }
    Ok(reserved)
}

/// The fast path's parked block `parked` (with free next neighbour `next`, or `NIL`), as it is:
/// free and in no set, of a pool the fast path may park in, and a merge (or insertion) the plain
/// free would have made.
fn check_parked<D: Device>(
    locked: &Locked<'_, D>,
    parked: u32,
    next: u32,
    in_sets: &HashSet<u32>,
) -> Result<(), InvariantViolation> {
    let st = &locked.st;
    let stream = locked.shard.stream;
    let blocks = &st.blocks;
    ensure!(
        st.fast.enabled(),
        "stream {stream}: a block is parked with the fast path off"
    );
    ensure!(
        blocks.is_live(parked),
        "stream {stream}: parked block {parked} is dead"
    );
    let b = &blocks[parked];
    ensure!(
        !b.is_active() && b.mapped && !b.is_expandable(),
        "stream {stream}: parked block {:#x} is in use, unmapped or expandable",
        b.addr
    );
    ensure!(
        !in_sets.contains(&parked),
        "stream {stream}: parked block {:#x} is in a free set",
        b.addr
    );
    ensure!(
        b.prev == NIL || !policy::may_merge(&blocks[b.prev], b.mapped),
        "stream {stream}: parked block {:#x} has a free previous neighbour",
        b.addr
    );
    if next == NIL {
        ensure!(
            b.next == NIL || !policy::may_merge(&blocks[b.next], b.mapped),
            "stream {stream}: parked block {:#x} has a free next neighbour it does not name",
            b.addr
        );
    } else {
        ensure!(
            b.next == next && blocks.is_live(next),
            "stream {stream}: parked block {:#x} names {next}, not its next neighbour",
            b.addr
        );
        let n = &blocks[next];
        ensure!(
            policy::may_merge(n, b.mapped) && in_sets.contains(&next) && n.pool == b.pool,
            "stream {stream}: the next neighbour {:#x} of a parked block is not free in its pool",
            n.addr
        );
    }
    Ok(())
}

fn add(expected: &mut [i64; FIGURES], kind: Kind, small: bool, amount: u64) {
    expected[peaks::all(kind)] += amount as i64;
    expected[peaks::pool(kind, small)] += amount as i64;
}
