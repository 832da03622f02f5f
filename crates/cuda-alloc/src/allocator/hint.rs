//! The calling thread's last shard, a hint for calls that name memory by pointer.
//!
//! `raw_free` gets only a pointer. Finding its stream through the device-wide segment map takes a
//! shared read lock (a write to one cache line by every thread) and a tree walk; but a thread almost
//! always frees what it allocated, on the stream it allocated on. So each thread remembers the shard
//! of its last pointer-based allocation, and `raw_free` looks the pointer up there first. The hint is
//! only a hint: a pointer found in a shard's index of allocated blocks belongs to that shard (allocated
//! blocks never overlap), and a miss falls back to the segment map.

use std::cell::Cell;

use super::shard::Shard;
use super::CachingAllocator;
use crate::device::Device;

thread_local! {
    /// `(allocator id, shard index)` of this thread's last pointer-based allocation (allocator ids
    /// start at 1).
    static LAST_SHARD: Cell<(u32, u32)> = const { Cell::new((0, u32::MAX)) };
}

impl<D: Device> CachingAllocator<D> {
    /// This allocator's identity in the thread-local hint (its process-unique id).
    #[inline]
    fn hint_id(&self) -> u32 {
        self.id
    }

    /// Remembers shard `index` as this thread's last one.
    #[inline]
    pub(crate) fn remember_shard(&self, index: u32) {
        let id = self.hint_id();
        LAST_SHARD.with(|last| {
            if last.get() != (id, index) {
                last.set((id, index));
            }
        });
    }

    /// This thread's last shard of this allocator, if any.
    #[inline]
    pub(crate) fn remembered_shard(&self) -> Option<&Shard<D>> {
        let (id, index) = LAST_SHARD.with(Cell::get);
        if id != self.hint_id() {
            return None;
        }
        self.streams.by_index(index)
    }
}
