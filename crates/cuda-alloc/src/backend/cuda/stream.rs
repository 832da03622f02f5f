//! Owned non-blocking streams, and the few stream operations tests and users need around the allocator
//! (memset, copies, host functions).

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use cudarc::driver::{sys, CudaStream as CudarcStream};

use super::driver::check;
use super::CudaBackend;
use crate::device::{DeviceAddress, DeviceResult, StreamId};

/// A non-blocking CUDA stream of one device: a [cudarc stream](cudarc::driver::CudaStream) made in the
/// device's primary context and entered in the backend's stream registry, so the allocator accepts its
/// [`StreamId`], plus the few operations tests and users need around the allocator.
///
/// Its [`StreamId`] is the numeric value of its handle, which is how the allocator, snapshots and traces
/// name streams. The stream is destroyed when the last reference to it goes, unless the allocator has
/// used it: from then on the registry keeps it alive (like PyTorch's streams, which are never
/// destroyed), so the allocator can always record events on it. Dropping a stream with work still
/// queued is allowed: the driver finishes the work first.
#[derive(Debug, Clone)]
pub struct BackendStream {
    inner: Arc<CudarcStream>,
    /// The device ordinal.
    ordinal: u32,
}

/// A host function queued on a stream: the boxed closure the trampoline runs once.
type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// Runs the closure handed to `cuLaunchHostFunc`; a panic is caught (it must not unwind into the driver).
unsafe extern "C" fn run_host_fn(data: *mut c_void) {
    // SAFETY: `data` is the `Box<HostFn>` leaked by `launch_host_fn`, handed to the driver once, and the
    // driver calls this function exactly once with it.
    let f: Box<HostFn> = unsafe { Box::from_raw(data.cast::<HostFn>()) };
    if std::panic::catch_unwind(AssertUnwindSafe(f)).is_err() {
        tracing::error!(
            "a host function queued on a CUDA stream panicked; the panic was contained"
        );
    }
}

impl BackendStream {
    /// Creates a non-blocking stream on `device` (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`).
    ///
    /// # References
    ///
    /// - [`cuStreamCreate`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) (Stream Management)
    #[doc(alias = "cuStreamCreate")]
    pub fn new(device: &CudaBackend) -> DeviceResult<Self> {
        Self::with_priority(device, 0)
    }

    /// Creates a non-blocking stream with a priority (`cuStreamCreateWithPriority`; lower numbers are
    /// higher priority, `0` is the default).
    ///
    /// # References
    ///
    /// - [`cuStreamCreateWithPriority`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) (Stream Management)
    #[doc(alias = "cuStreamCreateWithPriority")]
    pub fn with_priority(device: &CudaBackend, priority: i32) -> DeviceResult<Self> {
        device.make_current()?;
        let inner = device
            .cudarc_context()
            .new_stream_with_priority(priority)
            .map_err(|e| super::driver::error("cuStreamCreateWithPriority", e.0))?;
        super::registry::register(device.ordinal(), &inner, false);
        Ok(Self {
            inner,
            ordinal: device.ordinal(),
        })
    }

    /// The cudarc stream, for cudarc's copies, kernel launches and slices.
    #[inline]
    #[must_use]
    pub fn as_cudarc(&self) -> &Arc<CudarcStream> {
        &self.inner
    }

    /// The stream's name for the allocator: its handle value.
    #[inline]
    #[must_use]
    pub fn id(&self) -> StreamId {
        StreamId(self.inner.cu_stream() as u64)
    }

    /// The ordinal of the device the stream belongs to.
    #[inline]
    #[must_use]
    pub fn device_index(&self) -> u32 {
        self.ordinal
    }

    /// The raw handle, for driver calls this crate does not wrap. It stays owned by `self`.
    #[inline]
    #[must_use]
    pub fn as_raw(&self) -> sys::CUstream {
        self.inner.cu_stream()
    }

    /// Blocks until all work queued on the stream has finished (`cuStreamSynchronize`).
    ///
    /// # References
    ///
    /// - [`cuStreamSynchronize`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) (Stream Management)
    #[doc(alias = "cuStreamSynchronize")]
    pub fn synchronize(&self) -> DeviceResult<()> {
        // SAFETY: the stream is live.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.as_raw())
        })
    }

    /// Whether all work queued on the stream has finished (`cuStreamQuery`), without blocking.
    ///
    /// # References
    ///
    /// - [`cuStreamQuery`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) (Stream Management)
    #[doc(alias = "cuStreamQuery")]
    pub fn is_idle(&self) -> DeviceResult<bool> {
        // SAFETY: the stream is live.
        match unsafe { sys::cuStreamQuery(self.as_raw()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuStreamQuery", other).map(|()| false),
        }
    }

    /// Makes later work on this stream wait for `event` (`cuStreamWaitEvent`).
    ///
    /// # References
    ///
    /// - [`cuStreamWaitEvent`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html) (Stream Management)
    #[doc(alias = "cuStreamWaitEvent")]
    pub fn wait_event(&self, event: &super::BackendEvent) -> DeviceResult<()> {
        // SAFETY: the stream and the event are live.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.as_raw(), event.as_raw(), 0)
        })
    }

    /// Records `event` on this stream (`cuEventRecord`): it completes once the work queued so far has.
    ///
    /// # References
    ///
    /// - [`cuEventRecord`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html) (Event Management)
    #[doc(alias = "cuEventRecord")]
    pub fn record(&self, event: &super::BackendEvent) -> DeviceResult<()> {
        // SAFETY: the stream is live and non-null (so the current context does not matter).
        unsafe { event.record_raw(self.as_raw()) }
    }

    /// Queues `f` to run on a driver thread once the work queued before it has finished
    /// (`cuLaunchHostFunc`); work queued after it waits for it to return. Tests use it to hold a stream
    /// busy for as long as they like.
    ///
    /// A panic in `f` is caught and logged.
    ///
    /// # Safety
    ///
    /// `f` makes no CUDA call (the driver forbids it in host functions; it may fail or deadlock).
    ///
    /// # References
    ///
    /// - [`cuLaunchHostFunc`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html) (Execution Control)
    #[doc(alias = "cuLaunchHostFunc")]
    pub unsafe fn launch_host_fn(&self, f: impl FnOnce() + Send + 'static) -> DeviceResult<()> {
        let data = Box::into_raw(Box::new(Box::new(f) as HostFn)).cast::<c_void>();
        // SAFETY: the stream is live; `run_host_fn` takes back ownership of `data` when the driver calls it.
        let result = unsafe { sys::cuLaunchHostFunc(self.as_raw(), Some(run_host_fn), data) };
        if result != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: the launch failed, so the driver will never call `run_host_fn`; reclaim the box.
            drop(unsafe { Box::from_raw(data.cast::<HostFn>()) });
        }
        check("cuLaunchHostFunc", result)
    }

    /// Queues a fill of `len` bytes at `ptr` with `value` (`cuMemsetD8Async`).
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + len)` is device memory this stream may write, and nothing else uses it until the fill
    /// has completed.
    ///
    /// # References
    ///
    /// - [`cuMemsetD8Async`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemsetD8Async")]
    pub unsafe fn memset_d8(&self, ptr: DeviceAddress, value: u8, len: usize) -> DeviceResult<()> {
        // SAFETY: the stream is live; the range is the caller's obligation.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr.0, value, len, self.as_raw())
        })
    }

    /// Copies `src` from the host to `dst` on this stream and waits for the copy (`cuMemcpyHtoDAsync`,
    /// `cuStreamSynchronize`).
    ///
    /// # Safety
    ///
    /// `[dst, dst + src.len())` is device memory this stream may write.
    ///
    /// # References
    ///
    /// - [`cuMemcpyHtoDAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub unsafe fn copy_from_host(&self, dst: DeviceAddress, src: &[u8]) -> DeviceResult<()> {
        // SAFETY: `src` is valid for reads of its length until the synchronize below returns; the
        // destination is the caller's obligation.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr().cast(), src.len(), self.as_raw())
        })?;
        self.synchronize()
    }

    /// Copies `dst.len()` bytes from `src` to the host on this stream and waits for the copy
    /// (`cuMemcpyDtoHAsync`, `cuStreamSynchronize`).
    ///
    /// # Safety
    ///
    /// `[src, src + dst.len())` is device memory this stream may read.
    ///
    /// # References
    ///
    /// - [`cuMemcpyDtoHAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub unsafe fn copy_to_host(&self, dst: &mut [u8], src: DeviceAddress) -> DeviceResult<()> {
        // SAFETY: `dst` is valid for writes of its length until the synchronize below returns (it is
        // borrowed mutably for the whole call); the source is the caller's obligation.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src.0, dst.len(), self.as_raw())
        })?;
        self.synchronize()
    }

    /// Queues a copy of `len` bytes from `src` (on `src_device`) to `dst` (on `dst_device`)
    /// (`cuMemcpyPeerAsync`); works with or without peer access enabled (the driver stages through the
    /// host without it).
    ///
    /// # Safety
    ///
    /// The two ranges are device memory of the named devices, `dst` is not used by anything else until the
    /// copy completes and `src` is not written meanwhile.
    ///
    /// # References
    ///
    /// - [`cuMemcpyPeerAsync`](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html) (Memory Management)
    #[doc(alias = "cuMemcpyPeerAsync")]
    pub unsafe fn copy_peer(
        &self,
        dst: DeviceAddress,
        dst_device: &CudaBackend,
        src: DeviceAddress,
        src_device: &CudaBackend,
        len: usize,
    ) -> DeviceResult<()> {
        // SAFETY: the stream and both contexts are live; the ranges are the caller's obligation.
        check("cuMemcpyPeerAsync", unsafe {
            sys::cuMemcpyPeerAsync(
                dst.0,
                dst_device.context().raw(),
                src.0,
                src_device.context().raw(),
                len,
                self.as_raw(),
            )
        })
    }
}
