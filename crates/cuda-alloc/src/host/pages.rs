//! Host memory the process maps itself: anonymous mappings advised to use transparent huge pages
//! for sizes of [`HUGE_PAGE`] and more (a 2 MiB page is faulted in at once instead of 512 small
//! ones), the heap for smaller ones. Blocks to pin with `cuMemHostRegister` come from here, and so
//! does the ordinary memory a sleeping pool's backup is staged into.

use std::ptr::NonNull;

use crate::device::{DeviceError, DeviceResult};

/// The size of a transparent huge page on x86-64 (and on aarch64 kernels of 4 KiB pages).
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// `size` bytes (a multiple of the page size), page-aligned.
pub(crate) fn map(size: usize) -> DeviceResult<NonNull<u8>> {
    let out_of_memory = || DeviceError::OutOfMemory { bytes: size as u64 };
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if size >= HUGE_PAGE {
        return map_huge(size).ok_or_else(out_of_memory);
    }
    let layout = super::source::layout(size)?;
    // SAFETY: the layout's size is non-zero.
    let raw = unsafe { std::alloc::alloc(layout) };
    NonNull::new(raw).ok_or_else(out_of_memory)
}

/// Gives back a block of [`map`].
///
/// # Safety
/// `ptr` came from [`map`] with this `size`, is given back once, and nothing uses it any more.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, size: usize) -> DeviceResult<()> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if size >= HUGE_PAGE {
        // SAFETY: the caller guarantees `[ptr, ptr + size)` is a mapping of `map_huge`,
        // unused.
        return unsafe { rustix::mm::munmap(ptr.as_ptr().cast(), size) }.map_err(|errno| {
            DeviceError::Driver {
                call: "munmap",
                code: -1,
                message: errno.to_string(),
            }
        });
    }
    let layout = super::source::layout(size)?;
    // SAFETY: the caller guarantees `ptr` came from `map`'s heap branch with this size.
    unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
    Ok(())
}

/// A private anonymous mapping of `size` bytes, advised to use transparent huge pages.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn map_huge(size: usize) -> Option<NonNull<u8>> {
    use rustix::mm::{madvise, mmap_anonymous, Advice, MapFlags, ProtFlags};
    // SAFETY: a fresh private anonymous mapping at an address the kernel picks; nothing else
    // refers to it.
    let raw = unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            size,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .ok()?;
    // Advice only: a kernel without transparent huge pages refuses it, and small pages serve.
    // SAFETY: `[raw, raw + size)` is the mapping made above.
    if let Err(errno) = unsafe { madvise(raw, size, Advice::LinuxHugepage) } {
        tracing::debug!(%errno, "no transparent huge pages for host memory mapped here");
    }
    NonNull::new(raw.cast::<u8>())
}
