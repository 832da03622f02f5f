//! The CUDA backend: [`Device`] on a real GPU through the CUDA driver API (feature `cuda`).
//!
//! Built on [cudarc](https://docs.rs/cudarc) with dynamic loading: building needs no CUDA toolkit, and
//! `libcuda.so` is looked up when the first device is opened. Where cudarc's safe layer has no wrapper
//! (virtual memory, interprocess events, graph-capture status, host functions) this module calls the raw
//! driver API (`cudarc::driver::sys`) and checks every `CUresult` with [`check`] (the one conversion,
//! used by the IPC crate and the PyTorch plugin too), turning failures into
//! [`DeviceError::Driver`] (the call, the code, and the driver's name and description of it) and
//! `CUDA_ERROR_OUT_OF_MEMORY` into [`DeviceError::OutOfMemory`], which the allocator answers by freeing
//! cached memory and retrying.
//!
//! | CUDA concept | here |
//! | --- | --- |
//! | device ordinal + primary context | [`CudaBackend`] (one per ordinal; the context is retained for the process) |
//! | `cudaStream_t` created non-blocking | [`BackendStream`] (a cudarc stream); its [`StreamId`] is the handle value |
//! | cudarc's `Arc<CudaContext>` / `Arc<CudaStream>` | [`CudaBackend::from_context`] / [`CudaBackend::register_stream`] |
//! | `cudaEvent_t` (timing disabled, optionally interprocess) | [`BackendEvent`] |
//! | `CUmemGenericAllocationHandle` | [`PhysicalChunk`] |
//! | `cudaGetDeviceProperties` | [`device_properties`] |
//! | NVML's process list (`reportProcessMemoryInfo`) | [`Device::process_memory`] |
//!
//! # Without a driver or a device
//!
//! cudarc panics when `libcuda.so` is missing; this backend probes for the library first and calls
//! `cuInit` under `catch_unwind`, so [`CudaBackend::new`], [`device_count`] and friends return
//! [`DeviceError::Driver`] with code 100 (`CUDA_ERROR_NO_DEVICE`) and a message saying what is missing.
//! [`init`] tells whether CUDA is usable at all.
//!
//! # Threads and contexts
//!
//! Driver calls that act on "the current context" (allocation, event and stream creation, memory info,
//! synchronisation) first make the device's primary context current on the calling thread, unless the
//! driver already reports it current (one cheap `cuCtxGetCurrent`). The context is not cached on our side:
//! other code in the process (the CUDA runtime, PyTorch) may switch it at any time.
//!
//! # Graph capture
//!
//! The calls that create memory (`cuMemAlloc`, `cuMemAddressReserve`, `cuMemCreate`, `cuMemMap` and
//! `cuMemSetAccess`) run with the calling thread in relaxed capture mode (restored afterwards), so the
//! cache can grow while a stream is being captured into a graph, even in global mode (PyTorch's
//! `cudaMallocMaybeCapturing`). [`CudaBackend::is_capturing`] tells whether a stream is capturing.

mod capture;
mod context;
pub(crate) mod driver;
mod event;
mod nvml;
mod pinned;
mod properties;
pub(crate) mod registry;
mod stream;
mod vmm;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaStream as CudarcStream};
use parking_lot::Mutex;

use crate::device::{
    CaptureStatus, Device, DeviceAddress, DeviceError, DeviceResult, MemInfo, ProcessMemory,
    StreamId,
};

pub use context::has_primary_context;
use context::PrimaryContext;
pub(crate) use driver::error as driver_error;
pub use driver::{check, device_count, init};
pub use event::{BackendEvent, IPC_HANDLE_SIZE};
pub use pinned::CudaPinnedSource;
pub use properties::{can_access_peer, device_properties, DeviceProperties, DeviceUuid};
pub use stream::BackendStream;
use vmm::ChunkKind;
pub use vmm::PhysicalChunk;

/// The minimum alignment the allocator relies on (trait obligation 1).
const MIN_ALIGNMENT: u64 = 512;

/// One CUDA device as the allocator's memory provider.
///
/// Create one per device ordinal with [`CudaBackend::new`] and hand it to the allocator. It uses the
/// device's primary context (the one the CUDA runtime and PyTorch use), so pointers and streams are
/// interchangeable with runtime-API code in the same process.
#[derive(Debug)]
pub struct CudaBackend {
    /// The device ordinal.
    ordinal: u32,
    /// The primary context, retained for the rest of the process.
    ctx: &'static PrimaryContext,
    /// The same context as cudarc's handle (streams are made through it).
    cudarc: Arc<CudaContext>,
    /// The first error kept by [`Device::record_error`], for [`CudaBackend::check_err`].
    kept_error: Mutex<Option<DeviceError>>,
    /// How physical chunks are created; read on first virtual-memory use.
    chunk_kind: OnceLock<DeviceResult<ChunkKind>>,
    /// The mapping granularity; read on first virtual-memory use.
    granularity: OnceLock<DeviceResult<usize>>,
    /// Who may access this device's mapped virtual memory, and what is mapped.
    vmm: Mutex<VmmAccess>,
}

/// The state behind [`CudaBackend::enable_peer_access`] for virtual memory: unlike `cuMemAlloc` memory,
/// mapped chunks are accessible only to devices named in `cuMemSetAccess`, so a peer granted access later
/// must be given access to every live mapping too.
#[derive(Debug, Default)]
struct VmmAccess {
    /// Devices other than this one that were granted access (no duplicates).
    peers: Vec<sys::CUdevice>,
    /// Live mappings: start address -> length.
    mapped: BTreeMap<u64, usize>,
}

impl CudaBackend {
    /// Opens device `ordinal`: loads and initialises the driver if needed and retains the device's
    /// primary context.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Driver`] with `CUDA_ERROR_NO_DEVICE` (100) when there is no driver or no device,
    /// `CUDA_ERROR_INVALID_DEVICE` (101) when `ordinal` is past the device count.
    pub fn new(ordinal: u32) -> DeviceResult<Self> {
        // Probes for the driver first: cudarc panics where libcuda.so is missing.
        PrimaryContext::get(ordinal)?;
        let cudarc = CudaContext::new(ordinal as usize)
            .map_err(|e| driver::error("cuDevicePrimaryCtxRetain", e.0))?;
        Self::from_context(cudarc)
    }

    /// The backend of the device of a cudarc context, so that a program has one context and one set
    /// of streams: the allocator's memory is usable by cudarc's kernels and copies, and cudarc's streams
    /// (registered with [`register_stream`](Self::register_stream)) are the allocator's streams.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] unless `ctx` is the device's primary context (the one
    /// `CudaContext::new` retains, which the CUDA runtime and PyTorch use too); driver errors.
    pub fn from_context(ctx: Arc<CudaContext>) -> DeviceResult<Self> {
        if !ctx.is_primary() {
            return Err(DeviceError::Unsupported {
                what: "non-primary CUDA contexts (make the context with CudaContext::new)",
            });
        }
        let ordinal = u32::try_from(ctx.ordinal()).map_err(|_| DeviceError::Unsupported {
            what: "device ordinals past u32::MAX",
        })?;
        let primary = PrimaryContext::get(ordinal)?;
        debug_assert_eq!(
            primary.raw(),
            ctx.cu_ctx(),
            "one primary context per device"
        );
        Ok(Self {
            ordinal,
            ctx: primary,
            cudarc: ctx,
            kept_error: Mutex::new(None),
            chunk_kind: OnceLock::new(),
            granularity: OnceLock::new(),
            vmm: Mutex::new(VmmAccess::default()),
        })
    }

    /// The cudarc context of this device (its primary context).
    #[inline]
    #[must_use]
    pub fn cudarc_context(&self) -> &Arc<CudaContext> {
        &self.cudarc
    }

    /// Hands a cudarc stream of this device to the allocator: returns the [`StreamId`] the allocator
    /// knows it by. The stream is kept alive from then on (for the rest of the process), so events can
    /// be recorded on it whenever a block used on it is freed.
    ///
    /// # Errors
    ///
    /// [`DeviceError::UnknownStream`] if the stream belongs to another context.
    pub fn register_stream(&self, stream: &Arc<CudarcStream>) -> DeviceResult<StreamId> {
        let id = StreamId(stream.cu_stream() as u64);
        if stream.context().cu_ctx() != self.ctx.raw() {
            return Err(DeviceError::UnknownStream {
                stream: id,
                device: self.ordinal,
            });
        }
        Ok(registry::register(self.ordinal, stream, true))
    }

    /// The cudarc stream the allocator knows as `stream`, if it is one made by or registered with the
    /// backend (`None` for the default streams and for unknown ids).
    #[must_use]
    pub fn cudarc_stream(&self, stream: StreamId) -> Option<Arc<CudarcStream>> {
        registry::lookup(self.ordinal, stream)
    }

    /// Returns (and forgets) the first error kept while an allocator on this device was dropped (see
    /// [`Device::record_error`]); it is also recorded in the cudarc context
    /// (`CudaContext::check_err`).
    ///
    /// # Errors
    ///
    /// The kept error.
    pub fn check_err(&self) -> DeviceResult<()> {
        match self.kept_error.lock().take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// The device ordinal.
    #[inline]
    #[must_use]
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The primary context.
    #[inline]
    pub(crate) fn context(&self) -> &'static PrimaryContext {
        self.ctx
    }

    /// Makes this device's primary context current on the calling thread (`cuCtxSetCurrent`), like
    /// `cudaSetDevice`; a no-op if it already is.
    ///
    /// # References
    ///
    /// - [`cuCtxSetCurrent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html) (Context Management)
    #[doc(alias = "cuCtxSetCurrent")]
    pub fn make_current(&self) -> DeviceResult<()> {
        self.ctx.make_current()
    }

    /// Whether `stream` is being captured into a CUDA graph (`cuStreamGetCaptureInfo`): `true` for an
    /// active capture and for one that was invalidated but not yet ended, like PyTorch's
    /// `is_current_stream_capturing` on the stream.
    ///
    /// # Errors
    ///
    /// [`DeviceError::UnknownStream`] for a stream this backend does not know; driver errors.
    pub fn is_capturing(&self, stream: StreamId) -> DeviceResult<bool> {
        Ok(self.capture_status(stream)? != CaptureStatus::None)
    }

    /// The device's properties (see [`device_properties`]).
    pub fn properties(&self) -> DeviceResult<DeviceProperties> {
        device_properties(self.ordinal)
    }

    /// Whether the physical memory of this device's expandable segments is made GPUDirect RDMA
    /// capable (`CUmemAllocationProp::allocFlags.gpuDirectRDMACapable`, set where the device reports
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`): an RDMA library (NIXL, a
    /// network transport of NCCL) can then register the segments' mapped ranges as they are. A
    /// registration must follow the mapping: the trace tracker's `segment_map` and `segment_unmap`
    /// events say when ranges come and go (see `docs/nccl.md`).
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] without virtual memory management (no expandable segments).
    ///
    /// # References
    ///
    /// - [`CUmemAllocationProp`](https://docs.nvidia.com/cuda/cuda-driver-api/structCUmemAllocationProp__v1.html)
    /// - [`cuDeviceGetAttribute`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html) (Device Management)
    #[doc(alias = "gpuDirectRDMACapable")]
    pub fn expandable_memory_rdma_capable(&self) -> DeviceResult<bool> {
        Ok(self.chunk_kind()?.rdma_capable())
    }

    /// Creates an interprocess-capable event (`cuEventCreate` with `CU_EVENT_DISABLE_TIMING |
    /// CU_EVENT_INTERPROCESS`), for the CUDA IPC layer: export it with [`BackendEvent::ipc_handle`].
    ///
    /// # References
    ///
    /// - [`cuEventCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html) (Event Management)
    #[doc(alias = "cuEventCreate")]
    pub fn create_interprocess_event(&self) -> DeviceResult<BackendEvent> {
        self.ctx.make_current()?;
        BackendEvent::create_in_current_context(true)
    }

    /// Creates a non-blocking stream on this device (see [`BackendStream::new`]).
    pub fn create_stream(&self) -> DeviceResult<BackendStream> {
        BackendStream::new(self)
    }

    /// Lets kernels and copies running on this device access memory of `peer` directly
    /// (`cuCtxEnablePeerAccess` from this device's context to `peer`'s), and grants this device access to
    /// `peer`'s virtual-memory mappings, present and future (`cuMemSetAccess`), which peer access alone
    /// does not cover. Enabling twice is not an error.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] if the hardware cannot (see [`can_access_peer`]) or `peer` is this
    /// device; the driver's errors otherwise.
    ///
    /// # References
    ///
    /// - [`cuCtxEnablePeerAccess`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html) (Peer Context Memory Access)
    /// - [`cuMemSetAccess`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuCtxEnablePeerAccess")]
    pub fn enable_peer_access(&self, peer: &CudaBackend) -> DeviceResult<()> {
        if !can_access_peer(self.ordinal, peer.ordinal)? {
            return Err(DeviceError::Unsupported {
                what: "peer access between these two devices (cuDeviceCanAccessPeer says no)",
            });
        }
        self.ctx.make_current()?;
        // SAFETY: this device's context is current and `peer`'s context is live; flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.raw(), 0) } {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
            other => driver::check("cuCtxEnablePeerAccess", other)?,
        }
        peer.grant_vmm_access(self.ctx.device())
    }

    /// Adds `dev` to the devices that may access this device's virtual-memory mappings, and gives it
    /// access to every live mapping.
    fn grant_vmm_access(&self, dev: sys::CUdevice) -> DeviceResult<()> {
        let mut vmm = self.vmm.lock();
        if dev == self.ctx.device() || vmm.peers.contains(&dev) {
            return Ok(());
        }
        for (&ptr, &size) in &vmm.mapped {
            // SAFETY: `mapped` lists exactly the live mappings (`map` inserts after mapping, `unmap`
            // removes before unmapping, both under this lock).
            unsafe { vmm::set_access(ptr, size, &[dev])? };
        }
        vmm.peers.push(dev);
        Ok(())
    }

    fn chunk_kind(&self) -> DeviceResult<ChunkKind> {
        self.chunk_kind
            .get_or_init(|| ChunkKind::of(self.ctx.device()))
            .clone()
    }
}

// SAFETY: the obligations of `Device` hold:
// 1. `malloc` returns what `cuMemAlloc` returned; the driver hands a range out once until `cuMemFree`, and
//    the address is checked to be 512-byte aligned (the driver aligns to at least 256 bytes and in
//    practice to 512 or more; a less aligned address is freed and reported as an error).
// 2. `reserve_address_range` asks `cuMemAddressReserve` for an alignment of the granularity; reserved
//    ranges never overlap each other or `cuMemAlloc` memory (unified address space).
// 3. Events are real CUDA events, which complete only after the work recorded before them.
// 4. Nothing here calls back into an allocator: only driver calls, host functions are never queued by
//    these methods.
// 5. `check_stream`, `record_event` and `capture_status` accept only the default streams and streams of
//    this device in the registry, which pins them (keeps them alive) once checked.
unsafe impl Device for CudaBackend {
    type Event = BackendEvent;
    type PhysicalChunk = PhysicalChunk;

    #[inline]
    fn index(&self) -> u32 {
        self.ordinal
    }

    /// [`Device::mem_info`] through `cuMemGetInfo`, in this device's primary context.
    ///
    /// # References
    ///
    /// - [`cuMemGetInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemGetInfo")]
    fn mem_info(&self) -> DeviceResult<MemInfo> {
        self.ctx.make_current()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: this device's context is current; both out-parameters are valid.
        driver::check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    /// [`Device::malloc`] through `cuMemAlloc`, in this device's primary context.
    ///
    /// # References
    ///
    /// - [`cuMemAlloc`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemAlloc")]
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        self.ctx.make_current()?;
        let relaxed = capture::RelaxedCapture::enter()?;
        let mut ptr = 0;
        // SAFETY: this device's context is current; `ptr` is a valid out-parameter.
        let result = unsafe { sys::cuMemAlloc_v2(&mut ptr, size) };
        drop(relaxed);
        driver::check_alloc("cuMemAlloc", result, size)?;
        if ptr % MIN_ALIGNMENT != 0 {
            // SAFETY: `ptr` was just allocated by `cuMemAlloc` and is unused.
            let freed = unsafe { sys::cuMemFree_v2(ptr) };
            if let Err(err) = driver::check("cuMemFree", freed) {
                tracing::warn!(%err, "freeing a misaligned allocation failed");
            }
            return Err(DeviceError::Driver {
                call: "cuMemAlloc",
                code: sys::CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE as i32,
                message: format!(
                    "returned {ptr:#x}, which is not aligned to {MIN_ALIGNMENT} bytes"
                ),
            });
        }
        Ok(DeviceAddress(ptr))
    }

    /// [`Device::free`] through `cuMemFree`.
    ///
    /// # References
    ///
    /// - [`cuMemFree`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemFree")]
    unsafe fn free(&self, ptr: DeviceAddress, _size: usize) -> DeviceResult<()> {
        self.ctx.make_current()?;
        // SAFETY: the caller guarantees `ptr` came from `malloc` here, is freed once, and is idle.
        driver::check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn create_event(&self) -> DeviceResult<BackendEvent> {
        self.ctx.make_current()?;
        BackendEvent::create_in_current_context(false)
    }

    fn check_stream(&self, stream: StreamId) -> DeviceResult<()> {
        registry::check_and_pin(self.ordinal, stream)
    }

    fn record_error(&self, error: DeviceError) {
        tracing::warn!(%error, device = self.ordinal, "device error met while dropping an allocator");
        if let DeviceError::Driver { code, .. } = &error {
            if let Some(result) = driver::result_of(*code) {
                self.cudarc
                    .record_err(Err::<(), _>(cudarc::driver::DriverError(result)));
            }
        }
        self.kept_error.lock().get_or_insert(error);
    }

    #[inline]
    fn record_event(&self, event: &BackendEvent, stream: StreamId) -> DeviceResult<()> {
        registry::check_and_pin(self.ordinal, stream)?;
        if stream == StreamId::DEFAULT || stream.0 == registry::PER_THREAD_STREAM {
            // The default streams are the current context's: make sure it is this device's.
            self.ctx.make_current()?;
        }
        // SAFETY: `stream` is a default stream, whose context was just made current, or a stream of this
        // device in the registry, pinned there (kept alive for the process) by the check above.
        unsafe { event.record_raw(stream.0 as sys::CUstream) }
    }

    #[inline]
    fn query_event(&self, event: &BackendEvent) -> DeviceResult<bool> {
        event.query()
    }

    fn synchronize_event(&self, event: &BackendEvent) -> DeviceResult<()> {
        event.synchronize()
    }

    /// [`Device::synchronize`] through `cuCtxSynchronize`, in this device's primary context.
    ///
    /// # References
    ///
    /// - [`cuCtxSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html) (Context Management)
    #[doc(alias = "cuCtxSynchronize")]
    fn synchronize(&self) -> DeviceResult<()> {
        self.ctx.make_current()?;
        // SAFETY: this device's context is current.
        driver::check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// [`Device::capture_status`] through `cuStreamGetCaptureInfo`.
    ///
    /// # References
    ///
    /// - [`cuStreamGetCaptureInfo`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) (Stream Management)
    #[doc(alias = "cuStreamGetCaptureInfo")]
    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        registry::check_and_pin(self.ordinal, stream)?;
        if stream == StreamId::DEFAULT || stream.0 == registry::PER_THREAD_STREAM {
            self.ctx.make_current()?;
        }
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id = 0;
        // SAFETY: the stream is live (checked above, see `record_event`); the optional outputs are null, which the driver
        // accepts; `status` and `id` are valid out-parameters.
        driver::check("cuStreamGetCaptureInfo", unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream.0 as sys::CUstream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                CaptureStatus::Active { id }
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated
            }
        })
    }

    /// [`Device::process_memory`] through NVML (`libnvidia-ml.so.1`, opened at run time on the first
    /// out-of-memory error): `nvmlDeviceGetComputeRunningProcesses` on the device found by its PCI
    /// bus id, as PyTorch's `reportProcessMemoryInfo` does. `None` without NVML.
    ///
    /// # References
    ///
    /// - [`nvmlDeviceGetComputeRunningProcesses`](https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html) (Device Queries)
    #[doc(alias = "nvmlDeviceGetComputeRunningProcesses")]
    fn process_memory(&self) -> Option<Vec<ProcessMemory>> {
        nvml::process_memory(self.ordinal)
    }

    /// [`Device::vmm_granularity`] through `cuMemGetAllocationGranularity` (asked once, then cached).
    ///
    /// # References
    ///
    /// - [`cuMemGetAllocationGranularity`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuMemGetAllocationGranularity")]
    fn vmm_granularity(&self) -> DeviceResult<usize> {
        self.granularity
            .get_or_init(|| self.chunk_kind()?.granularity())
            .clone()
    }

    /// [`Device::reserve_address_range`] through `cuMemAddressReserve`, aligned to the granularity.
    ///
    /// # References
    ///
    /// - [`cuMemAddressReserve`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuMemAddressReserve")]
    fn reserve_address_range(&self, size: usize) -> DeviceResult<DeviceAddress> {
        let granularity = self.vmm_granularity()?;
        self.ctx.make_current()?;
        let _relaxed = capture::RelaxedCapture::enter()?;
        let mut ptr = 0;
        // SAFETY: this device's context is current; `ptr` is a valid out-parameter; no fixed address is
        // requested (0) and flags must be 0.
        let result = unsafe { sys::cuMemAddressReserve(&mut ptr, size, granularity, 0, 0) };
        driver::check_alloc("cuMemAddressReserve", result, size)?;
        Ok(DeviceAddress(ptr))
    }

    /// [`Device::release_address_range`] through `cuMemAddressFree`.
    ///
    /// # References
    ///
    /// - [`cuMemAddressFree`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuMemAddressFree")]
    unsafe fn release_address_range(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        // SAFETY: the caller guarantees the range was reserved with this size and has nothing mapped.
        driver::check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr.0, size)
        })
    }

    /// [`Device::create_physical`] through `cuMemCreate`.
    ///
    /// # References
    ///
    /// - [`cuMemCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuMemCreate")]
    fn create_physical(&self, size: usize) -> DeviceResult<PhysicalChunk> {
        let kind = self.chunk_kind()?;
        self.ctx.make_current()?;
        let _relaxed = capture::RelaxedCapture::enter()?;
        kind.create(size)
    }

    /// [`Device::map`] through `cuMemMap`, then `cuMemSetAccess` for this device and its peers.
    ///
    /// # References
    ///
    /// - [`cuMemMap`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    /// - [`cuMemSetAccess`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuMemMap")]
    unsafe fn map(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: &PhysicalChunk,
    ) -> DeviceResult<()> {
        debug_assert_eq!(size, chunk.size(), "a chunk is mapped whole");
        let _relaxed = capture::RelaxedCapture::enter()?;
        let mut vmm = self.vmm.lock();
        // SAFETY: the caller guarantees the range is reserved, unmapped, and `size` is the chunk's size.
        driver::check("cuMemMap", unsafe {
            sys::cuMemMap(ptr.0, size, 0, chunk.as_raw(), 0)
        })?;
        let mut devices = Vec::with_capacity(1 + vmm.peers.len());
        devices.push(self.ctx.device());
        devices.extend_from_slice(&vmm.peers);
        // SAFETY: the range was mapped in full just above.
        if let Err(err) = unsafe { vmm::set_access(ptr.0, size, &devices) } {
            // SAFETY: undo the mapping made above; nothing can have used it (no access was granted).
            let unmapped = unsafe { sys::cuMemUnmap(ptr.0, size) };
            if let Err(unmap_err) = driver::check("cuMemUnmap", unmapped) {
                tracing::warn!(%unmap_err, "undoing a mapping whose access could not be set failed");
            }
            return Err(err);
        }
        vmm.mapped.insert(ptr.0, size);
        Ok(())
    }

    /// [`Device::unmap`] through `cuMemUnmap`, then `cuMemRelease` of the chunk.
    ///
    /// # References
    ///
    /// - [`cuMemUnmap`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    /// - [`cuMemRelease`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html) (Virtual Memory Management)
    #[doc(alias = "cuMemUnmap")]
    unsafe fn unmap(
        &self,
        ptr: DeviceAddress,
        size: usize,
        chunk: PhysicalChunk,
    ) -> DeviceResult<()> {
        let mut vmm = self.vmm.lock();
        vmm.mapped.remove(&ptr.0);
        // SAFETY: the caller guarantees `chunk` is mapped exactly at this range and is idle.
        driver::check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr.0, size) })?;
        drop(vmm);
        chunk.release()
    }

    fn export_physical(&self, chunk: &PhysicalChunk) -> DeviceResult<std::os::fd::OwnedFd> {
        chunk.export_fd()
    }

    /// [`Device::copy_to_host`] through `cuMemcpyDtoH`, in this device's primary context.
    ///
    /// # References
    ///
    /// - [`cuMemcpyDtoH`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemcpyDtoH")]
    unsafe fn copy_to_host(
        &self,
        src: DeviceAddress,
        dst: *mut u8,
        len: usize,
    ) -> DeviceResult<()> {
        if len == 0 {
            return Ok(());
        }
        self.ctx.make_current()?;
        // SAFETY: this device's context is current; the caller guarantees `src` is mapped device
        // memory of `len` bytes no queued work writes and `dst` is valid for writes of `len` bytes.
        driver::check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.cast(), src.0, len)
        })
    }

    /// [`Device::copy_from_host`] through `cuMemcpyHtoD`, in this device's primary context.
    ///
    /// # References
    ///
    /// - [`cuMemcpyHtoD`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemcpyHtoD")]
    unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: DeviceAddress,
        len: usize,
    ) -> DeviceResult<()> {
        if len == 0 {
            return Ok(());
        }
        self.ctx.make_current()?;
        // SAFETY: this device's context is current; the caller guarantees `dst` is mapped device
        // memory of `len` bytes no queued work uses and `src` is valid for reads of `len` bytes.
        driver::check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst.0, src.cast(), len)
        })
    }
}
