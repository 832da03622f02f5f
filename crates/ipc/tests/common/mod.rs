//! Helpers shared by the IPC crate's integration tests: memory of expandable segments on the
//! simulated device, and which simulated chunks lie under it.
#![allow(dead_code, unreachable_pub)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use tensormem_cuda_alloc::backend::sim::{ExportedSimChunk, SimChunk, SimDevice};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{CachingAllocator, DeviceAddress, ShareableSegment};
use tensormem_ipc::{ChunkFdRoutes, ChunkHandle};

/// An allocator with expandable segments (chunks of 2 MiB in the small pool, 20 MiB in the large
/// one) on a simulated device of 8 GiB.
pub fn expandable_allocator() -> Arc<CachingAllocator<SimDevice>> {
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    Arc::new(CachingAllocator::with_config(
        SimDevice::new(8 << 30),
        config,
    ))
}

/// The chunks under an allocation of an expandable segment, as this process holds them.
pub struct Chunks {
    /// Where the first starts.
    pub base: DeviceAddress,
    /// The size of each.
    pub chunk_size: usize,
    /// A copy of each one's descriptor, in address order.
    pub fds: Vec<OwnedFd>,
}

impl Chunks {
    /// The descriptors, borrowed (what `FakeDriver::add_chunks` takes).
    pub fn borrowed(&self) -> Vec<BorrowedFd<'_>> {
        self.fds.iter().map(AsFd::as_fd).collect()
    }

    /// What each chunk is on the simulated device (its device and id): what a consumer's mapping
    /// must alias.
    pub fn ids(&self) -> Vec<ExportedSimChunk> {
        self.fds
            .iter()
            .map(|fd| SimChunk::read_exported(fd.as_fd()).unwrap())
            .collect()
    }
}

/// The chunks under the allocation at `ptr` of `allocator` (expandable segments), their
/// descriptors copied from this process the way a consumer takes them.
pub fn chunks_under(allocator: &CachingAllocator<SimDevice>, ptr: DeviceAddress) -> Chunks {
    let ShareableSegment::Chunks(export) = allocator.shareable_segment(ptr).unwrap() else {
        panic!("{ptr} is not memory of an expandable segment");
    };
    let handle = ChunkHandle {
        pid: std::process::id(),
        chunk_size: export.chunk_size,
        fds: export.fds,
    };
    // For the socket, where pidfd_getfd is not allowed.
    tensormem_ipc::chunks::offer(&handle.fds);
    let (fds, _) = handle.take_descriptors(ChunkFdRoutes::Auto).unwrap();
    Chunks {
        base: export.base,
        chunk_size: export.chunk_size as usize,
        fds,
    }
}
