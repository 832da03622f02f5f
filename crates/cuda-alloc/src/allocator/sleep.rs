//! Pools that sleep and wake: a private pool on expandable segments hands its physical memory back
//! to the device while every address it handed out stays reserved, and later gets fresh memory at
//! the same addresses (what vLLM's sleep mode and SGLang's `torch_memory_saver` do to PyTorch's
//! memory from the outside).
//!
//! [`CachingAllocator::sleep_pool`] waits for the device, optionally copies every mapped chunk of
//! the pool's segments to host memory (pinned memory the host allocator has ready, the rest
//! through pinned staging buffers into ordinary memory: see [`HostBackup`]), then unmaps and
//! releases the chunks
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

use super::backup::{Backup, HostBackup};
use super::CachingAllocator;
use crate::device::{CaptureStatus, Device, DeviceAddress};
use crate::error::{Error, Result, SleepError};
use crate::pool::PoolOwner;
use crate::pool_id::MempoolId;
use crate::snapshot::TraceAction;
use crate::stats::peaks::Kind;

/// What [`CachingAllocator::sleep_pool`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SleepReport {
    /// Bytes of physical memory unmapped and released to the device.
    pub released_bytes: u64,
    /// Bytes copied to host memory (0 when the contents were discarded).
    pub backed_up_bytes: u64,
    /// The part of them kept in ordinary host memory, copied through pinned staging buffers
    /// because the host had no pinned memory ready for it ([`HostBackup::allocate_cached`]).
    pub staged_bytes: u64,
    /// Expandable segments (stream and size-class parts of the pool) that slept.
    pub segments: usize,
}

/// What [`CachingAllocator::wake_pool`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct WakeReport {
    /// Bytes of fresh physical memory mapped at the pool's addresses.
    pub mapped_bytes: u64,
    /// Bytes copied back from host memory (0 when the contents were discarded).
    pub restored_bytes: u64,
    /// The part of them copied back through the staging buffers: staged pieces the background
    /// pinning had not moved into pinned memory yet.
    pub staged_bytes: u64,
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
    /// chunk of its segments to host memory from `keep` (when given: its cached pinned memory
    /// first, the rest staged into ordinary memory, [`HostBackup`]), then unmaps and
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
                let mut backup = Backup::new(host);
                let runs: Vec<(u64, u64)> = targets
                    .iter()
                    .flat_map(|&(li, slot, _)| {
                        locks[li].st.segments[slot]
                            .as_ref()
                            .expect("live")
                            .mapped_runs()
                    })
                    .collect();
                if let Err(e) = backup.copy_out(device, &runs) {
                    backup.give_back();
                    return Err(Box::new((None, e)));
                }
                Some(backup)
            }
        };
        let mut report = SleepReport {
            released_bytes: 0,
            backed_up_bytes: backup.as_ref().map_or(0, Backup::bytes),
            staged_bytes: backup.as_ref().map_or(0, Backup::staged_bytes),
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
        // While the pool sleeps, its staged pieces move into pinned memory for the wake.
        if let Some(backup) = &backup {
            backup.promote_in_background();
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
            staged = report.staged_bytes,
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
            Some(backup) => backup.copy_back(device, &mapped).map(|(restored, staged)| {
                report.restored_bytes = restored;
                report.staged_bytes = staged;
            }),
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
        self.sum_asleep(pool, |released, _| released)
    }

    /// Bytes of the sleeping pools' backups (all of them, or `pool`'s) kept in ordinary host
    /// memory: staged by their sleep and not yet moved into pinned memory by the background
    /// pinning. A wake copies these through the staging buffers; the rest straight from pinned
    /// memory.
    #[must_use]
    pub fn asleep_staged_bytes(&self, pool: Option<MempoolId>) -> u64 {
        self.sum_asleep(pool, |_, backup| backup.map_or(0, Backup::staged_bytes))
    }

    /// `figure` (of the bytes released and the backup) summed over the sleeping pools, all of them
    /// or `pool`; pools on their way to sleep or to wake count 0.
    fn sum_asleep(
        &self,
        pool: Option<MempoolId>,
        figure: impl Fn(u64, Option<&Backup>) -> u64,
    ) -> u64 {
        self.asleep
            .lock()
            .iter()
            .filter(|(id, _)| pool.is_none_or(|p| p == **id))
            .map(|(_, state)| match state {
                Asleep::Changing => 0,
                Asleep::Sleeping {
                    released, backup, ..
                } => figure(*released, backup.as_ref()),
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
