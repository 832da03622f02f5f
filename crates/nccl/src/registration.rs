//! Allocator memory registered with a communicator: [`Registration`] (a whole allocator, through
//! its trace tracker) and [`NcclPoolAllocator`] (one pool's segments, from `ncclMemAlloc`); see the
//! [crate docs](crate).

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::nccl::sys;
use parking_lot::Mutex;
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::snapshot::{TraceAction, TraceEntry};
use tensormem_cuda_alloc::{
    CachingAllocator, DeviceAddress, DeviceError, DeviceResult, PoolAllocator,
};

use crate::error::{Error, Result};

/// One registered range: its size and NCCL's handle.
#[derive(Debug, Clone, Copy)]
struct Registered {
    size: u64,
    handle: usize,
}

#[derive(Debug)]
struct Inner {
    /// The communicator (`ncclComm_t`), as an address so that the state is `Send`.
    comm: usize,
    /// Whether the tracker still acts (false once the registration is dropped).
    active: AtomicBool,
    /// Registered ranges by start address.
    ranges: Mutex<BTreeMap<u64, Registered>>,
    /// Failures met in the tracker, where they cannot be returned.
    errors: Mutex<Vec<Error>>,
}

impl Inner {
    /// A table for `comm`, acting.
    fn new(comm: sys::ncclComm_t) -> Arc<Self> {
        Arc::new(Inner {
            comm: comm as usize,
            active: AtomicBool::new(true),
            ranges: Mutex::new(BTreeMap::new()),
            errors: Mutex::new(Vec::new()),
        })
    }

    fn ranges(&self) -> Vec<(u64, u64)> {
        self.ranges
            .lock()
            .iter()
            .map(|(&addr, r)| (addr, r.size))
            .collect()
    }

    fn take_errors(&self) -> Vec<Error> {
        std::mem::take(&mut *self.errors.lock())
    }

    fn comm(&self) -> sys::ncclComm_t {
        self.comm as sys::ncclComm_t
    }

    fn register(&self, ranges: &mut BTreeMap<u64, Registered>, addr: u64, size: u64) {
        if size == 0 || ranges.contains_key(&addr) {
            return;
        }
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: the communicator is live (the caller of `Registration::new` promised it outlives
        // the registration, and the tracker stops acting when the registration is dropped); the
        // range is memory the allocator just mapped or holds; `handle` is a valid out-parameter.
        let result = unsafe {
            sys::ncclCommRegister(self.comm(), addr as *mut c_void, size as usize, &mut handle)
        };
        if result == sys::ncclResult_t::ncclSuccess {
            tracing::debug!(target: "tensormem_nccl", addr, size, "registered with NCCL");
            ranges.insert(
                addr,
                Registered {
                    size,
                    handle: handle as usize,
                },
            );
        } else {
            self.failed("ncclCommRegister", addr, size, result);
        }
    }

    fn deregister(&self, addr: u64, registered: Registered) {
        // SAFETY: `handle` came from `ncclCommRegister` on this communicator and is deregistered
        // once (it was just removed from the table); the communicator is live (see `register`).
        let result =
            unsafe { sys::ncclCommDeregister(self.comm(), registered.handle as *mut c_void) };
        if result == sys::ncclResult_t::ncclSuccess {
            tracing::debug!(target: "tensormem_nccl", addr, size = registered.size, "deregistered from NCCL");
        } else {
            self.failed("ncclCommDeregister", addr, registered.size, result);
        }
    }

    fn failed(&self, call: &'static str, addr: u64, size: u64, result: sys::ncclResult_t) {
        let error = Error::Nccl {
            call,
            addr,
            size,
            code: result as i32,
        };
        tracing::warn!(target: "tensormem_nccl", %error, "NCCL registration");
        self.errors.lock().push(error);
    }

    /// Deregisters everything overlapping `[addr, addr + size)`, registering again the parts of
    /// those registrations outside it.
    fn release(&self, ranges: &mut BTreeMap<u64, Registered>, addr: u64, size: u64) {
        let end = addr + size;
        let overlapping: Vec<(u64, Registered)> = ranges
            .range(..end)
            .filter(|(&start, r)| start + r.size > addr)
            .map(|(&start, &r)| (start, r))
            .collect();
        for (start, registered) in overlapping {
            ranges.remove(&start);
            self.deregister(start, registered);
            if start < addr {
                self.register(ranges, start, addr - start);
            }
            let stop = start + registered.size;
            if stop > end {
                self.register(ranges, end, stop - end);
            }
        }
    }

    fn on_trace(&self, entry: &TraceEntry) {
        let registers = matches!(
            entry.action,
            TraceAction::SegmentAlloc | TraceAction::SegmentMap
        );
        let releases = matches!(
            entry.action,
            TraceAction::SegmentFree | TraceAction::SegmentUnmap
        );
        if !(registers || releases) {
            return;
        }
        // Checked under the table's lock, which `Drop` holds while it switches the tracker off.
        let mut ranges = self.ranges.lock();
        if !self.active.load(Ordering::Acquire) {
            return;
        }
        if registers {
            self.register(&mut ranges, entry.addr, entry.size);
        } else {
            self.release(&mut ranges, entry.addr, entry.size);
        }
    }
}

/// An allocator's segments registered with one NCCL communicator (see the [crate docs](crate)).
#[derive(Debug)]
pub struct Registration {
    inner: Arc<Inner>,
}

impl Registration {
    /// Registers every segment of `allocator` with `comm`, now and as they are made, until the
    /// registration is dropped.
    ///
    /// # Safety
    ///
    /// `comm` is a live NCCL communicator whose device is the allocator's, and it is destroyed only
    /// after this registration is dropped.
    ///
    /// # Errors
    ///
    /// [`Error::NullCommunicator`] for a null `comm`. Failures to register single segments are
    /// kept in [`errors`](Self::errors) instead (the memory stays usable).
    pub unsafe fn new(
        allocator: &Arc<CachingAllocator<CudaBackend>>,
        comm: sys::ncclComm_t,
    ) -> Result<Self> {
        if comm.is_null() {
            return Err(Error::NullCommunicator);
        }
        let inner = Inner::new(comm);
        // The tracker first, then what exists: a segment made in between is registered once (the
        // table is keyed by address).
        let tracked = Arc::clone(&inner);
        allocator.attach_allocator_trace_tracker(Box::new(move |entry| tracked.on_trace(entry)));
        let snapshot = allocator.snapshot();
        let mut ranges = inner.ranges.lock();
        for segment in &snapshot.segments {
            if !segment.is_expandable {
                inner.register(&mut ranges, segment.address, segment.total_size);
                continue;
            }
            // Runs of adjacent mapped blocks (the snapshot lists mapped blocks only).
            let mut run: Option<(u64, u64)> = None;
            for block in &segment.blocks {
                run = match run {
                    Some((start, end)) if end == block.address => {
                        Some((start, block.address + block.size))
                    }
                    Some((start, end)) => {
                        inner.register(&mut ranges, start, end - start);
                        Some((block.address, block.address + block.size))
                    }
                    None => Some((block.address, block.address + block.size)),
                };
            }
            if let Some((start, end)) = run {
                inner.register(&mut ranges, start, end - start);
            }
        }
        drop(ranges);
        Ok(Self { inner })
    }

    /// The ranges registered now: start address and size, in address order.
    #[must_use]
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.inner.ranges()
    }

    /// Registration failures met so far (NCCL refused a range); taken out of the registration.
    #[must_use]
    pub fn errors(&self) -> Vec<Error> {
        self.inner.take_errors()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let ranges = {
            let mut ranges = self.inner.ranges.lock();
            self.inner.active.store(false, Ordering::Release);
            std::mem::take(&mut *ranges)
        };
        for (addr, registered) in ranges {
            self.inner.deregister(addr, registered);
        }
    }
}

/// A pool allocator (tensormem-cuda-alloc's `PoolAllocator`) whose segments come from NCCL
/// (`ncclMemAlloc`) and are registered with one communicator while they live; see the
/// [crate docs](crate#one-pool-instead-of-the-whole-allocator).
#[derive(Debug)]
pub struct NcclPoolAllocator {
    /// The device's context, made current around NCCL's allocation calls.
    device: CudaBackend,
    inner: Arc<Inner>,
}

impl NcclPoolAllocator {
    /// An allocator of segments on device `ordinal`, registered with `comm`.
    ///
    /// # Safety
    ///
    /// `comm` is a live NCCL communicator on device `ordinal`, destroyed only after every pool
    /// using this allocator released its segments (the allocator was dropped or emptied).
    ///
    /// # Errors
    ///
    /// [`Error::NullCommunicator`]; opening the device fails as
    /// [`Error::Device`].
    pub unsafe fn new(ordinal: u32, comm: sys::ncclComm_t) -> Result<Arc<Self>> {
        if comm.is_null() {
            return Err(Error::NullCommunicator);
        }
        let device = CudaBackend::new(ordinal)?;
        Ok(Arc::new(Self {
            device,
            inner: Inner::new(comm),
        }))
    }

    /// The device the segments come from.
    #[must_use]
    pub fn ordinal(&self) -> u32 {
        self.device.ordinal()
    }

    /// The segments registered now: start address and size, in address order.
    #[must_use]
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.inner.ranges()
    }

    /// Registration failures met so far; taken out of the allocator.
    #[must_use]
    pub fn errors(&self) -> Vec<Error> {
        self.inner.take_errors()
    }
}

impl PoolAllocator for NcclPoolAllocator {
    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        self.device.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-parameter; the device's context is current.
        let result = unsafe { sys::ncclMemAlloc(&mut ptr, size) };
        if result != sys::ncclResult_t::ncclSuccess || ptr.is_null() {
            // NCCL reports running out of device memory as a CUDA error; the pool goes on down
            // its out-of-memory path either way.
            tracing::debug!(target: "tensormem_nccl", size, ?result, "ncclMemAlloc failed");
            return Err(DeviceError::OutOfMemory { bytes: size as u64 });
        }
        let mut ranges = self.inner.ranges.lock();
        self.inner.register(&mut ranges, ptr as u64, size as u64);
        Ok(DeviceAddress(ptr as u64))
    }

    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        {
            let mut ranges = self.inner.ranges.lock();
            self.inner.release(&mut ranges, ptr.0, size as u64);
        }
        self.device.make_current()?;
        // SAFETY: the caller guarantees `ptr` came from `malloc` above (so from `ncclMemAlloc`), is
        // freed once and is idle; its registration was just dropped.
        let result = unsafe { sys::ncclMemFree(ptr.0 as *mut c_void) };
        if result == sys::ncclResult_t::ncclSuccess {
            Ok(())
        } else {
            Err(DeviceError::Driver {
                call: "ncclMemFree",
                code: result as i32,
                message: format!("{result:?}"),
            })
        }
    }
}
