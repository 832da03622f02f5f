//! Checkpointing a private pool (PyTorch's `getCheckpointState`, `setCheckpointPoolState`,
//! `checkPoolLiveAllocations`), as CUDA graph trees use it.
//!
//! Replaying a captured graph allocates nothing, but the tensors it writes are live; before a new
//! capture branches off after some replays, the pool must look as it did when the replayed graphs
//! were captured, or the new capture would hand out memory those tensors occupy. So the state of the
//! pool (every segment's blocks: address, size, allocated or not) is checkpointed after a capture and
//! restored before the next one: every block the pool has allocated now is freed, and every
//! segment of the checkpoint is cut into the same blocks, the live ones allocated again.

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

/// One segment of a [`PoolCheckpoint`]: its stream and blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SegmentCheckpoint {
    stream: StreamId,
    small: bool,
    blocks: Vec<BlockCheckpoint>,
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
    /// if a block of the pool still waits for other streams, or the pool has expandable segments.
    pub fn get_checkpoint_state(&self, pool: MempoolId) -> Result<PoolCheckpoint> {
        self.check_checkpointable(pool)?;
        let (_guard, locks) = self.lock_all();
        let mut segments = Vec::new();
        for locked in &locks {
            for (head, _) in locked.pool_segment_heads(pool)? {
                let mut blocks = Vec::new();
                let mut at = head;
                while at != NIL {
                    let b = &locked.st.blocks[at];
                    if b.event_count > 0 || b.used_elsewhere {
                        return Err(checkpoint_error(pool, EVENTS_PENDING.to_owned()));
                    }
                    blocks.push(BlockCheckpoint {
                        addr: b.addr,
                        size: b.size,
                        allocated: b.allocated,
                    });
                    at = b.next;
                }
                let small = locked.st.pools[locked.st.blocks[head].pool as usize].small;
                segments.push(SegmentCheckpoint {
                    stream: locked.shard.stream,
                    small,
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
    /// Segments made since the checkpoint stay, free.
    ///
    /// Everything is checked before anything changes: on an error the pool is as it was.
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool does not exist or was released by every user;
    /// [`Error::Checkpoint`] if the checkpoint is another allocator's, a checkpointed segment is gone
    /// or has another size now, or a block of the pool still waits for other streams.
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
        // Check: every checkpointed segment is a whole segment of the pool on its stream now, and no
        // block of the pool waits for other streams.
        let mut placed = Vec::with_capacity(checkpoint.segments.len());
        for segment in &checkpoint.segments {
            let first = segment.blocks[0].addr;
            let total: u64 = segment.blocks.iter().map(|b| b.size).sum();
            let found = locks
                .iter()
                .position(|l| l.shard.stream == segment.stream)
                .and_then(|shard| {
                    let heads = locks[shard].pool_segment_heads(pool).ok()?;
                    let (head, size) = heads
                        .into_iter()
                        .find(|&(h, _)| locks[shard].st.blocks[h].addr == first)?;
                    let small =
                        locks[shard].st.pools[locks[shard].st.blocks[head].pool as usize].small;
                    (size == total && small == segment.small).then_some(shard)
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
            for (head, _) in locked.pool_segment_heads(pool)? {
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
                .pool_segment_heads(pool)?
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
            for (head, _) in locked.pool_segment_heads_any(pool) {
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
    /// The heads of this stream's segments of private pool `pool`, with each segment's size; every
    /// kind of segment.
    fn pool_segment_heads_any(&self, pool: MempoolId) -> Vec<(u32, u64)> {
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

    /// As [`pool_segment_heads_any`](Self::pool_segment_heads_any), refusing expandable segments
    /// (like PyTorch, checkpoints know only whole device allocations).
    fn pool_segment_heads(&self, pool: MempoolId) -> Result<Vec<(u32, u64)>> {
        let heads = self.pool_segment_heads_any(pool);
        if heads
            .iter()
            .any(|&(head, _)| self.st.blocks[head].is_expandable())
        {
            return Err(checkpoint_error(
                pool,
                "the pool has expandable segments, which checkpoints do not cover".to_owned(),
            ));
        }
        Ok(heads)
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
            self.st.blocks[head].next == NIL && !self.st.blocks[head].is_active(),
            "every block of the pool was freed and merged"
        );
        let mut cut = Vec::with_capacity(segment.blocks.len());
        let mut at = head;
        for (i, state) in segment.blocks.iter().enumerate() {
            let split = i + 1 < segment.blocks.len();
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
