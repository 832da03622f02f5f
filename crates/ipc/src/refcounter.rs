//! Ref-counter files: PyTorch's `CudaIPCRefCountersFile`, plus who holds each slot.
//!
//! A ref-counter file is a refcounted shared memory object laid out as PyTorch's
//! `RefcountedMapAllocator` (64-byte header with the open count, data after it) whose data starts with
//! an array of `int64` counters, one *slot* per share: the producer sets a slot to 1 when it shares,
//! the consumer subtracts 1 when it is done. PyTorch consumers open the file by name and decrement
//! the slot at `ref_counter_offset` exactly as they do with PyTorch's own files.
//!
//! After the counters, tensormem's files carry what PyTorch's do not (PyTorch maps only the counters,
//! so it never sees it):
//!
//! ```text
//! data offset 0          n x i64       the counters (PyTorch's layout)
//!             8n         n x 32 bytes  owner of each slot: pid, start time + 1, pid namespace, flags
//!             40n        64 bytes      trailer: magic "TMIPCRC1", n, creator pid, start, namespace
//! ```
//!
//! A consumer records itself as the owner of the slot it opened; the producer's `collect` reclaims
//! slots whose owner died without releasing them (PyTorch leaks those forever), and a consumer that
//! finds the file's creator dead unlinks the name when it is done with it.
//!
//! Whether an owner died is asked of the kernel, not of pids: while it holds a slot, the owner
//! holds an open-file-description lock on one byte of the file for it (byte
//! [`SLOT_LOCKS`]` + slot`, past the end of the data; flag [`OWNER_LOCKS`] says so), which the
//! kernel drops when the owner is killed. That works across pid namespaces (a consumer in another
//! container, whose pid means nothing here). An owner recorded without the flag (a consumer that
//! does not lock) is judged by its pid, start time and namespace, and an owner of another pid
//! namespace without a lock is never taken for dead.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use parking_lot::Mutex;
use tensormem_shm::{
    MapOptions, Mapping, RefcountedRegion, SharedRegion, ShmName, REFCOUNT_HEADER_LEN, TORCH_PREFIX,
};

use crate::byte_lock::{byte_lock, byte_locked, Locked};
use crate::error::{Error, Result};
use crate::process::{Liveness, ProcessIdentity};

/// Slots per ref-counter file (PyTorch's `CUDA_IPC_REF_COUNTER_FILE_SIZE`).
pub const REF_COUNTER_FILE_SIZE: usize = 10_000;

const OWNER_LEN: usize = 32;
const TRAILER_LEN: usize = 64;
const TRAILER_MAGIC: u64 = u64::from_le_bytes(*b"TMIPCRC1");

/// Data bytes of a tensormem ref-counter file of `slots` slots.
pub(crate) fn data_len(slots: usize) -> usize {
    slots * (8 + OWNER_LEN) + TRAILER_LEN
}

/// The byte whose lock stands for slot 0's owner being alive; slot `n`'s is `SLOT_LOCKS + n` (past
/// every byte of the data: locks need no bytes behind them).
pub(crate) const SLOT_LOCKS: usize = 1 << 40;

/// Owner flag: the owner holds the lock on its slot's byte while it holds the slot.
pub(crate) const OWNER_LOCKS: u64 = 1;

/// What an owner word holds once the producer gave an unclaimed slot up
/// ([`RefCounterFile::expire_if_unclaimed`]): no process id is this.
const EXPIRED_OWNER: u64 = u64::MAX;

/// The holder [`SlotTable::claim`] reports for a slot the producer gave up unclaimed.
pub(crate) const EXPIRED: u32 = u32::MAX;

/// The refusal of a claim on `slot` of `name` that [`SlotTable::claim`] answered with `holder`:
/// another process holds it, or the producer gave it up unclaimed.
pub(crate) fn claim_refused(slot: u64, name: String, holder: u32) -> Error {
    if holder == EXPIRED {
        Error::ShareExpired { slot, name }
    } else {
        Error::SlotClaimed {
            slot,
            name,
            pid: holder,
        }
    }
}

/// The slots of a mapped ref-counter file: counters, and owners where the file has them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotTable {
    /// Offset of the data (0 for a `RefcountedRegion`'s mapping, 64 for a whole-object mapping).
    base: usize,
    /// Number of slots.
    slots: usize,
    /// Whether the owner table and trailer are there (tensormem's files, not PyTorch's).
    owners: bool,
}

impl SlotTable {
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    #[cfg(test)]
    pub(crate) fn has_owners(&self) -> bool {
        self.owners
    }

    /// The counter of `slot` (`slot < slots`).
    pub(crate) fn counter<'m>(&self, map: &'m Mapping, slot: usize) -> Result<&'m AtomicI64> {
        map.atomic::<AtomicI64>(self.base + slot * 8)
            .map_err(|e| Error::file(&"(mapped)", e))
    }

    fn owner_word<'m>(&self, map: &'m Mapping, slot: usize, word: usize) -> Result<&'m AtomicU64> {
        map.atomic::<AtomicU64>(self.base + self.slots * 8 + slot * OWNER_LEN + word * 8)
            .map_err(|e| Error::file(&"(mapped)", e))
    }

    fn trailer_word<'m>(&self, map: &'m Mapping, word: usize) -> Result<&'m AtomicU64> {
        map.atomic::<AtomicU64>(self.base + self.slots * (8 + OWNER_LEN) + word * 8)
            .map_err(|e| Error::file(&"(mapped)", e))
    }

    /// The owner recorded for `slot`, if any (and fully written).
    pub(crate) fn owner(&self, map: &Mapping, slot: usize) -> Result<Option<ProcessIdentity>> {
        if !self.owners {
            return Ok(None);
        }
        let pid = self.owner_word(map, slot, 0)?.load(Ordering::Acquire);
        let start = self.owner_word(map, slot, 1)?.load(Ordering::Acquire);
        if pid == 0 || start == 0 {
            return Ok(None);
        }
        Ok(Some(ProcessIdentity {
            pid: pid as u32,
            start_time: start - 1,
            pid_namespace: self.owner_word(map, slot, 2)?.load(Ordering::Acquire),
        }))
    }

    /// Whether the owner of `slot` holds the lock on its slot's byte while it holds the slot.
    fn owner_locks(&self, map: &Mapping, slot: usize) -> bool {
        self.owners
            && self
                .owner_word(map, slot, 3)
                .is_ok_and(|flags| flags.load(Ordering::Acquire) & OWNER_LOCKS != 0)
    }

    /// Records this process as the owner of `slot`. `Err(pid)` if another owner is recorded
    /// ([`EXPIRED`] when the producer gave the slot up unclaimed).
    pub(crate) fn claim(&self, map: &Mapping, slot: usize) -> Result<Result<(), u32>> {
        self.claim_with(map, slot, 0)
    }

    /// [`claim`](Self::claim) with the owner `flags` ([`OWNER_LOCKS`]).
    fn claim_with(&self, map: &Mapping, slot: usize, flags: u64) -> Result<Result<(), u32>> {
        if !self.owners {
            return Ok(Ok(()));
        }
        let me = ProcessIdentity::current();
        let pid = self.owner_word(map, slot, 0)?;
        if let Err(holder) =
            pid.compare_exchange(0, u64::from(me.pid), Ordering::AcqRel, Ordering::Acquire)
        {
            return Ok(Err(if holder == EXPIRED_OWNER {
                EXPIRED
            } else {
                holder as u32
            }));
        }
        self.owner_word(map, slot, 2)?
            .store(me.pid_namespace, Ordering::Release);
        self.owner_word(map, slot, 3)?
            .store(flags, Ordering::Release);
        // The start time last: an owner is read as recorded once it is there.
        self.owner_word(map, slot, 1)?
            .store(me.start_time + 1, Ordering::Release);
        Ok(Ok(()))
    }

    /// Whether the producer gave `slot` up unclaimed
    /// ([`RefCounterFile::expire_if_unclaimed`]).
    pub(crate) fn is_expired(&self, map: &Mapping, slot: usize) -> bool {
        self.owners
            && self
                .owner_word(map, slot, 0)
                .is_ok_and(|pid| pid.load(Ordering::Acquire) == EXPIRED_OWNER)
    }

    /// Clears this process's ownership of `slot` (after releasing it).
    pub(crate) fn unclaim(&self, map: &Mapping, slot: usize) -> Result<()> {
        if !self.owners {
            return Ok(());
        }
        let me = u64::from(ProcessIdentity::current().pid);
        self.owner_word(map, slot, 1)?.store(0, Ordering::Release);
        self.owner_word(map, slot, 3)?.store(0, Ordering::Release);
        let _ = self.owner_word(map, slot, 0)?.compare_exchange(
            me,
            0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        Ok(())
    }

    /// Clears any owner of `slot` (the producer, handing the slot out).
    fn reset_owner(&self, map: &Mapping, slot: usize) -> Result<()> {
        if self.owners {
            for word in [1, 2, 3, 0] {
                self.owner_word(map, slot, word)?
                    .store(0, Ordering::Release);
            }
        }
        Ok(())
    }

    /// The creator recorded in the trailer.
    pub(crate) fn creator(&self, map: &Mapping) -> Result<Option<ProcessIdentity>> {
        if !self.owners {
            return Ok(None);
        }
        Ok(Some(ProcessIdentity {
            pid: self.trailer_word(map, 2)?.load(Ordering::Acquire) as u32,
            start_time: self.trailer_word(map, 3)?.load(Ordering::Acquire),
            pid_namespace: self.trailer_word(map, 4)?.load(Ordering::Acquire),
        }))
    }

    /// Checks, through the kernel, that the table's last word is still backed by the object, for a
    /// caller about to touch its atomics. Truncation removes a suffix of the object, so the last word
    /// being there means every counter, owner and trailer word is; a mapping whose object was
    /// shrunk gives [`Error::RefCounterFile`] (with [`tensormem_shm::Error::Truncated`]) instead of
    /// raising `SIGBUS`. A truncation racing the check still faults, as every access in PyTorch does.
    pub(crate) fn probe(&self, map: &Mapping) -> Result<()> {
        let end = if self.owners {
            self.base + self.slots * (8 + OWNER_LEN) + TRAILER_LEN
        } else {
            self.base + self.slots * 8
        };
        let mut word = [0u8; 8];
        map.read_at(end - 8, &mut word)
            .map_err(|e| Error::file(&"(mapped)", e))
    }

    /// Recognises a mapped file `name` whose data starts at `base`: a tensormem file (trailer with
    /// the magic and a matching slot count) or a PyTorch file (a name `/torch_<pid>_<random>_<n>`
    /// as `NewProcessWideShmHandle` makes, and exactly [`REF_COUNTER_FILE_SIZE`] counters, as
    /// `CudaIPCTypes.cpp` creates). Anything else is another object, whose words are not ours to
    /// decrement.
    fn recognise(map: &Mapping, base: usize, name: &ShmName) -> Option<Self> {
        let data = map.len().checked_sub(base)?;
        if data >= TRAILER_LEN {
            let at = base + data - TRAILER_LEN;
            let mut trailer = [0u8; 16];
            // Read through the kernel: the object may have been truncated since it was mapped.
            map.read_at(at, &mut trailer).ok()?;
            let magic = u64::from_le_bytes(trailer[..8].try_into().ok()?);
            let slots = u64::from_le_bytes(trailer[8..].try_into().ok()?) as usize;
            if magic == TRAILER_MAGIC
                && slots.checked_mul(8 + OWNER_LEN).map(|n| n + TRAILER_LEN) == Some(data)
            {
                return Some(Self {
                    base,
                    slots,
                    owners: true,
                });
            }
        }
        let torch_name = name
            .parse_generated()
            .is_some_and(|parts| parts.prefix == TORCH_PREFIX);
        (torch_name && data == 8 * REF_COUNTER_FILE_SIZE).then_some(Self {
            base,
            slots: REF_COUNTER_FILE_SIZE,
            owners: false,
        })
    }
}

/// A ref-counter file this process created (the producer side): hands out its slots in order.
///
/// Two mappings of one object: the *hold*, which counts in the file's open count as PyTorch's
/// `RefcountedMapAllocator` does (the last closer unlinks the name), and the *view*, which does not
/// count and through which every slot is read and written. The hold can thus be released early
/// ([`release_hold`](Self::release_hold), at process exit) while shares still holding the file go on
/// reading their slots.
#[derive(Debug)]
pub(crate) struct RefCounterFile {
    /// This process's place in the open count; `None` once released.
    hold: Mutex<Option<RefcountedRegion>>,
    /// The whole object (header and data), mapped without counting; its table's base is the header.
    view: SharedRegion,
    name: ShmName,
    table: SlotTable,
    /// The next slot to hand out (under the producer's file lock).
    next: AtomicU64,
}

impl RefCounterFile {
    /// Creates a file of `slots` slots named `name`.
    pub(crate) fn create(name: &ShmName, slots: usize) -> Result<Self> {
        let hold = RefcountedRegion::create(name, data_len(slots) as u64)
            .map_err(|e| Error::file(name, e))?;
        // The descriptor is kept to ask the kernel about the owners' locks.
        let view = MapOptions::new()
            .keep_fd(true)
            .map_shm(name)
            .map_err(|e| Error::file(name, e))?;
        let len = REFCOUNT_HEADER_LEN + data_len(slots);
        if view.mapping().len() != len {
            // Unlinked and made again by another process of this user between the two opens.
            return Err(Error::NotRefCounterFile {
                name: name.to_string(),
                len: view.mapping().len() as u64,
                torch_len: (REFCOUNT_HEADER_LEN + 8 * REF_COUNTER_FILE_SIZE) as u64,
            });
        }
        let table = SlotTable {
            base: REFCOUNT_HEADER_LEN,
            slots,
            owners: true,
        };
        let me = ProcessIdentity::current();
        let words = [
            TRAILER_MAGIC,
            slots as u64,
            u64::from(me.pid),
            me.start_time,
            me.pid_namespace,
        ];
        for (i, value) in words.into_iter().enumerate().rev() {
            table
                .trailer_word(view.mapping(), i)?
                .store(value, Ordering::Release);
        }
        tracing::debug!(target: "tensormem_ipc", name = %name, slots, "created ref-counter file");
        Ok(Self {
            hold: Mutex::new(Some(hold)),
            view,
            name: name.clone(),
            table,
            next: AtomicU64::new(0),
        })
    }

    pub(crate) fn name(&self) -> &ShmName {
        &self.name
    }

    /// Releases this process's hold on the file now (what dropping it does, and PyTorch's
    /// `~CudaIPCGlobalEntities` at exit): the open count goes down by one, and the name is
    /// unlinked if that was the last hold (a PyTorch consumer holds one while it has the file
    /// open; tensormem consumers hold none). The slots stay readable here. Does nothing the second
    /// time. Returns whether the name was unlinked.
    pub(crate) fn release_hold(&self) -> bool {
        let Some(hold) = self.hold.lock().take() else {
            return false;
        };
        match hold.close() {
            Ok(unlinked) => unlinked,
            Err(err) => {
                tracing::warn!(target: "tensormem_ipc", name = %self.name, %err,
                    "could not release this process's hold on a ref-counter file");
                false
            }
        }
    }

    /// Hands out the next slot with its counter set to 1, or `None` when every slot was handed out.
    pub(crate) fn take_slot(&self) -> Result<Option<usize>> {
        let slot = self.next.load(Ordering::Relaxed) as usize;
        if slot >= self.table.slots {
            return Ok(None);
        }
        self.probe()?;
        let map = self.view.mapping();
        self.table.reset_owner(map, slot)?;
        self.table.counter(map, slot)?.store(1, Ordering::Release);
        self.next.store(slot as u64 + 1, Ordering::Relaxed);
        Ok(Some(slot))
    }

    /// Sets a slot handed out by [`take_slot`](Self::take_slot) but never sent back to 0.
    pub(crate) fn release_unsent(&self, slot: usize) {
        if self.probe().is_err() {
            return;
        }
        if let Ok(counter) = self.table.counter(self.view.mapping(), slot) {
            counter.store(0, Ordering::Release);
        }
    }

    /// Whether slots are left to hand out.
    pub(crate) fn has_slots(&self) -> bool {
        (self.next.load(Ordering::Relaxed) as usize) < self.table.slots
    }

    /// The counter of `slot`.
    ///
    /// # Errors
    ///
    /// [`Error::RefCounterFile`] if another process truncated the file: the counts are lost.
    pub(crate) fn value(&self, slot: usize) -> Result<i64> {
        self.probe()?;
        Ok(self
            .table
            .counter(self.view.mapping(), slot)?
            .load(Ordering::Acquire))
    }

    /// Checks through the kernel that the file was not truncated under its mapping (see
    /// [`SlotTable::probe`]).
    fn probe(&self) -> Result<()> {
        self.table
            .probe(self.view.mapping())
            .map_err(|e| e.renamed(self.name()))
    }

    /// Gives up `slot` if no consumer claimed it (a handle sent and never opened, or a consumer
    /// killed before its claim), or if the process that began to claim it died before it finished
    /// (killed between its two writes): marks the owner as expired, so that a consumer opening it
    /// later is refused, and sets the counter to 0. Returns whether it did. Only for slots whose
    /// every consumer claims (tensormem's): a PyTorch consumer never claims the slot it holds.
    pub(crate) fn expire_if_unclaimed(&self, slot: usize) -> bool {
        if !self.table.owners || self.probe().is_err() {
            return false;
        }
        let map = self.view.mapping();
        let (Ok(pid), Ok(start)) = (
            self.table.owner_word(map, slot, 0),
            self.table.owner_word(map, slot, 1),
        ) else {
            return false;
        };
        let holder = pid.load(Ordering::Acquire);
        let given_up = match holder {
            0 => pid
                .compare_exchange(0, EXPIRED_OWNER, Ordering::AcqRel, Ordering::Acquire)
                .is_ok(),
            EXPIRED_OWNER => false,
            // A claim begun (pid written) but not finished (no start time): only a dead claimant.
            holder if start.load(Ordering::Acquire) == 0 => {
                let dead = rustix::process::Pid::from_raw(holder as i32).is_none_or(|pid| {
                    rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
                });
                dead && pid
                    .compare_exchange(holder, EXPIRED_OWNER, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            }
            _ => false,
        };
        if !given_up {
            return false;
        }
        match self.table.counter(map, slot) {
            Ok(counter) => {
                let value = counter.load(Ordering::Acquire);
                value > 0
                    && counter
                        .compare_exchange(value, 0, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
            }
            Err(_) => false,
        }
    }

    /// Whether the owner of `slot` (`owner`) is alive: by the lock on its slot's byte when it
    /// takes one (the kernel's answer, whatever its pid namespace), else by its pid.
    fn owner_liveness(&self, slot: usize, owner: &ProcessIdentity) -> Liveness {
        if self.table.owner_locks(self.view.mapping(), slot) {
            if let Some(fd) = self.view.fd() {
                match byte_locked(fd, SLOT_LOCKS + slot) {
                    Some(true) => return Liveness::Alive,
                    // Released: either the owner let go of the slot (and cleared its record
                    // before unlocking) or it died.
                    Some(false) => return Liveness::Dead,
                    None => {}
                }
            }
        }
        owner.liveness()
    }

    /// If `slot` is still held by a consumer that has died, sets it to 0 and returns that owner.
    pub(crate) fn reclaim_if_owner_dead(&self, slot: usize) -> Option<ProcessIdentity> {
        self.probe().ok()?;
        let map = self.view.mapping();
        let owner = self.table.owner(map, slot).ok().flatten()?;
        if self.owner_liveness(slot, &owner) != Liveness::Dead {
            return None;
        }
        let counter = self.table.counter(map, slot).ok()?;
        let value = counter.load(Ordering::Acquire);
        if value > 0
            && counter
                .compare_exchange(value, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            Some(owner)
        } else {
            None
        }
    }
}

/// A ref-counter file mapped by a consumer, whose own slots it decrements.
///
/// Mapped without adding to the file's open count: a consumer killed with the file mapped leaves
/// nothing behind, and the producer's close still unlinks the name. The name exists while the
/// consumer's slot is non-zero, since the producer keeps its file until every slot returned to 0.
#[derive(Debug)]
pub(crate) struct MappedCounterFile {
    region: SharedRegion,
    name: ShmName,
    table: SlotTable,
}

impl MappedCounterFile {
    /// Maps the existing file `name` (tensormem's or PyTorch's).
    pub(crate) fn open(name: &ShmName) -> Result<Self> {
        // The descriptor is kept for the locks that show this process holds its slots.
        let region = MapOptions::new()
            .keep_fd(true)
            .map_shm(name)
            .map_err(|e| Error::file(name, e))?;
        let len = region.mapping().len();
        let table =
            SlotTable::recognise(region.mapping(), REFCOUNT_HEADER_LEN, name).ok_or_else(|| {
                Error::NotRefCounterFile {
                    name: name.to_string(),
                    len: len as u64,
                    torch_len: (REFCOUNT_HEADER_LEN + 8 * REF_COUNTER_FILE_SIZE) as u64,
                }
            })?;
        Ok(Self {
            region,
            name: name.clone(),
            table,
        })
    }

    pub(crate) fn name(&self) -> &ShmName {
        &self.name
    }

    pub(crate) fn table(&self) -> SlotTable {
        self.table
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        self.region.mapping()
    }

    /// Checks through the kernel that the file was not truncated since it was mapped (see
    /// [`SlotTable::probe`]); call it before touching the file's atomics.
    pub(crate) fn probe(&self) -> Result<()> {
        self.table
            .probe(self.region.mapping())
            .map_err(|e| e.renamed(&self.name))
    }

    /// Records this process as the owner of `slot` ([`SlotTable::claim`]), holding the lock on the
    /// slot's byte while it owns it (so that the producer sees it die, in any pid namespace); where
    /// the file system refuses the lock, the owner is recorded without it. `Err(pid)` if another
    /// owner holds the slot.
    pub(crate) fn claim(&self, slot: usize) -> Result<Result<(), u32>> {
        let map = self.region.mapping();
        if !self.table.owners {
            return Ok(Ok(()));
        }
        if self.table.owner_word(map, slot, 0)?.load(Ordering::Acquire) != 0 {
            // Claimed already (perhaps by this process, whose lock on the byte must stay): the
            // claim says by whom.
            return self.table.claim(map, slot);
        }
        let locked = match self.region.fd() {
            Some(fd) => byte_lock(fd, SLOT_LOCKS + slot, true),
            None => Locked::Unsupported,
        };
        if locked == Locked::Held {
            // Another live process holds this slot (its record may not be written yet).
            let holder = self.table.owner(map, slot)?.map_or(0, |o| o.pid);
            return Ok(Err(holder));
        }
        let flags = if locked == Locked::Taken {
            OWNER_LOCKS
        } else {
            0
        };
        let claimed = self.table.claim_with(map, slot, flags)?;
        if claimed.is_err() && locked == Locked::Taken {
            self.unlock(slot);
        }
        Ok(claimed)
    }

    /// Clears this process's ownership of `slot` ([`SlotTable::unclaim`]), then lets go of its lock.
    pub(crate) fn unclaim(&self, slot: usize) -> Result<()> {
        let cleared = self.table.unclaim(self.region.mapping(), slot);
        self.unlock(slot);
        cleared
    }

    fn unlock(&self, slot: usize) {
        if let Some(fd) = self.region.fd() {
            let _ = byte_lock(fd, SLOT_LOCKS + slot, false);
        }
    }
}

impl Drop for MappedCounterFile {
    fn drop(&mut self) {
        // A producer killed before closing its file leaves the name behind with its open count; the
        // last consumer to let go removes it. A file truncated under the mapping is left alone: its
        // trailer is gone, and touching it would fault.
        if self.probe().is_err() {
            return;
        }
        if let Ok(Some(creator)) = self.table.creator(self.region.mapping()) {
            if creator.liveness() == Liveness::Dead {
                match tensormem_shm::unlink_shm(&self.name) {
                    Ok(()) => tracing::info!(
                        target: "tensormem_ipc",
                        name = %self.name,
                        creator = creator.pid,
                        "removed the ref-counter file of a producer that died"
                    ),
                    Err(tensormem_shm::Error::NotFound { .. }) => {}
                    Err(err) => tracing::warn!(
                        target: "tensormem_ipc",
                        name = %self.name,
                        error = %err,
                        "could not remove the ref-counter file of a dead producer"
                    ),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensormem_shm::NameGenerator;

    #[test]
    fn slots_are_handed_out_in_order_and_seen_by_a_consumer_mapping() {
        let name = NameGenerator::default().next_name();
        let file = RefCounterFile::create(&name, 3).unwrap();
        assert_eq!(file.take_slot().unwrap(), Some(0));
        assert_eq!(file.take_slot().unwrap(), Some(1));
        let mapped = MappedCounterFile::open(&name).unwrap();
        let table = mapped.table();
        assert_eq!(table.slots(), 3);
        assert!(table.has_owners());
        let counter = table.counter(mapped.mapping(), 1).unwrap();
        assert_eq!(counter.load(Ordering::Acquire), 1);
        counter.fetch_sub(1, Ordering::AcqRel);
        assert_eq!(file.value(1).unwrap(), 0);
        assert_eq!(file.value(0).unwrap(), 1);
        assert_eq!(file.take_slot().unwrap(), Some(2));
        assert!(!file.has_slots());
        assert_eq!(file.take_slot().unwrap(), None);
        assert_eq!(
            table.creator(mapped.mapping()).unwrap(),
            Some(ProcessIdentity::current())
        );
        drop(mapped);
        assert!(
            name.path().exists(),
            "a live creator's file is not removed by a consumer"
        );
        drop(file);
        assert!(!name.path().exists());
    }

    #[test]
    fn releasing_the_hold_unlinks_the_name_and_keeps_the_slots_readable() {
        let name = NameGenerator::default().next_name();
        let file = RefCounterFile::create(&name, 2).unwrap();
        assert_eq!(file.take_slot().unwrap(), Some(0));
        let mapped = MappedCounterFile::open(&name).unwrap();
        // A PyTorch consumer holds the file open: the name stays until it closes too.
        let torch_consumer = RefcountedRegion::open(&name).unwrap();
        assert!(!file.release_hold(), "another holder is left");
        assert!(name.path().exists());
        assert!(!file.release_hold(), "released once only");
        assert!(torch_consumer.close().unwrap(), "the last holder unlinks");
        assert!(!name.path().exists());
        // The share and its consumer still see one slot.
        let counter = mapped.table().counter(mapped.mapping(), 0).unwrap();
        counter.fetch_sub(1, Ordering::AcqRel);
        assert_eq!(file.value(0).unwrap(), 0);
        drop(mapped);
        drop(file);
        assert!(!name.path().exists());
    }

    #[test]
    fn unclaimed_slots_and_half_claims_of_the_dead_expire_and_refuse_later_claims() {
        let name = NameGenerator::default().next_name();
        let file = RefCounterFile::create(&name, 3).unwrap();
        for _ in 0..3 {
            file.take_slot().unwrap();
        }
        let mapped = MappedCounterFile::open(&name).unwrap();
        let (table, map) = (mapped.table(), mapped.mapping());
        // Slot 0: never claimed.
        assert!(file.expire_if_unclaimed(0));
        assert_eq!(file.value(0).unwrap(), 0);
        assert!(table.is_expired(map, 0));
        assert_eq!(table.claim(map, 0).unwrap(), Err(EXPIRED));
        assert!(!file.expire_if_unclaimed(0), "once");
        // Slot 1: a claim begun by a process that died before writing its start time.
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        table
            .owner_word(map, 1, 0)
            .unwrap()
            .store(u64::from(dead_pid), Ordering::Release);
        assert!(file.expire_if_unclaimed(1));
        assert_eq!(file.value(1).unwrap(), 0);
        // Slot 2: claimed by a live process: never given up.
        assert_eq!(table.claim(map, 2).unwrap(), Ok(()));
        assert!(!file.expire_if_unclaimed(2));
        assert_eq!(file.value(2).unwrap(), 1);
    }

    #[test]
    fn owners_are_claimed_once_and_live_owners_are_not_reclaimed() {
        let name = NameGenerator::default().next_name();
        let file = RefCounterFile::create(&name, 2).unwrap();
        file.take_slot().unwrap();
        let mapped = MappedCounterFile::open(&name).unwrap();
        let table = mapped.table();
        assert_eq!(table.claim(mapped.mapping(), 0).unwrap(), Ok(()));
        assert_eq!(
            table.claim(mapped.mapping(), 0).unwrap(),
            Err(std::process::id())
        );
        assert_eq!(file.reclaim_if_owner_dead(0), None);
        assert_eq!(file.value(0).unwrap(), 1);
        table.unclaim(mapped.mapping(), 0).unwrap();
        assert_eq!(table.owner(mapped.mapping(), 0).unwrap(), None);
    }

    /// A consumer holds the lock of its slot's byte while it owns the slot: the producer asks the
    /// kernel, not the pid. Here the owner's pid is this live process, yet once its descriptor is
    /// gone (as when it is killed) the slot is reclaimed; a second claim of a slot it owns keeps the
    /// lock; letting go clears the record and the lock, so that another can claim it.
    #[test]
    fn an_owner_is_alive_while_it_holds_the_lock_of_its_slot() {
        let name = NameGenerator::default().next_name();
        let file = RefCounterFile::create(&name, 2).unwrap();
        file.take_slot().unwrap();
        file.take_slot().unwrap();
        let consumer = MappedCounterFile::open(&name).unwrap();
        assert_eq!(consumer.claim(0).unwrap(), Ok(()));
        assert!(consumer.table().owner_locks(consumer.mapping(), 0));
        assert_eq!(consumer.claim(0).unwrap(), Err(std::process::id()));
        assert_eq!(
            file.reclaim_if_owner_dead(0),
            None,
            "alive: its lock is there"
        );
        // Another open file description cannot take the slot's lock while it is held.
        let other = MappedCounterFile::open(&name).unwrap();
        assert!(other.claim(0).unwrap().is_err());

        assert_eq!(consumer.claim(1).unwrap(), Ok(()));
        consumer.unclaim(1).unwrap();
        assert_eq!(consumer.table().owner(consumer.mapping(), 1).unwrap(), None);
        assert_eq!(
            other.claim(1).unwrap(),
            Ok(()),
            "the lock went with the record"
        );
        other.unclaim(1).unwrap();

        drop(consumer);
        let owner = file
            .reclaim_if_owner_dead(0)
            .expect("its lock went with its descriptor");
        assert_eq!(owner.pid, std::process::id());
        assert_eq!(file.value(0).unwrap(), 0);
    }

    /// An owner of another pid namespace (a consumer in another container: its pid means nothing
    /// here) is judged by its lock when it takes one, and never taken for dead when it does not.
    #[test]
    fn an_owner_of_another_pid_namespace_is_judged_by_its_lock_alone() {
        let name = NameGenerator::default().next_name();
        let file = RefCounterFile::create(&name, 2).unwrap();
        file.take_slot().unwrap();
        file.take_slot().unwrap();
        let map = file.view.mapping();
        let table = file.table;
        for (slot, flags) in [(0, OWNER_LOCKS), (1, 0)] {
            // pid 1 of a namespace that is not this one, recorded as a consumer there writes it.
            table
                .owner_word(map, slot, 0)
                .unwrap()
                .store(1, Ordering::Release);
            table
                .owner_word(map, slot, 2)
                .unwrap()
                .store(u64::MAX - 1, Ordering::Release);
            table
                .owner_word(map, slot, 3)
                .unwrap()
                .store(flags, Ordering::Release);
            table
                .owner_word(map, slot, 1)
                .unwrap()
                .store(7, Ordering::Release);
        }
        // Slot 0's owner takes locks and holds none: it died. Slot 1's does not lock: unknown.
        assert_eq!(file.reclaim_if_owner_dead(0).map(|o| o.pid), Some(1));
        assert_eq!(file.reclaim_if_owner_dead(1), None);
        assert_eq!(file.value(1).unwrap(), 1);
    }

    #[test]
    fn a_pytorch_file_is_recognised_by_its_name_and_size() {
        let name = NameGenerator::with_prefix(TORCH_PREFIX)
            .unwrap()
            .next_name();
        let region = RefcountedRegion::create(&name, (8 * REF_COUNTER_FILE_SIZE) as u64).unwrap();
        let mapped = MappedCounterFile::open(&name).unwrap();
        assert_eq!(mapped.table().slots(), REF_COUNTER_FILE_SIZE);
        assert!(!mapped.table().has_owners());
        assert_eq!(mapped.table().claim(mapped.mapping(), 5).unwrap(), Ok(()));
        drop(mapped);
        drop(region);
        assert!(!name.path().exists());
    }

    #[test]
    fn objects_that_are_not_ref_counter_files_are_refused() {
        let torch = NameGenerator::with_prefix(TORCH_PREFIX).unwrap();
        let cases = [
            // PyTorch's size under another name: an application's region.
            (
                NameGenerator::default().next_name(),
                8 * REF_COUNTER_FILE_SIZE,
            ),
            // PyTorch's name, any other multiple of 8.
            (torch.next_name(), 8),
            (torch.next_name(), 8 * (REF_COUNTER_FILE_SIZE + 1)),
            (torch.next_name(), 8 * REF_COUNTER_FILE_SIZE - 8),
            // A name of PyTorch's shape with another prefix.
            (
                ShmName::new(format!("/torched_{}_1_2", std::process::id())).unwrap(),
                8 * REF_COUNTER_FILE_SIZE,
            ),
            // tensormem's size, but no trailer.
            (NameGenerator::default().next_name(), data_len(4)),
        ];
        for (name, len) in cases {
            let region = RefcountedRegion::create(&name, len as u64).unwrap();
            let err = MappedCounterFile::open(&name).unwrap_err();
            assert!(
                matches!(&err, Error::NotRefCounterFile { len: l, .. }
                    if *l == (REFCOUNT_HEADER_LEN + len) as u64),
                "{name} of {len} bytes: {err}"
            );
            drop(region);
        }
    }

    #[test]
    fn a_truncated_file_is_reported_instead_of_faulting() {
        let name = NameGenerator::default().next_name();
        let file = RefCounterFile::create(&name, 3).unwrap();
        assert_eq!(file.take_slot().unwrap(), Some(0));
        let mapped = MappedCounterFile::open(&name).unwrap();
        mapped.probe().unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(name.path())
            .unwrap()
            .set_len(0)
            .unwrap();
        let err = mapped.probe().unwrap_err();
        assert!(
            matches!(&err, Error::RefCounterFile { name: n, source: tensormem_shm::Error::Truncated { .. } } if *n == name.to_string()),
            "{err}"
        );
        assert!(file.value(0).is_err());
        assert!(file.take_slot().is_err());
        assert_eq!(file.reclaim_if_owner_dead(0), None);
        file.release_unsent(0);
        drop(mapped);
        drop(file);
        // A truncated file's counts are unknown, so nothing unlinked it: the test does.
        tensormem_shm::unlink_shm(&name).unwrap();
    }
}
