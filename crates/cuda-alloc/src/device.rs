//! The memory provider the allocator sits on: a device, its streams, its events and its virtual memory.
//!
//! The caching allocator is generic over [`Device`] and calls it with static dispatch, so the policy code
//! (pools, splitting, stats, OOM handling) never knows whether it runs on a real GPU or on the
//! [simulated device](crate::backend::sim). The CUDA backend (`crate::backend::cuda`, feature `cuda`)
//! implements the same trait through the CUDA driver API.
//!
//! Streams are named by [`StreamId`], the numeric value of the stream handle (what PyTorch records as
//! `stream` in snapshots and traces; `0` is the legacy default stream). Device memory is named by
//! [`DeviceAddress`], a device address.

use std::fmt;

/// A device address, as the device reports it (`CUdeviceptr`).
///
/// It is a plain number: holding one grants no access to the memory, so it is safe to copy around.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct DeviceAddress(pub u64);

impl DeviceAddress {
    /// The address `bytes` past this one.
    #[inline]
    #[must_use]
    pub const fn offset(self, bytes: usize) -> DeviceAddress {
        DeviceAddress(self.0 + bytes as u64)
    }

    /// The address as an integer.
    #[inline]
    #[must_use]
    pub const fn addr(self) -> u64 {
        self.0
    }
}

impl fmt::Debug for DeviceAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::Display for DeviceAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// `{:x}` / `{:#x}` (with width, fill and zero padding) as for the `u64` it holds.
impl fmt::LowerHex for DeviceAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

/// `{:X}` / `{:#X}` (with width, fill and zero padding) as for the `u64` it holds.
impl fmt::UpperHex for DeviceAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::UpperHex::fmt(&self.0, f)
    }
}

/// A stream, named by the numeric value of its handle (`cudaStream_t` as an integer; `0` is the legacy
/// default stream). Blocks belong to the stream they were allocated on.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    Debug,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The legacy default stream (`0`).
    pub const DEFAULT: StreamId = StreamId(0);
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Free and total memory of a device, in bytes (`cuMemGetInfo`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct MemInfo {
    /// Bytes the device could still hand out.
    pub free: u64,
    /// The device's capacity.
    pub total: u64,
}

/// A process using a device and the device memory it holds, as NVML reports it
/// (`nvmlProcessInfo_v1_t`, from `nvmlDeviceGetComputeRunningProcesses`): what the out-of-memory
/// message lists, one sentence per process, as PyTorch's does.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ProcessMemory {
    /// The process id, as NVML gives it (the pid namespace of the driver's host, which inside a
    /// container may not be the caller's).
    pub pid: u32,
    /// Device memory the process holds, in bytes (NVML's `usedGpuMemory`; NVML's "not available",
    /// `u64::MAX`, is kept as it is, as PyTorch keeps it).
    pub used_bytes: u64,
    /// Whether it is the process that met the error (its pid is this process's).
    pub this_process: bool,
}

/// Whether a stream is being captured into a CUDA graph (`cuStreamGetCaptureInfo`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CaptureStatus {
    /// Not capturing: work runs when it is enqueued.
    None,
    /// Capturing under the given capture id: work is recorded into a graph, events may not be recorded.
    Active {
        /// The driver's unique id of the capture sequence.
        id: u64,
    },
    /// A capture on this stream was invalidated (an error was made while capturing).
    Invalidated,
}

/// Why the device refused an operation.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DeviceError {
    /// The device has no memory left for this request (`CUDA_ERROR_OUT_OF_MEMORY`). The allocator treats
    /// this as recoverable: it releases cached memory and retries before reporting an out-of-memory error.
    #[error("the device is out of memory ({bytes} bytes requested)")]
    OutOfMemory {
        /// The size of the refused request.
        bytes: u64,
    },
    /// The device does not support the operation (for example virtual memory management on an old GPU).
    #[error("the device does not support {what}")]
    Unsupported {
        /// The operation that is unsupported.
        what: &'static str,
    },
    /// A stream id that names no live stream of this device known to the backend (a [`StreamId`] is a
    /// number anyone can write; the CUDA backend accepts only streams it made or was handed).
    #[error(
        "stream {stream} is not a live stream of device {device} known to this backend; use streams \
         made by the backend (CudaBackend::create_stream) or handed to it (CudaBackend::register_stream), \
         or the default stream 0"
    )]
    UnknownStream {
        /// The stream id given.
        stream: StreamId,
        /// The device ordinal.
        device: u32,
    },
    /// Any other failure, with the driver's code and name where there is one.
    #[error("{call} failed: {message} (code {code})")]
    Driver {
        /// The driver call that failed, e.g. `cuMemAlloc`.
        call: &'static str,
        /// The driver's numeric result code (`CUresult`), or `-1` for failures of the simulated device.
        code: i32,
        /// The driver's description of the code.
        message: String,
    },
}

/// Result alias of device calls.
pub type DeviceResult<T> = Result<T, DeviceError>;

/// The allocator's memory provider: one device, its streams, events and virtual memory.
///
/// All methods take `&self`: the allocator calls them from many threads at once, possibly while holding one
/// of its own locks (never while holding all of them, except in [`Device::synchronize`]'s callers).
///
/// # Safety
///
/// The allocator hands out the memory this trait returns as if it owned it. Implementors guarantee:
///
/// 1. Memory returned by [`Device::malloc`] is at least `size` bytes, is not handed out again (by any method)
///    until it is passed to [`Device::free`], and its address is aligned to at least 512 bytes.
/// 2. [`Device::reserve_address_range`] returns a range of at least `size` bytes aligned to
///    [`Device::vmm_granularity`] that overlaps no other live allocation or reservation of this device.
/// 3. Events report completion ([`Device::query_event`] returns `true`, [`Device::synchronize_event`]
///    returns) only once all work enqueued on the stream before the matching [`Device::record_event`] has
///    finished.
/// 4. No method calls back into the allocator that is using it (no re-entry): the allocator may hold its
///    locks across these calls.
/// 5. Every method taking a [`StreamId`] is sound for any value: where streams are real handles, an id
///    that is not a live stream of this device is refused with [`DeviceError::UnknownStream`] (by
///    [`Device::check_stream`], which such backends must override), never passed to the driver. A
///    stream accepted by [`Device::check_stream`] stays usable by the other methods for the device's
///    life.
pub unsafe trait Device: Send + Sync + 'static {
    /// An event that can be recorded on a stream and queried. The allocator pools them.
    type Event: Send + Sync + 'static;
    /// A physical memory chunk for expandable segments (`CUmemGenericAllocationHandle`).
    type PhysicalChunk: Send + Sync + 'static;

    /// The device ordinal this provider serves.
    fn index(&self) -> u32;

    /// Free and total memory of the device (`cuMemGetInfo`).
    fn mem_info(&self) -> DeviceResult<MemInfo>;

    /// Allocates `size` bytes of device memory (`cuMemAlloc`). Out of memory is
    /// [`DeviceError::OutOfMemory`], not a panic.
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress>;

    /// Returns memory obtained from [`Device::malloc`] (`cuMemFree`).
    ///
    /// # Safety
    ///
    /// `ptr` came from [`Device::malloc`] on this device with this `size`, has not been freed yet, and no
    /// queued device work uses it any more.
    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()>;

    /// Creates an event (`cuEventCreate` with timing disabled).
    fn create_event(&self) -> DeviceResult<Self::Event>;

    /// Records `event` on `stream` (`cuEventRecord`): it completes once the work enqueued so far has.
    fn record_event(&self, event: &Self::Event, stream: StreamId) -> DeviceResult<()>;

    /// Whether `event` has completed (`cuEventQuery`), without blocking.
    fn query_event(&self, event: &Self::Event) -> DeviceResult<bool>;

    /// Blocks until `event` has completed (`cuEventSynchronize`).
    fn synchronize_event(&self, event: &Self::Event) -> DeviceResult<()>;

    /// Blocks until all work on the device has finished (`cuCtxSynchronize`).
    fn synchronize(&self) -> DeviceResult<()>;

    /// Checks that `stream` names a stream this device can record events on, now and later (the
    /// allocator calls it when a stream is first used and on every `record_stream`). The default
    /// accepts every id: right for backends whose streams are plain numbers, like the simulated device.
    ///
    /// # Errors
    /// [`DeviceError::UnknownStream`] for an id that is not a live stream of this device.
    fn check_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let _ = stream;
        Ok(())
    }

    /// Keeps an error met where it cannot be returned (releasing memory while the allocator is
    /// dropped) for a later check, the way cudarc keeps errors met in `Drop`. The default logs it.
    fn record_error(&self, error: DeviceError) {
        tracing::warn!(%error, device = self.index(), "device error met while dropping an allocator");
    }

    /// Whether `stream` is being captured into a graph (`cuStreamGetCaptureInfo`).
    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus>;

    /// The processes using this device and the memory each holds (NVML's
    /// `nvmlDeviceGetComputeRunningProcesses`), asked only when an allocation has failed, for the
    /// out-of-memory message (PyTorch's `reportProcessMemoryInfo`). `None` where the backend cannot
    /// tell (no NVML, or NVML refused): the message then has no process sentences, as PyTorch's has
    /// none without NVML. Never an error. The default: `None`.
    fn process_memory(&self) -> Option<Vec<ProcessMemory>> {
        None
    }

    /// The granularity of virtual-memory mappings in bytes (`cuMemGetAllocationGranularity`), typically 2 MiB.
    fn vmm_granularity(&self) -> DeviceResult<usize>;

    /// Reserves `size` bytes of device address space without backing it (`cuMemAddressReserve`).
    fn reserve_address_range(&self, size: usize) -> DeviceResult<DeviceAddress>;

    /// Releases an address range from [`Device::reserve_address_range`] (`cuMemAddressFree`).
    ///
    /// # Safety
    ///
    /// The range came from [`Device::reserve_address_range`] with this size and has nothing mapped in it.
    unsafe fn release_address_range(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()>;

    /// Creates `size` bytes of physical device memory (`cuMemCreate`); `size` is a multiple of
    /// [`Device::vmm_granularity`]. Out of memory is [`DeviceError::OutOfMemory`].
    fn create_physical(&self, size: usize) -> DeviceResult<Self::PhysicalChunk>;

    /// Maps `chunk` at `ptr` (`cuMemMap`) and grants this device (and its peers with access) read-write
    /// access to it (`cuMemSetAccess`).
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` lies in a reserved range and has nothing mapped; `size` is the chunk's size.
    unsafe fn map(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: &Self::PhysicalChunk,
    ) -> DeviceResult<()>;

    /// Unmaps `[ptr, ptr + size)` (`cuMemUnmap`) and releases the chunk mapped there (`cuMemRelease`).
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` is exactly where `chunk` was mapped by [`Device::map`], and no queued device work
    /// uses it any more.
    unsafe fn unmap(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: Self::PhysicalChunk,
    ) -> DeviceResult<()>;

    /// A file descriptor another process can import `chunk` from (`cuMemExportToShareableHandle`
    /// with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`): how memory of expandable segments is shared.
    /// The default refuses: a backend whose chunks cannot leave the process.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] where chunks cannot be exported; the driver's error otherwise.
    fn export_physical(&self, chunk: &Self::PhysicalChunk) -> DeviceResult<std::os::fd::OwnedFd> {
        let _ = chunk;
        Err(DeviceError::Unsupported {
            what: "exporting physical memory to other processes (expandable-segment sharing)",
        })
    }

    /// Copies `len` bytes of device memory at `src` to host memory at `dst` and waits for the copy
    /// (`cuMemcpyDtoH`): how a sleeping pool's contents are kept. The default refuses.
    ///
    /// # Safety
    ///
    /// `[src, src + len)` is mapped device memory no queued work writes; `dst` is valid for writes
    /// of `len` bytes (pinned host memory for full bandwidth).
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] where the backend cannot copy; the driver's error otherwise.
    unsafe fn copy_to_host(
        &self,
        src: DeviceAddress,
        dst: *mut u8,
        len: usize,
    ) -> DeviceResult<()> {
        let _ = (src, dst, len);
        Err(DeviceError::Unsupported {
            what: "copying device memory to the host (sleeping pools that keep their contents)",
        })
    }

    /// Copies `len` bytes of host memory at `src` to device memory at `dst` and waits for the copy
    /// (`cuMemcpyHtoD`): how a waking pool's contents come back. The default refuses.
    ///
    /// # Safety
    ///
    /// `[dst, dst + len)` is mapped device memory no queued work uses; `src` is valid for reads of
    /// `len` bytes.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] where the backend cannot copy; the driver's error otherwise.
    unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: DeviceAddress,
        len: usize,
    ) -> DeviceResult<()> {
        let _ = (src, dst, len);
        Err(DeviceError::Unsupported {
            what: "copying host memory to the device (sleeping pools that keep their contents)",
        })
    }
}

// SAFETY: every method delegates to the shared device, which upholds the obligations itself; sharing
// it changes nothing about what memory, reservations and events it hands out.
unsafe impl<D: Device> Device for std::sync::Arc<D> {
    type Event = D::Event;
    type PhysicalChunk = D::PhysicalChunk;

    fn index(&self) -> u32 {
        (**self).index()
    }
    fn mem_info(&self) -> DeviceResult<MemInfo> {
        (**self).mem_info()
    }
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        (**self).malloc(size)
    }
    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the shared device's.
        unsafe { (**self).free(ptr, size) }
    }
    fn create_event(&self) -> DeviceResult<Self::Event> {
        (**self).create_event()
    }
    fn record_event(&self, event: &Self::Event, stream: StreamId) -> DeviceResult<()> {
        (**self).record_event(event, stream)
    }
    fn query_event(&self, event: &Self::Event) -> DeviceResult<bool> {
        (**self).query_event(event)
    }
    fn synchronize_event(&self, event: &Self::Event) -> DeviceResult<()> {
        (**self).synchronize_event(event)
    }
    fn synchronize(&self) -> DeviceResult<()> {
        (**self).synchronize()
    }
    fn check_stream(&self, stream: StreamId) -> DeviceResult<()> {
        (**self).check_stream(stream)
    }
    fn record_error(&self, error: DeviceError) {
        (**self).record_error(error);
    }
    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        (**self).capture_status(stream)
    }
    fn process_memory(&self) -> Option<Vec<ProcessMemory>> {
        (**self).process_memory()
    }
    fn vmm_granularity(&self) -> DeviceResult<usize> {
        (**self).vmm_granularity()
    }
    fn reserve_address_range(&self, size: usize) -> DeviceResult<DeviceAddress> {
        (**self).reserve_address_range(size)
    }
    unsafe fn release_address_range(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the shared device's.
        unsafe { (**self).release_address_range(ptr, size) }
    }
    fn create_physical(&self, size: usize) -> DeviceResult<Self::PhysicalChunk> {
        (**self).create_physical(size)
    }
    unsafe fn map(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: &Self::PhysicalChunk,
    ) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the shared device's.
        unsafe { (**self).map(ptr, size, chunk) }
    }
    unsafe fn unmap(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: Self::PhysicalChunk,
    ) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the shared device's.
        unsafe { (**self).unmap(ptr, size, chunk) }
    }
    fn export_physical(&self, chunk: &Self::PhysicalChunk) -> DeviceResult<std::os::fd::OwnedFd> {
        (**self).export_physical(chunk)
    }
    unsafe fn copy_to_host(
        &self,
        src: DeviceAddress,
        dst: *mut u8,
        len: usize,
    ) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the shared device's.
        unsafe { (**self).copy_to_host(src, dst, len) }
    }
    unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: DeviceAddress,
        len: usize,
    ) -> DeviceResult<()> {
        // SAFETY: the caller's obligations are the shared device's.
        unsafe { (**self).copy_from_host(src, dst, len) }
    }
}

#[cfg(test)]
mod address_format_tests {
    use super::DeviceAddress;

    #[test]
    fn addresses_format_as_hex_like_the_integer() {
        let addr = DeviceAddress(0x7f3a_0000_2000);
        assert_eq!(format!("{addr:#x}"), "0x7f3a00002000");
        assert_eq!(format!("{addr:x}"), "7f3a00002000");
        assert_eq!(format!("{addr:#X}"), "0x7F3A00002000");
        assert_eq!(format!("{addr:#018x}"), "0x00007f3a00002000");
        assert_eq!(format!("{addr}"), "0x7f3a00002000");
        assert_eq!(format!("{addr:?}"), "0x7f3a00002000");
    }
}
