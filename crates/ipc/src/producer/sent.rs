//! What the producer keeps of each shared allocation: the allocation, and the slots consumers may
//! still hold it by ([`Sent`], [`SentSlot`]), pruned as consumers release them, die, or never open
//! them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensormem_cuda_alloc::{Allocation, CachingAllocator, Device};

use super::events::EventGuard;
use crate::driver::IpcDriver;
use crate::refcounter::RefCounterFile;

/// One share: a slot of a file, and the event the consumer waits on.
///
/// The slot of a batch is held by every allocation of the batch (one `SentSlot` each, sharing the
/// file, the slot and the event): each is pruned when the consumer releases the slot or the
/// producer reclaims it, and the event goes back to the pool with the last of them.
pub(super) struct SentSlot<B: IpcDriver> {
    pub(super) file: Arc<RefCounterFile>,
    pub(super) slot: usize,
    pub(super) _event: Option<Arc<EventGuard<B>>>,
    /// When it was handed out, and how long it may stay unclaimed once its memory is freed here.
    pub(super) shared_at: Instant,
    pub(super) expires: Option<Duration>,
}

/// An allocation that was shared, with its outstanding slots.
pub(super) struct Sent<D: Device, B: IpcDriver> {
    pub(super) allocation: Allocation,
    pub(super) allocator: Arc<CachingAllocator<D>>,
    pub(super) slots: Vec<SentSlot<B>>,
}

impl<D: Device, B: IpcDriver> Sent<D, B> {
    /// Drops the slots consumers released (and, with `reclaim`, those of dead consumers); returns how
    /// many were reclaimed.
    pub(super) fn prune(&mut self, reclaim: bool) -> usize {
        let mut reclaimed = 0;
        self.slots.retain(|s| {
            match s.file.value(s.slot) {
                Ok(value) if value <= 0 => return false,
                Ok(_) => {}
                Err(err) => {
                    // Another process truncated the file: the consumer's release can never be
                    // seen, so the memory stays held (never reused) rather than freed under it.
                    tracing::warn!(
                        target: "tensormem_ipc",
                        %err,
                        slot = s.slot,
                        "a ref-counter file was truncated by another process; its memory stays held"
                    );
                    return true;
                }
            }
            if reclaim {
                if let Some(owner) = s.file.reclaim_if_owner_dead(s.slot) {
                    tracing::warn!(
                        target: "tensormem_ipc",
                        pid = owner.pid,
                        file = %s.file.name(),
                        slot = s.slot,
                        "a consumer process died holding shared CUDA memory; its reference was reclaimed"
                    );
                    reclaimed += 1;
                    return false;
                }
                if s.expires.is_some_and(|limit| s.shared_at.elapsed() >= limit)
                    && s.file.expire_if_unclaimed(s.slot)
                {
                    tracing::warn!(
                        target: "tensormem_ipc",
                        file = %s.file.name(),
                        slot = s.slot,
                        after_s = s.shared_at.elapsed().as_secs_f64(),
                        "a share was never opened (or its consumer died opening it); its memory \
                         was given back and a late open will be refused"
                    );
                    reclaimed += 1;
                    return false;
                }
            }
            true
        });
        reclaimed
    }

    pub(super) fn free(self) {
        let ptr = self.allocation.ptr();
        drop(self.slots);
        if let Err(err) = self.allocator.free(self.allocation) {
            tracing::error!(target: "tensormem_ipc", %ptr, %err, "freeing a shared allocation failed");
        }
    }
}
