//! Pools that sleep and wake: a private pool on expandable segments hands its physical memory back
//! to the device while every address it handed out stays reserved, and later gets fresh memory at
//! the same addresses (what vLLM's sleep mode and SGLang's `torch_memory_saver` do to PyTorch's
//! memory from the outside).
//!
//! [`CachingAllocator::sleep_pool`] waits for the device, optionally copies every mapped chunk of
//! the pool's segments to pinned host memory, then unmaps and releases the chunks
//! (`cuMemUnmap` + `cuMemRelease`), keeping the reserved ranges. The allocator's books do not
//! change: blocks stay allocated or free at their addresses, tensors and captured CUDA graphs keep
//! their pointers. [`CachingAllocator::wake_pool`] maps fresh chunks at the same addresses (with
//! access set) and copies the contents back.
//!
//! # Statistics while asleep
//!
//! The reserved bytes of `memory_stats()` leave with the physical memory and come back with it, as
//! they do when PyTorch unmaps an expandable segment's chunks: for expandable segments PyTorch's
//! reserved bytes are the bytes mapped. Allocated and active bytes do not change (the pool still
//! owns its blocks and addresses, and gets them back as they were), nor does the memory a memory
//! fraction counts (the pool may wake at any time and needs its memory back then). The memory
//! returned also shows in the device's free memory (`cuMemGetInfo`,
//! [`CachingAllocator::device`]`.mem_info()`) and in [`CachingAllocator::asleep_bytes`].
//!
//! # Refusals
//!
//! A pool sleeps only when every one of its segments is expandable, none of its chunks was exported
//! to another process ([`CachingAllocator::shareable_segment`]: that process may be using it), no
//! capture or `MemPool` context allocates to it and no stream of the allocator is being captured
//! (sleeping waits for the device). While asleep, allocating to the pool is refused
//! ([`CachingAllocator::begin_allocate_to_pool`] fails); freeing its blocks is allowed.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::CachingAllocator;
use crate::device::{CaptureStatus, Device, DeviceAddress};
use crate::error::{Error, Result, SleepError};
use crate::host::{HostCachingAllocator, PinnedBuffer};
use crate::pool::PoolOwner;
use crate::pool_id::MempoolId;
use crate::snapshot::TraceAction;
use crate::stats::peaks::Kind;

/// The largest pinned buffer one piece of a sleeping pool's backup takes (a power of two, so that
/// the host allocator's rounding wastes nothing): what to reserve host memory in
/// ([`HostCachingAllocator::reserve`]) for the first sleep to copy at once.
pub const BACKUP_PIECE_BYTES: usize = 256 << 20;

const BACKUP_PIECE: u64 = BACKUP_PIECE_BYTES as u64;

/// Where a sleeping pool's contents are kept: pinned host memory from a
/// [`HostCachingAllocator`] (implemented for it, for `&'static` references to it and for `Arc`s
/// of it).
pub trait HostBackup: Send + Sync {
    /// Pinned host memory of at least `size` bytes.
    ///
    /// # Errors
    /// As [`HostCachingAllocator::allocate`].
    fn allocate(&self, size: usize) -> Result<PinnedBuffer>;

    /// Gives back memory from [`allocate`](Self::allocate).
    ///
    /// # Errors
    /// As [`HostCachingAllocator::free`].
    fn free(&self, buffer: PinnedBuffer) -> Result<()>;
}

impl<H: Device> HostBackup for HostCachingAllocator<H> {
    fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        HostCachingAllocator::allocate(self, size)
    }
    fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        HostCachingAllocator::free(self, buffer)
    }
}

impl<T: HostBackup + ?Sized> HostBackup for &'static T {
    fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        (**self).allocate(size)
    }
    fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        (**self).free(buffer)
    }
}

impl<T: HostBackup + ?Sized> HostBackup for Arc<T> {
    fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        (**self).allocate(size)
    }
    fn free(&self, buffer: PinnedBuffer) -> Result<()> {
        (**self).free(buffer)
    }
}

/// What [`CachingAllocator::sleep_pool`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SleepReport {
    /// Bytes of physical memory unmapped and released to the device.
    pub released_bytes: u64,
    /// Bytes copied to pinned host memory (0 when the contents were discarded).
    pub backed_up_bytes: u64,
    /// Expandable segments (stream and size-class parts of the pool) that slept.
    pub segments: usize,
}

/// What [`CachingAllocator::wake_pool`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WakeReport {
    /// Bytes of fresh physical memory mapped at the pool's addresses.
    pub mapped_bytes: u64,
    /// Bytes copied back from pinned host memory (0 when the contents were discarded).
    pub restored_bytes: u64,
}

/// A sleeping pool's backup: pinned pieces and the device addresses they were copied from.
pub(crate) struct Backup {
    host: Box<dyn HostBackup>,
    pieces: Vec<(u64, PinnedBuffer)>,
}

impl Backup {
    fn bytes(&self) -> u64 {
        self.pieces.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// Gives every piece back to the host allocator (what dropping it does too).
    fn give_back(self) {
        drop(self);
    }
}

impl Drop for Backup {
    /// Gives every piece back to the host allocator (logging failures: the memory is pinned host
    /// memory the host allocator keeps either way), also when the allocator is dropped with the
    /// pool asleep.
    fn drop(&mut self) {
        for (_, buffer) in std::mem::take(&mut self.pieces) {
            if let Err(error) = self.host.free(buffer) {
                tracing::warn!(%error, "giving a sleeping pool's backup back to the host allocator failed");
            }
        }
    }
}

/// A segment that slept: where it was (shard index, segment slot) and which segment it was. A
/// slot freed while the pool sleeps can hold another segment by the time the pool wakes, even at
/// the same base address (the driver hands released ranges out again), so a segment is found by
/// its identity, never by its place alone.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slept {
    pub(crate) shard: u32,
    pub(crate) slot: usize,
    pub(crate) id: u64,
    /// Whether the segment belongs to the pool's small blocks (the statistic it counts in).
    pub(crate) small: bool,
}

/// The state of a pool that is not plainly awake.
pub(crate) enum Asleep {
    /// `sleep_pool` or `wake_pool` is under way: the pool is not ended meanwhile.
    Changing,
    /// Asleep: the segments that slept and the backup.
    Sleeping {
        segments: Vec<Slept>,
        released: u64,
        backup: Option<Backup>,
    },
}

/// Sleeping pools by id.
pub(crate) type SleepBook = parking_lot::Mutex<BTreeMap<MempoolId, Asleep>>;

impl<D: Device> CachingAllocator<D> {
    /// Puts private pool `pool` to sleep: waits for the device, copies the bytes of every mapped
    /// chunk of its segments to pinned host memory from `keep` (when given), then unmaps and
    /// releases every chunk, keeping the address ranges reserved and the blocks where they are.
    /// Allocating to the pool is refused until [`wake_pool`](Self::wake_pool); freeing its blocks
    /// is allowed. Every allocator call waits while it runs.
    ///
    /// The reserved bytes of the statistics drop by the memory released (and come back on wake);
    /// allocated and active bytes do not change (the pool keeps its blocks and gets them back as
    /// they were). The memory returned also shows in the device's free memory (`cuMemGetInfo`) and
    /// in [`asleep_bytes`](Self::asleep_bytes).
    ///
    /// It refuses ([`SleepError`]) a pool with a segment that is not expandable, one with a chunk
    /// exported to another process ([`shareable_segment`](Self::shareable_segment)), one a capture
    /// or `MemPool` context allocates to, any pool while a stream of this allocator is being
    /// captured, and a pool already asleep.
    ///
    /// # Errors
    /// [`Error::Sleep`] when the pool cannot sleep ([`SleepError`]); [`Error::Device`] when waiting,
    /// copying or releasing fails, and [`Error::Device`]/[`Error::TooLarge`] when the pinned
    /// memory cannot be had. A failure before the first chunk is released changes nothing; one
    /// after it leaves the pool asleep with the chunks released so far (waking maps them again).
    pub fn sleep_pool(
        &self,
        pool: MempoolId,
        keep: Option<Box<dyn HostBackup>>,
    ) -> Result<SleepReport> {
        if !self.private.lock().contains_key(&pool) {
            return Err(SleepError::NoSuchPool { pool }.into());
        }
        {
            let mut book = self.asleep.lock();
            if book.contains_key(&pool) {
                return Err(SleepError::Asleep { pool }.into());
            }
            // From here `begin_allocate_to_pool` refuses the pool; a capture that began before is
            // in the list checked next.
            book.insert(pool, Asleep::Changing);
        }
        match self.sleep_now(pool, keep) {
            Ok((state, report)) => {
                self.asleep.lock().insert(pool, state);
                Ok(report)
            }
            Err(failure) => {
                let (state, error) = *failure;
                let mut book = self.asleep.lock();
                match state {
                    Some(state) => book.insert(pool, state),
                    None => book.remove(&pool),
                };
                Err(error)
            }
        }
    }

    /// The work of [`sleep_pool`](Self::sleep_pool) once the pool is marked as changing. On
    /// failure, the state to leave the pool in (`None`: awake) and the error.
    #[allow(clippy::type_complexity)] // a pair and its failure, each used once
    fn sleep_now(
        &self,
        pool: MempoolId,
        keep: Option<Box<dyn HostBackup>>,
    ) -> std::result::Result<(Asleep, SleepReport), Box<(Option<Asleep>, Error)>> {
        let refuse = |e: SleepError| Box::new((None, Error::from(e)));
        if self.captures.read().iter().any(|c| c.pool == pool) {
            return Err(refuse(SleepError::AllocatingTo { pool }));
        }
        let (_pass, mut locks) = self.lock_all();
        let device = &self.device;
        for locked in &locks {
            let stream = locked.shard.stream;
            match device
                .capture_status(stream)
                .map_err(|e| Box::new((None, e.into())))?
            {
                CaptureStatus::None => {}
                CaptureStatus::Active { .. } | CaptureStatus::Invalidated => {
                    return Err(refuse(SleepError::Capturing { pool, stream }));
                }
            }
        }
        // The pool's segments, and the checks that they can sleep.
        let mut targets: Vec<(usize, usize, bool)> = Vec::new();
        for (li, locked) in locks.iter().enumerate() {
            let st = &locked.st;
            let owned: Vec<u16> = (0..st.pools.len() as u16)
                .filter(|&i| st.pools[i as usize].owner == PoolOwner::Private(pool))
                .collect();
            if owned.is_empty() {
                continue;
            }
            let mut slots: Vec<(usize, bool)> = Vec::new();
            for (_, block) in st.blocks.iter() {
                if !owned.contains(&block.pool) {
                    continue;
                }
                if !block.is_expandable() {
                    let mut first = block;
                    while first.prev != crate::block::NIL {
                        first = &st.blocks[first.prev];
                    }
                    return Err(refuse(SleepError::NotExpandable {
                        pool,
                        segment: DeviceAddress(first.addr),
                    }));
                }
                slots.push((
                    block.expandable as usize,
                    st.pools[block.pool as usize].small,
                ));
            }
            slots.sort_unstable();
            slots.dedup();
            for (slot, small) in slots {
                let segment = st.segments[slot]
                    .as_ref()
                    .expect("an expandable block's segment is live");
                if let Some(chunk) = segment.first_exported() {
                    return Err(refuse(SleepError::Shared { pool, chunk }));
                }
                targets.push((li, slot, small));
            }
        }
        device
            .synchronize()
            .map_err(|e| Box::new((None, e.into())))?;
        let backup = match keep {
            None => None,
            Some(host) => {
                let mut backup = Backup {
                    host,
                    pieces: Vec::new(),
                };
                let mut pieces = Vec::new();
                for &(li, slot, _) in &targets {
                    let segment = locks[li].st.segments[slot].as_ref().expect("live");
                    for (start, len) in segment.mapped_runs() {
                        pieces.extend(backup_pieces(start, len));
                    }
                }
                if let Err(e) = copy_out(device, &mut backup, &pieces) {
                    backup.give_back();
                    return Err(Box::new((None, e)));
                }
                Some(backup)
            }
        };
        let backed_up_bytes = backup.as_ref().map_or(0, Backup::bytes);
        let mut report = SleepReport {
            released_bytes: 0,
            backed_up_bytes,
            segments: targets.len(),
        };
        let mut segments = Vec::with_capacity(targets.len());
        let mut failure = None;
        for &(li, slot, small) in &targets {
            let locked = &mut locks[li];
            let shard = locked.shard.index;
            let segment = locked.st.segments[slot].as_mut().expect("live");
            segments.push(Slept {
                shard,
                slot,
                id: segment.id(),
                small,
            });
            // Trackers let go of the memory before it is released.
            for (addr, len) in segment.mapped_runs() {
                self.trace
                    .tell_trackers(TraceAction::SegmentUnmap, addr, len, pool);
            }
            let result = segment.sleep(device);
            let released = match &result {
                Ok(bytes) => *bytes,
                Err(_) => segment.asleep_bytes(),
            };
            report.released_bytes += released;
            locked.dec(Kind::ReservedBytes, small, released);
            if let Err(e) = result {
                failure = Some(e);
                break;
            }
        }
        drop(locks);
        if let (Some(e), 0) = (&failure, report.released_bytes) {
            // Nothing was released: the pool stays awake, as if the call had not been made.
            if let Some(backup) = backup {
                backup.give_back();
            }
            return Err(Box::new((None, e.clone().into())));
        }
        let state = Asleep::Sleeping {
            segments,
            released: report.released_bytes,
            backup,
        };
        tracing::debug!(
            target: "tensormem_cuda_alloc",
            %pool,
            released = report.released_bytes,
            backed_up = report.backed_up_bytes,
            "a pool went to sleep"
        );
        match failure {
            None => Ok((state, report)),
            Some(e) => Err(Box::new((Some(state), e.into()))),
        }
    }

    /// Wakes private pool `pool`: maps fresh physical memory (with access set) at every address
    /// whose chunk [`sleep_pool`](Self::sleep_pool) released, copies the kept contents back and
    /// gives the pinned memory back to its host allocator. Blocks freed while asleep and released
    /// by `empty_cache` meanwhile are not mapped again. Every allocator call waits while it runs.
    ///
    /// # Errors
    /// [`Error::Sleep`] ([`SleepError::NotAsleep`], or [`SleepError::Asleep`] while another call
    /// is putting it to sleep or waking it); [`Error::Device`] when the device has no room for the
    /// memory ([`DeviceError::OutOfMemory`](crate::DeviceError::OutOfMemory); the pool stays
    /// asleep, nothing changed) or a driver call fails. A failure while copying back leaves the
    /// pool awake with its contents undefined.
    pub fn wake_pool(&self, pool: MempoolId) -> Result<WakeReport> {
        if !self.private.lock().contains_key(&pool) {
            return Err(SleepError::NoSuchPool { pool }.into());
        }
        let (segments, released, backup) = {
            let mut book = self.asleep.lock();
            match book.get(&pool) {
                None => return Err(SleepError::NotAsleep { pool }.into()),
                Some(Asleep::Changing) => return Err(SleepError::Asleep { pool }.into()),
                Some(Asleep::Sleeping { .. }) => {}
            }
            let Some(Asleep::Sleeping {
                segments,
                released,
                backup,
            }) = book.insert(pool, Asleep::Changing)
            else {
                unreachable!("checked above")
            };
            (segments, released, backup)
        };
        let mut locks = self.lock_all();
        let device = &self.device;
        let mut report = WakeReport::default();
        let mut woken: Vec<(usize, usize, bool, u64)> = Vec::new();
        for &Slept {
            shard,
            slot,
            id,
            small,
        } in &segments
        {
            let Some(li) = locks.1.iter().position(|l| l.shard.index == shard) else {
                continue;
            };
            // A segment released while the pool slept is gone; its slot may hold another one.
            let Some(segment) = locks.1[li]
                .st
                .segments
                .get_mut(slot)
                .and_then(Option::as_mut)
                .filter(|segment| segment.id() == id)
            else {
                continue;
            };
            match segment.wake(device) {
                Ok(bytes) => {
                    report.mapped_bytes += bytes;
                    woken.push((li, slot, small, bytes));
                }
                Err(e) => {
                    for &(li, slot, _, _) in &woken {
                        let segment = locks.1[li].st.segments[slot].as_mut().expect("live");
                        if let Err(undo) = segment.sleep(device) {
                            tracing::warn!(%undo, "putting a partly woken pool back to sleep failed");
                        }
                    }
                    drop(locks);
                    self.asleep.lock().insert(
                        pool,
                        Asleep::Sleeping {
                            segments,
                            released,
                            backup,
                        },
                    );
                    return Err(e.into());
                }
            }
        }
        // The ranges still mapped after `empty_cache` meanwhile: copy back only into those.
        for &(li, _, small, bytes) in &woken {
            locks.1[li].inc(Kind::ReservedBytes, small, bytes);
        }
        let mapped: Vec<(u64, u64)> = woken
            .iter()
            .flat_map(|&(li, slot, _, _)| {
                locks.1[li].st.segments[slot]
                    .as_ref()
                    .expect("live")
                    .mapped_runs()
            })
            .collect();
        // Trackers take the fresh memory at the same addresses.
        for &(addr, len) in &mapped {
            self.trace
                .tell_trackers(TraceAction::SegmentMap, addr, len, pool);
        }
        let result = match &backup {
            None => Ok(()),
            Some(backup) => copy_back(device, backup, &mapped, &mut report),
        };
        drop(locks);
        self.asleep.lock().remove(&pool);
        if let Some(backup) = backup {
            backup.give_back();
        }
        result?;
        tracing::debug!(
            target: "tensormem_cuda_alloc",
            %pool,
            mapped = report.mapped_bytes,
            restored = report.restored_bytes,
            "a pool woke"
        );
        Ok(report)
    }

    /// Whether `pool` is asleep (or on its way to sleep or to wake).
    #[must_use]
    pub fn is_pool_asleep(&self, pool: MempoolId) -> bool {
        self.asleep.lock().contains_key(&pool)
    }

    /// Bytes of physical memory released by sleeping pools (all of them, or `pool`'s): what the
    /// reserved statistic dropped by, and what a memory fraction still counts.
    #[must_use]
    pub fn asleep_bytes(&self, pool: Option<MempoolId>) -> u64 {
        self.asleep
            .lock()
            .iter()
            .filter(|(id, _)| pool.is_none_or(|p| p == **id))
            .map(|(_, state)| match state {
                Asleep::Changing => 0,
                Asleep::Sleeping { released, .. } => *released,
            })
            .sum()
    }

    /// Takes an ended pool (`release_cached_blocks` removing it, every allocator lock held) out
    /// of the sleep book and gives its backup back to its host allocator. Returns `false`, leaving
    /// everything as it was, while a `sleep_pool` or `wake_pool` of the pool is under way: the
    /// pool is not ended then (a later release ends it).
    pub(crate) fn forget_ended_pool(&self, pool: MempoolId) -> bool {
        let mut book = self.asleep.lock();
        match book.get(&pool) {
            None => true,
            Some(Asleep::Changing) => false,
            Some(Asleep::Sleeping { .. }) => {
                if let Some(Asleep::Sleeping { backup, .. }) = book.remove(&pool) {
                    drop(book);
                    let kept = backup.as_ref().map_or(0, Backup::bytes);
                    drop(backup);
                    tracing::debug!(
                        target: "tensormem_cuda_alloc",
                        %pool,
                        backup = kept,
                        "a pool ended while asleep; its backup was given back"
                    );
                }
                true
            }
        }
    }

    /// The pools in the sleep book, for the invariant walk: each with the identities of the
    /// segments that slept (none while it changes).
    pub(crate) fn sleeping_pools(&self) -> Vec<(MempoolId, Vec<Slept>)> {
        self.asleep
            .lock()
            .iter()
            .map(|(&id, state)| match state {
                Asleep::Changing => (id, Vec::new()),
                Asleep::Sleeping { segments, .. } => (id, segments.clone()),
            })
            .collect()
    }

    /// Refuses to allocate to `pool` while it is asleep (called by `begin_allocate_to_pool` with
    /// the capture list's write lock held).
    ///
    /// # Errors
    /// [`Error::Sleep`] with [`SleepError::Asleep`].
    pub(crate) fn refuse_if_asleep(&self, pool: MempoolId) -> Result<()> {
        if self.asleep.lock().contains_key(&pool) {
            return Err(SleepError::Asleep { pool }.into());
        }
        Ok(())
    }
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

/// The most threads that pin a backup's host memory at once.
const MAX_PINNING_THREADS: usize = 8;

/// Copies `pieces` (device address, length) of device memory to pinned host memory from the
/// backup's host allocator. Pinning new host memory is the slow part of a first sleep (the host
/// allocator's cache serves later ones), and it runs without any device work: helper threads pin
/// the pieces' buffers, up to [`MAX_PINNING_THREADS`] at once, while this thread copies each piece
/// as soon as its buffer is there, so the copy overlaps the pinning of the pieces after it. Every
/// buffer ends in the backup, copied or not, so that a failure gives them all back.
fn copy_out<D: Device>(device: &D, backup: &mut Backup, pieces: &[(u64, u64)]) -> Result<()> {
    if pieces.len() <= 1 {
        for &(at, len) in pieces {
            let buffer = backup.host.allocate(len as usize)?;
            backup.pieces.push((at, buffer));
            let (_, buffer) = backup.pieces.last_mut().expect("just pushed");
            copy_piece(device, at, buffer)?;
        }
        return Ok(());
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, MAX_PINNING_THREADS)
        .min(pieces.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let host = &*backup.host;
    let (sender, pinned) = std::sync::mpsc::channel::<(u64, Result<PinnedBuffer>)>();
    let mut first_error = None;
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let sender = sender.clone();
            let (next, failed) = (&next, &failed);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(at, len)) = pieces.get(i) else {
                    break;
                };
                if failed.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                if sender.send((at, host.allocate(len as usize))).is_err() {
                    break;
                }
            });
        }
        drop(sender);
        for (at, buffer) in pinned {
            match buffer {
                Ok(buffer) => {
                    backup.pieces.push((at, buffer));
                    if first_error.is_none() {
                        let (_, buffer) = backup.pieces.last_mut().expect("just pushed");
                        if let Err(e) = copy_piece(device, at, buffer) {
                            failed.store(true, std::sync::atomic::Ordering::Relaxed);
                            first_error = Some(e);
                        }
                    }
                }
                Err(e) => {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    first_error.get_or_insert(e);
                }
            }
        }
    });
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Copies the device memory at `at` into `buffer` (its whole length).
fn copy_piece<D: Device>(device: &D, at: u64, buffer: &mut PinnedBuffer) -> Result<()> {
    let len = buffer.len();
    let dst = buffer.as_mut_slice().as_mut_ptr();
    // SAFETY: `[at, at + len)` is a piece of a run of chunks mapped in the sleeping pool's segment
    // (`backup_pieces`), and the device was synchronized with every lock held, so no queued work
    // writes it; `dst` is the pinned buffer of `len` bytes owned here.
    unsafe { device.copy_to_host(DeviceAddress(at), dst, len) }?;
    Ok(())
}

/// Copies the pieces of `backup` back, into the parts of them inside the `mapped` runs.
fn copy_back<D: Device>(
    device: &D,
    backup: &Backup,
    mapped: &[(u64, u64)],
    report: &mut WakeReport,
) -> Result<()> {
    for (at, buffer) in &backup.pieces {
        let (lo, hi) = (*at, *at + buffer.len() as u64);
        for &(start, len) in mapped {
            let (from, to) = (lo.max(start), hi.min(start + len));
            if from >= to {
                continue;
            }
            let offset = (from - lo) as usize;
            let bytes = &buffer.as_slice()[offset..offset + (to - from) as usize];
            // SAFETY: `[from, to)` lies in a run of chunks this call mapped and nothing has used
            // yet (every allocator lock is held); `bytes` is valid for reads of that length.
            unsafe { device.copy_from_host(bytes.as_ptr(), DeviceAddress(from), bytes.len())? };
            report.restored_bytes += bytes.len() as u64;
        }
    }
    Ok(())
}
