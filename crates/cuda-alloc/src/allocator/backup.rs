//! Where a sleeping pool's contents wait: pinned host memory that the host allocator has cached
//! (reserved ahead, or left by an earlier sleep), copied at the device's full bandwidth, and for
//! the rest ordinary memory filled through a small ring of pinned staging buffers: the device
//! copies into one buffer while other threads copy the filled ones out (and the other way on
//! wake). Pinning host memory runs at a few GB/s (the driver serializes much of it) against tens of
//! GB/s for the copies, so a first sleep that pinned its backup as it went would wait for the
//! pinning; staged, it waits only for the copies and for the kernel to fault in ordinary pages,
//! which many threads do at once.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{mpsc, Arc};

use parking_lot::Mutex;

use crate::device::{Device, DeviceAddress};
use crate::error::{Error, Result};
use crate::host::{pages, HostCachingAllocator, PinnedBuffer};

/// The largest piece of a sleeping pool's backup (a power of two, so that the host allocator's
/// rounding wastes nothing): what to reserve pinned host memory in
/// ([`HostCachingAllocator::reserve`]) for a sleep to copy straight into it.
pub const BACKUP_PIECE_BYTES: usize = 256 << 20;

const BACKUP_PIECE: u64 = BACKUP_PIECE_BYTES as u64;

/// One staging buffer: large enough that a copy's fixed cost is a few percent of it, small enough
/// that the ring stays a few hundred MiB of pinned memory.
const STAGE_BYTES: usize = 32 << 20;

/// The most threads that copy between staging buffers and ordinary memory at once.
const MAX_STAGING_THREADS: usize = 8;

/// Staging buffers: one per copying thread, and two more so that the device always has one to
/// copy into.
const STAGE_SLOTS: usize = MAX_STAGING_THREADS + 2;

/// Where a sleeping pool's contents are kept: pinned host memory from a
/// [`HostCachingAllocator`] (implemented for it, for `&'static` references to it and for `Arc`s
/// of it).
///
/// A backup takes pinned memory the host memory has ready
/// ([`allocate_cached`](Self::allocate_cached)) and copies the rest through a ring of staging
/// buffers ([`allocate`](Self::allocate)d once, given back after) into ordinary host memory. An
/// implementation whose `allocate_cached` pins new memory on demand backs every piece up in pinned
/// memory instead, at the speed pinning allows.
pub trait HostBackup: Send + Sync {
    /// Pinned host memory of at least `size` bytes.
    ///
    /// # Errors
    /// As [`HostCachingAllocator::allocate`].
    fn allocate(&self, size: usize) -> Result<PinnedBuffer>;

    /// Gives back memory from [`allocate`](Self::allocate) or
    /// [`allocate_cached`](Self::allocate_cached).
    ///
    /// # Errors
    /// As [`HostCachingAllocator::free`].
    fn free(&self, buffer: PinnedBuffer) -> Result<()>;

    /// Pinned host memory of at least `size` bytes that is ready now, without pinning new memory;
    /// `None` when there is none. By default `None`: every piece is staged.
    ///
    /// # Errors
    /// As [`HostCachingAllocator::allocate_cached`].
    fn allocate_cached(&self, size: usize) -> Result<Option<PinnedBuffer>> {
        let _ = size;
        Ok(None)
    }
}

impl<H: Device> HostBackup for HostCachingAllocator<H> {
    fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        HostCachingAllocator::allocate(self, size)
    }
    fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        HostCachingAllocator::free(self, buffer)
    }
    fn allocate_cached(&self, size: usize) -> Result<Option<PinnedBuffer>> {
        HostCachingAllocator::allocate_cached(self, size)
    }
}

impl<T: HostBackup + ?Sized> HostBackup for &'static T {
    fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        (**self).allocate(size)
    }
    fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        (**self).free(buffer)
    }
    fn allocate_cached(&self, size: usize) -> Result<Option<PinnedBuffer>> {
        (**self).allocate_cached(size)
    }
}

impl<T: HostBackup + ?Sized> HostBackup for Arc<T> {
    fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        (**self).allocate(size)
    }
    fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        (**self).free(buffer)
    }
    fn allocate_cached(&self, size: usize) -> Result<Option<PinnedBuffer>> {
        (**self).allocate_cached(size)
    }
}

/// A [`HostBackup`] that keeps every piece in pinned memory, pinning what its host memory does not
/// have ready on the way: the first sleep waits for the pinning (a few GB/s), and the pinned memory
/// stays cached for the next sleep, which then copies at the device's full bandwidth without
/// staging.
///
/// ```
/// use std::sync::Arc;
/// use tensormem_cuda_alloc::backend::sim::SimDevice;
/// use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator};
/// use tensormem_cuda_alloc::{AlwaysPinned, HostBackup};
///
/// let host = Arc::new(HostCachingAllocator::new(SimDevice::new(1 << 30), HeapSource));
/// let backup = AlwaysPinned(Arc::clone(&host));
/// let piece = backup.allocate_cached(1 << 20)?.expect("pinned on the way");
/// backup.free(piece)?;
/// // Cached for the next sleep: served without pinning.
/// assert!(host.allocate_cached(1 << 20)?.is_some());
/// # Ok::<(), tensormem_cuda_alloc::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct AlwaysPinned<H>(pub H);

impl<H: HostBackup> HostBackup for AlwaysPinned<H> {
    fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        self.0.allocate(size)
    }
    fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        self.0.free(buffer)
    }
    fn allocate_cached(&self, size: usize) -> Result<Option<PinnedBuffer>> {
        self.0.allocate(size).map(Some)
    }
}

/// Ordinary host memory this process mapped for a staged piece (huge pages where the kernel
/// gives them), unmapped when dropped.
struct Plain {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `Plain` owns its mapping exclusively; the pointer is not shared with anything else.
unsafe impl Send for Plain {}
// SAFETY: shared references only read through `as_ptr`; writes need `&mut` or the staging
// threads' exclusive ranges.
unsafe impl Sync for Plain {}

impl Plain {
    fn new(len: usize) -> Result<Self> {
        Ok(Self {
            ptr: pages::map(len)?,
            len,
        })
    }
}

impl Drop for Plain {
    fn drop(&mut self) {
        // SAFETY: the mapping came from `pages::map` with this length and is given back once,
        // here, when nothing uses it any more.
        if let Err(error) = unsafe { pages::unmap(self.ptr, self.len) } {
            tracing::warn!(%error, "unmapping a sleeping pool's staged backup failed");
        }
    }
}

/// One piece's memory.
enum Kept {
    Pinned(PinnedBuffer),
    Plain(Arc<Plain>),
}

impl Kept {
    fn is_staged(&self) -> bool {
        matches!(self, Self::Plain(_))
    }

    fn len(&self) -> usize {
        match self {
            Self::Pinned(buffer) => buffer.len(),
            Self::Plain(plain) => plain.len,
        }
    }

    fn as_ptr(&self) -> *const u8 {
        match self {
            Self::Pinned(buffer) => buffer.as_ptr(),
            Self::Plain(plain) => plain.ptr.as_ptr(),
        }
    }
}

/// The pieces of a backup and the device addresses they were copied from.
type Pieces = Arc<Mutex<Vec<(u64, Kept)>>>;

/// A sleeping pool's backup: its pieces, and whether threads moving staged pieces into pinned
/// memory while the pool sleeps should stop.
pub(crate) struct Backup {
    host: Arc<dyn HostBackup>,
    pieces: Pieces,
    stop: Arc<AtomicBool>,
}

/// The most threads that pin memory for staged pieces while a pool sleeps (pinning is serialized
/// in the driver beyond a few).
const PROMOTING_THREADS: usize = 4;

impl Backup {
    pub(crate) fn new(host: Box<dyn HostBackup>) -> Self {
        Self {
            host: Arc::from(host),
            pieces: Arc::default(),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Bytes kept.
    pub(crate) fn bytes(&self) -> u64 {
        self.pieces.lock().iter().map(|(_, k)| k.len() as u64).sum()
    }

    /// Bytes kept in ordinary memory through the staging buffers.
    pub(crate) fn staged_bytes(&self) -> u64 {
        self.pieces
            .lock()
            .iter()
            .filter(|(_, k)| k.is_staged())
            .map(|(_, k)| k.len() as u64)
            .sum()
    }

    /// Starts moving the staged pieces into pinned memory from the host, in the background, so
    /// that the wake copies them straight and the pinned memory stays cached for the next sleep
    /// (as if it had been reserved ahead). One piece at a time: host memory grows by a piece per
    /// thread at most. A piece the host cannot pin stays staged. The threads are not waited for:
    /// once told to stop (a wake, the backup dropped), a thread gives the memory it was pinning to
    /// the host's cache and ends.
    pub(crate) fn promote_in_background(&self) {
        let staged: Vec<usize> = self
            .pieces
            .lock()
            .iter()
            .enumerate()
            .filter(|(_, (_, k))| k.is_staged())
            .map(|(i, _)| i)
            .collect();
        if staged.is_empty() {
            return;
        }
        let staged = Arc::new(staged);
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..PROMOTING_THREADS.min(staged.len()) {
            let (host, pieces) = (Arc::clone(&self.host), Arc::clone(&self.pieces));
            let (staged, next) = (Arc::clone(&staged), Arc::clone(&next));
            let stop = Arc::clone(&self.stop);
            let spawned = std::thread::Builder::new()
                .name("tensormem-backup-pin".into())
                .spawn(move || {
                    while !stop.load(Relaxed) {
                        let Some(&i) = staged.get(next.fetch_add(1, Relaxed)) else {
                            break;
                        };
                        if let Err(error) = promote(&*host, &pieces, i, &stop) {
                            tracing::debug!(%error, "a staged backup piece stays in ordinary memory");
                            break;
                        }
                    }
                });
            if let Err(error) = spawned {
                tracing::debug!(%error, "no thread to pin a staged backup");
                break;
            }
        }
    }

    /// Gives every piece back (what dropping it does too).
    pub(crate) fn give_back(self) {
        drop(self);
    }

    /// Copies the runs (device address, length) of device memory into this backup: pinned memory
    /// the host has ready for a piece, else staged. Every piece made ends in the backup, copied or
    /// not, so that a failure gives them all back.
    pub(crate) fn copy_out<D: Device>(&mut self, device: &D, runs: &[(u64, u64)]) -> Result<()> {
        let mut kept = self.pieces.lock();
        let mut staged = Vec::new();
        for &(start, len) in runs {
            for (at, len) in backup_pieces(start, len) {
                match self.host.allocate_cached(len as usize)? {
                    Some(mut buffer) => {
                        let dst = buffer.as_mut_slice().as_mut_ptr();
                        kept.push((at, Kept::Pinned(buffer)));
                        // SAFETY: `[at, at + len)` is a piece of a run of mapped chunks, and the
                        // device was synchronized with every allocator lock held, so no queued
                        // work writes it; `dst` is the pinned buffer of `len` bytes owned here.
                        unsafe { device.copy_to_host(DeviceAddress(at), dst, len as usize) }?;
                    }
                    None => staged.push((at, len)),
                }
            }
        }
        if staged.is_empty() {
            return Ok(());
        }
        let mut jobs = Vec::new();
        for (at, len) in staged {
            let plain = Plain::new(len as usize)?;
            jobs.extend(stage_jobs(at, plain.ptr.as_ptr() as usize, len));
            kept.push((at, Kept::Plain(Arc::new(plain))));
        }
        drop(kept);
        Ring::new(&*self.host)?.stage_out(device, &jobs)
    }

    /// Copies the pieces back, into the parts of them inside the `mapped` runs, and tells the
    /// background pinning to stop (without waiting for it). Returns the bytes copied and the part
    /// of them staged.
    pub(crate) fn copy_back<D: Device>(
        &self,
        device: &D,
        mapped: &[(u64, u64)],
    ) -> Result<(u64, u64)> {
        // Pieces pinned from here on go to the host's cache, not into this backup.
        self.stop.store(true, Relaxed);
        let pieces = self.pieces.lock();
        let (mut jobs, mut restored) = (Vec::new(), 0);
        for (at, kept) in pieces.iter() {
            let (lo, hi) = (*at, *at + kept.len() as u64);
            for &(start, len) in mapped {
                let (from, to) = (lo.max(start), hi.min(start + len));
                if from >= to {
                    continue;
                }
                // SAFETY: `from - lo` is inside the piece (lo <= from < hi).
                let src = unsafe { kept.as_ptr().add((from - lo) as usize) };
                match kept {
                    Kept::Pinned(_) => {
                        // SAFETY: `[from, to)` lies in a run of chunks the wake mapped and nothing
                        // has used yet (every allocator lock is held); `src` is valid for reads of
                        // that length (inside the pinned piece).
                        unsafe {
                            device.copy_from_host(
                                src,
                                DeviceAddress(from),
                                (to - from) as usize,
                            )?;
                        };
                    }
                    Kept::Plain(_) => jobs.extend(stage_jobs(from, src as usize, to - from)),
                }
                restored += to - from;
            }
        }
        let staged = jobs.iter().map(|j| j.len as u64).sum();
        if !jobs.is_empty() {
            Ring::new(&*self.host)?.stage_back(device, &jobs)?;
        }
        Ok((restored, staged))
    }
}

impl Drop for Backup {
    /// Gives every pinned piece back to the host allocator (logging failures: the memory is
    /// pinned host memory the host allocator keeps either way) and unmaps the staged ones, also
    /// when the allocator is dropped with the pool asleep.
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        for (_, kept) in std::mem::take(&mut *self.pieces.lock()) {
            if let Kept::Pinned(buffer) = kept {
                if let Err(error) = self.host.free(buffer) {
                    tracing::warn!(%error, "giving a sleeping pool's backup back to the host allocator failed");
                }
            }
        }
    }
}

/// Moves staged piece `i` into pinned memory from `host`, unless told to `stop` meanwhile: the
/// pinned memory then goes to the host's cache.
fn promote(
    host: &dyn HostBackup,
    pieces: &Mutex<Vec<(u64, Kept)>>,
    i: usize,
    stop: &AtomicBool,
) -> Result<()> {
    let plain = match pieces.lock().get(i) {
        Some((_, Kept::Plain(plain))) => Arc::clone(plain),
        _ => return Ok(()),
    };
    let mut buffer = host.allocate(plain.len)?;
    // SAFETY: `plain` (kept alive by this reference) is `len` bytes of staged memory that nothing
    // writes while the pool sleeps; the buffer holds at least `len` bytes and is this thread's.
    unsafe {
        std::ptr::copy_nonoverlapping(
            plain.ptr.as_ptr(),
            buffer.as_mut_slice().as_mut_ptr(),
            plain.len,
        );
    }
    let mut kept = pieces.lock();
    if stop.load(Relaxed) || kept.get(i).is_none() {
        drop(kept);
        return host.free(buffer);
    }
    let staged = std::mem::replace(&mut kept[i].1, Kept::Pinned(buffer));
    drop(kept);
    drop(staged);
    Ok(())
}

/// The pieces a run of `len` bytes from `start` is backed up in: [`BACKUP_PIECE`] bytes each, the
/// rest in powers of two (so that the host allocator's rounding wastes nothing).
fn backup_pieces(start: u64, len: u64) -> Vec<(u64, u64)> {
    let mut pieces = Vec::new();
    let mut at = start;
    let end = start + len;
    while at < end {
        let left = end - at;
        let piece = if left >= BACKUP_PIECE {
            BACKUP_PIECE
        } else {
            1 << (63 - left.leading_zeros())
        };
        pieces.push((at, piece));
        at += piece;
    }
    pieces
}

/// One staged copy: `len` bytes (at most a staging buffer) between the device at `device` and
/// ordinary host memory at `host`.
#[derive(Clone, Copy)]
struct Job {
    device: u64,
    host: usize,
    len: usize,
}

/// `len` bytes between the device at `device` and the host at `host`, in staging-buffer jobs.
fn stage_jobs(device: u64, host: usize, len: u64) -> impl Iterator<Item = Job> {
    (0..len).step_by(STAGE_BYTES).map(move |offset| Job {
        device: device + offset,
        host: host + offset as usize,
        len: (len - offset).min(STAGE_BYTES as u64) as usize,
    })
}

/// The threads that copy between staging buffers and ordinary memory.
fn staging_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, MAX_STAGING_THREADS)
}

/// Pinned staging buffers, given back to the host when dropped.
struct Ring<'a> {
    host: &'a dyn HostBackup,
    slots: Vec<PinnedBuffer>,
}

impl<'a> Ring<'a> {
    /// [`STAGE_SLOTS`] buffers from the host (cached after the first sleep; the first pins them,
    /// a few hundred MiB). A failure gives back the ones made.
    fn new(host: &'a dyn HostBackup) -> Result<Self> {
        let mut ring = Self {
            host,
            slots: Vec::with_capacity(STAGE_SLOTS),
        };
        for _ in 0..STAGE_SLOTS {
            ring.slots.push(host.allocate(STAGE_BYTES)?);
        }
        Ok(ring)
    }

    /// The slots' addresses (handed between threads by index) and the list of free slots, all
    /// of them to begin with.
    fn free_list(&mut self) -> (Vec<usize>, mpsc::Sender<usize>, mpsc::Receiver<usize>) {
        let slots: Vec<usize> = self
            .slots
            .iter_mut()
            .map(|b| b.as_mut_slice().as_mut_ptr() as usize)
            .collect();
        let (free_tx, free_rx) = mpsc::channel();
        for slot in 0..slots.len() {
            free_tx.send(slot).expect("the receiver is here");
        }
        (slots, free_tx, free_rx)
    }

    /// Device to ordinary memory: this thread copies each job's bytes into a free slot, threads
    /// copy filled slots out to the job's host memory and free them.
    fn stage_out<D: Device>(mut self, device: &D, jobs: &[Job]) -> Result<()> {
        let (slots, free_tx, free_rx) = self.free_list();
        let (work_tx, work_rx) = mpsc::channel::<(usize, Job)>();
        let work_rx = Mutex::new(work_rx);
        std::thread::scope(|scope| {
            for _ in 0..staging_threads() {
                let free_tx = free_tx.clone();
                let (work_rx, slots) = (&work_rx, &slots);
                scope.spawn(move || loop {
                    let next = work_rx.lock().recv();
                    let Ok((slot, job)) = next else { break };
                    // SAFETY: the slot is this thread's until it is sent back (slots travel by
                    // index, one holder at a time) and holds `job.len` bytes the device copied;
                    // `job.host` is `job.len` bytes of a staged piece no other job writes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            slots[slot] as *const u8,
                            job.host as *mut u8,
                            job.len,
                        );
                    }
                    if free_tx.send(slot).is_err() {
                        break;
                    }
                });
            }
            drop(free_tx);
            let mut result = Ok(());
            for job in jobs {
                let Ok(slot) = free_rx.recv() else { break };
                // SAFETY: `[job.device, +len)` lies in the sleeping pool's mapped chunks, which no
                // queued work writes (the device was synchronized, every allocator lock held); the
                // slot is this thread's (taken from the free list) and holds `len` bytes.
                let copied = unsafe {
                    device.copy_to_host(DeviceAddress(job.device), slots[slot] as *mut u8, job.len)
                };
                if let Err(error) = copied {
                    result = Err(Error::from(error));
                    break;
                }
                if work_tx.send((slot, *job)).is_err() {
                    break;
                }
            }
            drop(work_tx);
            result
        })
    }

    /// Ordinary memory to the device: threads copy each job's host bytes into a free slot, this
    /// thread copies filled slots to the device and frees them. Jobs write distinct device ranges,
    /// so their order does not matter.
    fn stage_back<D: Device>(mut self, device: &D, jobs: &[Job]) -> Result<()> {
        let (slots, free_tx, free_rx) = self.free_list();
        let free_rx = Mutex::new(free_rx);
        let (filled_tx, filled_rx) = mpsc::channel::<(usize, Job)>();
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..staging_threads().min(jobs.len()) {
                let filled_tx = filled_tx.clone();
                let (free_rx, slots, next) = (&free_rx, &slots, &next);
                scope.spawn(move || {
                    while let Some(job) = jobs.get(next.fetch_add(1, Relaxed)) {
                        let free = free_rx.lock().recv();
                        let Ok(slot) = free else { break };
                        // SAFETY: the slot is this thread's until it is sent on (one holder at a
                        // time) and holds at least `job.len` bytes; `job.host` is `job.len` readable
                        // bytes of a staged piece.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                job.host as *const u8,
                                slots[slot] as *mut u8,
                                job.len,
                            );
                        }
                        if filled_tx.send((slot, *job)).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(filled_tx);
            let mut result = Ok(());
            for (slot, job) in &filled_rx {
                // SAFETY: `[job.device, +len)` lies in a run of chunks the wake mapped and nothing
                // has used yet (every allocator lock is held); the slot holds the job's bytes.
                let copied = unsafe {
                    device.copy_from_host(
                        slots[slot] as *const u8,
                        DeviceAddress(job.device),
                        job.len,
                    )
                };
                if let Err(error) = copied {
                    result = Err(Error::from(error));
                    break;
                }
                if free_tx.send(slot).is_err() {
                    break;
                }
            }
            // Threads waiting for a slot or sending one see the channels close and stop (each copies
            // at most the slot it holds).
            drop(free_tx);
            drop(filled_rx);
            result
        })
    }
}

impl Drop for Ring<'_> {
    fn drop(&mut self) {
        for buffer in self.slots.drain(..) {
            if let Err(error) = self.host.free(buffer) {
                tracing::warn!(%error, "giving a staging buffer back to the host allocator failed");
            }
        }
    }
}
