//! [`FakeDriver`]: the IPC driver calls without a GPU, for tests and examples.
//!
//! Memory handles encode the base address and size of the allocation they name, so a handle made in
//! one process opens in another; an opened handle is "mapped" at the producer's address plus
//! [`FAKE_MAPPING_OFFSET`] (no memory is behind either address). Chunks of expandable segments
//! are imported from the simulated device's exports ([`SimChunk::read_exported`]) into ranges from
//! [`FAKE_CHUNKS_BASE`] on, one mapping per chunk as the CUDA driver makes them
//! ([`FakeDriver::chunk_at`] says which chunk lies under an address). Chunks of this process that
//! the fake is told of ([`FakeDriver::add_chunks`]) behave as `cuMemCreate` memory does: no IPC
//! memory handle, one mapping per chunk, exported by [`IpcDriver::export_mapping`]. Every call is
//! counted, so tests can check that a handle was opened once, that every open was closed, that
//! streams were synchronized before slots were released, and that no event is left alive.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tensormem_cuda_alloc::backend::sim::{ExportedSimChunk, SimChunk};
use tensormem_cuda_alloc::{DeviceAddress, DeviceError, DeviceResult, StreamId};

use super::{DeviceCopy, EventHandle, ExportedMapping, IpcDriver, MemHandle, IPC_HANDLE_SIZE};

/// Where the fake maps an opened handle: the producer's address plus this, so that, as in a real
/// second process, received memory never has the address of one of this process's allocations.
pub const FAKE_MAPPING_OFFSET: u64 = 1 << 62;
/// Where the fake maps imported chunks: ranges handed out one after another from here.
pub const FAKE_CHUNKS_BASE: u64 = 3 << 61;

const MEM_MAGIC: &[u8; 8] = b"FAKEMEM\0";
const EVENT_MAGIC: &[u8; 8] = b"FAKEEVT\0";
/// `CUDA_ERROR_INVALID_VALUE`, as the fake reports bad handles.
const INVALID_VALUE: i32 = 1;

/// Call counts of a [`FakeDriver`].
#[derive(Debug, Default)]
pub struct FakeCounts {
    /// `open_mem_handle` calls that mapped a handle not open yet (the real opens).
    pub opens: AtomicUsize,
    /// `close_mem_handle` calls that unmapped a handle (its last reference).
    pub closes: AtomicUsize,
    /// `mem_handle` calls.
    pub handles_exported: AtomicUsize,
    /// Events created.
    pub events_created: AtomicUsize,
    /// Events alive now.
    pub events_alive: Arc<AtomicUsize>,
    /// Event records.
    pub records: AtomicUsize,
    /// Imported events opened.
    pub events_opened: AtomicUsize,
    /// Waits on imported events.
    pub event_waits: AtomicUsize,
    /// Stream synchronizations.
    pub stream_syncs: AtomicUsize,
    /// Chunks imported by `import_chunks` (ranges count in `opens` and `closes`).
    pub chunk_imports: AtomicUsize,
    /// `copy_batch` calls.
    pub copy_batches: AtomicUsize,
    /// Mappings of this process exported by `export_mapping`.
    pub mappings_exported: AtomicUsize,
}

/// An event of the fake driver.
#[derive(Debug)]
pub struct FakeEvent {
    id: u64,
    alive: Arc<AtomicUsize>,
}

impl Drop for FakeEvent {
    fn drop(&mut self) {
        self.alive.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A range of imported chunks: the chunk size, and what each chunk is, in order.
type ImportedRange = (usize, Vec<ExportedSimChunk>);

/// IPC driver calls without a GPU (see the [module docs](self)).
#[derive(Debug)]
pub struct FakeDriver {
    devices: u32,
    /// Open mappings of this process: base address -> (size, references).
    open: Mutex<HashMap<(u32, u64), (usize, usize)>>,
    next_event: AtomicU64,
    /// Bytes of imported-chunk ranges handed out so far.
    next_range: AtomicU64,
    /// What `stream_idle` answers (default: work pending, so shares record events).
    streams_idle: AtomicBool,
    /// Every copy queued by `copy_batch`, in order.
    copies: Mutex<Vec<DeviceCopy>>,
    /// Allocations of this process that `address_range` knows: (device, base, size).
    allocations: Mutex<Vec<(u32, u64, usize)>>,
    /// Chunks of this process mapped as `cuMemCreate` memory ([`add_chunks`](Self::add_chunks)):
    /// (device, base, size, a descriptor of the chunk).
    chunks: Mutex<Vec<(u32, u64, usize, OwnedFd)>>,
    /// Ranges of imported chunks by (device, base).
    imported: Mutex<HashMap<(u32, u64), ImportedRange>>,
    /// The device of each stream [`set_stream_device`](Self::set_stream_device) named.
    stream_devices: Mutex<HashMap<u64, u32>>,
    /// Every (device, peer) of `enable_peer_access`, and the device of every `copy_batch`.
    peer_accesses: Mutex<Vec<(u32, u32)>>,
    copy_devices: Mutex<Vec<u32>>,
    /// Call counts.
    pub counts: FakeCounts,
}

impl Default for FakeDriver {
    fn default() -> Self {
        Self::new(1)
    }
}

impl FakeDriver {
    /// A fake driver that sees `devices` devices.
    #[must_use]
    pub fn new(devices: u32) -> Self {
        Self {
            devices,
            open: Mutex::new(HashMap::new()),
            next_event: AtomicU64::new(1),
            next_range: AtomicU64::new(0),
            streams_idle: AtomicBool::new(false),
            copies: Mutex::new(Vec::new()),
            allocations: Mutex::new(Vec::new()),
            chunks: Mutex::new(Vec::new()),
            imported: Mutex::new(HashMap::new()),
            stream_devices: Mutex::new(HashMap::new()),
            peer_accesses: Mutex::new(Vec::new()),
            copy_devices: Mutex::new(Vec::new()),
            counts: FakeCounts::default(),
        }
    }

    /// Makes `stream_device` answer `device` for `stream` (a stream of another device than the
    /// memory it copies, as a consumer on another GPU has).
    pub fn set_stream_device(&self, stream: StreamId, device: u32) {
        self.stream_devices.lock().insert(stream.0, device);
    }

    /// Every (device, peer) `enable_peer_access` was asked for, in order.
    #[must_use]
    pub fn peer_accesses(&self) -> Vec<(u32, u32)> {
        self.peer_accesses.lock().clone()
    }

    /// The device of every `copy_batch` call, in order.
    #[must_use]
    pub fn copy_devices(&self) -> Vec<u32> {
        self.copy_devices.lock().clone()
    }

    /// Makes `stream_idle` report every stream idle (`true`) or busy (`false`, the default).
    pub fn set_streams_idle(&self, idle: bool) {
        self.streams_idle.store(idle, Ordering::Relaxed);
    }

    /// Tells `address_range` of an allocation of this process (`cuMemGetAddressRange` on a real
    /// device knows every allocation; the fake knows only those it is told of and the mappings it
    /// opened).
    pub fn add_allocation(&self, device: u32, base: DeviceAddress, size: usize) {
        self.allocations.lock().push((device, base.0, size));
    }

    /// Tells the fake of chunks of this process mapped as virtual-memory-managed memory
    /// (`cuMemCreate` + `cuMemMap`, an expandable segment's): the chunk exported as `fds[i]` (a
    /// simulated device's export, [`SimChunk::read_exported`]) mapped at `base + i * chunk_size`.
    /// From then on `address_range` gives each chunk's own mapping (as `cuMemGetAddressRange`
    /// does for such memory), `mem_handle` refuses them (as `cuIpcGetMemHandle` does) and
    /// `export_mapping` hands out a copy of the chunk's descriptor. The descriptors are copied.
    ///
    /// # Errors
    ///
    /// The error of copying a descriptor (`fcntl(F_DUPFD_CLOEXEC)`).
    pub fn add_chunks(
        &self,
        device: u32,
        base: DeviceAddress,
        chunk_size: usize,
        fds: &[BorrowedFd<'_>],
    ) -> std::io::Result<()> {
        let mut chunks = self.chunks.lock();
        for (i, fd) in fds.iter().enumerate() {
            let copy = rustix::io::fcntl_dupfd_cloexec(fd, 0)?;
            chunks.push((device, base.0 + (i * chunk_size) as u64, chunk_size, copy));
        }
        Ok(())
    }

    /// The imported chunk mapped over `ptr` (what the producer's simulated device exported) and
    /// the offset of `ptr` in it; `None` outside every range of imported chunks. Tests check with
    /// it that received memory aliases the producer's chunks.
    #[must_use]
    pub fn chunk_at(&self, device: u32, ptr: DeviceAddress) -> Option<(ExportedSimChunk, u64)> {
        let imported = self.imported.lock();
        imported.iter().filter(|(&(d, _), _)| d == device).find_map(
            |(&(_, base), (chunk_size, chunks))| {
                let into = ptr.0.checked_sub(base)?;
                let chunk = chunks.get(usize::try_from(into / *chunk_size as u64).ok()?)?;
                Some((*chunk, into % *chunk_size as u64))
            },
        )
    }

    /// The chunk mapping of this process ([`add_chunks`](Self::add_chunks)) holding `ptr`.
    fn own_chunk<T>(
        &self,
        device: u32,
        ptr: u64,
        f: impl FnOnce(u64, usize, &OwnedFd) -> T,
    ) -> Option<T> {
        let chunks = self.chunks.lock();
        chunks
            .iter()
            .find(|(d, base, size, _)| *d == device && ptr >= *base && ptr < base + *size as u64)
            .map(|(_, base, size, fd)| f(*base, *size, fd))
    }

    /// Every copy queued by `copy_batch` so far, in order (the fake has no bytes to move).
    #[must_use]
    pub fn copies(&self) -> Vec<DeviceCopy> {
        self.copies.lock().clone()
    }

    /// How many distinct handles are open in this process now.
    #[must_use]
    pub fn open_mappings(&self) -> usize {
        self.open.lock().len()
    }

    fn check_device(&self, device: u32) -> DeviceResult<()> {
        if device < self.devices {
            Ok(())
        } else {
            Err(invalid("fake device", format!("no device {device}")))
        }
    }

    fn decode(handle: &MemHandle) -> DeviceResult<(u32, u64, usize)> {
        let b = &handle.0;
        if &b[..8] != MEM_MAGIC {
            return Err(invalid(
                "cuIpcOpenMemHandle",
                "not a handle of the fake driver".into(),
            ));
        }
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Ok((word(8) as u32, word(16), word(24) as usize))
    }
}

fn invalid(call: &'static str, message: String) -> DeviceError {
    DeviceError::Driver {
        call,
        code: INVALID_VALUE,
        message,
    }
}

impl IpcDriver for FakeDriver {
    type Event = FakeEvent;
    type ImportedEvent = EventHandle;

    fn device_count(&self) -> DeviceResult<u32> {
        Ok(self.devices)
    }

    fn buffer_id(&self, device: u32, base: DeviceAddress) -> DeviceResult<u64> {
        self.check_device(device)?;
        Ok(base.0 ^ (u64::from(device) << 56))
    }

    fn mem_handle(&self, device: u32, base: DeviceAddress, size: usize) -> DeviceResult<MemHandle> {
        self.check_device(device)?;
        if self.own_chunk(device, base.0, |_, _, _| ()).is_some() {
            return Err(invalid(
                "cuIpcGetMemHandle",
                format!("{base} is memory of cuMemCreate, which has no IPC memory handle"),
            ));
        }
        self.counts.handles_exported.fetch_add(1, Ordering::Relaxed);
        let mut b = [0u8; IPC_HANDLE_SIZE];
        b[..8].copy_from_slice(MEM_MAGIC);
        b[8..16].copy_from_slice(&u64::from(device).to_le_bytes());
        b[16..24].copy_from_slice(&base.0.to_le_bytes());
        b[24..32].copy_from_slice(&(size as u64).to_le_bytes());
        Ok(MemHandle(b))
    }

    fn create_event(&self, device: u32) -> DeviceResult<FakeEvent> {
        self.check_device(device)?;
        self.counts.events_created.fetch_add(1, Ordering::Relaxed);
        self.counts.events_alive.fetch_add(1, Ordering::Relaxed);
        Ok(FakeEvent {
            id: self.next_event.fetch_add(1, Ordering::Relaxed),
            alive: Arc::clone(&self.counts.events_alive),
        })
    }

    fn record_event(&self, device: u32, _event: &FakeEvent, _stream: StreamId) -> DeviceResult<()> {
        self.check_device(device)?;
        self.counts.records.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn event_handle(&self, event: &FakeEvent) -> DeviceResult<EventHandle> {
        let mut b = [0u8; IPC_HANDLE_SIZE];
        b[..8].copy_from_slice(EVENT_MAGIC);
        b[8..16].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
        b[16..24].copy_from_slice(&event.id.to_le_bytes());
        Ok(EventHandle(b))
    }

    fn stream_idle(&self, device: u32, _stream: StreamId) -> DeviceResult<bool> {
        self.check_device(device)?;
        Ok(self.streams_idle.load(Ordering::Relaxed))
    }

    fn synchronize_stream(&self, device: u32, _stream: StreamId) -> DeviceResult<()> {
        self.check_device(device)?;
        self.counts.stream_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn open_mem_handle(&self, device: u32, handle: &MemHandle) -> DeviceResult<DeviceAddress> {
        self.check_device(device)?;
        let (made_on, base, size) = Self::decode(handle)?;
        if made_on != device {
            return Err(invalid(
                "cuIpcOpenMemHandle",
                format!("handle of device {made_on} opened on device {device}"),
            ));
        }
        let mapped = base.wrapping_add(FAKE_MAPPING_OFFSET);
        let mut open = self.open.lock();
        let entry = open.entry((device, mapped)).or_insert((size, 0));
        if entry.1 == 0 {
            self.counts.opens.fetch_add(1, Ordering::Relaxed);
        }
        entry.1 += 1;
        Ok(DeviceAddress(mapped))
    }

    fn address_range(
        &self,
        device: u32,
        ptr: DeviceAddress,
    ) -> DeviceResult<(DeviceAddress, usize)> {
        let inside = |d: u32, base: u64, size: usize| {
            d == device && ptr.0 >= base && ptr.0 < base + size as u64
        };
        let open = self.open.lock();
        let imported = self.imported.lock();
        open.iter()
            .find(|(&(d, base), &(size, _))| inside(d, base, size))
            .map(|(&(d, base), &(size, _))| match imported.get(&(d, base)) {
                // Imported chunks are mapped one by one: the mapping is the chunk's.
                Some(&(chunk_size, _)) => {
                    let chunk = (ptr.0 - base) / chunk_size as u64;
                    (DeviceAddress(base + chunk * chunk_size as u64), chunk_size)
                }
                None => (DeviceAddress(base), size),
            })
            .or_else(|| self.own_chunk(device, ptr.0, |base, size, _| (DeviceAddress(base), size)))
            .or_else(|| {
                self.allocations
                    .lock()
                    .iter()
                    .find(|&&(d, base, size)| inside(d, base, size))
                    .map(|&(_, base, size)| (DeviceAddress(base), size))
            })
            .ok_or_else(|| invalid("cuMemGetAddressRange", format!("{ptr} is not mapped")))
    }

    unsafe fn close_mem_handle(&self, device: u32, ptr: DeviceAddress) -> DeviceResult<()> {
        let mut open = self.open.lock();
        let Some(entry) = open.get_mut(&(device, ptr.0)) else {
            return Err(invalid("cuIpcCloseMemHandle", format!("{ptr} is not open")));
        };
        entry.1 -= 1;
        if entry.1 == 0 {
            open.remove(&(device, ptr.0));
            self.counts.closes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn import_chunks(
        &self,
        device: u32,
        chunk_size: usize,
        fds: &[OwnedFd],
    ) -> DeviceResult<DeviceAddress> {
        self.check_device(device)?;
        let mut read = Vec::with_capacity(fds.len());
        for fd in fds {
            let chunk = SimChunk::read_exported(fd.as_fd())?;
            if chunk.device != device || chunk.size != chunk_size {
                return Err(invalid(
                    "cuMemImportFromShareableHandle",
                    format!(
                        "a {}-byte chunk of device {} imported as {chunk_size} bytes on device {device}",
                        chunk.size, chunk.device
                    ),
                ));
            }
            read.push(chunk);
        }
        let size = chunk_size * fds.len();
        let base = FAKE_CHUNKS_BASE + self.next_range.fetch_add(size as u64, Ordering::Relaxed);
        self.open.lock().insert((device, base), (size, 1));
        self.imported
            .lock()
            .insert((device, base), (chunk_size, read));
        self.counts.opens.fetch_add(1, Ordering::Relaxed);
        self.counts
            .chunk_imports
            .fetch_add(fds.len(), Ordering::Relaxed);
        Ok(DeviceAddress(base))
    }

    unsafe fn close_chunks(
        &self,
        device: u32,
        ptr: DeviceAddress,
        size: usize,
    ) -> DeviceResult<()> {
        let mut open = self.open.lock();
        match open.get(&(device, ptr.0)) {
            Some(&(mapped, 1)) if mapped == size => {
                open.remove(&(device, ptr.0));
                self.imported.lock().remove(&(device, ptr.0));
                self.counts.closes.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(invalid(
                "cuMemUnmap",
                format!("{ptr} + {size} is not a range of imported chunks"),
            )),
        }
    }

    fn export_mapping(&self, device: u32, ptr: DeviceAddress) -> DeviceResult<ExportedMapping> {
        self.check_device(device)?;
        let found = self.own_chunk(device, ptr.0, |base, size, fd| {
            rustix::io::fcntl_dupfd_cloexec(fd, 0).map(|fd| ExportedMapping {
                base: DeviceAddress(base),
                size,
                fd,
            })
        });
        match found {
            Some(Ok(mapping)) => {
                self.counts
                    .mappings_exported
                    .fetch_add(1, Ordering::Relaxed);
                Ok(mapping)
            }
            Some(Err(e)) => Err(invalid(
                "cuMemExportToShareableHandle",
                format!("copying the chunk's descriptor: {e}"),
            )),
            None => Err(invalid(
                "cuMemRetainAllocationHandle",
                format!("{ptr} is not memory of cuMemCreate"),
            )),
        }
    }

    fn open_event_handle(&self, device: u32, handle: &EventHandle) -> DeviceResult<EventHandle> {
        self.check_device(device)?;
        if &handle.0[..8] != EVENT_MAGIC {
            return Err(invalid(
                "cuIpcOpenEventHandle",
                "not an event handle of the fake driver".into(),
            ));
        }
        self.counts.events_opened.fetch_add(1, Ordering::Relaxed);
        Ok(*handle)
    }

    fn wait_event(&self, device: u32, _event: &EventHandle, _stream: StreamId) -> DeviceResult<()> {
        self.check_device(device)?;
        self.counts.event_waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn copy_batch(
        &self,
        device: u32,
        copies: &[DeviceCopy],
        _stream: StreamId,
    ) -> DeviceResult<()> {
        self.check_device(device)?;
        self.counts.copy_batches.fetch_add(1, Ordering::Relaxed);
        self.copies.lock().extend_from_slice(copies);
        self.copy_devices.lock().push(device);
        Ok(())
    }

    fn stream_device(&self, stream: StreamId) -> DeviceResult<Option<u32>> {
        Ok(self.stream_devices.lock().get(&stream.0).copied())
    }

    fn enable_peer_access(&self, device: u32, peer: u32) -> DeviceResult<()> {
        self.check_device(device)?;
        self.check_device(peer)?;
        self.peer_accesses.lock().push((device, peer));
        Ok(())
    }
}
