//! What another process needs to map an allocation: the device allocation it lies in, or the
//! chunks of the expandable segment under it (PyTorch's `shareIpcHandle`).

use super::CachingAllocator;
use crate::block::NIL;
use crate::device::{Device, DeviceAddress};
use crate::error::{Error, Result};
use crate::expandable::ChunkExport;

/// The memory under an allocated pointer, as another process opens it (see
/// [`CachingAllocator::shareable_segment`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShareableSegment {
    /// A device allocation (`cuMemAlloc`) holding the pointer: shared with `cuIpcGetMemHandle` of
    /// its base.
    Allocation {
        /// The allocation's start.
        base: DeviceAddress,
        /// Its size in bytes.
        size: usize,
    },
    /// The physical chunks of an expandable segment under the allocated block, exported as file
    /// descriptors (PyTorch's handle type `'e'`).
    Chunks(ChunkExport),
}

impl<D: Device> CachingAllocator<D> {
    /// The memory another process must map to use the allocation at `ptr`: its device allocation
    /// (what [`base_allocation`](Self::base_allocation) gives), or, in an expandable segment, the
    /// chunks under the allocated block, each exported once as a file descriptor and kept open
    /// while the chunk stays mapped (at least while `ptr` stays allocated), so that sharing the
    /// same block again names the same descriptors.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidPointer`] if `ptr` is not the start of an allocation of this allocator;
    /// [`Error::Device`] if the device cannot export its chunks
    /// ([`Device::export_physical`]: unsupported on this device or backend, or the driver failed).
    pub fn shareable_segment(&self, ptr: DeviceAddress) -> Result<ShareableSegment> {
        self.enable_pointer_index();
        let Some(shard) = self.route(ptr) else {
            // An allocation made while caching was off: a device allocation of its own.
            let (base, size) = self
                .uncached_allocation(ptr)
                .ok_or(Error::InvalidPointer { ptr })?;
            return Ok(ShareableSegment::Allocation { base, size });
        };
        let mut st = shard.lock_settled();
        let &index = st
            .allocated
            .get(&ptr.0)
            .ok_or(Error::InvalidPointer { ptr })?;
        let block = &st.blocks[index];
        if !block.is_expandable() {
            drop(st);
            let (base, size) = self.base_allocation(ptr)?;
            return Ok(ShareableSegment::Allocation { base, size });
        }
        let (addr, size, slot) = (block.addr, block.size, block.expandable);
        debug_assert_ne!(slot, NIL);
        let segment = st.segments[slot as usize]
            .as_mut()
            .expect("an expandable block's segment is live");
        let export = segment.export(self.device(), addr, size)?;
        tracing::debug!(
            target: "tensormem_cuda_alloc",
            %ptr,
            chunks = export.fds.len(),
            chunk_size = export.chunk_size,
            "exported the chunks under an expandable block"
        );
        Ok(ShareableSegment::Chunks(export))
    }
}
