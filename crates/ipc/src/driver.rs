//! The few driver calls CUDA IPC needs, behind a trait: the CUDA implementation
//! (`driver::cuda`, feature `cuda`) and an in-process [fake](fake::FakeDriver) that lets everything
//! else (ref counting, limbo, bounds checks, handle caches, wire formats) be tested without a GPU.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fake;

use std::os::fd::OwnedFd;

use tensormem_cuda_alloc::{DeviceAddress, DeviceError, DeviceResult, StreamId};

/// Bytes in a CUDA IPC memory or event handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_SIZE: usize = 64;

/// A CUDA IPC memory handle (`CUipcMemHandle`): names one device allocation across processes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemHandle(pub [u8; IPC_HANDLE_SIZE]);

/// A CUDA IPC event handle (`CUipcEventHandle`): names one interprocess event across processes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventHandle(pub [u8; IPC_HANDLE_SIZE]);

impl std::fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemHandle({})", hex(&self.0[..16]))
    }
}

impl std::fmt::Debug for EventHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventHandle({})", hex(&self.0[..16]))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One device-to-device copy: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceCopy {
    /// Where the bytes are read.
    pub src: DeviceAddress,
    /// Where they are written.
    pub dst: DeviceAddress,
    /// How many.
    pub len: u64,
}

/// The physical memory under one mapping of virtual-memory-managed memory (`cuMemCreate` +
/// `cuMemMap`, what expandable segments are made of), exported for another process: see
/// [`IpcDriver::export_mapping`].
#[derive(Debug)]
pub struct ExportedMapping {
    /// Where the mapping starts in this process.
    pub base: DeviceAddress,
    /// Its size in bytes: the size of the physical chunk mapped there.
    pub size: usize,
    /// The chunk as a POSIX file descriptor of this process (`cuMemExportToShareableHandle`),
    /// what another process imports (`cuMemImportFromShareableHandle`). Each call gives a new one.
    pub fd: OwnedFd,
}

/// The driver calls of CUDA IPC, per device ordinal.
///
/// Every method makes the device's context current itself where the call needs one.
pub trait IpcDriver: Send + Sync + 'static {
    /// An interprocess event owned by the producer (destroyed on drop).
    type Event: Send + Sync + 'static;
    /// An event another process exported, opened here (destroyed on drop).
    type ImportedEvent: Send + Sync + 'static;

    /// How many devices this process sees.
    fn device_count(&self) -> DeviceResult<u32>;

    /// A process-wide unique id of the physical allocation at `base` (`CU_POINTER_ATTRIBUTE_BUFFER_ID`):
    /// changes when the address is freed and allocated again, so cached memory handles can be checked.
    fn buffer_id(&self, device: u32, base: DeviceAddress) -> DeviceResult<u64>;

    /// The IPC handle of the allocation starting at `base` of `size` bytes (`cuIpcGetMemHandle`).
    fn mem_handle(&self, device: u32, base: DeviceAddress, size: usize) -> DeviceResult<MemHandle>;

    /// Creates an interprocess event (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`).
    fn create_event(&self, device: u32) -> DeviceResult<Self::Event>;

    /// Records `event` on `stream` of `device` (`cuEventRecord`).
    fn record_event(&self, device: u32, event: &Self::Event, stream: StreamId) -> DeviceResult<()>;

    /// The IPC handle of `event` (`cuIpcGetEventHandle`).
    fn event_handle(&self, event: &Self::Event) -> DeviceResult<EventHandle>;

    /// Whether every piece of work queued on `stream` of `device` has finished (`cuStreamQuery`),
    /// without blocking.
    fn stream_idle(&self, device: u32, stream: StreamId) -> DeviceResult<bool>;

    /// Blocks until the work queued on `stream` of `device` has finished (`cuStreamSynchronize`).
    fn synchronize_stream(&self, device: u32, stream: StreamId) -> DeviceResult<()>;

    /// Opens another process's allocation (`cuIpcOpenMemHandle`, lazy peer access); returns where it is
    /// mapped in this process. Opening a handle that is already open in this context adds a reference.
    fn open_mem_handle(&self, device: u32, handle: &MemHandle) -> DeviceResult<DeviceAddress>;

    /// The allocation containing `ptr`: its base and size (`cuMemGetAddressRange`).
    fn address_range(
        &self,
        device: u32,
        ptr: DeviceAddress,
    ) -> DeviceResult<(DeviceAddress, usize)>;

    /// Closes a mapping from [`open_mem_handle`](Self::open_mem_handle) (`cuIpcCloseMemHandle`).
    ///
    /// # Safety
    ///
    /// `ptr` was returned by `open_mem_handle` on `device`, is closed once per open, and no queued
    /// work of this process uses it any more.
    unsafe fn close_mem_handle(&self, device: u32, ptr: DeviceAddress) -> DeviceResult<()>;

    /// Maps chunks of physical memory another process exported (an expandable segment's, see
    /// [`crate::chunks`]): reserves `chunk_size * fds.len()` bytes of address space, imports each
    /// descriptor (`cuMemImportFromShareableHandle`) and maps it there in order, read-write for
    /// `device`. Returns the start of the range; on failure nothing stays mapped or reserved. The
    /// descriptors may be closed afterwards.
    fn import_chunks(
        &self,
        device: u32,
        chunk_size: usize,
        fds: &[std::os::fd::OwnedFd],
    ) -> DeviceResult<DeviceAddress>;

    /// Unmaps and frees a range from [`import_chunks`](Self::import_chunks).
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` is exactly a range `import_chunks` returned on `device`, closed once, and
    /// no queued work of this process uses it any more.
    unsafe fn close_chunks(&self, device: u32, ptr: DeviceAddress, size: usize)
        -> DeviceResult<()>;

    /// The mapping that holds `ptr` in memory of the virtual memory management calls
    /// (`cuMemCreate` + `cuMemMap`, which has no CUDA IPC memory handle): its start and size
    /// (`cuMemGetAddressRange`, which for such memory gives the one mapping, not the reserved
    /// range), and the physical chunk mapped there exported as a file descriptor
    /// (`cuMemRetainAllocationHandle`, `cuMemExportToShareableHandle` with
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). What a publication of memory found by address
    /// ([`crate::weights`]) shares expandable segments with.
    ///
    /// The default refuses: a driver that cannot export such memory need not implement it.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Driver`] for memory that is not virtual-memory-managed (`cuMemAlloc`'s), or
    /// a chunk made without the file-descriptor handle type (`cuMemCreate` without
    /// `requestedHandleTypes`); [`DeviceError::Unsupported`] from the default.
    fn export_mapping(&self, device: u32, ptr: DeviceAddress) -> DeviceResult<ExportedMapping> {
        let _ = (device, ptr);
        Err(DeviceError::Unsupported {
            what: "exporting virtual-memory-managed memory with this IPC driver",
        })
    }

    /// Opens the event another process exported as `handle` (`cuIpcOpenEventHandle`).
    fn open_event_handle(
        &self,
        device: u32,
        handle: &EventHandle,
    ) -> DeviceResult<Self::ImportedEvent>;

    /// Makes `stream` of `device` wait for the work captured by the event's last record, whichever
    /// process recorded it (`cuStreamWaitEvent`).
    fn wait_event(
        &self,
        device: u32,
        event: &Self::ImportedEvent,
        stream: StreamId,
    ) -> DeviceResult<()>;

    /// Queues `copies` on `stream` of `device`, in as few launches as the driver allows
    /// (`cuMemcpyBatchAsync` where the driver has it and the stream is not the legacy default
    /// stream, else one `cuMemcpyDtoDAsync` each). Returns when they are queued, not done.
    ///
    /// # Safety
    ///
    /// Every range is device memory usable by this process on `device` (its own, or mapped from
    /// another process) and stays so until the copies have run; no destination overlaps another
    /// copy's source or destination.
    unsafe fn copy_batch(
        &self,
        device: u32,
        copies: &[DeviceCopy],
        stream: StreamId,
    ) -> DeviceResult<()>;

    /// The device of `stream`'s context (`cuStreamGetCtx`), where the driver can tell; `None` for
    /// the legacy default stream and by default.
    fn stream_device(&self, stream: StreamId) -> DeviceResult<Option<u32>> {
        let _ = stream;
        Ok(None)
    }

    /// Lets `device` reach `peer`'s memory, mappings of other processes' memory on `peer`
    /// included (`cuCtxEnablePeerAccess`), as copies queued on `device` between the two need.
    /// Enabling twice is not an error. By default nothing (one device).
    fn enable_peer_access(&self, device: u32, peer: u32) -> DeviceResult<()> {
        let _ = (device, peer);
        Ok(())
    }
}
