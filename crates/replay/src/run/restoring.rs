//! Checkpoint restores of CUDA graph trees while a plan is replayed: the checkpoints taken where the
//! recorded pool may have been in the state a restore returns it to, and the restore applied through
//! the allocator's checkpoint API when one agrees with the trace.

use std::collections::{HashMap, HashSet};

use super::Replayer;
use crate::plan::RestorePlan;
use crate::pools::PoolRun;
use crate::ReplayDevice;
use tensormem_cuda_alloc::device::DeviceAddress;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, PoolCheckpoint};

impl Replayer<'_, '_> {
    /// The pool of restore `restore` may be in the state it returns to: a checkpoint of it, kept
    /// for the restore.
    pub(super) fn checkpoint(&mut self, restore: usize) {
        if let Some(pool) = self.pools.restored_pool(&self.plan.restores[restore]) {
            if let Ok(checkpoint) = self.allocator.get_checkpoint_state(pool) {
                self.checkpoints[restore].push(checkpoint);
            }
        }
    }

    /// Restore `restore` starts: the pool returns to the latest checkpoint that agrees with it, if
    /// one does (the blocks of a restore before it that no allocation claimed are given up).
    pub(super) fn restore(&mut self, restore: usize) {
        if let Some(mut done) = self.restoring.take() {
            self.strays.extend(done.live.drain().map(|(_, a)| a));
        }
        let candidates = std::mem::take(&mut self.checkpoints[restore]);
        let plan = &self.plan.restores[restore];
        self.restoring = apply_restore(&self.allocator, self.pools, plan, &candidates);
        match (&self.restoring, self.pools.restored_pool(plan)) {
            (Some(_), _) => self.restores.applied += 1,
            (None, Some(_)) => self.restores.not_applied += 1,
            // Graph trees restore private pools only: blocks cut like a restore's in segments of
            // the default pools were ordinary requests.
            (None, None) => {}
        }
    }
}

/// Checkpoint restores of CUDA graph trees (`setCheckpointPoolState`) a device's trace shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreCount {
    /// Restores the replay made through the allocator's checkpoint API.
    pub applied: u64,
    /// Restores replayed as ordinary allocations: no checkpoint the replay took agreed with the
    /// trace (or the pool could not be checkpointed: expandable segments). Runs of events shaped
    /// like a restore in segments that are not one private pool's are not counted.
    pub not_applied: u64,
}

/// A restore in progress: the blocks it made, claimed by the recorded allocations of its events.
pub(super) struct Restoring {
    /// One past its last event.
    pub(super) end: u32,
    /// Blocks live in the checkpoint, by address.
    pub(super) live: HashMap<u64, Allocation>,
    /// The blocks free in the checkpoint, by address (made and freed again by the restore).
    pub(super) free: HashSet<u64>,
}

/// What a restore made at one recorded allocation's address.
pub(super) enum Restored {
    Live(Allocation),
    Free,
    Missing,
}

impl Restoring {
    pub(super) fn take(&mut self, addr: u64) -> Restored {
        if let Some(a) = self.live.remove(&addr) {
            Restored::Live(a)
        } else if self.free.contains(&addr) {
            Restored::Free
        } else {
            Restored::Missing
        }
    }
}

/// Restores the pool of `restore` to the latest of `candidates` that agrees with it: the same
/// pool, as many segments, the same live blocks. Only a private pool with nothing allocated is
/// restored (its blocks were freed by the events before the restore, as PyTorch frees them).
/// `None` when none applies: the restore's events are then replayed as requests.
fn apply_restore(
    allocator: &CachingAllocator<ReplayDevice>,
    pools: &PoolRun,
    restore: &RestorePlan,
    candidates: &[PoolCheckpoint],
) -> Option<Restoring> {
    let pool = pools.restored_pool(restore)?;
    if !allocator
        .check_pool_live_allocations(pool, &HashSet::new())
        .unwrap_or(false)
    {
        return None;
    }
    let live: Vec<DeviceAddress> = restore
        .live
        .iter()
        .map(|&(addr, _)| DeviceAddress(addr))
        .collect();
    let checkpoint = candidates.iter().rev().find(|c| {
        c.pool() == pool
            && c.segment_count() == restore.instances.len()
            && c.live_allocations() == live
    })?;
    let delta = match allocator.set_checkpoint_pool_state(checkpoint) {
        Ok(delta) => delta,
        Err(e) => {
            tracing::debug!(%pool, error = %e, "a checkpoint restore was refused");
            return None;
        }
    };
    let live: HashMap<u64, Allocation> =
        delta.created.into_iter().map(|a| (a.ptr().0, a)).collect();
    let exact = live.len() == restore.live.len()
        && restore
            .live
            .iter()
            .all(|&(addr, size)| live.get(&addr).is_some_and(|a| a.size() as u64 == size));
    Some(Restoring {
        end: restore.end,
        live,
        // Blocks free in the checkpoint are known to sit where the trace has them only when the
        // live ones do.
        free: if exact {
            restore.free.iter().copied().collect()
        } else {
            HashSet::new()
        },
    })
}
