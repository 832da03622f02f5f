//! An in-memory stand-in for devices and a communicator, for tests and examples without a GPU:
//! each rank's device memory is a set of byte vectors, each stream a thread running its queue in
//! order, events behave as CUDA's (a wait holds a stream until the event's last record made before
//! it has completed), and collectives meet in a rendezvous where every rank hands in its part.
//! Every copy and collective is logged ([`FakeWorld::log`]) when it is issued, starts and
//! finishes, so a test can check the order the streams ran in.
//!
//! A fake [`Delays`] makes copies and broadcasts take time: a broadcast reads the root's bytes and
//! writes the others' at its end, a copy moves its bytes at its end, so work that is not ordered
//! after them sees stale bytes, as on a device.
//!
//! Out-of-bounds access, a collective some rank never joins, or an event never completed panics
//! the stream's thread (after 10 s for the last two); the engine's next
//! [`synchronize`](CopyEngine::synchronize) then fails.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tensormem_cuda_alloc::{DeviceAddress, DeviceError};

use super::engine::{Collective, CopyEngine, CopySpan, Step};
use crate::error::{Error, Result};

/// How long a stream waits for another rank or an event before giving up (a bug in the caller).
const TIMEOUT: Duration = Duration::from_secs(10);

/// How long operations take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delays {
    /// Each [`CopyEngine::copy`] call.
    pub copy: Duration,
    /// Each broadcast.
    pub broadcast: Duration,
}

/// Which of a rank's two streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// The copy engine's.
    Compute,
    /// The collective's.
    Comm,
}

/// A point in an operation's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Queued by the host.
    Issued,
    /// Begun on its stream.
    Started,
    /// Done on its stream.
    Finished,
}

/// An operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// A [`CopyEngine::copy`] call.
    Copy(Step),
    /// A broadcast.
    Broadcast(Step),
    /// An all-reduce.
    AllReduce,
}

/// One line of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry {
    /// The rank.
    pub rank: usize,
    /// The stream.
    pub lane: Lane,
    /// The operation.
    pub op: Op,
    /// What happened to it.
    pub phase: Phase,
}

/// Ranks, their memories, the rendezvous of their collectives and the log.
#[derive(Debug)]
pub struct FakeWorld {
    memories: Vec<Arc<Memory>>,
    /// Per rank, the number of its next collective (ranks meet by number): one communicator per
    /// rank, whatever the number of [`FakeCollective`]s (streams) on it.
    issued: Vec<AtomicU64>,
    rendezvous: Rendezvous,
    delays: Delays,
    log: Mutex<Vec<Entry>>,
}

impl FakeWorld {
    /// `ranks` ranks whose operations take no time.
    #[must_use]
    pub fn new(ranks: usize) -> Arc<Self> {
        Self::with_delays(ranks, Delays::default())
    }

    /// `ranks` ranks whose operations take `delays`.
    #[must_use]
    pub fn with_delays(ranks: usize, delays: Delays) -> Arc<Self> {
        Arc::new(Self {
            // Each rank's addresses start elsewhere, so that a mix-up shows.
            memories: (0..ranks)
                .map(|r| Arc::new(Memory::new((r as u64 + 1) << 40)))
                .collect(),
            issued: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            rendezvous: Rendezvous {
                ranks,
                slots: Mutex::new(HashMap::new()),
                arrived: Condvar::new(),
                lost: Mutex::new(None),
            },
            delays,
            log: Mutex::new(Vec::new()),
        })
    }

    /// Rank `rank`.
    ///
    /// # Panics
    ///
    /// If there is no such rank.
    #[must_use]
    pub fn rank(self: &Arc<Self>, rank: usize) -> FakeRank {
        FakeRank {
            world: Arc::clone(self),
            rank,
            memory: Arc::clone(&self.memories[rank]),
        }
    }

    /// Loses rank `rank`, as a communicator loses a rank whose process died: collectives waiting
    /// for it end without moving anything, and the other ranks' collectives report the loss
    /// ([`Collective::is_idle`] fails, as NCCL's asynchronous error does).
    pub fn lose(&self, rank: usize) {
        *lock(&self.rendezvous.lost) = Some(rank);
        let _slots = lock(&self.rendezvous.slots);
        self.rendezvous.arrived.notify_all();
    }

    /// The rank lost, if any.
    fn lost(&self) -> Option<usize> {
        *lock(&self.rendezvous.lost)
    }

    /// Everything logged so far, in the order it happened.
    #[must_use]
    pub fn log(&self) -> Vec<Entry> {
        lock(&self.log).clone()
    }

    fn note(&self, rank: usize, lane: Lane, op: Op, phase: Phase) {
        lock(&self.log).push(Entry {
            rank,
            lane,
            op,
            phase,
        });
    }
}

/// One rank: its memory, and makers of its engine and collective.
#[derive(Debug, Clone)]
pub struct FakeRank {
    world: Arc<FakeWorld>,
    rank: usize,
    memory: Arc<Memory>,
}

impl FakeRank {
    /// The rank's number.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `bytes` of zeroed memory.
    #[must_use]
    pub fn alloc(&self, bytes: usize) -> DeviceAddress {
        self.memory.alloc(bytes)
    }

    /// Writes `bytes` at `addr` now (not on a stream).
    ///
    /// # Panics
    ///
    /// Outside an allocation.
    pub fn write(&self, addr: DeviceAddress, bytes: &[u8]) {
        self.memory.write(addr, bytes);
    }

    /// Reads `len` bytes at `addr` now.
    ///
    /// # Panics
    ///
    /// Outside an allocation.
    #[must_use]
    pub fn read(&self, addr: DeviceAddress, len: usize) -> Vec<u8> {
        self.memory.read(addr, len)
    }

    /// The number of live allocations (staging buffers included).
    #[must_use]
    pub fn allocations(&self) -> usize {
        lock(&self.memory.regions).len()
    }

    /// A copy engine on a new compute stream.
    #[must_use]
    pub fn engine(&self) -> FakeEngine {
        FakeEngine {
            rank: self.clone(),
            stream: Stream::new(format!("fake-compute-{}", self.rank)),
        }
    }

    /// A collective on a new communication stream of the rank's one communicator.
    #[must_use]
    pub fn collective(&self) -> FakeCollective {
        FakeCollective {
            rank: self.clone(),
            stream: Stream::new(format!("fake-comm-{}", self.rank)),
        }
    }
}

/// A fake event.
#[derive(Debug, Clone, Default)]
pub struct FakeEvent(Arc<EventState>);

#[derive(Debug, Default)]
struct EventState {
    /// Records made by the host.
    recorded: AtomicU64,
    /// The highest record completed on its stream (each event is recorded on one stream here, so
    /// records complete in order).
    completed: Mutex<u64>,
    changed: Condvar,
}

/// A fake staging buffer, freed when dropped.
#[derive(Debug)]
pub struct FakeStaging {
    memory: Arc<Memory>,
    addr: DeviceAddress,
}

impl Drop for FakeStaging {
    fn drop(&mut self) {
        lock(&self.memory.regions).remove(&self.addr.0);
    }
}

/// A rank's copy engine.
#[derive(Debug)]
pub struct FakeEngine {
    rank: FakeRank,
    stream: Stream,
}

// SAFETY: staging buffers are allocations of the asked size, freed on drop; streams run their
// queues in order on one thread each; events follow CUDA's semantics (`record_on`, `wait_on`);
// `write`, `read` and `synchronize` wait for the stream.
unsafe impl CopyEngine for FakeEngine {
    type Event = FakeEvent;
    type Staging = FakeStaging;

    fn staging(&self, bytes: usize) -> Result<FakeStaging> {
        Ok(FakeStaging {
            memory: Arc::clone(&self.rank.memory),
            addr: self.rank.alloc(bytes),
        })
    }

    fn staging_addr(staging: &FakeStaging) -> DeviceAddress {
        staging.addr
    }

    fn event(&self) -> Result<FakeEvent> {
        Ok(FakeEvent::default())
    }

    fn record(&self, event: &FakeEvent) -> Result<()> {
        record_on(&self.stream, event)
    }

    fn wait(&self, event: &FakeEvent) -> Result<()> {
        wait_on(&self.stream, event)
    }

    unsafe fn copy(&self, step: Step, copies: &[CopySpan]) -> Result<()> {
        let (world, rank, memory) = self.rank.parts();
        let copies = copies.to_vec();
        world.note(rank, Lane::Compute, Op::Copy(step), Phase::Issued);
        self.stream.enqueue(move || {
            world.note(rank, Lane::Compute, Op::Copy(step), Phase::Started);
            std::thread::sleep(world.delays.copy);
            for c in copies {
                let bytes = memory.read(c.src, c.len);
                memory.write(c.dst, &bytes);
            }
            world.note(rank, Lane::Compute, Op::Copy(step), Phase::Finished);
        })
    }

    unsafe fn write(&self, dst: DeviceAddress, bytes: &[u8]) -> Result<()> {
        let (memory, bytes) = (Arc::clone(&self.rank.memory), bytes.to_vec());
        self.stream.enqueue(move || memory.write(dst, &bytes))?;
        self.stream.synchronize()
    }

    unsafe fn read(&self, src: DeviceAddress, out: &mut [u8]) -> Result<()> {
        let (memory, len) = (Arc::clone(&self.rank.memory), out.len());
        let (tx, rx) = mpsc::channel();
        self.stream.enqueue(move || {
            let _ = tx.send(memory.read(src, len));
        })?;
        out.copy_from_slice(&rx.recv().map_err(|_| dead())?);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }
}

/// NCCL's `ncclRemoteError`: what a communicator reports once a peer is gone.
const NCCL_REMOTE_ERROR: i32 = 6;

/// A rank's collective.
#[derive(Debug)]
pub struct FakeCollective {
    rank: FakeRank,
    stream: Stream,
}

impl FakeCollective {
    /// Queues collective number `id`: this rank hands in `given(memory)`, then `taken(memory,
    /// every rank's part)` runs after the delay, between log entries of `op`.
    fn queue(
        &self,
        op: Op,
        delay: Duration,
        given: impl FnOnce(&Memory) -> Vec<u8> + Send + 'static,
        taken: impl FnOnce(&Memory, Vec<Vec<u8>>) + Send + 'static,
    ) -> Result<()> {
        let (world, rank, memory) = self.rank.parts();
        let id = world.issued[rank].fetch_add(1, Ordering::Relaxed);
        world.note(rank, Lane::Comm, op, Phase::Issued);
        self.stream.enqueue(move || {
            world.note(rank, Lane::Comm, op, Phase::Started);
            std::thread::sleep(delay);
            if let Some(all) = world.rendezvous.exchange(id, rank, given(&memory)) {
                taken(&memory, all);
                world.note(rank, Lane::Comm, op, Phase::Finished);
            }
        })
    }
}

// SAFETY: collectives meet by number, in call order; a broadcast writes only `buf` on non-roots,
// an all-reduce only its `8 * count` bytes; the stream and events are as the engine's.
unsafe impl Collective for FakeCollective {
    type Event = FakeEvent;

    fn rank(&self) -> usize {
        self.rank.rank
    }

    fn ranks(&self) -> usize {
        self.rank.world.memories.len()
    }

    unsafe fn broadcast(
        &self,
        step: Step,
        buf: DeviceAddress,
        len: usize,
        root: usize,
    ) -> Result<()> {
        let me = self.rank.rank;
        self.queue(
            Op::Broadcast(step),
            self.rank.world.delays.broadcast,
            move |memory| {
                if me == root {
                    memory.read(buf, len)
                } else {
                    Vec::new()
                }
            },
            move |memory, all| {
                assert_eq!(
                    all[root].len(),
                    len,
                    "a broadcast of another size on the root"
                );
                if me != root {
                    memory.write(buf, &all[root]);
                }
            },
        )
    }

    unsafe fn all_reduce_max(&self, buf: DeviceAddress, count: usize) -> Result<()> {
        self.queue(
            Op::AllReduce,
            Duration::ZERO,
            move |memory| memory.read(buf, 8 * count),
            move |memory, all| {
                let word = |b: &[u8], i: usize| {
                    u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("eight bytes"))
                };
                let max: Vec<u8> = (0..count)
                    .flat_map(|i| {
                        let m = all.iter().map(|b| word(b, i)).max().unwrap_or(0);
                        m.to_le_bytes()
                    })
                    .collect();
                memory.write(buf, &max);
            },
        )
    }

    fn record(&self, event: &FakeEvent) -> Result<()> {
        record_on(&self.stream, event)
    }

    fn wait(&self, event: &FakeEvent) -> Result<()> {
        wait_on(&self.stream, event)
    }

    fn is_idle(&self) -> Result<bool> {
        if self.rank.world.lost().is_some() {
            return Err(Error::Collective {
                call: "a fake collective (rank lost)",
                code: NCCL_REMOTE_ERROR,
            });
        }
        self.stream.is_idle()
    }
}

impl FakeRank {
    fn parts(&self) -> (Arc<FakeWorld>, usize, Arc<Memory>) {
        (Arc::clone(&self.world), self.rank, Arc::clone(&self.memory))
    }
}

fn record_on(stream: &Stream, event: &FakeEvent) -> Result<()> {
    let state = Arc::clone(&event.0);
    let record = state.recorded.fetch_add(1, Ordering::SeqCst) + 1;
    stream.enqueue(move || {
        let mut completed = lock(&state.completed);
        *completed = (*completed).max(record);
        state.changed.notify_all();
    })
}

fn wait_on(stream: &Stream, event: &FakeEvent) -> Result<()> {
    let state = Arc::clone(&event.0);
    let record = state.recorded.load(Ordering::SeqCst);
    if record == 0 {
        return Ok(()); // never recorded: nothing to wait for, as in CUDA
    }
    stream.enqueue(move || {
        let completed = lock(&state.completed);
        let (completed, timeout) = state
            .changed
            .wait_timeout_while(completed, TIMEOUT, |c| *c < record)
            .unwrap_or_else(PoisonError::into_inner);
        assert!(
            !timeout.timed_out(),
            "fake event: record {record} never completed (at {})",
            *completed
        );
    })
}

fn dead() -> Error {
    Error::Device(DeviceError::Driver {
        call: "fake stream",
        code: -1,
        message: "the stream's thread panicked (see its message above)".into(),
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread running jobs in order.
struct Stream {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    /// Jobs queued and not finished.
    pending: Arc<AtomicUsize>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream").finish_non_exhaustive()
    }
}

impl Stream {
    fn new(name: String) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("a thread for a fake stream");
        Self {
            jobs: Some(tx),
            thread: Some(thread),
            pending: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn enqueue(&self, job: impl FnOnce() + Send + 'static) -> Result<()> {
        let jobs = self.jobs.as_ref().expect("live until dropped");
        let pending = Arc::clone(&self.pending);
        pending.fetch_add(1, Ordering::SeqCst);
        jobs.send(Box::new(move || {
            job();
            pending.fetch_sub(1, Ordering::SeqCst);
        }))
        .map_err(|_| dead())
    }

    /// Whether every job queued has run; an error once the stream's thread died.
    fn is_idle(&self) -> Result<bool> {
        if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
            return Err(dead());
        }
        Ok(self.pending.load(Ordering::SeqCst) == 0)
    }

    fn synchronize(&self) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.enqueue(move || {
            let _ = tx.send(());
        })?;
        rx.recv().map_err(|_| dead())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            // A panic was reported by the thread itself and by the failed calls after it.
            let _ = thread.join();
        }
    }
}

/// One rank's device memory: allocations by start address.
#[derive(Debug)]
struct Memory {
    regions: Mutex<BTreeMap<u64, Vec<u8>>>,
    next: AtomicU64,
}

impl Memory {
    fn new(base: u64) -> Self {
        Self {
            regions: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(base),
        }
    }

    fn alloc(&self, bytes: usize) -> DeviceAddress {
        // 512-byte aligned, with a gap, so that no two allocations touch.
        let step = (bytes as u64).div_ceil(512) * 512 + 4096;
        let addr = self.next.fetch_add(step, Ordering::Relaxed);
        lock(&self.regions).insert(addr, vec![0; bytes]);
        DeviceAddress(addr)
    }

    fn with<R>(&self, addr: DeviceAddress, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let mut regions = lock(&self.regions);
        let found = regions.range_mut(..=addr.0).next_back();
        let Some((&base, bytes)) =
            found.filter(|(&base, bytes)| addr.0 + len as u64 <= base + bytes.len() as u64)
        else {
            panic!("fake device: {len} bytes at {addr} lie outside every allocation");
        };
        let start = (addr.0 - base) as usize;
        f(&mut bytes[start..start + len])
    }

    fn read(&self, addr: DeviceAddress, len: usize) -> Vec<u8> {
        self.with(addr, len, |b| b.to_vec())
    }

    fn write(&self, addr: DeviceAddress, bytes: &[u8]) {
        self.with(addr, bytes.len(), |b| b.copy_from_slice(bytes));
    }
}

/// Where collectives meet: by number, every rank hands in its part and takes everyone's.
#[derive(Debug)]
struct Rendezvous {
    ranks: usize,
    slots: Mutex<HashMap<u64, Slot>>,
    arrived: Condvar,
    /// A rank the world lost ([`FakeWorld::lose`]): collectives waiting for it end unfinished.
    lost: Mutex<Option<usize>>,
}

#[derive(Debug)]
struct Slot {
    parts: Vec<Option<Vec<u8>>>,
    arrived: usize,
    left: usize,
}

impl Rendezvous {
    /// Hands in this rank's part of collective `id` and waits for every rank's; `None` when a
    /// rank was lost before all arrived.
    fn exchange(&self, id: u64, rank: usize, part: Vec<u8>) -> Option<Vec<Vec<u8>>> {
        let ranks = self.ranks;
        let mut slots = lock(&self.slots);
        let slot = slots.entry(id).or_insert_with(|| Slot {
            parts: vec![None; ranks],
            arrived: 0,
            left: 0,
        });
        assert!(
            slot.parts[rank].is_none(),
            "rank {rank} joined collective {id} twice"
        );
        slot.parts[rank] = Some(part);
        slot.arrived += 1;
        self.arrived.notify_all();
        let (mut slots, timeout) = self
            .arrived
            .wait_timeout_while(slots, TIMEOUT, |s| {
                s[&id].arrived < ranks && lock(&self.lost).is_none()
            })
            .unwrap_or_else(PoisonError::into_inner);
        if slots[&id].arrived < ranks && lock(&self.lost).is_some() {
            return None;
        }
        assert!(
            !timeout.timed_out(),
            "fake collective {id}: a rank never joined (rank {rank} waited {TIMEOUT:?})"
        );
        let slot = slots.get_mut(&id).expect("present until every rank left");
        let all = slot
            .parts
            .iter()
            .map(|p| p.clone().expect("arrived"))
            .collect();
        slot.left += 1;
        if slot.left == ranks {
            slots.remove(&id);
        }
        Some(all)
    }
}
