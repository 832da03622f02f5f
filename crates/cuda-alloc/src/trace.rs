//! The trace ring buffer: what the allocator did, in order (PyTorch's `_record_memory_history`).
//!
//! When history recording is on, every allocator event is appended to a ring buffer of at most
//! `max_entries` entries (the oldest are overwritten). Snapshots carry the buffer as `device_traces`,
//! which PyTorch's `_memory_viz` draws and tensormem's replay reads back. Entries are kept compactly and
//! converted to the snapshot model's [`TraceEntry`] when read.
//!
//! Trace trackers (PyTorch's `attachAllocatorTraceTracker`) are told about every entry as it is made,
//! whether or not the ring buffer is recording.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};

use crate::device::StreamId;
use crate::pool_id::MempoolId;
use crate::snapshot::{TraceAction, TraceEntry};
use crate::stack::{RecordContext, Stack};

/// One recorded event, as kept in the ring buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) action: TraceAction,
    /// The address concerned (for `Oom`, the device's free bytes; 0 for snapshots and annotations).
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) stream: StreamId,
    /// When, in microseconds since the Unix epoch.
    pub(crate) time_us: i64,
    /// The annotation of a `UserDefined` entry.
    pub(crate) user_metadata: Option<Box<str>>,
    /// The call stack, when the context level keeps one for this entry.
    pub(crate) stack: Option<Stack>,
    /// The memory pool concerned (`pool_id`): the pool owning the block or segment
    /// ([`MempoolId::DEFAULT`] for the default pools), the pool a failed request was for, the pool a
    /// snapshot was taken of; `None` for entries about no pool (annotations).
    pub(crate) pool: Option<MempoolId>,
}

impl Record {
    /// The entry as PyTorch writes it in `device_traces` (its stack symbolized, if it has one), with
    /// the `pool_id` that versions after 2.11 add.
    pub(crate) fn to_entry(&self) -> TraceEntry {
        TraceEntry {
            frames: self.stack.as_ref().map(|s| s.frames().to_vec()),
            ..self.to_entry_without_frames()
        }
    }

    /// The entry without its frames (for trace trackers, which run on the allocation path).
    pub(crate) fn to_entry_without_frames(&self) -> TraceEntry {
        TraceEntry {
            action: self.action.clone(),
            addr: self.addr,
            size: self.size,
            stream: self.stream.0,
            time_us: self.time_us,
            frames: None,
            compile_context: Some("N/A".to_owned()),
            user_metadata: Some(self.user_metadata.as_deref().unwrap_or("").to_owned()),
            pool_id: self.pool.map(|p| (p.0, p.1)),
            other: Vec::new(),
        }
    }
}

/// Microseconds since the Unix epoch.
pub(crate) fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

#[derive(Debug)]
struct Ring {
    entries: Vec<Record>,
    /// Where the next entry goes once the ring is full.
    next: usize,
    max_entries: usize,
}

/// A function told about every trace entry as the allocator makes it (PyTorch's
/// `AllocatorTraceTracker`), registered with
/// [`CachingAllocator::attach_allocator_trace_tracker`](crate::CachingAllocator::attach_allocator_trace_tracker).
///
/// It runs on the thread that made the entry, with that call's allocator locks held (as in PyTorch):
/// it must be quick and must not call into the same allocator, which would deadlock. The entry has no
/// `frames` (symbolizing a stack is too slow for the allocation path; snapshots carry them).
pub type TraceTracker = Box<dyn Fn(&TraceEntry) + Send + Sync>;

/// The ring buffer with its on/off switch, and the trace trackers.
pub(crate) struct TraceRecorder {
    enabled: AtomicBool,
    /// The [`RecordContext`] level while enabled.
    context: AtomicU8,
    ring: Mutex<Ring>,
    /// Whether any tracker is attached (checked before building an entry).
    tracking: AtomicBool,
    trackers: RwLock<Vec<TraceTracker>>,
}

impl std::fmt::Debug for TraceRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceRecorder")
            .field("enabled", &self.enabled)
            .field("ring", &self.ring)
            .field("trackers", &self.trackers.read().len())
            .finish()
    }
}

impl Default for TraceRecorder {
    fn default() -> Self {
        TraceRecorder {
            enabled: AtomicBool::new(false),
            context: AtomicU8::new(0),
            ring: Mutex::new(Ring {
                entries: Vec::new(),
                next: 0,
                max_entries: 1,
            }),
            tracking: AtomicBool::new(false),
            trackers: RwLock::new(Vec::new()),
        }
    }
}

impl TraceRecorder {
    /// Whether entries are being recorded in the ring buffer.
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Relaxed)
    }

    /// Whether an entry made now goes anywhere (the ring buffer or a tracker): checked before
    /// building one.
    #[inline]
    pub(crate) fn wanted(&self) -> bool {
        self.enabled.load(Relaxed) || self.tracking.load(Relaxed)
    }

    /// Adds a tracker, told about every entry from now on.
    pub(crate) fn attach(&self, tracker: TraceTracker) {
        let mut trackers = self.trackers.write();
        trackers.push(tracker);
        self.tracking.store(true, Relaxed);
    }

    /// Turns recording on or off (off clears the buffer, as in PyTorch); `max_entries` is at least 1;
    /// `context` says which entries keep call stacks.
    pub(crate) fn configure(&self, enabled: bool, max_entries: usize, context: RecordContext) {
        let mut ring = self.ring.lock();
        ring.max_entries = max_entries.max(1);
        if !enabled {
            ring.entries.clear();
            ring.next = 0;
        }
        let context = if enabled {
            context
        } else {
            RecordContext::Never
        };
        self.context.store(context.as_u8(), Relaxed);
        self.enabled.store(enabled, Relaxed);
    }

    /// The context level (`Never` while recording is off).
    #[inline]
    pub(crate) fn context(&self) -> RecordContext {
        RecordContext::from_u8(self.context.load(Relaxed))
    }

    /// The caller's stack if the context level is at least `level` (PyTorch's `maybeGatherContext`);
    /// one relaxed load when not.
    #[inline]
    pub(crate) fn gather(&self, level: RecordContext) -> Option<Stack> {
        if self.context.load(Relaxed) >= level.as_u8() && level != RecordContext::Never {
            Stack::capture()
        } else {
            None
        }
    }

    /// Appends an entry about no pool if recording is on, and tells the trackers.
    #[inline]
    pub(crate) fn record(&self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        self.record_with(action, addr, size, stream, None, || None);
    }

    /// Appends an entry about memory of `pool` if recording is on, and tells the trackers.
    #[inline]
    pub(crate) fn record_in(
        &self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        pool: MempoolId,
    ) {
        self.record_with(action, addr, size, stream, None, || Some(pool));
    }

    /// [`record`](Self::record) with the entry's call stack, kept if the context level is at least
    /// [`RecordContext::Alloc`], and its pool, which `pool` gives only when the entry is wanted.
    /// Always inlined: on the allocation path with history off it is the two flag loads of
    /// [`wanted`](Self::wanted) (the pool is not looked up); building the entry is out of line.
    #[inline(always)]
    pub(crate) fn record_with(
        &self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        stack: Option<&Stack>,
        pool: impl FnOnce() -> Option<MempoolId>,
    ) {
        if self.wanted() {
            self.record_wanted(action, addr, size, stream, stack, pool());
        }
    }

    /// Builds and pushes the entry of [`record_with`](Self::record_with).
    #[cold]
    #[inline(never)]
    fn record_wanted(
        &self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        stack: Option<&Stack>,
        pool: Option<MempoolId>,
    ) {
        let stack = stack
            .filter(|_| self.context() >= RecordContext::Alloc)
            .cloned();
        self.push(Record {
            action,
            addr,
            size,
            stream,
            time_us: now_us(),
            user_metadata: None,
            stack,
            pool,
        });
    }

    /// Tells the trackers, and only them, that the physical memory of a range of private pool
    /// `pool` went away or came back under the allocator's books (`SegmentUnmap` / `SegmentMap` of
    /// a pool put to sleep or woken): a tracker that registered the memory somewhere (NCCL) must
    /// let go of it and take the new memory. The history is left alone: sleeping changes no block
    /// or statistic PyTorch records, so a trace stays PyTorch's.
    pub(crate) fn tell_trackers(&self, action: TraceAction, addr: u64, size: u64, pool: MempoolId) {
        if !self.tracking.load(Relaxed) {
            return;
        }
        let model = Record {
            action,
            addr,
            size,
            stream: StreamId(0),
            time_us: now_us(),
            user_metadata: None,
            stack: None,
            pool: Some(pool),
        }
        .to_entry_without_frames();
        for tracker in self.trackers.read().iter() {
            tracker(&model);
        }
    }

    /// Tells the trackers about `entry`, then appends it to the ring buffer if recording is on.
    #[cold]
    pub(crate) fn push(&self, entry: Record) {
        if self.tracking.load(Relaxed) {
            let model = entry.to_entry_without_frames();
            // Trackers never call into the allocator (their documented obligation), so none attaches
            // another while this read lock is held.
            for tracker in self.trackers.read().iter() {
                tracker(&model);
            }
        }
        if !self.enabled() {
            return;
        }
        let mut ring = self.ring.lock();
        if ring.entries.len() < ring.max_entries {
            ring.entries.push(entry);
        } else {
            let next = ring.next;
            ring.entries[next] = entry;
            ring.next = (next + 1) % ring.max_entries;
        }
    }

    /// The entries, oldest first.
    pub(crate) fn entries(&self) -> Vec<TraceEntry> {
        // Copied under the lock, converted (stacks symbolized) after it, so that recording goes on.
        let records: Vec<Record> = {
            let ring = self.ring.lock();
            ring.entries[ring.next..]
                .iter()
                .chain(&ring.entries[..ring.next])
                .cloned()
                .collect()
        };
        records.iter().map(Record::to_entry).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn ring_keeps_the_newest_entries_in_order() {
        let t = TraceRecorder::default();
        t.record(TraceAction::Alloc, 1, 1, StreamId(0));
        assert!(t.entries().is_empty(), "off by default");
        t.configure(true, 3, RecordContext::Never);
        for addr in 0..5 {
            t.record(TraceAction::Alloc, addr, 512, StreamId(0));
        }
        let addrs: Vec<u64> = t.entries().iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [2, 3, 4]);
        t.configure(false, 3, RecordContext::Never);
        assert!(t.entries().is_empty());
    }

    #[test]
    fn the_pool_is_looked_up_only_for_a_wanted_entry_and_kept_as_pool_id() {
        let t = TraceRecorder::default();
        let looked_up = std::cell::Cell::new(0);
        let pool = || {
            looked_up.set(looked_up.get() + 1);
            Some(MempoolId(0, 3))
        };
        t.record_with(TraceAction::Alloc, 1, 512, StreamId(0), None, pool);
        assert_eq!(looked_up.get(), 0, "history off: no entry, no lookup");
        t.configure(true, 4, RecordContext::Never);
        t.record_with(TraceAction::Alloc, 2, 512, StreamId(0), None, pool);
        t.record(TraceAction::UserDefined, 0, 0, StreamId(0));
        t.record_in(TraceAction::Oom, 0, 512, StreamId(0), MempoolId::DEFAULT);
        assert_eq!(looked_up.get(), 1);
        let pools: Vec<Option<(u64, u64)>> = t.entries().iter().map(|e| e.pool_id).collect();
        assert_eq!(pools, [Some((0, 3)), None, Some((0, 0))]);
    }

    #[test]
    fn trackers_see_every_entry_whether_or_not_the_ring_records() {
        let t = TraceRecorder::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        t.attach(Box::new(move |e| {
            sink.lock().push((e.action.clone(), e.addr))
        }));
        t.record(TraceAction::SegmentAlloc, 7, 512, StreamId(0));
        t.configure(true, 2, RecordContext::Never);
        t.record(TraceAction::Alloc, 8, 512, StreamId(0));
        assert_eq!(
            *seen.lock(),
            [(TraceAction::SegmentAlloc, 7), (TraceAction::Alloc, 8)]
        );
        assert_eq!(
            t.entries().len(),
            1,
            "the ring holds only what came while on"
        );
    }
}
