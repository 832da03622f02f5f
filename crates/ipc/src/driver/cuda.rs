//! [`CudaIpcDriver`]: the IPC driver calls on a real GPU (raw `cudarc::driver::sys` calls, the driver
//! loaded at run time), their results turned into errors by the allocator's one conversion
//! ([`cuda::check`]).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::{self, check, BackendEvent, CudaBackend};
use tensormem_cuda_alloc::{DeviceAddress, DeviceError, DeviceResult, StreamId};

use super::{DeviceCopy, EventHandle, ExportedMapping, IpcDriver, MemHandle, IPC_HANDLE_SIZE};

/// The CUDA IPC driver calls, through the primary context of each device (the one the CUDA runtime
/// and PyTorch use, so pointers and streams are interchangeable with theirs).
#[derive(Debug)]
pub struct CudaIpcDriver {
    /// One opened device per ordinal, opened on first use.
    devices: Vec<OnceLock<CudaBackend>>,
}

impl CudaIpcDriver {
    /// Loads and initialises the driver.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Driver`] with `CUDA_ERROR_NO_DEVICE` (100) when there is no driver or device.
    pub fn new() -> DeviceResult<Self> {
        cuda::init()?;
        let count = cuda::device_count()?;
        Ok(Self {
            devices: (0..count).map(|_| OnceLock::new()).collect(),
        })
    }

    /// Device `ordinal`, its primary context made current on this thread.
    fn current(&self, ordinal: u32) -> DeviceResult<&CudaBackend> {
        let slot = self
            .devices
            .get(ordinal as usize)
            .ok_or_else(|| DeviceError::Driver {
                call: "cuDeviceGet",
                code: sys::CUresult::CUDA_ERROR_INVALID_DEVICE as i32,
                message: format!(
                    "CUDA_ERROR_INVALID_DEVICE: no device {ordinal} ({} visible)",
                    self.devices.len()
                ),
            })?;
        let device = match slot.get() {
            Some(device) => device,
            None => {
                let opened = CudaBackend::new(ordinal)?;
                slot.get_or_init(|| opened)
            }
        };
        device.make_current()?;
        Ok(device)
    }
}

impl IpcDriver for CudaIpcDriver {
    type Event = BackendEvent;
    type ImportedEvent = BackendEvent;

    fn device_count(&self) -> DeviceResult<u32> {
        Ok(self.devices.len() as u32)
    }

    fn buffer_id(&self, device: u32, base: DeviceAddress) -> DeviceResult<u64> {
        self.current(device)?;
        let mut id = 0u64;
        // SAFETY: BUFFER_ID writes one unsigned long long into `id`; the driver validates `base`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&mut id as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                base.0,
            )
        })?;
        Ok(id)
    }

    fn mem_handle(&self, device: u32, base: DeviceAddress, size: usize) -> DeviceResult<MemHandle> {
        let (real_base, real_size) = self.address_range(device, base)?;
        if real_base != base || real_size != size {
            return Err(DeviceError::Driver {
                call: "cuMemGetAddressRange",
                code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i32,
                message: format!(
                    "the allocator's base allocation {base} ({size} bytes) is not the driver's \
                     allocation {real_base} ({real_size} bytes)"
                ),
            });
        }
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_SIZE],
        };
        // SAFETY: the context of `device` is current (address_range made it so); `handle` is a valid
        // out-parameter; `base` is the start of a live allocation (checked just above).
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base.0)
        })?;
        Ok(MemHandle(handle.reserved.map(|b| b as u8)))
    }

    fn create_event(&self, device: u32) -> DeviceResult<BackendEvent> {
        self.current(device)?.create_interprocess_event()
    }

    fn record_event(
        &self,
        device: u32,
        event: &BackendEvent,
        stream: StreamId,
    ) -> DeviceResult<()> {
        self.current(device)?;
        // SAFETY: the stream is the default stream of the device's context (current now) or a live
        // stream of that device, which is the caller's obligation as for every StreamId.
        unsafe { event.record_raw(stream.0 as sys::CUstream) }
    }

    fn event_handle(&self, event: &BackendEvent) -> DeviceResult<EventHandle> {
        event.ipc_handle().map(EventHandle)
    }

    fn stream_idle(&self, device: u32, stream: StreamId) -> DeviceResult<bool> {
        self.current(device)?;
        // SAFETY: as in `record_event`.
        match unsafe { sys::cuStreamQuery(stream.0 as sys::CUstream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuStreamQuery", other).map(|()| false),
        }
    }

    fn synchronize_stream(&self, device: u32, stream: StreamId) -> DeviceResult<()> {
        self.current(device)?;
        // SAFETY: as in `record_event`.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.0 as sys::CUstream)
        })
    }

    fn open_mem_handle(&self, device: u32, handle: &MemHandle) -> DeviceResult<DeviceAddress> {
        self.current(device)?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: the device's context is current; `ptr` is a valid out-parameter; the handle is plain
        // bytes the driver validates.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(DeviceAddress(ptr))
    }

    fn address_range(
        &self,
        device: u32,
        ptr: DeviceAddress,
    ) -> DeviceResult<(DeviceAddress, usize)> {
        self.current(device)?;
        let (mut base, mut size) = (0, 0usize);
        // SAFETY: both out-parameters are valid; the driver validates `ptr`.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr.0)
        })?;
        Ok((DeviceAddress(base), size))
    }

    unsafe fn close_mem_handle(&self, device: u32, ptr: DeviceAddress) -> DeviceResult<()> {
        self.current(device)?;
        // SAFETY: the caller guarantees `ptr` came from `open_mem_handle` on this device, is closed
        // once per open, and is idle.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(ptr.0)
        })
    }

    fn import_chunks(
        &self,
        device: u32,
        chunk_size: usize,
        fds: &[OwnedFd],
    ) -> DeviceResult<DeviceAddress> {
        self.current(device)?;
        let size = chunk_size * fds.len();
        let mut base = 0;
        // SAFETY: `base` is a valid out-parameter; no fixed address or flags are asked for.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, 0, 0, 0)
        })?;
        let mut mapped = 0;
        let result = (|| {
            for fd in fds {
                let mut handle = 0;
                // SAFETY: for the POSIX handle type the driver takes the descriptor's number as the
                // pointer-sized argument; `fd` is open for the call (borrowed) and not consumed.
                check("cuMemImportFromShareableHandle", unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                })?;
                let at = base + (mapped * chunk_size) as u64;
                // SAFETY: `[at, at + chunk_size)` lies in the range reserved above and has nothing
                // mapped (chunks are mapped in order); the imported handle is live.
                let map = check("cuMemMap", unsafe {
                    sys::cuMemMap(at, chunk_size, 0, handle, 0)
                });
                // SAFETY: the handle came from the import above and is released once; a mapping
                // keeps its memory alive until unmapped.
                let release = check("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
                map?;
                mapped += 1;
                release?;
            }
            let mut dev = 0;
            // SAFETY: `dev` is a valid out-parameter.
            check("cuDeviceGet", unsafe {
                sys::cuDeviceGet(&mut dev, device as i32)
            })?;
            // SAFETY: a plain C struct; all-zero bytes is a valid value, every field is set below.
            let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            access.location.id = dev;
            access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            // SAFETY: the whole range is mapped (every chunk above); `access` lives for the call.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(base, size, &access, 1)
            })
        })();
        if let Err(err) = result {
            // SAFETY: exactly the first `mapped` chunks were mapped in the range reserved above,
            // and nothing has used them.
            unsafe {
                if mapped > 0 {
                    let _ = sys::cuMemUnmap(base, mapped * chunk_size);
                }
                let _ = sys::cuMemAddressFree(base, size);
            }
            return Err(err);
        }
        Ok(DeviceAddress(base))
    }

    unsafe fn close_chunks(
        &self,
        device: u32,
        ptr: DeviceAddress,
        size: usize,
    ) -> DeviceResult<()> {
        self.current(device)?;
        // SAFETY: the caller guarantees the range came from `import_chunks` (fully mapped, and
        // reserved with this size), is closed once and is idle.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr.0, size) })?;
        // SAFETY: as above; nothing is mapped in the range any more.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr.0, size)
        })
    }

    /// [`IpcDriver::export_mapping`] through `cuMemGetAddressRange`, `cuMemRetainAllocationHandle`
    /// and `cuMemExportToShareableHandle` (POSIX file descriptor), the retained handle released
    /// again (`cuMemRelease`).
    ///
    /// # References
    ///
    /// - [`cuMemRetainAllocationHandle`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    /// - [`cuMemExportToShareableHandle`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuMemRetainAllocationHandle")]
    #[doc(alias = "cuMemExportToShareableHandle")]
    fn export_mapping(&self, device: u32, ptr: DeviceAddress) -> DeviceResult<ExportedMapping> {
        let (base, size) = self.address_range(device, ptr)?;
        let mut handle = 0;
        // SAFETY: `handle` is a valid out-parameter; the driver validates the address (any address
        // of a mapping; memory not made by cuMemCreate is refused).
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&mut handle, base.0 as *mut std::ffi::c_void)
        })?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `fd` is valid for writes of a C int (what the POSIX handle type writes); the
        // handle was retained above and is live; flags must be 0.
        let exported = check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&raw mut fd).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        });
        // SAFETY: the handle was retained above and is released once; the mapping keeps the
        // memory alive, and an exported descriptor does not need the handle.
        let released = check("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
        exported?;
        if fd < 0 {
            return Err(DeviceError::Driver {
                call: "cuMemExportToShareableHandle",
                code: -1,
                message: format!("the driver returned file descriptor {fd}"),
            });
        }
        // SAFETY: the driver just opened `fd` for this process and hands its ownership over; it
        // is closed on every path from here (dropped if the release failed).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        released?;
        Ok(ExportedMapping { base, size, fd })
    }

    fn open_event_handle(&self, device: u32, handle: &EventHandle) -> DeviceResult<BackendEvent> {
        self.current(device)?;
        // SAFETY: the context of the device the event was made on is current (the handle names the
        // same device as the memory, and this thread made that device's context current above).
        unsafe { BackendEvent::open_ipc_handle(&handle.0) }
    }

    fn wait_event(&self, device: u32, event: &BackendEvent, stream: StreamId) -> DeviceResult<()> {
        self.current(device)?;
        // SAFETY: the event is live (borrowed); the stream is the current context's default stream
        // or a live stream of the device (the caller's obligation, as for every StreamId).
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.0 as sys::CUstream, event.as_raw(), 0)
        })
    }

    /// The device of `stream`'s context: `cuStreamGetCtx`, that context made current for a
    /// `cuCtxGetDevice` and the previous one current again.
    ///
    /// # References
    ///
    /// - [`cuStreamGetCtx`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) (Stream Management)
    /// - [`cuCtxGetDevice`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html) (Context Management)
    #[doc(alias = "cuStreamGetCtx")]
    fn stream_device(&self, stream: StreamId) -> DeviceResult<Option<u32>> {
        let raw = stream.0 as sys::CUstream;
        if raw.is_null() {
            return Ok(None);
        }
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the stream is live (the caller's obligation for every StreamId); `ctx` is a valid
        // out-parameter.
        check("cuStreamGetCtx", unsafe {
            sys::cuStreamGetCtx(raw, &mut ctx)
        })?;
        // SAFETY: `ctx` is the stream's live context; it is pushed, asked and popped again, so the
        // calling thread's current context is what it was.
        unsafe {
            check("cuCtxPushCurrent", sys::cuCtxPushCurrent_v2(ctx))?;
            let mut device = 0;
            let asked = check("cuCtxGetDevice", sys::cuCtxGetDevice(&mut device));
            let mut popped = std::ptr::null_mut();
            check("cuCtxPopCurrent", sys::cuCtxPopCurrent_v2(&mut popped))?;
            asked?;
            Ok(u32::try_from(device).ok())
        }
    }

    fn enable_peer_access(&self, device: u32, peer: u32) -> DeviceResult<()> {
        let peer_backend = self.current(peer)?;
        self.current(device)?.enable_peer_access(peer_backend)
    }

    unsafe fn copy_batch(
        &self,
        device: u32,
        copies: &[DeviceCopy],
        stream: StreamId,
    ) -> DeviceResult<()> {
        self.current(device)?;
        let raw = stream.0 as sys::CUstream;
        if copies.len() > 1 && !raw.is_null() && batch_copies_supported() {
            // SAFETY: the caller guarantees every range is device memory usable here until the
            // copies ran and that no destination overlaps; the stream is live (the caller's
            // obligation for every StreamId) and not the legacy default stream.
            return unsafe { copy_batched(device, copies, raw) };
        }
        for copy in copies {
            // SAFETY: as above, one range at a time.
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(copy.dst.0, copy.src.0, copy.len as usize, raw)
            })?;
        }
        Ok(())
    }
}

/// Whether the driver has `cuMemcpyBatchAsync` in its CUDA 13 form (driver 13.0 or newer).
fn batch_copies_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let mut version = 0;
        // SAFETY: `version` is a valid out-parameter; the driver was initialised by `new`.
        let ok = unsafe { sys::cuDriverGetVersion(&mut version) } == sys::CUresult::CUDA_SUCCESS;
        ok && version >= 13_000
    })
}

/// The most copies handed to one `cuMemcpyBatchAsync` call (the three arrays stay a few MiB).
const BATCH_LIMIT: usize = 65_536;

/// One `cuMemcpyBatchAsync` per [`BATCH_LIMIT`] copies, all with one attribute: sources read in
/// stream order, both sides on `device`.
///
/// # Safety
///
/// As [`IpcDriver::copy_batch`]; `stream` is a live stream of `device`'s current context, not the
/// legacy default stream.
unsafe fn copy_batched(
    device: u32,
    copies: &[DeviceCopy],
    stream: sys::CUstream,
) -> DeviceResult<()> {
    // SAFETY: a plain C struct; all-zero bytes is a valid value, the fields used are set below.
    let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    attr.srcLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    attr.srcLocHint.id = device as i32;
    attr.dstLocHint = attr.srcLocHint;
    for chunk in copies.chunks(BATCH_LIMIT) {
        let mut dsts: Vec<sys::CUdeviceptr> = chunk.iter().map(|c| c.dst.0).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = chunk.iter().map(|c| c.src.0).collect();
        let mut sizes: Vec<usize> = chunk.iter().map(|c| c.len as usize).collect();
        let mut index = 0usize;
        // SAFETY: the three arrays hold `chunk.len()` entries each and live for the call; one
        // attribute applies from copy 0 on; the ranges are the caller's obligation.
        check("cuMemcpyBatchAsync", unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                chunk.len(),
                &mut attr,
                &mut index,
                1,
                stream,
            )
        })?;
    }
    Ok(())
}
