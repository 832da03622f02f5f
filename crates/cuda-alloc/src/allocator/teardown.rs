//! Dropping an allocator: every segment, cached or not, and every allocation made while caching was
//! off goes back to the device.

use std::sync::atomic::Ordering::Relaxed;

use super::CachingAllocator;
use crate::block::NIL;
use crate::device::{Device, DeviceAddress};

impl<D: Device> Drop for CachingAllocator<D> {
    /// Waits for the device, then returns every device allocation and expandable segment (chunks
    /// unmapped, address ranges released) and destroys every event. Errors met on the way cannot be
    /// returned: each goes to [`Device::record_error`] for a later check (the CUDA backend keeps it
    /// for `CudaBackend::check_err` and in the cudarc context's error slot), and the rest is still
    /// released. An allocator that never reserved memory makes no device call.
    fn drop(&mut self) {
        let holds_memory = self.uncached.lock().holds_memory()
            || self.streams.iter().any(|shard| {
                let st = shard.state.lock();
                st.blocks.iter().next().is_some() || st.segments.iter().any(Option::is_some)
            });
        if !holds_memory {
            return;
        }
        let mut errors = Vec::new();
        // Memory may still be in use by queued work (blocks freed with pending events, or allocations
        // never freed whose kernels still run): wait for all of it first.
        if let Err(e) = self.device.synchronize() {
            errors.push(e);
        }
        // Pending events are moot once the device is idle; dropping them destroys them.
        drop(std::mem::take(&mut *self.events.lock()));
        self.pending.store(0, Relaxed);
        // Allocations made while caching was off, live or waiting for other streams.
        for (addr, size) in self.uncached.lock().take_all() {
            // SAFETY: each came from `malloc` with this size and is freed once (the table forgot
            // them all), after the device was synchronized, so no queued work uses it.
            if let Err(e) = unsafe { self.device.free(DeviceAddress(addr), size as usize) } {
                errors.push(e);
            }
        }
        for shard in self.streams.iter() {
            let mut st = shard.lock_settled();
            let heads: Vec<(u64, u64, u16)> = st
                .blocks
                .iter()
                .filter(|(_, b)| b.prev == NIL && !b.is_expandable())
                .map(|(index, head)| {
                    let mut size = 0;
                    let mut at = index;
                    while at != NIL {
                        size += st.blocks[at].size;
                        at = st.blocks[at].next;
                    }
                    (head.addr, size, head.pool)
                })
                .collect();
            for (addr, size, pool) in heads {
                if let Some(own) = st.pools[pool as usize].allocator.clone() {
                    // SAFETY: as below, a segment of the pool's own allocator.
                    if let Err(e) = unsafe { own.free(DeviceAddress(addr), size as usize) } {
                        errors.push(e);
                    }
                    self.counters.reserved.fetch_sub(size, Relaxed);
                    continue;
                }
                // SAFETY: a block with no predecessor outside expandable segments starts a device
                // allocation made by `malloc` at `addr`, and its chain of blocks covers exactly the
                // `size` bytes allocated; each is freed once (the allocator is going away and forgets
                // them), after the device was synchronized, so no queued work uses them.
                if let Err(e) = unsafe { self.device.free(DeviceAddress(addr), size as usize) } {
                    errors.push(e);
                }
                self.counters.reserved.fetch_sub(size, Relaxed);
            }
            for segment in st.segments.drain(..).flatten() {
                self.counters
                    .reserved
                    .fetch_sub(segment.mapped_bytes(), Relaxed);
                errors.extend(segment.tear_down(&self.device));
            }
        }
        if !errors.is_empty() {
            tracing::warn!(
                errors = errors.len(),
                device = self.device.index(),
                "releasing device memory while dropping a caching allocator failed"
            );
        }
        for error in errors {
            self.device.record_error(error);
        }
    }
}
