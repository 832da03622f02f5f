//! Pools that sleep and wake: chunks released and mapped again at the same addresses, contents
//! kept through pinned host memory when asked, and the refusals.

mod common;

use std::sync::Arc;

use common::*;
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::host::{HeapSource, HostCachingAllocator};
use tensormem_cuda_alloc::{
    AlwaysPinned, CachingAllocator, Device, DeviceError, Error, HostBackup, MempoolId, SleepError,
};

const POOL: MempoolId = MempoolId(0, 7);

fn host() -> Box<dyn HostBackup> {
    Box::new(Arc::new(HostCachingAllocator::new(
        SimDevice::new(GIB as u64),
        HeapSource,
    )))
}

/// Waits up to a minute for `done` (what background threads finish), failing with `what`.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "timed out waiting: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// An allocator on expandable segments with `POOL` holding a 30 MiB and a 100 KiB block (one
/// segment of each size class), filled with patterns.
fn pool_with_data() -> (
    CachingAllocator<SimDevice>,
    tensormem_cuda_alloc::Allocation,
    tensormem_cuda_alloc::Allocation,
) {
    let a = sim_with("expandable_segments:True", GIB);
    a.create_or_incref_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let big = a.allocate(30 * MIB, S0).unwrap();
    let small = a.allocate(100 * KIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.device()
        .write_memory(big.ptr(), &pattern(1, big.size()))
        .unwrap();
    a.device()
        .write_memory(small.ptr(), &pattern(2, small.size()))
        .unwrap();
    (a, big, small)
}

#[test]
fn a_pool_sleeps_and_wakes_with_its_contents_at_the_same_addresses() {
    let (a, big, small) = pool_with_data();
    // Memory of the default pool is left alone.
    let other = a.allocate(10 * MIB, S1).unwrap();
    let before = checked(&a);
    let mapped = a.device().counters().mapped_bytes;
    let free_before = a.device().mem_info().unwrap().free;

    let report = a.sleep_pool(POOL, Some(host())).unwrap();
    // 40 MiB of the large segment (two 20 MiB chunks) and 2 MiB of the small one.
    assert_eq!(report.released_bytes, 42 * MIB as u64);
    assert_eq!(report.backed_up_bytes, 42 * MIB as u64);
    assert_eq!(report.segments, 2);
    assert!(a.is_pool_asleep(POOL));
    assert_eq!(a.asleep_bytes(Some(POOL)), report.released_bytes);
    assert_eq!(a.asleep_bytes(None), report.released_bytes);
    let c = a.device().counters();
    assert_eq!(c.mapped_bytes, mapped - report.released_bytes);
    assert_eq!(
        a.device().mem_info().unwrap().free,
        free_before + report.released_bytes
    );
    assert!(
        a.device().read_memory(big.ptr(), 16).is_err(),
        "nothing is mapped under the pool"
    );
    // Reserved bytes leave with the physical memory (2 MiB of small chunks, 40 MiB of large
    // ones); allocated bytes stay: the pool keeps its blocks.
    let asleep = checked(&a);
    assert_eq!(
        asleep.reserved_bytes.all.current,
        before.reserved_bytes.all.current - 42 * MIB as i64
    );
    assert_eq!(
        asleep.reserved_bytes.small_pool.current,
        before.reserved_bytes.small_pool.current - 2 * MIB as i64
    );
    assert_eq!(
        asleep.reserved_bytes.large_pool.current,
        before.reserved_bytes.large_pool.current - 40 * MIB as i64
    );
    assert_eq!(
        asleep.allocated_bytes.all.current,
        before.allocated_bytes.all.current
    );
    // A memory fraction still counts them: the pool needs them back when it wakes.
    assert_eq!(a.reserved_bytes(), before.reserved_bytes.all.current as u64);

    let woke = a.wake_pool(POOL).unwrap();
    assert_eq!(woke.mapped_bytes, report.released_bytes);
    assert_eq!(woke.restored_bytes, report.backed_up_bytes);
    assert!(!a.is_pool_asleep(POOL));
    assert_eq!(a.device().counters().mapped_bytes, mapped);
    assert_eq!(
        a.device().read_memory(big.ptr(), big.size()).unwrap(),
        pattern(1, big.size())
    );
    assert_eq!(
        a.device().read_memory(small.ptr(), small.size()).unwrap(),
        pattern(2, small.size())
    );
    assert_eq!(
        checked(&a).reserved_bytes.all.current,
        before.reserved_bytes.all.current
    );
    // The pool is usable again: its blocks free, it allocates.
    a.free(big).unwrap();
    a.free(small).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let again = a.allocate(30 * MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.free(again).unwrap();
    a.free(other).unwrap();
    checked(&a);
}

#[test]
fn sleeping_without_contents_releases_the_memory_and_wakes_to_fresh_chunks() {
    let (a, big, small) = pool_with_data();
    let report = a.sleep_pool(POOL, None).unwrap();
    assert_eq!(report.backed_up_bytes, 0);
    assert_eq!(a.device().counters().bytes_to_host, 0);
    let woke = a.wake_pool(POOL).unwrap();
    assert_eq!(woke.restored_bytes, 0);
    assert_eq!(
        a.device().read_memory(big.ptr(), 4096).unwrap(),
        vec![0; 4096],
        "fresh chunks"
    );
    a.free(big).unwrap();
    a.free(small).unwrap();
    checked(&a);
}

#[test]
fn blocks_freed_and_released_while_asleep_are_not_mapped_again() {
    let (a, big, small) = pool_with_data();
    let mapped = a.device().counters().mapped_bytes;
    a.sleep_pool(POOL, Some(host())).unwrap();
    a.free(big).unwrap();
    // Its users (the pool's maker and the capture) give it up: its free memory may go.
    a.release_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    checked(&a);
    let woke = a.wake_pool(POOL).unwrap();
    assert_eq!(
        woke.mapped_bytes,
        2 * MIB as u64,
        "only the small block's chunk"
    );
    assert_eq!(woke.restored_bytes, 2 * MIB as u64);
    assert_eq!(a.device().counters().mapped_bytes, mapped - 40 * MIB as u64);
    assert_eq!(
        a.device().read_memory(small.ptr(), small.size()).unwrap(),
        pattern(2, small.size())
    );
    a.free(small).unwrap();
    a.empty_cache().unwrap();
    let s = checked(&a);
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(a.device().counters().mapped_bytes, 0);
}

fn sleep_error(result: Result<impl std::fmt::Debug, Error>) -> SleepError {
    match result {
        Err(Error::Sleep(e)) => e,
        other => panic!("expected a sleep error, got {other:?}"),
    }
}

#[test]
fn asleep_pools_refuse_allocation_second_sleeps_and_needless_wakes() {
    let (a, big, small) = pool_with_data();
    assert_eq!(
        sleep_error(a.wake_pool(POOL)),
        SleepError::NotAsleep { pool: POOL }
    );
    a.sleep_pool(POOL, None).unwrap();
    assert_eq!(
        sleep_error(a.sleep_pool(POOL, None)),
        SleepError::Asleep { pool: POOL }
    );
    assert_eq!(
        sleep_error(a.begin_allocate_to_pool(POOL, |_| true)),
        SleepError::Asleep { pool: POOL }
    );
    a.wake_pool(POOL).unwrap();
    assert_eq!(
        sleep_error(a.wake_pool(POOL)),
        SleepError::NotAsleep { pool: POOL }
    );
    assert_eq!(
        sleep_error(a.sleep_pool(MempoolId::DEFAULT, None)),
        SleepError::NoSuchPool {
            pool: MempoolId::DEFAULT
        }
    );
    a.free(big).unwrap();
    a.free(small).unwrap();
}

#[test]
fn a_pool_being_allocated_to_or_captured_does_not_sleep() {
    let (a, big, small) = pool_with_data();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    assert_eq!(
        sleep_error(a.sleep_pool(POOL, None)),
        SleepError::AllocatingTo { pool: POOL }
    );
    a.end_allocate_to_pool(POOL).unwrap();
    a.device().begin_capture(S0);
    assert_eq!(
        sleep_error(a.sleep_pool(POOL, None)),
        SleepError::Capturing {
            pool: POOL,
            stream: S0
        }
    );
    a.device().end_capture(S0);
    assert!(!a.is_pool_asleep(POOL), "a refusal changes nothing");
    a.sleep_pool(POOL, None).unwrap();
    a.wake_pool(POOL).unwrap();
    a.free(big).unwrap();
    a.free(small).unwrap();
}

#[test]
fn memory_shared_with_another_process_does_not_sleep() {
    let (a, big, small) = pool_with_data();
    let _shared = a.shareable_segment(big.ptr()).unwrap();
    match sleep_error(a.sleep_pool(POOL, None)) {
        SleepError::Shared { pool, chunk } => {
            assert_eq!(pool, POOL);
            assert_eq!(chunk, big.ptr());
        }
        other => panic!("{other:?}"),
    }
    // Once the shared block is freed and its chunks released, the pool sleeps.
    a.free(big).unwrap();
    // Its users (the pool's maker and the capture) give it up: its free memory may go.
    a.release_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    a.sleep_pool(POOL, None).unwrap();
    a.wake_pool(POOL).unwrap();
    a.free(small).unwrap();
}

#[test]
fn a_pool_not_on_expandable_segments_does_not_sleep() {
    let a = sim(GIB);
    a.create_or_incref_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let x = a.allocate(30 * MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    match sleep_error(a.sleep_pool(POOL, None)) {
        SleepError::NotExpandable { pool, segment } => {
            assert_eq!(pool, POOL);
            assert_eq!(segment, x.ptr());
        }
        other => panic!("{other:?}"),
    }
    assert!(!a.is_pool_asleep(POOL));
    a.free(x).unwrap();
}

#[test]
fn a_wake_without_room_leaves_the_pool_asleep() {
    let (a, big, small) = pool_with_data();
    let report = a.sleep_pool(POOL, Some(host())).unwrap();
    let used = a.device().counters().used_bytes;
    a.device().set_capacity(used + 10 * MIB as u64);
    match a.wake_pool(POOL) {
        Err(Error::Device(DeviceError::OutOfMemory { .. })) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(a.is_pool_asleep(POOL));
    assert_eq!(a.device().counters().used_bytes, used, "nothing kept");
    a.device().set_capacity(GIB as u64);
    let woke = a.wake_pool(POOL).unwrap();
    assert_eq!(woke.mapped_bytes, report.released_bytes);
    assert_eq!(
        a.device().read_memory(big.ptr(), big.size()).unwrap(),
        pattern(1, big.size())
    );
    a.free(big).unwrap();
    a.free(small).unwrap();
    checked(&a);
}

#[test]
fn a_device_that_cannot_release_leaves_the_pool_awake() {
    let (a, big, small) = pool_with_data();
    a.device().fail_releases(true);
    match a.sleep_pool(POOL, Some(host())) {
        Err(Error::Device(DeviceError::Driver { .. })) => {}
        other => panic!("expected the device's error, got {other:?}"),
    }
    a.device().fail_releases(false);
    // The first release failed: nothing was released, the pool is awake with its contents, and
    // its backup went back to the host allocator.
    assert!(!a.is_pool_asleep(POOL));
    assert_eq!(a.asleep_bytes(None), 0);
    assert_eq!(
        a.device().read_memory(big.ptr(), big.size()).unwrap(),
        pattern(1, big.size())
    );
    a.free(big).unwrap();
    a.free(small).unwrap();
}

#[test]
fn sleeping_and_allocating_on_other_threads_neither_deadlock_nor_mix() {
    let (a, big, small) = pool_with_data();
    let a = Arc::new(a);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
            std::thread::spawn(move || {
                let stream = tensormem_cuda_alloc::StreamId(0x100 * (i + 1));
                let mut refused = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Allocating to the sleeping pool is refused or happens while it is awake.
                    let target = if i == 0 { POOL } else { MempoolId(0, 8 + i) };
                    match a.begin_allocate_to_pool(target, move |s| s == stream) {
                        Ok(()) => {
                            let x = a.allocate(3 * MIB, stream).unwrap();
                            a.end_allocate_to_pool(target).unwrap();
                            a.free(x).unwrap();
                        }
                        Err(Error::Sleep(SleepError::Asleep { .. })) => refused += 1,
                        Err(e) => panic!("{e}"),
                    }
                    let y = a.allocate(5 * MIB, stream).unwrap();
                    a.free(y).unwrap();
                }
                refused
            })
        })
        .collect();
    for _ in 0..50 {
        match a.sleep_pool(POOL, Some(host())) {
            Ok(_) => {
                a.wake_pool(POOL).unwrap();
            }
            Err(Error::Sleep(SleepError::AllocatingTo { .. })) => {}
            Err(e) => panic!("{e}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert!(!a.is_pool_asleep(POOL));
    assert_eq!(
        a.device().read_memory(big.ptr(), big.size()).unwrap(),
        pattern(1, big.size())
    );
    a.free(big).unwrap();
    a.free(small).unwrap();
    checked(&a);
}

#[test]
fn an_allocator_dropped_with_a_pool_asleep_gives_everything_back() {
    let host = Arc::new(HostCachingAllocator::new(
        SimDevice::new(GIB as u64),
        HeapSource,
    ));
    let (a, big, small) = pool_with_data();
    a.sleep_pool(POOL, Some(Box::new(AlwaysPinned(Arc::clone(&host)))))
        .unwrap();
    assert!(host.stats().active_bytes.current > 0);
    let _ = (big.into_ptr(), small.into_ptr());
    drop(a);
    assert_eq!(host.stats().active_bytes.current, 0, "the backup went back");
    // Staged, with its pieces being pinned in the background when the allocator goes.
    host.empty_cache().unwrap();
    let (a, big, small) = pool_with_data();
    let slept = a
        .sleep_pool(POOL, Some(Box::new(Arc::clone(&host))))
        .unwrap();
    assert!(slept.staged_bytes > 0);
    let _ = (big.into_ptr(), small.into_ptr());
    drop(a);
    eventually("the backup went back", || {
        host.stats().active_bytes.current == 0
    });
}

#[test]
fn trackers_see_the_memory_go_and_come_back_and_the_history_does_not() {
    use std::sync::Mutex;
    use tensormem_cuda_alloc::snapshot::TraceAction;
    let (a, big, small) = pool_with_data();
    a.record_history(true, 1000);
    let seen: Arc<Mutex<Vec<(TraceAction, u64, u64)>>> = Arc::default();
    let tracked = Arc::clone(&seen);
    a.attach_allocator_trace_tracker(Box::new(move |e| {
        tracked
            .lock()
            .unwrap()
            .push((e.action.clone(), e.addr, e.size));
    }));
    let history_before = a.snapshot().device_traces[0].len();
    let report = a.sleep_pool(POOL, None).unwrap();
    let unmapped: u64 = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(action, ..)| *action == TraceAction::SegmentUnmap)
        .map(|&(_, _, size)| size)
        .sum();
    assert_eq!(
        unmapped, report.released_bytes,
        "every released byte told as unmapped"
    );
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .any(|&(_, addr, size)| addr <= big.ptr().0 && big.ptr().0 < addr + size));
    seen.lock().unwrap().clear();
    a.wake_pool(POOL).unwrap();
    let mapped: u64 = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(action, ..)| *action == TraceAction::SegmentMap)
        .map(|&(_, _, size)| size)
        .sum();
    assert_eq!(
        mapped, report.released_bytes,
        "the same ranges told as mapped again"
    );
    // The history (what replay reads, PyTorch's format) has no sleep or wake in it; the snapshot
    // itself adds one `snapshot` entry each time.
    let history = &a.snapshot().device_traces[0];
    assert!(!history[history_before..].iter().any(|e| matches!(
        e.action,
        TraceAction::SegmentUnmap | TraceAction::SegmentMap
    )));
    a.free(big).unwrap();
    a.free(small).unwrap();
    checked(&a);
}

/// A pool that ends while asleep (its blocks freed, its users gone, its segments released) leaves
/// the sleep book and gives its backup back; when the driver hands its address range out again to
/// a live allocation, a wake of the dead pool is refused and the live memory is untouched.
#[test]
fn a_pool_that_ends_asleep_never_wakes_over_live_memory() {
    let a = sim_with("expandable_segments:True", GIB);
    let host = Arc::new(HostCachingAllocator::new(
        SimDevice::new(GIB as u64),
        HeapSource,
    ));
    a.create_or_incref_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let big = a.allocate(30 * MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.device()
        .write_memory(big.ptr(), &pattern(1, big.size()))
        .unwrap();
    // The pool's first block starts its segment's reserved range.
    let segment_base = big.ptr();
    let report = a
        .sleep_pool(POOL, Some(Box::new(AlwaysPinned(Arc::clone(&host)))))
        .unwrap();
    assert!(report.backed_up_bytes > 0);
    assert!(
        host.stats().active_bytes.current > 0,
        "the backup is pinned"
    );

    // The pool ends while asleep.
    a.free(big).unwrap();
    a.release_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.pool_use_count(POOL), 0);
    assert!(
        !a.is_pool_asleep(POOL),
        "an ended pool leaves the sleep book"
    );
    assert_eq!(a.asleep_bytes(None), 0);
    assert_eq!(
        host.stats().active_bytes.current,
        0,
        "its backup went back to the host allocator"
    );
    checked(&a);

    // The driver hands the same range out again, to an allocation of the default pool.
    a.device().push_addresses([segment_base.0]);
    let live = a.allocate(30 * MIB, S0).unwrap();
    assert_eq!(live.ptr(), segment_base, "the same range, reused");
    a.device()
        .write_memory(live.ptr(), &pattern(9, live.size()))
        .unwrap();
    assert_eq!(
        sleep_error(a.wake_pool(POOL)),
        SleepError::NoSuchPool { pool: POOL }
    );
    assert_eq!(
        a.device().read_memory(live.ptr(), live.size()).unwrap(),
        pattern(9, live.size()),
        "the live allocation is untouched"
    );
    a.free(live).unwrap();
    checked(&a);
}

/// A segment of a sleeping pool released meanwhile, and another segment at the same slot and
/// address: the wake finds the pool's segments by identity and leaves the newcomer alone.
#[test]
fn a_wake_skips_a_newcomer_at_a_released_segments_place() {
    let (a, big, small) = pool_with_data();
    let big_base = big.ptr();
    a.sleep_pool(POOL, Some(host())).unwrap();
    // Its users give it up, but the small block keeps it (and its small segment) alive; the
    // large segment goes: its block freed, the segment released.
    a.free(big).unwrap();
    a.release_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert!(
        a.is_pool_asleep(POOL),
        "the pool still exists: it still sleeps"
    );
    a.device().push_addresses([big_base.0]);
    let live = a.allocate(30 * MIB, S0).unwrap();
    assert_eq!(live.ptr(), big_base, "the same range, reused");
    a.device()
        .write_memory(live.ptr(), &pattern(9, live.size()))
        .unwrap();
    checked(&a);
    let woke = a.wake_pool(POOL).unwrap();
    assert_eq!(woke.mapped_bytes, 2 * MIB as u64, "only the small segment");
    assert_eq!(
        a.device().read_memory(live.ptr(), live.size()).unwrap(),
        pattern(9, live.size())
    );
    assert_eq!(
        a.device().read_memory(small.ptr(), small.size()).unwrap(),
        pattern(2, small.size())
    );
    a.free(live).unwrap();
    a.free(small).unwrap();
    checked(&a);
}

/// Restoring a checkpoint into a sleeping pool would re-create allocations on unmapped memory:
/// refused like every other way of allocating to it, and nothing changes.
#[test]
fn a_checkpoint_is_not_restored_into_a_sleeping_pool() {
    let (a, big, small) = pool_with_data();
    let checkpoint = a.get_checkpoint_state(POOL).unwrap();
    a.sleep_pool(POOL, None).unwrap();
    let before = checked(&a);
    assert_eq!(
        sleep_error(a.set_checkpoint_pool_state(&checkpoint)),
        SleepError::Asleep { pool: POOL }
    );
    assert_eq!(checked(&a), before);
    a.wake_pool(POOL).unwrap();
    a.set_checkpoint_pool_state(&checkpoint).unwrap();
    drop((big, small));
}

/// Host memory that runs out after `budget` buffers, counting what it hands out and gets back.
struct Failing {
    inner: Arc<HostCachingAllocator<SimDevice>>,
    budget: std::sync::atomic::AtomicIsize,
    out: std::sync::atomic::AtomicIsize,
}

impl HostBackup for Failing {
    fn allocate(
        &self,
        size: usize,
    ) -> tensormem_cuda_alloc::Result<tensormem_cuda_alloc::host::PinnedBuffer> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.budget.fetch_sub(1, SeqCst) <= 0 {
            return Err(Error::TooLarge { bytes: size });
        }
        let buffer = self.inner.allocate(size)?;
        self.out.fetch_add(1, SeqCst);
        Ok(buffer)
    }
    fn free(
        &self,
        buffer: tensormem_cuda_alloc::host::PinnedBuffer,
    ) -> tensormem_cuda_alloc::Result<()> {
        self.out.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.free(buffer)
    }
}

/// [`Failing`] handed to the allocator while the test keeps its own reference.
struct Shared(Arc<Failing>);

impl HostBackup for Shared {
    fn allocate(
        &self,
        size: usize,
    ) -> tensormem_cuda_alloc::Result<tensormem_cuda_alloc::host::PinnedBuffer> {
        self.0.allocate(size)
    }
    fn free(
        &self,
        buffer: tensormem_cuda_alloc::host::PinnedBuffer,
    ) -> tensormem_cuda_alloc::Result<()> {
        self.0.free(buffer)
    }
}

/// A backup made of many pieces, staged through pinned buffers into ordinary memory (the host has
/// nothing pinned ready) or kept in pinned pieces: the contents come back whole either way. When
/// the host runs out part way, the sleep fails, the pool stays awake with its contents, and every
/// buffer is given back.
#[test]
fn a_backup_of_many_pieces_comes_back_whole_staged_or_pinned_and_a_failure_gives_every_piece_back()
{
    for (budget, pinned) in [
        (isize::MAX, false),
        (isize::MAX, true),
        (1, false),
        (1, true),
    ] {
        let a = sim_with("expandable_segments:True", GIB);
        a.create_or_incref_pool(POOL).unwrap();
        a.begin_allocate_to_pool(POOL, |_| true).unwrap();
        // Runs of odd lengths: each is backed up in several power-of-two pieces.
        let blocks: Vec<_> = (0..6)
            .map(|i| a.allocate((7 + 3 * i) * MIB + 4321, S0).unwrap())
            .collect();
        a.end_allocate_to_pool(POOL).unwrap();
        for (i, b) in blocks.iter().enumerate() {
            a.device()
                .write_memory(b.ptr(), &pattern(i as u8, b.size()))
                .unwrap();
        }
        let host = Arc::new(Failing {
            inner: Arc::new(HostCachingAllocator::new(
                SimDevice::new(GIB as u64),
                HeapSource,
            )),
            budget: budget.into(),
            out: 0.into(),
        });
        let keep: Box<dyn HostBackup> = if pinned {
            Box::new(AlwaysPinned(Shared(Arc::clone(&host))))
        } else {
            Box::new(Shared(Arc::clone(&host)))
        };
        let slept = a.sleep_pool(POOL, Some(keep));
        let out = || host.out.load(std::sync::atomic::Ordering::SeqCst);
        if budget == 1 {
            assert!(slept.is_err(), "the host ran out");
            assert!(!a.is_pool_asleep(POOL));
            assert_eq!(out(), 0);
        } else {
            let report = slept.unwrap();
            assert!(report.backed_up_bytes >= blocks.iter().map(|b| b.size() as u64).sum());
            if pinned {
                assert!(out() >= 2, "several pinned pieces");
                assert_eq!(report.staged_bytes, 0);
            } else {
                assert_eq!(report.staged_bytes, report.backed_up_bytes);
            }
            a.wake_pool(POOL).unwrap();
            // Memory being pinned for the backup when it woke goes back once pinned.
            eventually("every buffer went back", || out() == 0);
        }
        for (i, b) in blocks.iter().enumerate() {
            let back = a.device().read_memory(b.ptr(), b.size()).unwrap();
            assert!(
                back == pattern(i as u8, b.size()),
                "block {i} (budget {budget})"
            );
        }
        for b in blocks {
            a.free(b).unwrap();
        }
        checked(&a);
    }
}

/// A backup larger than the staging ring, part of it in pinned memory reserved ahead: the reserved
/// piece is copied straight, the rest staged through the ring many times over (or moved into
/// pinned memory meanwhile), and everything comes back; the pinned piece is cached again after the
/// wake.
#[test]
fn a_backup_takes_reserved_pinned_memory_first_and_stages_the_rest() {
    let a = sim_with("expandable_segments:True", 2 * GIB);
    let host = Arc::new(HostCachingAllocator::new(
        SimDevice::new(GIB as u64),
        HeapSource,
    ));
    assert_eq!(
        host.reserve(128 * MIB, 128 * MIB, 1).unwrap(),
        128 * MIB,
        "one piece reserved"
    );
    a.create_or_incref_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let big = a.allocate(400 * MIB + 12345, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let data = pattern(3, big.size());
    a.device().write_memory(big.ptr(), &data).unwrap();

    let report = a
        .sleep_pool(POOL, Some(Box::new(Arc::clone(&host))))
        .unwrap();
    assert!(report.backed_up_bytes >= big.size() as u64);
    assert!(
        report.staged_bytes > 0 && report.staged_bytes <= report.backed_up_bytes - 128 * MIB as u64,
        "{report:?}"
    );
    // Fresh chunks are zeros: a piece not copied back would show.
    let woke = a.wake_pool(POOL).unwrap();
    assert_eq!(woke.restored_bytes, report.backed_up_bytes);
    assert!(woke.staged_bytes <= report.staged_bytes);
    assert!(a.device().read_memory(big.ptr(), big.size()).unwrap() == data);
    eventually("the pinned pieces went back", || {
        host.stats().active_bytes.current == 0
    });
    assert!(
        host.allocate_cached(128 * MIB).unwrap().is_some(),
        "the pinned piece is cached for the next sleep"
    );
    a.free(big).unwrap();
    checked(&a);
}

/// While a pool sleeps, its staged pieces move into pinned memory: a wake after that copies every
/// piece straight, and the next sleep finds the pinned memory cached and stages nothing.
#[test]
fn staged_pieces_move_into_pinned_memory_while_the_pool_sleeps() {
    let a = sim_with("expandable_segments:True", 2 * GIB);
    let host = Arc::new(HostCachingAllocator::new(
        SimDevice::new(GIB as u64),
        HeapSource,
    ));
    a.create_or_incref_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let big = a.allocate(300 * MIB, S0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let data = pattern(4, big.size());
    a.device().write_memory(big.ptr(), &data).unwrap();

    let slept = a
        .sleep_pool(POOL, Some(Box::new(Arc::clone(&host))))
        .unwrap();
    assert_eq!(
        slept.staged_bytes, slept.backed_up_bytes,
        "nothing was pinned"
    );
    // The background pinning may have moved some pieces already.
    assert!(a.asleep_staged_bytes(Some(POOL)) <= slept.staged_bytes);
    eventually("the staged pieces were pinned", || {
        a.asleep_staged_bytes(None) == 0
    });
    let woke = a.wake_pool(POOL).unwrap();
    assert_eq!(woke.restored_bytes, slept.backed_up_bytes);
    assert_eq!(woke.staged_bytes, 0, "every piece was pinned by then");
    assert!(a.device().read_memory(big.ptr(), big.size()).unwrap() == data);

    let again = a
        .sleep_pool(POOL, Some(Box::new(Arc::clone(&host))))
        .unwrap();
    assert_eq!(again.staged_bytes, 0, "the pinned pieces were cached");
    a.wake_pool(POOL).unwrap();
    assert!(a.device().read_memory(big.ptr(), big.size()).unwrap() == data);
    a.free(big).unwrap();
    checked(&a);
}
