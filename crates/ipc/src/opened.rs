//! Memory of other processes opened in this one: the opened base allocations (or chunks) that
//! received memory and batches lease, the table of received ranges that keeps them from being
//! shared on, and what dropping received memory does to the producer's slot.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tensormem_cuda_alloc::{DeviceAddress, StreamId};

use crate::chunks::{ChunkFdRoutes, FdRoute};
use crate::driver::IpcDriver;
use crate::error::{Error, Result};
use crate::handle::SegmentMemory;
use crate::refcounter::MappedCounterFile;

/// Device ranges opened from other processes: (device, start) -> (end, opens).
static RECEIVED: Mutex<BTreeMap<(u32, u64), (u64, usize)>> = Mutex::new(BTreeMap::new());

/// Refuses memory that was received from another process (PyTorch's `received_cuda` check): sharing it
/// on is not supported.
///
/// # Errors
///
/// [`Error::ReceivedMemory`] (PyTorch's message) if `ptr` lies in memory this process opened with
/// [`IpcConsumer::open`](crate::IpcConsumer::open).
pub(crate) fn check_shareable(device: u32, ptr: DeviceAddress) -> Result<()> {
    let received = RECEIVED.lock();
    let inside = received
        .range(..=(device, ptr.0))
        .next_back()
        .is_some_and(|(&(d, start), &(end, _))| d == device && ptr.0 >= start && ptr.0 < end);
    if inside {
        Err(Error::ReceivedMemory)
    } else {
        Ok(())
    }
}

/// The key of an opened segment: device and what names its memory.
pub(crate) type SegmentKey = (u32, SegmentMemory);

/// A base allocation (or an expandable segment's chunks) of another process, opened here.
#[derive(Debug)]
pub(crate) struct OpenedBase<B: IpcDriver> {
    driver: Arc<B>,
    device: u32,
    pub(crate) ptr: DeviceAddress,
    pub(crate) size: usize,
    /// How the chunks' descriptors were obtained; `None` for a device allocation's handle.
    pub(crate) route: Option<FdRoute>,
}

impl<B: IpcDriver> OpenedBase<B> {
    pub(crate) fn open(
        driver: &Arc<B>,
        device: u32,
        memory: &SegmentMemory,
        routes: ChunkFdRoutes,
        timeout: Duration,
    ) -> Result<Self> {
        let handle = match memory {
            SegmentMemory::Allocation(handle) => handle,
            SegmentMemory::Chunks(handle) => {
                // Checked where handles are read; checked again for handles built in code.
                if let Some(problem) = handle.problem() {
                    return Err(Error::InvalidTuple { problem });
                }
                let (Ok(chunk_size), Ok(size)) = (
                    usize::try_from(handle.chunk_size),
                    usize::try_from(handle.extent()),
                ) else {
                    return Err(Error::InvalidTuple {
                        problem: format!(
                            "{} chunks of {} bytes do not fit this process's address space",
                            handle.fds.len(),
                            handle.chunk_size
                        ),
                    });
                };
                let (fds, route) = handle.take_descriptors_within(routes, timeout)?;
                let ptr = driver.import_chunks(device, chunk_size, &fds)?;
                drop(fds);
                register_received(device, ptr, size);
                tracing::info!(target: "tensormem_ipc", device, %ptr, size, pid = handle.pid,
                    chunks = handle.fds.len(), ?route, "opened an expandable segment's chunks");
                return Ok(Self {
                    driver: Arc::clone(driver),
                    device,
                    ptr,
                    size,
                    route: Some(route),
                });
            }
        };
        let ptr = driver.open_mem_handle(device, handle)?;
        // Closes the mapping if the query below fails.
        let mut opened = Self {
            driver: Arc::clone(driver),
            device,
            ptr,
            size: 0,
            route: None,
        };
        // The mapping's real extent, not what the handle claims.
        let (base, size) = driver.address_range(device, ptr)?;
        // `ptr` is the start of the mapping (what cuIpcOpenMemHandle returns); the usable extent is
        // what lies after it.
        opened.size = (base.0 + size as u64).saturating_sub(ptr.0) as usize;
        register_received(device, ptr, size);
        tracing::debug!(target: "tensormem_ipc", device, base = %ptr, size, "opened an IPC memory handle");
        Ok(opened)
    }
}

/// Records `[ptr, ptr + size)` as memory received from another process (see [`check_shareable`]).
fn register_received(device: u32, ptr: DeviceAddress, size: usize) {
    let mut received = RECEIVED.lock();
    let entry = received
        .entry((device, ptr.0))
        .or_insert((ptr.0 + size as u64, 0));
    entry.1 += 1;
}

impl<B: IpcDriver> Drop for OpenedBase<B> {
    fn drop(&mut self) {
        if self.size > 0 {
            let mut received = RECEIVED.lock();
            if let Some(entry) = received.get_mut(&(self.device, self.ptr.0)) {
                entry.1 -= 1;
                if entry.1 == 0 {
                    received.remove(&(self.device, self.ptr.0));
                }
            }
        }
        let closed = if self.route.is_some() {
            // SAFETY: `[ptr, ptr + size)` is the range `import_chunks` returned on this device,
            // this value closes it once, and every user synchronized its streams before letting
            // go of its lease (`ReceivedMemory::drop`).
            unsafe { self.driver.close_chunks(self.device, self.ptr, self.size) }
        } else {
            // SAFETY: `ptr` was returned by `open_mem_handle` on this device (an opened base starts
            // where the mapping starts), this value closes it once, and every user synchronized
            // its streams before letting go of its lease (`ReceivedMemory::drop`).
            unsafe { self.driver.close_mem_handle(self.device, self.ptr) }
        };
        if let Err(err) = closed {
            tracing::warn!(target: "tensormem_ipc", %err, ptr = %self.ptr, "closing an IPC memory handle failed");
        }
    }
}

/// What dropping received memory (one handle's or a batch's) does: synchronize the streams it was
/// used on, then decrement its slot and clear the owner record.
pub(crate) fn release_held<'s, B: IpcDriver>(
    driver: &B,
    device: u32,
    streams: impl Iterator<Item = &'s StreamId>,
    file: &MappedCounterFile,
    slot: usize,
) {
    for &stream in streams {
        if let Err(err) = driver.synchronize_stream(device, stream) {
            tracing::error!(target: "tensormem_ipc", %err, %stream, "synchronizing before releasing shared memory failed");
        }
    }
    if let Err(err) = file.probe() {
        // Another process truncated the file under the mapping: touching the counter would
        // fault (SIGBUS), and the producer cannot read it any more either.
        tracing::error!(target: "tensormem_ipc", %err, "releasing a ref-counter slot failed");
        return;
    }
    match file.table().counter(file.mapping(), slot) {
        Ok(counter) => {
            counter.fetch_sub(1, Ordering::AcqRel);
        }
        Err(err) => {
            tracing::error!(target: "tensormem_ipc", %err, "releasing a ref-counter slot failed")
        }
    }
    let _ = file.unclaim(slot);
}
