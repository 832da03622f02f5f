//! Virtual memory management (`cuMem*` of CUDA 10.2+), what expandable segments are built on: reserve
//! address space once, then back it chunk by chunk with physical memory as the segment grows.

use cudarc::driver::sys;

use super::driver::{attribute, check};
use crate::device::{DeviceError, DeviceResult};

/// A chunk of physical device memory (`CUmemGenericAllocationHandle` from `cuMemCreate`), released on
/// drop (`cuMemRelease`) unless [`Device::unmap`](crate::Device::unmap) consumed it.
///
/// A mapped chunk's memory stays alive until it is both unmapped and released, so releasing the handle
/// of a still-mapped chunk is allowed by the driver (the mapping keeps it alive).
#[derive(Debug)]
pub struct PhysicalChunk {
    /// The driver's handle; live until released exactly once.
    handle: sys::CUmemGenericAllocationHandle,
    /// Bytes of physical memory, a multiple of the allocation granularity.
    size: usize,
    /// Whether it was created exportable as a POSIX file descriptor.
    exportable: bool,
}

impl PhysicalChunk {
    /// The size of the chunk in bytes.
    #[inline]
    #[must_use]
    pub fn size(&self) -> usize {
        self.size
    }

    /// The raw driver handle (for exporting it with `cuMemExportToShareableHandle`). It stays owned by
    /// `self`.
    #[inline]
    #[must_use]
    pub fn as_raw(&self) -> sys::CUmemGenericAllocationHandle {
        self.handle
    }

    /// A file descriptor another process imports this chunk from (`cuMemExportToShareableHandle`,
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). Every call makes a new descriptor.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] when the device cannot export file descriptors (the chunk was
    /// created without that handle type); the driver's error otherwise.
    pub(crate) fn export_fd(&self) -> DeviceResult<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        if !self.exportable {
            return Err(DeviceError::Unsupported {
                what: "exporting physical memory as file descriptors on this device",
            });
        }
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `fd` is valid for writes of a C int (what the POSIX handle type writes); the handle
        // is live (owned by `self`), and flags must be 0.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&raw mut fd).cast(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(DeviceError::Driver {
                call: "cuMemExportToShareableHandle",
                code: -1,
                message: format!("the driver returned file descriptor {fd}"),
            });
        }
        // SAFETY: the driver just opened `fd` for this process and hands its ownership to the caller.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// Releases the handle now and reports the driver's answer (`cuMemRelease`).
    pub(crate) fn release(self) -> DeviceResult<()> {
        let handle = self.handle;
        std::mem::forget(self);
        // SAFETY: `handle` came from `cuMemCreate` and is released exactly once (`self` was forgotten, so
        // `drop` will not release it again).
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
    }
}

impl Drop for PhysicalChunk {
    fn drop(&mut self) {
        // SAFETY: the handle came from `cuMemCreate` and is released exactly once.
        let result = unsafe { sys::cuMemRelease(self.handle) };
        if let Err(err) = check("cuMemRelease", result) {
            tracing::warn!(%err, size = self.size, "releasing a physical memory chunk failed");
        }
    }
}

/// How physical memory of one device is created: pinned device memory on that device, exportable as a
/// POSIX file descriptor where the device supports it (what PyTorch requests, so that expandable
/// segments can be shared with other processes), and usable for GPUDirect RDMA where the device
/// supports that on memory it maps (so that an RDMA library such as NIXL or a network transport can
/// register the segments as they are, as PyTorch's expandable segments allow from 2.13 on).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkKind {
    /// The device handle.
    dev: sys::CUdevice,
    /// Whether the device can export handles as file descriptors.
    exportable: bool,
    /// Whether the memory is made GPUDirect RDMA capable
    /// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`).
    rdma: bool,
}

impl ChunkKind {
    /// The chunk kind of `dev`, or [`DeviceError::Unsupported`] if the device has no virtual memory
    /// management.
    pub(crate) fn of(dev: sys::CUdevice) -> DeviceResult<Self> {
        use sys::CUdevice_attribute as Attr;
        if attribute(
            dev,
            Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        )? == 0
        {
            return Err(DeviceError::Unsupported {
                what: "virtual memory management (expandable segments); unset expandable_segments",
            });
        }
        let exportable = attribute(
            dev,
            Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )? != 0;
        // A driver that does not know the attribute has no such support: ask, never fail on it.
        let rdma = attribute(
            dev,
            Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        )
        .is_ok_and(|supported| supported != 0);
        Ok(Self {
            dev,
            exportable,
            rdma,
        })
    }

    /// Whether the memory this kind makes can be registered for GPUDirect RDMA as it is.
    pub(crate) fn rdma_capable(self) -> bool {
        self.rdma
    }

    /// The `CUmemAllocationProp` for `cuMemCreate` and `cuMemGetAllocationGranularity`.
    fn prop(self) -> sys::CUmemAllocationProp {
        // SAFETY: `CUmemAllocationProp` is a plain C struct for which all-zero bytes is a valid value (null
        // pointer, zero enums and flags), which is also what the driver documents as defaults.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.dev;
        prop.requestedHandleTypes = if self.exportable {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        prop.allocFlags.gpuDirectRDMACapable = u8::from(self.rdma);
        prop
    }

    /// The minimum mapping granularity (`cuMemGetAllocationGranularity`), 2 MiB on current GPUs.
    pub(crate) fn granularity(self) -> DeviceResult<usize> {
        let prop = self.prop();
        let mut granularity = 0usize;
        // SAFETY: `prop` and `granularity` are valid for the duration of the call.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granularity)
    }

    /// Creates `size` bytes of physical memory (`cuMemCreate`); out of memory is
    /// [`DeviceError::OutOfMemory`].
    pub(crate) fn create(self, size: usize) -> DeviceResult<PhysicalChunk> {
        let prop = self.prop();
        let mut handle = 0;
        // SAFETY: `prop` and `handle` are valid for the duration of the call; flags must be 0.
        let result = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        super::driver::check_alloc("cuMemCreate", result, size)?;
        Ok(PhysicalChunk {
            handle,
            size,
            exportable: self.exportable,
        })
    }
}

/// Grants read-write access to `[ptr, ptr + size)` to each device in `devices` (`cuMemSetAccess`).
///
/// # Safety
///
/// The range is mapped (by `cuMemMap`) in full.
pub(crate) unsafe fn set_access(
    ptr: u64,
    size: usize,
    devices: &[sys::CUdevice],
) -> DeviceResult<()> {
    let descs: Vec<sys::CUmemAccessDesc> = devices
        .iter()
        .map(|&dev| {
            // SAFETY: a plain C struct; all-zero bytes is a valid value, every field is set below.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = dev;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            desc
        })
        .collect();
    // SAFETY: `descs` is valid for `descs.len()` elements during the call; the mapping is the caller's
    // obligation.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
    })
}
