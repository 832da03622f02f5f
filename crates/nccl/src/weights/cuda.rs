//! The real engine and collective: copies and events on CUDA streams (tensormem-cuda-alloc's CUDA
//! backend, through cudarc), broadcasts through NCCL (`cudarc::nccl`), staging buffers from
//! `ncclMemAlloc` registered with the communicator ([`NcclPoolAllocator`]).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::nccl::{result, sys};
use tensormem_cuda_alloc::backend::cuda::{check, BackendEvent, BackendStream, CudaBackend};
use tensormem_cuda_alloc::{Device, DeviceAddress, DeviceError, PoolAllocator};

use super::engine::{Collective, CopyEngine, CopySpan, Step};
use super::layout::LocalTensor;
use super::sync::{SyncOptions, WeightSync};
use crate::error::{Error, Result};
use crate::registration::NcclPoolAllocator;

/// A weight sync on CUDA and NCCL.
pub type CudaWeightSync = WeightSync<CudaCopyEngine, NcclCollective>;

/// Connects this rank's end of a weight sync on communicator `comm`: staging buffers from
/// `ncclMemAlloc` registered with `comm`, copies on `stream` (the stream the weights are written on,
/// on the sender, or read on, on a receiver), broadcasts on a stream of its own. See
/// [`WeightSync::connect`] for what every rank agrees on, and its errors.
///
/// # Safety
///
/// `comm` is a live NCCL communicator of `stream`'s device, destroyed only after the returned sync
/// is dropped.
///
/// # Errors
///
/// [`WeightSync::connect`]'s; [`Error::NullCommunicator`]; NCCL's and the device's.
pub unsafe fn connect(
    comm: sys::ncclComm_t,
    stream: BackendStream,
    root: usize,
    tensors: &[LocalTensor],
    options: SyncOptions,
) -> Result<CudaWeightSync> {
    let ordinal = stream.device_index();
    // SAFETY: the caller's obligations: `comm` lives on this device and outlives the sync, which
    // holds the staging buffers (the last users of the pool allocator).
    let staging = unsafe { NcclPoolAllocator::new(ordinal, comm)? };
    let engine = CudaCopyEngine::new(stream, staging)?;
    // SAFETY: as above.
    let collective = unsafe { NcclCollective::new(ordinal, comm)? };
    WeightSync::connect(engine, collective, root, tensors, options)
}

/// The compute stream of one device: copies with `cuMemcpyDtoDAsync`, events with
/// `cuEventRecord` and `cuStreamWaitEvent`, staging buffers from a [`PoolAllocator`].
pub struct CudaCopyEngine {
    device: CudaBackend,
    stream: BackendStream,
    staging: Arc<dyn PoolAllocator>,
}

impl std::fmt::Debug for CudaCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyEngine")
            .field("device", &self.device.ordinal())
            .field("stream", &self.stream.id())
            .finish_non_exhaustive()
    }
}

impl CudaCopyEngine {
    /// An engine on `stream`, whose staging buffers come from `staging` (NCCL's allocator,
    /// registered with the communicator the broadcasts use).
    ///
    /// # Errors
    ///
    /// [`DeviceError::Unsupported`] when `staging` serves another device than `stream`'s; opening
    /// the device.
    pub fn new(stream: BackendStream, staging: Arc<NcclPoolAllocator>) -> Result<Self> {
        if staging.ordinal() != stream.device_index() {
            return Err(Error::Device(DeviceError::Unsupported {
                what: "staging memory on another device than the stream's",
            }));
        }
        // SAFETY: `NcclPoolAllocator::malloc` returns `ncclMemAlloc` memory of the size asked,
        // on the stream's device (checked above), valid until freed.
        unsafe { Self::with_allocator(stream, staging) }
    }

    /// An engine on `stream` whose staging buffers come from any pool allocator (a closure over
    /// an allocator with a [`Registration`](crate::Registration), for instance).
    ///
    /// # Safety
    ///
    /// `staging.malloc(n)` returns device memory of `stream`'s device, at least `n` bytes, valid
    /// until given to `staging.free`.
    ///
    /// # Errors
    ///
    /// Opening the device.
    pub unsafe fn with_allocator(
        stream: BackendStream,
        staging: Arc<dyn PoolAllocator>,
    ) -> Result<Self> {
        Ok(Self {
            device: CudaBackend::new(stream.device_index())?,
            stream,
            staging,
        })
    }

    /// The stream.
    #[must_use]
    pub fn stream(&self) -> &BackendStream {
        &self.stream
    }
}

/// A staging buffer of a [`CudaCopyEngine`], given back to its allocator when dropped.
pub struct CudaStaging {
    allocator: Arc<dyn PoolAllocator>,
    ptr: DeviceAddress,
    size: usize,
}

impl std::fmt::Debug for CudaStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStaging")
            .field("ptr", &self.ptr)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl Drop for CudaStaging {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `size` came from this allocator's `malloc` and are freed once; the
        // sync drops staging buffers only when no queued work uses them (it leaks them otherwise).
        if let Err(error) = unsafe { self.allocator.free(self.ptr, self.size) } {
            tracing::warn!(target: "tensormem_nccl", %error, "freeing a staging buffer");
        }
    }
}

// SAFETY: staging buffers are the allocator's memory of the size asked (the constructors'
// obligation); copies and events are queued on one CUDA stream, in order, with CUDA's event
// semantics; `write`, `read` and `synchronize` synchronize the stream.
unsafe impl CopyEngine for CudaCopyEngine {
    type Event = BackendEvent;
    type Staging = CudaStaging;

    fn staging(&self, bytes: usize) -> Result<CudaStaging> {
        let ptr = self.staging.malloc(bytes)?;
        Ok(CudaStaging {
            allocator: Arc::clone(&self.staging),
            ptr,
            size: bytes,
        })
    }

    fn staging_addr(staging: &CudaStaging) -> DeviceAddress {
        staging.ptr
    }

    fn event(&self) -> Result<BackendEvent> {
        Ok(Device::create_event(&self.device)?)
    }

    fn record(&self, event: &BackendEvent) -> Result<()> {
        Ok(self.stream.record(event)?)
    }

    fn wait(&self, event: &BackendEvent) -> Result<()> {
        Ok(self.stream.wait_event(event)?)
    }

    unsafe fn copy(&self, step: Step, copies: &[CopySpan]) -> Result<()> {
        self.device.make_current()?;
        tracing::trace!(target: "tensormem_nccl", ?step, copies = copies.len(), "copies queued");
        for c in copies {
            // SAFETY: the stream is live; the ranges are the caller's obligation.
            check("cuMemcpyDtoDAsync", unsafe {
                cu::cuMemcpyDtoDAsync_v2(c.dst.0, c.src.0, c.len, self.stream.as_raw())
            })?;
        }
        Ok(())
    }

    unsafe fn write(&self, dst: DeviceAddress, bytes: &[u8]) -> Result<()> {
        self.device.make_current()?;
        // SAFETY: the destination is the caller's obligation; the call synchronizes the stream.
        unsafe { self.stream.copy_from_host(dst, bytes)? };
        Ok(())
    }

    unsafe fn read(&self, src: DeviceAddress, out: &mut [u8]) -> Result<()> {
        self.device.make_current()?;
        // SAFETY: the source is the caller's obligation; the call synchronizes the stream.
        unsafe { self.stream.copy_to_host(out, src)? };
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

/// One rank of an NCCL communicator, with a stream of its own for the collectives.
pub struct NcclCollective {
    /// The communicator (`ncclComm_t`), as an address so that the type is `Send`.
    comm: usize,
    rank: usize,
    ranks: usize,
    device: CudaBackend,
    stream: BackendStream,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .field("device", &self.device.ordinal())
            .field("stream", &self.stream.id())
            .finish_non_exhaustive()
    }
}

/// NCCL's error as the crate's, keeping its code.
fn nccl(call: &'static str) -> impl FnOnce(result::NcclError) -> Error {
    move |e| Error::Collective {
        call,
        code: e.0 as i32,
    }
}

impl NcclCollective {
    /// This rank of `comm` (`ncclCommUserRank`, `ncclCommCount`), collectives on a new stream of
    /// device `ordinal`.
    ///
    /// # Safety
    ///
    /// `comm` is a live NCCL communicator of device `ordinal`, destroyed only after this value is
    /// dropped.
    ///
    /// # Errors
    ///
    /// [`Error::NullCommunicator`]; NCCL's; the device's.
    pub unsafe fn new(ordinal: u32, comm: sys::ncclComm_t) -> Result<Self> {
        if comm.is_null() {
            return Err(Error::NullCommunicator);
        }
        // SAFETY: `comm` is live (the caller's obligation).
        let rank = unsafe { result::comm_user_rank(comm) }.map_err(nccl("ncclCommUserRank"))?;
        // SAFETY: as above.
        let ranks = unsafe { result::comm_count(comm) }.map_err(nccl("ncclCommCount"))?;
        let device = CudaBackend::new(ordinal)?;
        let stream = device.create_stream()?;
        Ok(Self {
            comm: comm as usize,
            rank: rank as usize,
            ranks: ranks as usize,
            device,
            stream,
        })
    }

    /// The stream the collectives run on.
    #[must_use]
    pub fn stream(&self) -> &BackendStream {
        &self.stream
    }

    fn comm(&self) -> sys::ncclComm_t {
        self.comm as sys::ncclComm_t
    }

    fn raw_stream(&self) -> sys::cudaStream_t {
        self.stream.as_raw() as sys::cudaStream_t
    }
}

// SAFETY: NCCL matches a communicator's collectives across ranks in call order; the calls write
// only the buffers named; the stream is one CUDA stream, with CUDA's event semantics.
unsafe impl Collective for NcclCollective {
    type Event = BackendEvent;

    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    unsafe fn broadcast(
        &self,
        step: Step,
        buf: DeviceAddress,
        len: usize,
        root: usize,
    ) -> Result<()> {
        self.device.make_current()?;
        tracing::trace!(target: "tensormem_nccl", ?step, len, root, "broadcast queued");
        // SAFETY: the communicator is live (constructor's obligation); `buf` is the caller's
        // obligation; the stream is live and of the communicator's device.
        unsafe {
            result::broadcast(
                buf.0 as *const c_void,
                buf.0 as *mut c_void,
                len,
                sys::ncclDataType_t::ncclUint8,
                root as c_int,
                self.comm(),
                self.raw_stream(),
            )
        }
        .map_err(nccl("ncclBroadcast"))?;
        Ok(())
    }

    unsafe fn all_reduce_max(&self, buf: DeviceAddress, count: usize) -> Result<()> {
        self.device.make_current()?;
        // SAFETY: as in `broadcast`.
        unsafe {
            result::all_reduce(
                buf.0 as *const c_void,
                buf.0 as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint64,
                sys::ncclRedOp_t::ncclMax,
                self.comm(),
                self.raw_stream(),
            )
        }
        .map_err(nccl("ncclAllReduce"))?;
        Ok(())
    }

    fn record(&self, event: &BackendEvent) -> Result<()> {
        Ok(self.stream.record(event)?)
    }

    fn wait(&self, event: &BackendEvent) -> Result<()> {
        Ok(self.stream.wait_event(event)?)
    }

    fn is_idle(&self) -> Result<bool> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is live (`new`'s contract); `state` is a valid place for the
        // answer.
        let rc = unsafe { sys::ncclCommGetAsyncError(self.comm(), &mut state) };
        if rc != sys::ncclResult_t::ncclSuccess {
            return Err(Error::Collective {
                call: "ncclCommGetAsyncError",
                code: rc as i32,
            });
        }
        if !matches!(
            state,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            // A rank lost, a network error: what the collectives queued will never finish.
            return Err(Error::Collective {
                call: "a collective of the communicator (ncclCommGetAsyncError)",
                code: state as i32,
            });
        }
        Ok(self.stream.is_idle()?)
    }
}
