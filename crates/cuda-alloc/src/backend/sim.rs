//! A simulated device: deterministic, runs anywhere, and checks how it is used.
//!
//! [`SimDevice`] models what the allocator needs from a GPU and nothing more:
//!
//! - **Memory**: a capacity in bytes. [`Device::malloc`] and [`Device::create_physical`] count against
//!   it and fail with [`DeviceError::OutOfMemory`] past it; frees and unmaps give it back.
//! - **Addresses**: by default invented (2 MiB aligned, never overlapping anything live, in a window
//!   of its own per device, so that two simulated devices never hand out the same address). A replay can
//!   queue the addresses a real device returned ([`SimDevice::push_addresses`]); each new allocation or
//!   reservation takes the next one, so the allocator sees the real layout and makes the real
//!   decisions.
//! - **Streams and events**: recording an event enqueues a marker on its stream. Markers complete only
//!   when the caller says so: [`SimDevice::complete_stream_work`] ("the work pending on stream S is
//!   done now"), [`SimDevice::complete_all_work`], or a synchronizing call ([`Device::synchronize`],
//!   [`Device::synchronize_event`]), which in a simulation simply finishes the work it waits for.
//!   [`SimDevice::set_auto_complete`] makes every marker complete at once instead.
//! - **Virtual memory**: reserved ranges, physical chunks and mappings, with the checks the driver
//!   makes (a mapping lies in a reserved range, overlaps no other, is unmapped exactly as mapped).
//! - **Graph capture**: [`SimDevice::begin_capture`] / [`SimDevice::end_capture`] set what
//!   [`Device::capture_status`] reports.
//!
//! Misuse (freeing an unknown pointer, overlapping mappings, releasing a range with mappings in it)
//! is reported as [`DeviceError::Driver`] with code `-1`, so tests catch allocator bugs as errors.
//! [`SimDevice::counters`] tells how the device was used.
//!
//! ```
//! use tensormem_cuda_alloc::backend::sim::SimDevice;
//! use tensormem_cuda_alloc::{Device, StreamId};
//!
//! let device = SimDevice::new(1 << 30);
//! let event = device.create_event()?;
//! device.record_event(&event, StreamId(7))?;
//! assert!(!device.query_event(&event)?);
//! device.complete_stream_work(StreamId(7));
//! assert!(device.query_event(&event)?);
//! # Ok::<(), tensormem_cuda_alloc::DeviceError>(())
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Bound;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::device::{
    CaptureStatus, Device, DeviceAddress, DeviceError, DeviceResult, MemInfo, ProcessMemory,
    StreamId,
};

/// Where invented addresses start (a typical user-space GPU virtual address): the first window.
const INVENTED_BASE: u64 = 0x7f00_0000_0000;
/// The size of each device's window of invented addresses (16 TiB: replays simulate devices of
/// over a TiB, and expandable segments reserve 9/8 of the capacity).
const WINDOW: u64 = 1 << 44;
/// Windows handed out in turn to simulated devices (window 0 is the fixed one, see
/// [`SimDevice::with_fixed_addresses`]); past this many the windows are reused.
const WINDOWS: u64 = 1 << 19;

/// The next device's window of invented addresses: 1, 2, ..., `WINDOWS - 1`, 1, ...
fn next_window() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    1 + NEXT.fetch_add(1, Relaxed) % (WINDOWS - 1)
}
/// The virtual-memory granularity the simulated device reports: 2 MiB, like current GPUs.
pub const SIM_GRANULARITY: usize = 2 << 20;

/// An event of the simulated device: which stream it was recorded on and the marker it waits for.
#[derive(Debug)]
pub struct SimEvent {
    /// The stream of the last record (meaningful only when `ticket` is non-zero).
    stream: AtomicU64,
    /// The marker number on that stream; 0: never recorded (an unrecorded event is complete).
    ticket: AtomicU64,
}

/// A physical memory chunk of the simulated device.
#[derive(Debug)]
pub struct SimChunk {
    id: u64,
    size: usize,
}

/// How a [`SimDevice`] has been used so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Allocations made by `malloc` and not yet freed.
    pub live_allocations: usize,
    /// Bytes in those allocations.
    pub allocated_bytes: u64,
    /// Address ranges reserved and not yet released.
    pub reserved_ranges: usize,
    /// Physical chunks created and not yet released.
    pub live_chunks: usize,
    /// Bytes mapped into reserved ranges.
    pub mapped_bytes: u64,
    /// Bytes of capacity in use (allocations plus physical chunks).
    pub used_bytes: u64,
    /// Successful `malloc` calls.
    pub mallocs: u64,
    /// `malloc` and `create_physical` calls refused for lack of memory.
    pub out_of_memory: u64,
    /// `free` calls.
    pub frees: u64,
    /// `map` calls.
    pub maps: u64,
    /// `unmap` calls.
    pub unmaps: u64,
    /// Physical chunks exported to other processes ([`Device::export_physical`]).
    pub exports: u64,
    /// Events created.
    pub events_created: u64,
    /// Events recorded.
    pub events_recorded: u64,
    /// `synchronize` calls (whole device).
    pub device_synchronizes: u64,
    /// Bytes copied from the device to the host ([`Device::copy_to_host`]).
    pub bytes_to_host: u64,
    /// Bytes copied from the host to the device ([`Device::copy_from_host`]).
    pub bytes_from_host: u64,
}

#[derive(Debug, Default)]
struct StreamWork {
    /// Markers enqueued so far.
    enqueued: u64,
    /// Markers completed so far.
    completed: u64,
}

#[derive(Debug)]
struct Reservation {
    size: u64,
    /// Mapped ranges inside the reservation: start -> (size, chunk id).
    mapped: BTreeMap<u64, (u64, u64)>,
}

#[derive(Debug)]
struct SimState {
    capacity: u64,
    used: u64,
    allocations: BTreeMap<u64, u64>,
    reservations: BTreeMap<u64, Reservation>,
    live_chunks: usize,
    mapped_bytes: u64,
    queued: VecDeque<u64>,
    /// This device's window of invented addresses: `[window, window + WINDOW)`.
    window: u64,
    next_invented: u64,
    streams: HashMap<StreamId, StreamWork>,
    captures: HashMap<StreamId, u64>,
    next_capture_id: u64,
    next_chunk_id: u64,
    auto_complete: bool,
    /// Whether `free`, `unmap` and `release_address_range` fail (see `fail_releases`).
    fail_releases: bool,
    /// Errors handed to `record_error`, oldest first.
    kept_errors: Vec<DeviceError>,
    /// What `process_memory` answers (see `set_process_memory`).
    processes: Option<Vec<ProcessMemory>>,
    /// The bytes written into physical chunks, by chunk id (made on the first write; a chunk never
    /// written reads as zeros; dropped with the chunk).
    contents: HashMap<u64, Vec<u8>>,
    counters: SimCounters,
}

/// The simulated device. See the [module documentation](self).
#[derive(Debug)]
pub struct SimDevice {
    index: u32,
    state: Mutex<SimState>,
}

fn misuse(call: &'static str, message: impl Into<String>) -> DeviceError {
    DeviceError::Driver {
        call,
        code: -1,
        message: message.into(),
    }
}

/// The live range (start, end) in `map` that overlaps `[start, start + size)`, if any.
fn overlap<V>(
    map: &BTreeMap<u64, V>,
    start: u64,
    size: u64,
    len: impl Fn(&V) -> u64,
) -> Option<(u64, u64)> {
    let end = start + size;
    let (&s, v) = map.range(..end).next_back()?;
    let e = s + len(v);
    (e > start).then_some((s, e))
}

impl SimState {
    fn overlapping(&self, start: u64, size: u64) -> Option<(u64, u64)> {
        overlap(&self.allocations, start, size, |&len| len)
            .or_else(|| overlap(&self.reservations, start, size, |r| r.size))
    }

    /// The address for a new allocation or reservation of `size` bytes aligned to `align`.
    fn take_address(&mut self, call: &'static str, size: u64, align: u64) -> DeviceResult<u64> {
        if let Some(addr) = self.queued.pop_front() {
            if addr % align != 0 {
                return Err(misuse(
                    call,
                    format!("queued address {addr:#x} is not aligned to {align} bytes"),
                ));
            }
            if let Some((s, e)) = self.overlapping(addr, size) {
                return Err(misuse(
                    call,
                    format!(
                        "queued address {addr:#x} ({size} bytes) overlaps the live range {s:#x}..{e:#x}"
                    ),
                ));
            }
            return Ok(addr);
        }
        let (start, end) = (self.window, self.window + WINDOW);
        let mut candidate = self.next_invented.next_multiple_of(align);
        let mut wrapped = false;
        loop {
            if candidate + size > end {
                // The window's end: start again from its beginning (what was freed there is free).
                if wrapped || size > WINDOW {
                    return Err(DeviceError::OutOfMemory { bytes: size });
                }
                wrapped = true;
                candidate = start;
                continue;
            }
            match self.overlapping(candidate, size) {
                Some((_, used_end)) => candidate = used_end.next_multiple_of(align),
                None => break,
            }
        }
        self.next_invented = candidate + size;
        Ok(candidate)
    }

    fn charge(&mut self, call: &'static str, size: u64) -> DeviceResult<()> {
        if self.used + size > self.capacity {
            self.counters.out_of_memory += 1;
            tracing::debug!(
                call,
                size,
                used = self.used,
                capacity = self.capacity,
                "simulated OOM"
            );
            return Err(DeviceError::OutOfMemory { bytes: size });
        }
        self.used += size;
        Ok(())
    }

    /// The chunk mapped over `addr`: its id, its size and the offset of `addr` in it.
    fn mapped_at(&self, call: &'static str, addr: u64) -> DeviceResult<(u64, usize, usize)> {
        let unmapped = || misuse(call, format!("{addr:#x} is not mapped"));
        let (&base, reservation) = self
            .reservations
            .range(..=addr)
            .next_back()
            .ok_or_else(unmapped)?;
        if addr >= base + reservation.size {
            return Err(unmapped());
        }
        let (&start, &(len, id)) = reservation
            .mapped
            .range(..=addr)
            .next_back()
            .ok_or_else(unmapped)?;
        if addr >= start + len {
            return Err(unmapped());
        }
        Ok((id, len as usize, (addr - start) as usize))
    }

    fn is_complete(&self, stream: StreamId, ticket: u64) -> bool {
        ticket == 0
            || self
                .streams
                .get(&stream)
                .is_some_and(|w| w.completed >= ticket)
    }
}

impl SimDevice {
    /// A simulated device 0 with `capacity` bytes of memory.
    #[must_use]
    pub fn new(capacity: u64) -> Self {
        Self::with_index(0, capacity)
    }

    /// A simulated device with the given ordinal and capacity.
    ///
    /// Like real devices of one process (which share one virtual address space), simulated devices
    /// invent addresses that no other simulated device hands out: each gets its own 16 TiB window, so
    /// a pointer of one device is never a pointer of another (up to 524 287 devices alive at once).
    #[must_use]
    pub fn with_index(index: u32, capacity: u64) -> Self {
        Self::in_window(index, capacity, INVENTED_BASE + next_window() * WINDOW)
    }

    /// A simulated device that invents the same addresses as every other device made this way,
    /// from `0x7f00_0000_0000` up: runs are reproducible whatever other devices the process made
    /// (trace replays use it, where invented addresses decide ties between free blocks). Its
    /// invented addresses may coincide with those of other devices made this way, never with those
    /// of devices made by [`new`](Self::new) or [`with_index`](Self::with_index).
    #[must_use]
    pub fn with_fixed_addresses(index: u32, capacity: u64) -> Self {
        Self::in_window(index, capacity, INVENTED_BASE)
    }

    fn in_window(index: u32, capacity: u64, window: u64) -> Self {
        SimDevice {
            index,
            state: Mutex::new(SimState {
                capacity,
                used: 0,
                allocations: BTreeMap::new(),
                reservations: BTreeMap::new(),
                live_chunks: 0,
                mapped_bytes: 0,
                queued: VecDeque::new(),
                window,
                next_invented: window,
                streams: HashMap::new(),
                captures: HashMap::new(),
                next_capture_id: 1,
                next_chunk_id: 1,
                auto_complete: false,
                fail_releases: false,
                kept_errors: Vec::new(),
                processes: None,
                contents: HashMap::new(),
                counters: SimCounters::default(),
            }),
        }
    }

    /// Changes the capacity (memory already in use stays in use, even past the new capacity).
    pub fn set_capacity(&self, capacity: u64) {
        self.state.lock().capacity = capacity;
    }

    /// Queues addresses for the next allocations and reservations, in order. Each must be aligned
    /// (512 bytes for `malloc`, [`SIM_GRANULARITY`] for reservations) and must not overlap anything live
    /// when it is used, or the call that takes it fails.
    pub fn push_addresses(&self, addresses: impl IntoIterator<Item = u64>) {
        self.state.lock().queued.extend(addresses);
    }

    /// Addresses queued and not used yet.
    #[must_use]
    pub fn queued_addresses(&self) -> usize {
        self.state.lock().queued.len()
    }

    /// Completes the work enqueued on `stream` so far: every event recorded on it reports complete.
    pub fn complete_stream_work(&self, stream: StreamId) {
        let mut state = self.state.lock();
        let work = state.streams.entry(stream).or_default();
        work.completed = work.enqueued;
    }

    /// Completes the first `markers` event markers of `stream` still pending (events complete in the
    /// order they were recorded on a stream).
    pub fn complete_stream_markers(&self, stream: StreamId, markers: u64) {
        let mut state = self.state.lock();
        let work = state.streams.entry(stream).or_default();
        work.completed = (work.completed + markers).min(work.enqueued);
    }

    /// Event markers recorded on `stream` and not completed yet.
    #[must_use]
    pub fn pending_markers(&self, stream: StreamId) -> u64 {
        let state = self.state.lock();
        state
            .streams
            .get(&stream)
            .map_or(0, |w| w.enqueued - w.completed)
    }

    /// Completes the work on every stream.
    pub fn complete_all_work(&self) {
        let mut state = self.state.lock();
        for work in state.streams.values_mut() {
            work.completed = work.enqueued;
        }
    }

    /// When on, every event completes as soon as it is recorded (no pending work ever).
    pub fn set_auto_complete(&self, on: bool) {
        let mut state = self.state.lock();
        state.auto_complete = on;
        if on {
            for work in state.streams.values_mut() {
                work.completed = work.enqueued;
            }
        }
    }

    /// Starts a simulated graph capture on `stream`; returns its capture id.
    pub fn begin_capture(&self, stream: StreamId) -> u64 {
        let mut state = self.state.lock();
        let id = state.next_capture_id;
        state.next_capture_id += 1;
        state.captures.insert(stream, id);
        id
    }

    /// Ends the capture on `stream` (no effect if none is underway).
    pub fn end_capture(&self, stream: StreamId) {
        self.state.lock().captures.remove(&stream);
    }

    /// When on, every `free`, `unmap` and `release_address_range` fails (a driver error, code `-1`)
    /// and changes nothing: for testing how callers handle a device that cannot take memory back.
    pub fn fail_releases(&self, on: bool) {
        self.state.lock().fail_releases = on;
    }

    /// Sets what [`Device::process_memory`] answers, NVML's list of the processes on a real device
    /// (`None`, the default: the device cannot tell).
    pub fn set_process_memory(&self, processes: Option<Vec<ProcessMemory>>) {
        self.state.lock().processes = processes;
    }

    /// The errors kept by [`Device::record_error`] (met while an allocator was dropped), oldest
    /// first, forgotten by this call.
    #[must_use]
    pub fn take_kept_errors(&self) -> Vec<DeviceError> {
        std::mem::take(&mut self.state.lock().kept_errors)
    }

    /// Writes `bytes` into the device memory at `addr`, which must be mapped (it may span chunks):
    /// the memory model behind [`Device::copy_to_host`] and [`Device::copy_from_host`], for tests
    /// that check contents survive unmapping and remapping. A chunk never written reads as zeros.
    ///
    /// # Errors
    /// [`DeviceError::Driver`] (code `-1`) if part of the range is not mapped.
    pub fn write_memory(&self, addr: DeviceAddress, bytes: &[u8]) -> DeviceResult<()> {
        let mut state = self.state.lock();
        let mut done = 0;
        while done < bytes.len() {
            let at = addr.0 + done as u64;
            let (id, chunk_size, offset) = state.mapped_at("write_memory", at)?;
            let n = (chunk_size - offset).min(bytes.len() - done);
            let data = state
                .contents
                .entry(id)
                .or_insert_with(|| vec![0; chunk_size]);
            data[offset..offset + n].copy_from_slice(&bytes[done..done + n]);
            done += n;
        }
        Ok(())
    }

    /// Reads `len` bytes of the device memory at `addr`, which must be mapped (see
    /// [`write_memory`](Self::write_memory)).
    ///
    /// # Errors
    /// [`DeviceError::Driver`] (code `-1`) if part of the range is not mapped.
    pub fn read_memory(&self, addr: DeviceAddress, len: usize) -> DeviceResult<Vec<u8>> {
        let state = self.state.lock();
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let at = addr.0 + out.len() as u64;
            let (id, chunk_size, offset) = state.mapped_at("read_memory", at)?;
            let n = (chunk_size - offset).min(len - out.len());
            match state.contents.get(&id) {
                Some(data) => out.extend_from_slice(&data[offset..offset + n]),
                None => out.resize(out.len() + n, 0),
            }
        }
        Ok(out)
    }

    /// How the device has been used so far.
    #[must_use]
    pub fn counters(&self) -> SimCounters {
        let state = self.state.lock();
        SimCounters {
            live_allocations: state.allocations.len(),
            allocated_bytes: state.allocations.values().sum(),
            reserved_ranges: state.reservations.len(),
            live_chunks: state.live_chunks,
            mapped_bytes: state.mapped_bytes,
            used_bytes: state.used,
            ..state.counters
        }
    }
}

// SAFETY: the simulated device upholds the trait's obligations: (1) `malloc` returns addresses checked
// not to overlap any live allocation or reservation, aligned to at least 512 bytes (queued addresses are
// checked, invented ones are 2 MiB aligned), and forgets them only in `free`; (2) reservations are
// granularity aligned and checked against everything live the same way; (3) an event reports complete
// only once its marker has been completed, which happens only when the caller completes the stream's
// work or synchronizes; (4) no method calls back into any allocator. The device never touches the
// memory it hands out (there is none), so no method can corrupt anything.
unsafe impl Device for SimDevice {
    type Event = SimEvent;
    type PhysicalChunk = SimChunk;

    fn index(&self) -> u32 {
        self.index
    }

    fn mem_info(&self) -> DeviceResult<MemInfo> {
        let state = self.state.lock();
        Ok(MemInfo {
            free: state.capacity.saturating_sub(state.used),
            total: state.capacity,
        })
    }

    fn malloc(&self, size: usize) -> DeviceResult<DeviceAddress> {
        let mut state = self.state.lock();
        let size = size as u64;
        state.charge("cuMemAlloc", size)?;
        let addr = match state.take_address("cuMemAlloc", size.max(1), 512) {
            Ok(addr) => addr,
            Err(e) => {
                state.used -= size;
                return Err(e);
            }
        };
        state.allocations.insert(addr, size);
        state.counters.mallocs += 1;
        Ok(DeviceAddress(addr))
    }

    unsafe fn free(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        let mut state = self.state.lock();
        if state.fail_releases {
            return Err(misuse("cuMemFree", "failure injected by fail_releases"));
        }
        match state.allocations.get(&ptr.0) {
            Some(&len) if len == size as u64 => {
                state.allocations.remove(&ptr.0);
                state.used -= len;
                state.counters.frees += 1;
                Ok(())
            }
            Some(&len) => Err(misuse(
                "cuMemFree",
                format!("{ptr} was allocated with {len} bytes, freed with {size}"),
            )),
            None => Err(misuse(
                "cuMemFree",
                format!("{ptr} is not a live allocation"),
            )),
        }
    }

    fn record_error(&self, error: DeviceError) {
        self.state.lock().kept_errors.push(error);
    }

    fn create_event(&self) -> DeviceResult<SimEvent> {
        self.state.lock().counters.events_created += 1;
        Ok(SimEvent {
            stream: AtomicU64::new(0),
            ticket: AtomicU64::new(0),
        })
    }

    fn record_event(&self, event: &SimEvent, stream: StreamId) -> DeviceResult<()> {
        let mut state = self.state.lock();
        let auto = state.auto_complete;
        let work = state.streams.entry(stream).or_default();
        work.enqueued += 1;
        let ticket = work.enqueued;
        if auto {
            work.completed = work.enqueued;
        }
        state.counters.events_recorded += 1;
        // The state lock orders these stores with the loads in `query_event`.
        event.stream.store(stream.0, Relaxed);
        event.ticket.store(ticket, Relaxed);
        Ok(())
    }

    fn query_event(&self, event: &SimEvent) -> DeviceResult<bool> {
        let state = self.state.lock();
        let stream = StreamId(event.stream.load(Relaxed));
        Ok(state.is_complete(stream, event.ticket.load(Relaxed)))
    }

    fn synchronize_event(&self, event: &SimEvent) -> DeviceResult<()> {
        let mut state = self.state.lock();
        let ticket = event.ticket.load(Relaxed);
        if ticket != 0 {
            let stream = StreamId(event.stream.load(Relaxed));
            let work = state.streams.entry(stream).or_default();
            work.completed = work.completed.max(ticket);
        }
        Ok(())
    }

    fn synchronize(&self) -> DeviceResult<()> {
        let mut state = self.state.lock();
        state.counters.device_synchronizes += 1;
        for work in state.streams.values_mut() {
            work.completed = work.enqueued;
        }
        Ok(())
    }

    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        Ok(match self.state.lock().captures.get(&stream) {
            Some(&id) => CaptureStatus::Active { id },
            None => CaptureStatus::None,
        })
    }

    fn process_memory(&self) -> Option<Vec<ProcessMemory>> {
        self.state.lock().processes.clone()
    }

    fn vmm_granularity(&self) -> DeviceResult<usize> {
        Ok(SIM_GRANULARITY)
    }

    fn reserve_address_range(&self, size: usize) -> DeviceResult<DeviceAddress> {
        let mut state = self.state.lock();
        let size = (size as u64).next_multiple_of(SIM_GRANULARITY as u64);
        let addr = state.take_address("cuMemAddressReserve", size, SIM_GRANULARITY as u64)?;
        state.reservations.insert(
            addr,
            Reservation {
                size,
                mapped: BTreeMap::new(),
            },
        );
        Ok(DeviceAddress(addr))
    }

    unsafe fn release_address_range(&self, ptr: DeviceAddress, size: usize) -> DeviceResult<()> {
        let mut state = self.state.lock();
        if state.fail_releases {
            return Err(misuse(
                "cuMemAddressFree",
                "failure injected by fail_releases",
            ));
        }
        let size = (size as u64).next_multiple_of(SIM_GRANULARITY as u64);
        match state.reservations.get(&ptr.0) {
            Some(r) if r.size != size => Err(misuse(
                "cuMemAddressFree",
                format!(
                    "{ptr} was reserved with {} bytes, released with {size}",
                    r.size
                ),
            )),
            Some(r) if !r.mapped.is_empty() => Err(misuse(
                "cuMemAddressFree",
                format!("{ptr} still has {} mappings", r.mapped.len()),
            )),
            Some(_) => {
                state.reservations.remove(&ptr.0);
                Ok(())
            }
            None => Err(misuse(
                "cuMemAddressFree",
                format!("{ptr} is not a reserved range"),
            )),
        }
    }

    fn create_physical(&self, size: usize) -> DeviceResult<SimChunk> {
        if !size.is_multiple_of(SIM_GRANULARITY) {
            return Err(misuse(
                "cuMemCreate",
                format!("{size} bytes is not a multiple of the granularity {SIM_GRANULARITY}"),
            ));
        }
        let mut state = self.state.lock();
        state.charge("cuMemCreate", size as u64)?;
        state.live_chunks += 1;
        let id = state.next_chunk_id;
        state.next_chunk_id += 1;
        Ok(SimChunk { id, size })
    }

    unsafe fn map(&self, ptr: DeviceAddress, size: usize, chunk: &SimChunk) -> DeviceResult<()> {
        if size != chunk.size {
            return Err(misuse(
                "cuMemMap",
                format!("mapping {size} bytes of a {}-byte chunk", chunk.size),
            ));
        }
        let mut state = self.state.lock();
        let (start, size) = (ptr.0, size as u64);
        let Some((&base, reservation)) = state
            .reservations
            .range_mut((Bound::Unbounded, Bound::Included(start)))
            .next_back()
        else {
            return Err(misuse(
                "cuMemMap",
                format!("{ptr} is not in a reserved range"),
            ));
        };
        if start + size > base + reservation.size {
            return Err(misuse(
                "cuMemMap",
                format!("{ptr} + {size} runs past the reserved range at {base:#x}"),
            ));
        }
        if let Some((s, e)) = overlap(&reservation.mapped, start, size, |&(len, _)| len) {
            return Err(misuse(
                "cuMemMap",
                format!("{ptr} + {size} overlaps the mapping {s:#x}..{e:#x}"),
            ));
        }
        reservation.mapped.insert(start, (size, chunk.id));
        state.mapped_bytes += size;
        state.counters.maps += 1;
        Ok(())
    }

    unsafe fn unmap(&self, ptr: DeviceAddress, size: usize, chunk: SimChunk) -> DeviceResult<()> {
        let mut state = self.state.lock();
        if state.fail_releases {
            return Err(misuse("cuMemUnmap", "failure injected by fail_releases"));
        }
        let Some((_, reservation)) = state
            .reservations
            .range_mut((Bound::Unbounded, Bound::Included(ptr.0)))
            .next_back()
        else {
            return Err(misuse(
                "cuMemUnmap",
                format!("{ptr} is not in a reserved range"),
            ));
        };
        match reservation.mapped.get(&ptr.0) {
            Some(&(len, id)) if len == size as u64 && id == chunk.id => {
                reservation.mapped.remove(&ptr.0);
            }
            _ => {
                return Err(misuse(
                    "cuMemUnmap",
                    format!("{ptr} + {size} is not where chunk {} is mapped", chunk.id),
                ))
            }
        }
        state.mapped_bytes -= size as u64;
        state.used -= chunk.size as u64;
        state.live_chunks -= 1;
        state.counters.unmaps += 1;
        state.contents.remove(&chunk.id);
        Ok(())
    }

    unsafe fn copy_to_host(
        &self,
        src: DeviceAddress,
        dst: *mut u8,
        len: usize,
    ) -> DeviceResult<()> {
        if len == 0 {
            return Ok(());
        }
        let bytes = self.read_memory(src, len)?;
        // SAFETY: the caller guarantees `dst` is valid for writes of `len` bytes; `bytes` holds
        // exactly `len` bytes and is a fresh vector, so the two cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, len) };
        self.state.lock().counters.bytes_to_host += len as u64;
        Ok(())
    }

    unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: DeviceAddress,
        len: usize,
    ) -> DeviceResult<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller guarantees `src` is valid for reads of `len` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(src, len) };
        self.write_memory(dst, bytes)?;
        self.state.lock().counters.bytes_from_host += len as u64;
        Ok(())
    }

    fn export_physical(&self, chunk: &SimChunk) -> DeviceResult<OwnedFd> {
        let fail = |e: rustix::io::Errno| DeviceError::Driver {
            call: "cuMemExportToShareableHandle",
            code: -1,
            message: format!("the simulated export's memfd: {e}"),
        };
        let fd = rustix::fs::memfd_create("tensormem-sim-chunk", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(fail)?;
        let mut bytes = Vec::with_capacity(EXPORTED_CHUNK_LEN);
        bytes.extend_from_slice(EXPORTED_CHUNK_MAGIC);
        bytes.extend_from_slice(&u64::from(self.index).to_le_bytes());
        bytes.extend_from_slice(&chunk.id.to_le_bytes());
        bytes.extend_from_slice(&(chunk.size as u64).to_le_bytes());
        let written = rustix::io::pwrite(&fd, &bytes, 0).map_err(fail)?;
        if written != bytes.len() {
            return Err(fail(rustix::io::Errno::IO));
        }
        self.state.lock().counters.exports += 1;
        Ok(fd)
    }
}

const EXPORTED_CHUNK_MAGIC: &[u8; 8] = b"TMSIMCHK";
const EXPORTED_CHUNK_LEN: usize = 32;

/// What a simulated chunk's exported file descriptor names (see [`SimChunk::read_exported`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportedSimChunk {
    /// The device ordinal of the [`SimDevice`] that exported it.
    pub device: u32,
    /// The chunk's id on that device.
    pub id: u64,
    /// Its size in bytes.
    pub size: usize,
}

impl SimChunk {
    /// Reads what a file descriptor from the simulated device's
    /// [`export_physical`](Device::export_physical) names (a memfd holding the device, the chunk's id
    /// and size): what a fake driver "imports" in another process, where no memory exists.
    ///
    /// # Errors
    ///
    /// [`DeviceError::Driver`] (code `-1`, `cuMemImportFromShareableHandle`) when the descriptor is
    /// not such an export.
    pub fn read_exported(fd: BorrowedFd<'_>) -> DeviceResult<ExportedSimChunk> {
        let bad = |why: String| misuse("cuMemImportFromShareableHandle", why);
        let mut bytes = [0u8; EXPORTED_CHUNK_LEN];
        let read =
            rustix::io::pread(fd, &mut bytes, 0).map_err(|e| bad(format!("reading: {e}")))?;
        if read != EXPORTED_CHUNK_LEN || &bytes[..8] != EXPORTED_CHUNK_MAGIC {
            return Err(bad(
                "the descriptor is not a simulated chunk's export".to_string()
            ));
        }
        let at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Ok(ExportedSimChunk {
            device: u32::try_from(at(8)).map_err(|_| bad("device out of range".into()))?,
            id: at(16),
            size: usize::try_from(at(24)).map_err(|_| bad("size out of range".into()))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_invent_disjoint_addresses_and_fixed_ones_repeat() {
        let (a, b) = (SimDevice::new(1 << 30), SimDevice::new(1 << 30));
        let (pa, pb) = (a.malloc(2 << 20).unwrap(), b.malloc(2 << 20).unwrap());
        assert!(
            pa.0.abs_diff(pb.0) >= WINDOW,
            "{pa} and {pb} share a window"
        );
        let (f, g) = (
            SimDevice::with_fixed_addresses(0, 1 << 30),
            SimDevice::with_fixed_addresses(0, 1 << 30),
        );
        let pf = f.malloc(2 << 20).unwrap();
        assert_eq!(pf, g.malloc(2 << 20).unwrap());
        assert_eq!(pf.0, INVENTED_BASE);
    }

    #[test]
    fn invented_addresses_wrap_within_the_window() {
        let d = SimDevice::with_fixed_addresses(0, u64::MAX);
        let big = (WINDOW / 2) as usize;
        let first = d.malloc(big).unwrap();
        // SAFETY: `first` came from `malloc` with this size and is freed once.
        unsafe { d.free(first, big).unwrap() };
        let second = d.malloc(big).unwrap();
        // The window has no room after `second`: the next one starts over at the beginning.
        let third = d.malloc(big).unwrap();
        assert_eq!(third, first);
        assert!(matches!(
            d.malloc(big),
            Err(DeviceError::OutOfMemory { .. })
        ));
        assert!(second.0 + big as u64 <= INVENTED_BASE + WINDOW);
    }

    #[test]
    fn malloc_counts_against_capacity() {
        let d = SimDevice::new(4 << 20);
        let a = d.malloc(2 << 20).unwrap();
        let b = d.malloc(2 << 20).unwrap();
        assert_ne!(a, b);
        assert_eq!(d.malloc(512), Err(DeviceError::OutOfMemory { bytes: 512 }));
        // SAFETY: `a` came from `malloc` with this size and is freed once.
        unsafe { d.free(a, 2 << 20).unwrap() };
        assert_eq!(d.mem_info().unwrap().free, 2 << 20);
        // SAFETY: freeing an unknown pointer is reported, not undefined, on the simulated device.
        assert!(unsafe { d.free(a, 2 << 20) }.is_err());
        let c = d.counters();
        assert_eq!(
            (c.live_allocations, c.mallocs, c.frees, c.out_of_memory),
            (1, 2, 1, 1)
        );
    }

    #[test]
    fn queued_addresses_are_used_in_order_and_checked() {
        let d = SimDevice::new(1 << 30);
        d.push_addresses([0x1000_0000, 0x2000_0000, 0x1000_0200]);
        assert_eq!(d.malloc(512).unwrap(), DeviceAddress(0x1000_0000));
        assert_eq!(d.malloc(512).unwrap(), DeviceAddress(0x2000_0000));
        // 0x1000_0200 would overlap nothing (the first allocation is 512 bytes): fine.
        assert_eq!(d.malloc(512).unwrap(), DeviceAddress(0x1000_0200));
        d.push_addresses([0x1000_0000]);
        assert!(matches!(d.malloc(512), Err(DeviceError::Driver { .. })));
        // Invented addresses avoid live ranges.
        let x = d.malloc(4 << 20).unwrap();
        let y = d.malloc(4 << 20).unwrap();
        assert!(y.0 >= x.0 + (4 << 20));
    }

    #[test]
    fn events_complete_when_told() {
        let d = SimDevice::new(1 << 20);
        let s = StreamId(3);
        let e1 = d.create_event().unwrap();
        let e2 = d.create_event().unwrap();
        d.record_event(&e1, s).unwrap();
        d.record_event(&e2, s).unwrap();
        assert_eq!(d.pending_markers(s), 2);
        d.complete_stream_markers(s, 1);
        assert!(d.query_event(&e1).unwrap());
        assert!(!d.query_event(&e2).unwrap());
        d.synchronize_event(&e2).unwrap();
        assert!(d.query_event(&e2).unwrap());
        d.set_auto_complete(true);
        d.record_event(&e1, s).unwrap();
        assert!(d.query_event(&e1).unwrap());
    }

    #[test]
    fn virtual_memory_is_checked() {
        let d = SimDevice::new(8 << 20);
        let g = d.vmm_granularity().unwrap();
        let base = d.reserve_address_range(16 << 20).unwrap();
        let c1 = d.create_physical(g).unwrap();
        let c2 = d.create_physical(g).unwrap();
        // SAFETY: the simulated device checks every precondition and reports violations.
        unsafe {
            d.map(base, g, &c1).unwrap();
            assert!(d.map(base, g, &c2).is_err(), "overlapping mapping");
            d.map(base.offset(g), g, &c2).unwrap();
            assert!(
                d.release_address_range(base, 16 << 20).is_err(),
                "still mapped"
            );
        }
        assert_eq!(d.counters().mapped_bytes, 2 * g as u64);
        assert!(matches!(
            d.create_physical(6 << 20),
            Err(DeviceError::OutOfMemory { .. })
        ));
        // SAFETY: as above.
        unsafe {
            d.unmap(base, g, c1).unwrap();
            d.unmap(base.offset(g), g, c2).unwrap();
            d.release_address_range(base, 16 << 20).unwrap();
        }
        let c = d.counters();
        assert_eq!((c.mapped_bytes, c.used_bytes, c.reserved_ranges), (0, 0, 0));
    }

    #[test]
    fn capture_status_follows_begin_and_end() {
        let d = SimDevice::new(0);
        let s = StreamId(9);
        assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
        let id = d.begin_capture(s);
        assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::Active { id });
        d.end_capture(s);
        assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
    }
}
