//! Page-locked host memory from the CUDA driver, for the pinned host allocator
//! ([`HostCachingAllocator`](crate::host::HostCachingAllocator)).

use std::ptr::NonNull;

use cudarc::driver::sys;

use super::context::PrimaryContext;
use super::driver::{check, check_alloc};
use super::CudaBackend;
use crate::config::AllocatorConfig;
use crate::device::{DeviceError, DeviceResult};
use crate::host::{pages, PinnedSource, HOST_ALIGNMENT};

/// How pinned blocks are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `cuMemHostAlloc` (PyTorch's default, `cudaHostAlloc`).
    HostAlloc,
    /// Page-aligned heap memory whose pages `threads` threads touch in parallel, then
    /// `cuMemHostRegister` (`pinned_use_cuda_host_register`, `pinned_num_register_threads`).
    Register { threads: usize },
}

/// Pinned host memory of the CUDA driver: `cuMemHostAlloc`, or heap memory registered with
/// `cuMemHostRegister`. Blocks are portable (`CU_MEMHOSTALLOC_PORTABLE` /
/// `CU_MEMHOSTREGISTER_PORTABLE`): pinned for every context, so copies to any device run at full speed.
#[derive(Debug)]
pub struct CudaPinnedSource {
    ctx: &'static PrimaryContext,
    mode: Mode,
}

impl CudaPinnedSource {
    /// Blocks from `cuMemHostAlloc`, made with `device`'s primary context current.
    #[must_use]
    pub fn host_alloc(device: &CudaBackend) -> Self {
        Self {
            ctx: device.context(),
            mode: Mode::HostAlloc,
        }
    }

    /// Blocks registered with `cuMemHostRegister`, their pages first touched by `threads`
    /// threads in parallel (mapping the pages is what makes registration of large blocks slow).
    /// Blocks of 2 MiB and more are anonymous mappings that ask for transparent huge pages
    /// (`MADV_HUGEPAGE`): a 2 MiB page is faulted and pinned at once instead of 512 small ones,
    /// where the kernel allows (`/sys/kernel/mm/transparent_hugepage/enabled` not `never`).
    #[must_use]
    pub fn host_register(device: &CudaBackend, threads: usize) -> Self {
        Self {
            ctx: device.context(),
            mode: Mode::Register {
                threads: threads.max(1),
            },
        }
    }

    /// As the configuration says: [`host_register`](Self::host_register) with
    /// `pinned_num_register_threads` when `pinned_use_cuda_host_register` is set, else
    /// [`host_alloc`](Self::host_alloc).
    #[must_use]
    pub fn from_config(device: &CudaBackend, config: &AllocatorConfig) -> Self {
        if config.pinned_use_cuda_host_register {
            Self::host_register(device, config.pinned_num_register_threads)
        } else {
            Self::host_alloc(device)
        }
    }
}

/// Touches one byte of every page of `[ptr, ptr + size)` with `threads` threads, each its own
/// contiguous share, so that the kernel maps the pages in parallel before they are registered.
fn touch_pages(ptr: NonNull<u8>, size: usize, threads: usize) {
    let pages = size / HOST_ALIGNMENT;
    let per_thread = pages.div_ceil(threads);
    let base = ptr.as_ptr() as usize;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let first = t * per_thread;
            let last = ((t + 1) * per_thread).min(pages);
            if first >= last {
                break;
            }
            scope.spawn(move || {
                for page in first..last {
                    let at = (base + page * HOST_ALIGNMENT) as *mut u8;
                    // SAFETY: `at` is inside the block (page < pages, size = pages * page size),
                    // which nothing else uses yet; each thread writes only its own pages.
                    unsafe { at.write_volatile(0) };
                }
            });
        }
    });
}

// SAFETY: `cuMemHostAlloc` returns host memory valid for `size` bytes, page-aligned, until
// `cuMemFreeHost`; registered blocks are fresh page-aligned heap allocations of `size` bytes, freed
// only in `free` after being unregistered. Nothing calls back into an allocator.
unsafe impl PinnedSource for CudaPinnedSource {
    /// [`PinnedSource::alloc`] through `cuMemHostAlloc` (portable pinned memory) or, in the register mode, a
    /// page-aligned heap block pinned with `cuMemHostRegister`.
    ///
    /// # References
    ///
    /// - [`cuMemHostAlloc`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    /// - [`cuMemHostRegister`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemHostAlloc")]
    #[doc(alias = "cuMemHostRegister")]
    fn alloc(&self, size: usize) -> DeviceResult<NonNull<u8>> {
        self.ctx.make_current()?;
        match self.mode {
            Mode::HostAlloc => {
                let mut ptr = std::ptr::null_mut();
                // SAFETY: a context is current; `ptr` is a valid out-parameter.
                let result =
                    unsafe { sys::cuMemHostAlloc(&mut ptr, size, sys::CU_MEMHOSTALLOC_PORTABLE) };
                check_alloc("cuMemHostAlloc", result, size)?;
                NonNull::new(ptr.cast::<u8>())
                    .ok_or(DeviceError::OutOfMemory { bytes: size as u64 })
            }
            Mode::Register { threads } => {
                let ptr = pages::map(size)?;
                touch_pages(ptr, size, threads);
                // SAFETY: `[ptr, ptr + size)` is a live heap allocation, page-aligned, not registered.
                let result = unsafe {
                    sys::cuMemHostRegister_v2(
                        ptr.as_ptr().cast(),
                        size,
                        sys::CU_MEMHOSTREGISTER_PORTABLE,
                    )
                };
                if let Err(error) = check_alloc("cuMemHostRegister", result, size) {
                    // SAFETY: mapped above with this size, never handed out.
                    unsafe { pages::unmap(ptr, size) }?;
                    return Err(error);
                }
                Ok(ptr)
            }
        }
    }

    /// [`PinnedSource::free`] through `cuMemFreeHost`, or `cuMemHostUnregister` and the heap's free in the
    /// register mode.
    ///
    /// # References
    ///
    /// - [`cuMemFreeHost`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    /// - [`cuMemHostUnregister`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemFreeHost")]
    #[doc(alias = "cuMemHostUnregister")]
    unsafe fn free(&self, ptr: NonNull<u8>, size: usize) -> DeviceResult<()> {
        self.ctx.make_current()?;
        match self.mode {
            // SAFETY: the caller guarantees `ptr` came from `cuMemHostAlloc` here and is idle.
            Mode::HostAlloc => check("cuMemFreeHost", unsafe {
                sys::cuMemFreeHost(ptr.as_ptr().cast())
            }),
            Mode::Register { .. } => {
                // SAFETY: the caller guarantees `ptr` is a block registered by `alloc` and idle.
                check("cuMemHostUnregister", unsafe {
                    sys::cuMemHostUnregister(ptr.as_ptr().cast())
                })?;
                // SAFETY: mapped by `alloc` with this size, unregistered just above.
                unsafe { pages::unmap(ptr, size) }
            }
        }
    }

    fn name(&self) -> &'static str {
        match self.mode {
            Mode::HostAlloc => "cuMemHostAlloc",
            Mode::Register { .. } => "cuMemHostRegister",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks for registering, mapped and from the heap, are page-aligned, writable over their
    /// whole length by the touching threads, and given back.
    #[test]
    fn blocks_to_register_are_aligned_and_writable() {
        for size in [
            HOST_ALIGNMENT,
            64 << 10,
            pages::HUGE_PAGE,
            3 * pages::HUGE_PAGE,
        ] {
            let ptr = pages::map(size).unwrap();
            assert_eq!(ptr.as_ptr() as usize % HOST_ALIGNMENT, 0, "{size}");
            touch_pages(ptr, size, 4);
            // SAFETY: `ptr` is a live block of `size` bytes made above, used only here.
            let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), size) };
            bytes.fill(0xa5);
            assert!(bytes.iter().all(|&b| b == 0xa5));
            // SAFETY: made by `map` with this size, no longer used.
            unsafe { pages::unmap(ptr, size) }.unwrap();
        }
    }
}
