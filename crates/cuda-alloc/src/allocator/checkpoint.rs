//! Checkpointing a private pool (PyTorch's `getCheckpointState`, `setCheckpointPoolState`,
//! `checkPoolLiveAllocations`), as CUDA graph trees use it.
//!
//! Replaying a captured graph allocates nothing, but the tensors it writes are live; before a new
//! capture branches off after some replays, the pool must look as it did when the replayed graphs
//! were captured, or the new capture would hand out memory those tensors occupy. So the state of the
//! pool (every segment's blocks: address, size, allocated or not) is checkpointed after a capture and
//! restored before the next one: every block the pool has allocated now is freed, and every
//! segment of the checkpoint is cut into the same blocks, the live ones allocated again.
//!
//! An expandable segment is checkpointed as its mapped blocks, from its first byte up to the
//! unmapped address space after them (the segment's last block, which a restore leaves as it is),
//! as PyTorch does; a restore needs the segment mapped exactly that far again.

use std::collections::HashSet;

use super::alloc::Source;
use super::{Allocation, CachingAllocator, Locked};
use crate::block::NIL;
use crate::device::{Device, DeviceAddress, StreamId};
use crate::error::{Error, Result};
use crate::pool_id::MempoolId;

/// The state of a private pool's blocks at one moment ([`CachingAllocator::get_checkpoint_state`];
/// PyTorch's `PrivatePoolState`), to return the pool to it later
/// ([`CachingAllocator::set_checkpoint_pool_state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolCheckpoint {
    pool: MempoolId,
    /// The allocator it was taken from (checked on restore).
    allocator: u32,
    /// Segments by address.
    segments: Vec<SegmentCheckpoint>,
}

/// One segment of a [`PoolCheckpoint`]: its stream and blocks in address order (of an expandable
/// segment, the mapped ones).
#[derive(Clone, Debug, PartialEq, Eq)]
struct SegmentCheckpoint {
    stream: StreamId,
    small: bool,
    expandable: bool,
    blocks: Vec<BlockCheckpoint>,
}

impl SegmentCheckpoint {
    /// The bytes the checkpointed blocks cover.
    fn size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }
}

/// One block of a segment checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BlockCheckpoint {
    addr: u64,
    size: u64,
    allocated: bool,
}

impl PoolCheckpoint {
    /// The private pool checkpointed.
    #[must_use]
    pub fn pool(&self) -> MempoolId {
        self.pool
    }

    /// The number of segments the pool had.
    #[must_use]
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The addresses of the blocks that were allocated, in address order.
    #[must_use]
    pub fn live_allocations(&self) -> Vec<DeviceAddress> {
        self.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.allocated)
            .map(|b| DeviceAddress(b.addr))
            .collect()
    }
}

/// What [`CachingAllocator::set_checkpoint_pool_state`] changed (PyTorch's `CheckpointDelta`).
#[derive(Debug)]
#[non_exhaustive]
pub struct CheckpointDelta {
    /// Every block of the pool that was allocated before the restore: all were freed, and the handles
    /// and pointers of the callers that held them are no longer valid (those of blocks allocated again
    /// are in [`created`](Self::created)).
    pub freed: Vec<DeviceAddress>,
    /// The blocks allocated in the checkpoint, allocated again, as new handles, in address order.
    pub created: Vec<Allocation>,
}

/// The message PyTorch gives when a block has outstanding stream uses.
/// Why an expandable segment with mapped memory after an unmapped gap is not checkpointed.
const MAPPED_AFTER_GAP: &str =
    "an expandable segment of the pool has mapped memory after an unmapped gap, which a \
     checkpoint cannot cut again";

/// The message PyTorch gives when a block has outstanding stream uses.
const EVENTS_PENDING: &str =
    "Events should have synchronized when checkpointing or setting a checkpointed block: a block of \
     the pool is still used by another stream (record_stream) or waits for its events; synchronize \
     those streams first";

impl<D: Device> CachingAllocator<D> {
    /// The state of private pool `pool`'s blocks (PyTorch's `getCheckpointState`), to return the pool to
    /// it with [`set_checkpoint_pool_state`](Self::set_checkpoint_pool_state).
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool does not exist or was released by every user; [`Error::Checkpoint`]
    /// if a block of the pool still waits for other streams, or an expandable segment of the pool
    /// has mapped memory after an unmapped gap (which a restore could not cut again).
    pub fn get_checkpoint_state(&self, pool: MempoolId) -> Result<PoolCheckpoint> {
        self.check_checkpointable(pool)?;
        let (_guard, locks) = self.lock_all();
        let mut segments = Vec::new();
        for locked in &locks {
            for (head, _) in locked.pool_segment_heads(pool) {
                let expandable = locked.st.blocks[head].is_expandable();
                let mapped = locked.mapped_prefix(head);
                if mapped.is_empty() {
                    // An expandable segment with nothing mapped at its start: PyTorch's checkpoints
                    // know only segments whose first block is mapped.
                    if locked.mapped_after(head) {
                        return Err(checkpoint_error(pool, MAPPED_AFTER_GAP.to_owned()));
                    }
                    continue;
                }
                if expandable && locked.mapped_after(*mapped.last().expect("not empty")) {
                    return Err(checkpoint_error(pool, MAPPED_AFTER_GAP.to_owned()));
                }
                let mut blocks = Vec::with_capacity(mapped.len());
                for index in mapped {
                    let b = &locked.st.blocks[index];
                    if b.event_count > 0 || b.used_elsewhere {
                        return Err(checkpoint_error(pool, EVENTS_PENDING.to_owned()));
                    }
                    blocks.push(BlockCheckpoint {
                        addr: b.addr,
                        size: b.size,
                        allocated: b.allocated,
                    });
                }
                let small = locked.st.pools[locked.st.blocks[head].pool as usize].small;
                segments.push(SegmentCheckpoint {
                    stream: locked.shard.stream,
                    small,
                    expandable,
                    blocks,
                });
            }
        }
        segments.sort_by_key(|s| s.blocks[0].addr);
        Ok(PoolCheckpoint {
            pool,
            allocator: self.id,
            segments,
        })
    }

    /// Returns private pool `checkpoint.pool()` to the checkpointed state (PyTorch's
    /// `setCheckpointPoolState`): frees every block the pool has allocated now, then cuts every
    /// checkpointed segment into the checkpointed blocks and allocates those that were allocated.
    /// Segments made since the checkpoint stay, free. An expandable segment is cut where it is
    /// mapped; its unmapped rest stays as it is.
    ///
    /// Everything is checked before anything changes: on an error the pool is as it was.
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool does not exist or was released by every user;
    /// [`Error::Checkpoint`] if the checkpoint is another allocator's, a checkpointed segment is gone
    /// or has another size now (an expandable one: is mapped to another extent, or has mapped memory
    /// after an unmapped gap), or a block of the pool still waits for other streams;
    /// [`Error::Sleep`] if the pool is asleep ([`sleep_pool`](Self::sleep_pool): its memory is
    /// unmapped; wake it first).
    pub fn set_checkpoint_pool_state(
        &self,
        checkpoint: &PoolCheckpoint,
    ) -> Result<CheckpointDelta> {
        let pool = checkpoint.pool;
        if checkpoint.allocator != self.id {
            return Err(checkpoint_error(
                pool,
                format!(
                    "the checkpoint was taken on allocator #{}, not this one (#{})",
                    checkpoint.allocator, self.id
                ),
            ));
        }
        self.check_checkpointable(pool)?;
        let (_guard, mut locks) = self.lock_all();
        // A sleeping pool's memory is unmapped: re-created allocations would point at nothing.
        // Checked with every lock held, so that no sleep or wake runs meanwhile.
        self.refuse_if_asleep(pool)?;
        // Check: every checkpointed segment is a whole segment of the pool on its stream now, and no
        // block of the pool waits for other streams.
        let mut placed = Vec::with_capacity(checkpoint.segments.len());
        for segment in &checkpoint.segments {
            let first = segment.blocks[0].addr;
            let total = segment.size();
            let found = locks
                .iter()
                .position(|l| l.shard.stream == segment.stream)
                .and_then(|shard| {
                    let locked = &locks[shard];
                    let (head, size) = locked
                        .pool_segment_heads(pool)
                        .into_iter()
                        .find(|&(h, _)| locked.st.blocks[h].addr == first)?;
                    let b = &locked.st.blocks[head];
                    let small = locked.st.pools[b.pool as usize].small;
                    let size = if b.is_expandable() {
                        let mapped = locked.mapped_prefix(head);
                        let last = *mapped.last()?;
                        if locked.mapped_after(last) {
                            return None;
                        }
                        mapped.iter().map(|&i| locked.st.blocks[i].size).sum()
                    } else {
                        size
                    };
                    (size == total
                        && small == segment.small
                        && b.is_expandable() == segment.expandable)
                        .then_some(shard)
                });
            let Some(shard) = found else {
                return Err(checkpoint_error(
                    pool,
                    format!(
                        "could not find the checkpointed segment at {} ({total} bytes on stream {}) \
                         in the pool",
                        DeviceAddress(first),
                        segment.stream
                    ),
                ));
            };
            placed.push(shard);
        }
        for locked in &locks {
            for (head, _) in locked.pool_segment_heads(pool) {
                let mut at = head;
                while at != NIL {
                    let b = &locked.st.blocks[at];
                    if b.event_count > 0 || b.used_elsewhere {
                        return Err(checkpoint_error(pool, EVENTS_PENDING.to_owned()));
                    }
                    at = b.next;
                }
            }
        }
        // Free every allocated block of the pool.
        let mut freed = Vec::new();
        for locked in &mut locks {
            let allocated: Vec<u32> = locked
                .pool_segment_heads(pool)
                .into_iter()
                .flat_map(|(head, _)| locked.segment_blocks(head))
                .filter(|&i| locked.st.blocks[i].allocated)
                .collect();
            for index in allocated {
                let addr = locked.st.blocks[index].addr;
                if self.pointer_index_on() {
                    locked.st.allocated.forget(addr);
                }
                locked.free_allocated::<false>(index, None)?;
                freed.push(DeviceAddress(addr));
            }
        }
        freed.sort();
        // Cut the checkpointed segments again and allocate what was allocated.
        let mut created = Vec::new();
        for (segment, &shard) in checkpoint.segments.iter().zip(&placed) {
            let locked = &mut locks[shard];
            created.extend(locked.restore_segment(segment)?);
        }
        created.sort_by_key(Allocation::ptr);
        Ok(CheckpointDelta { freed, created })
    }

    /// Whether the blocks private pool `pool` has allocated are exactly `expected` (PyTorch's
    /// `checkPoolLiveAllocations`).
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool does not exist.
    pub fn check_pool_live_allocations(
        &self,
        pool: MempoolId,
        expected: &HashSet<DeviceAddress>,
    ) -> Result<bool> {
        if !self.private.lock().contains_key(&pool) {
            return Err(Error::Pool {
                pool,
                message: "Could not find pool of id",
            });
        }
        let (_guard, locks) = self.lock_all();
        let mut live = 0usize;
        for locked in &locks {
            for (head, _) in locked.pool_segment_heads(pool) {
                for index in locked.segment_blocks(head) {
                    let b = &locked.st.blocks[index];
                    if b.allocated {
                        if !expected.contains(&DeviceAddress(b.addr)) {
                            return Ok(false);
                        }
                        live += 1;
                    }
                }
            }
        }
        Ok(live == expected.len())
    }

    /// `Ok` if `pool` exists and some user still holds it (PyTorch's checks and messages).
    fn check_checkpointable(&self, pool: MempoolId) -> Result<()> {
        match self.private.lock().get(&pool) {
            None => Err(Error::Pool {
                pool,
                message: "Could not find pool of id",
            }),
            Some(p) if p.use_count <= 0 => Err(Error::Pool {
                pool,
                message: "Not expected to checkpoint freeable graph",
            }),
            Some(_) => Ok(()),
        }
    }
}

fn checkpoint_error(pool: MempoolId, reason: String) -> Error {
    Error::Checkpoint { pool, reason }
}

impl<D: Device> Locked<'_, D> {
    /// The heads of this stream's segments of private pool `pool`, with each segment's size (of an
    /// expandable segment, its whole reserved range).
    fn pool_segment_heads(&self, pool: MempoolId) -> Vec<(u32, u64)> {
        let parts = [
            self.st.private_pool(pool, true),
            self.st.private_pool(pool, false),
        ];
        self.st
            .blocks
            .iter()
            .filter(|(_, b)| b.prev == NIL && parts.contains(&Some(b.pool)))
            .map(|(index, _)| {
                let size = self
                    .segment_blocks(index)
                    .into_iter()
                    .map(|i| self.st.blocks[i].size)
                    .sum();
                (index, size)
            })
            .collect()
    }

    /// The mapped blocks of the segment starting at `head`, from its first byte up to its first
    /// unmapped block (every block of a segment that is not expandable).
    fn mapped_prefix(&self, head: u32) -> Vec<u32> {
        let mut blocks = Vec::new();
        let mut at = head;
        while at != NIL && self.st.blocks[at].mapped {
            blocks.push(at);
            at = self.st.blocks[at].next;
        }
        blocks
    }

    /// Whether a block after `index` in its segment is mapped.
    fn mapped_after(&self, index: u32) -> bool {
        let mut at = self.st.blocks[index].next;
        while at != NIL {
            if self.st.blocks[at].mapped {
                return true;
            }
            at = self.st.blocks[at].next;
        }
        false
    }

    /// The blocks of the segment starting at `head`, in address order.
    fn segment_blocks(&self, head: u32) -> Vec<u32> {
        let mut blocks = Vec::new();
        let mut at = head;
        while at != NIL {
            blocks.push(at);
            at = self.st.blocks[at].next;
        }
        blocks
    }

    /// Cuts the (wholly free) segment `segment` describes into its blocks and allocates those the
    /// checkpoint has allocated (PyTorch's `setSegmentStateToCheckpoint`). The caller checked that the
    /// segment is there with the same size.
    fn restore_segment(&mut self, segment: &SegmentCheckpoint) -> Result<Vec<Allocation>> {
        let first = segment.blocks[0].addr;
        let (head, pool) = self
            .st
            .blocks
            .iter()
            .find(|(_, b)| b.addr == first && b.prev == NIL)
            .map(|(i, b)| (i, b.pool))
            .expect("checked before anything changed");
        debug_assert!(
            !self.st.blocks[head].is_active()
                && self.st.blocks[head].size == segment.size()
                && (self.st.blocks[head].next == NIL
                    || !self.st.blocks[self.st.blocks[head].next].mapped),
            "every block of the pool was freed and merged"
        );
        let mut cut = Vec::with_capacity(segment.blocks.len());
        let mut at = head;
        for state in &segment.blocks {
            // The block left is as large as the rest of the checkpointed blocks: it is cut while
            // it is larger than the next one.
            let split = self.st.blocks[at].size > state.size;
            let index = self.alloc_found_block::<false>(
                pool,
                at,
                state.size,
                state.size,
                split,
                Source::Free(None),
                None,
            );
            debug_assert_eq!(
                (self.st.blocks[index].addr, self.st.blocks[index].size),
                (state.addr, state.size)
            );
            at = self.st.blocks[index].next;
            cut.push(index);
        }
        let mut created = Vec::new();
        for (&index, state) in cut.iter().zip(&segment.blocks) {
            if state.allocated {
                let b = &self.st.blocks[index];
                created.push(Allocation {
                    ptr: DeviceAddress(b.addr),
                    allocator: self.a.id,
                    size: b.size as usize,
                    requested: b.requested as usize,
                    stream: self.shard.stream,
                    shard: self.shard.index,
                    block: index,
                    generation: b.generation,
                });
            } else {
                if self.a.pointer_index_on() {
                    let addr = self.st.blocks[index].addr;
                    self.st.allocated.forget(addr);
                }
                self.free_allocated::<false>(index, None)?;
            }
        }
        Ok(created)
    }
}
