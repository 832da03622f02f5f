//! Where pinned host memory comes from: [`PinnedSource`] and the plain-heap source for machines
//! without a GPU.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::device::{DeviceError, DeviceResult};

/// The alignment of host blocks: a page, as `cudaHostAlloc` and `cudaHostRegister` give.
pub const HOST_ALIGNMENT: usize = 4096;

/// A provider of page-locked host memory for [`HostCachingAllocator`](super::HostCachingAllocator):
/// `cuMemHostAlloc`, `malloc` + `cuMemHostRegister` (the CUDA backend's `CudaPinnedSource`), or plain
/// heap memory ([`HeapSource`]) where there is no GPU.
///
/// # Safety
///
/// Implementors guarantee that memory returned by [`alloc`](Self::alloc) is valid for reads and writes
/// of `size` bytes, aligned to [`HOST_ALIGNMENT`], and handed out again only after it was passed to
/// [`free`](Self::free); and that no method calls back into the allocator using it.
pub unsafe trait PinnedSource: Send + Sync + std::fmt::Debug + 'static {
    /// Allocates `size` bytes (a multiple of [`HOST_ALIGNMENT`]: a power of two, or a whole number
    /// of pages above `pinned_max_round_threshold_mb`).
    ///
    /// # Errors
    /// [`DeviceError::OutOfMemory`] when the system has no memory to lock; driver errors.
    fn alloc(&self, size: usize) -> DeviceResult<NonNull<u8>>;

    /// Returns memory from [`alloc`](Self::alloc).
    ///
    /// # Safety
    /// `ptr` came from `alloc` on this source with this `size`, is freed once, and nothing (host code or
    /// queued device work) uses it any more.
    unsafe fn free(&self, ptr: NonNull<u8>, size: usize) -> DeviceResult<()>;

    /// How this source names itself in logs (`"cuMemHostAlloc"`, ...).
    fn name(&self) -> &'static str;
}

/// Heap memory (`std::alloc`, page-aligned), not page-locked: the host allocator's source on
/// machines without a GPU, and with the simulated device in tests.
#[derive(Debug, Default, Clone, Copy)]
pub struct HeapSource;

// SAFETY: `alloc` returns a fresh `std::alloc` allocation of `size` bytes aligned to a page, owned
// until `free` deallocates it with the same layout; nothing calls back into an allocator.
unsafe impl PinnedSource for HeapSource {
    fn alloc(&self, size: usize) -> DeviceResult<NonNull<u8>> {
        let layout = layout(size)?;
        // SAFETY: the layout has a non-zero size (callers pass at least a page).
        let ptr = unsafe { std::alloc::alloc(layout) };
        NonNull::new(ptr).ok_or(DeviceError::OutOfMemory { bytes: size as u64 })
    }

    unsafe fn free(&self, ptr: NonNull<u8>, size: usize) -> DeviceResult<()> {
        let layout = layout(size)?;
        // SAFETY: the caller guarantees `ptr` came from `alloc` with this size, hence this layout.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        Ok(())
    }

    fn name(&self) -> &'static str {
        "heap"
    }
}

/// The page-aligned layout of `size` bytes.
pub(crate) fn layout(size: usize) -> DeviceResult<Layout> {
    Layout::from_size_align(size.max(1), HOST_ALIGNMENT)
        .map_err(|_| DeviceError::OutOfMemory { bytes: size as u64 })
}
