//! Moving a private buffer into shared memory quickly (PyTorch's `share_memory_`, which makes a
//! new fd-backed storage and `storage_copy`s into it).
//!
//! Copying into fresh shared memory costs more than a `memcpy`: every destination page must be
//! allocated by the kernel, zeroed, added to the object's page cache and mapped; in a virtual
//! machine the first touch of guest memory may also fault on the host. PyTorch's way is a plain
//! (OpenMP-parallel) copy into the new mapping, taking one page fault per 4 KiB page. The ways this
//! module knows ([`CopyMethod`]), chosen per copy by a [`CopyPlan`]:
//!
//! - [`CopyMethod::PrefaultSplit`]: the buffer is split into
//!   one contiguous piece per thread (2 MiB aligned, so no two threads share a huge page or a
//!   page-table page); each thread pre-faults a step of its piece with `MADV_POPULATE_WRITE`
//!   (Linux 5.14+: one system call allocates, zeroes and maps all its pages, instead of one trap
//!   per page) and copies that step while the zeroed lines are still in its cache, then the next
//!   step. Nothing is serialised on the object: page allocation, the page-cache insertion and the
//!   page-table locks are per CPU, per page or per 2 MiB range.
//! - [`CopyMethod::Pwrite`] (the default with one thread): one `pwrite` of the whole buffer. The
//!   kernel copies into freshly allocated pages without zeroing them first and without any
//!   page-table work, the cheapest way per byte; but the kernel holds the object's inode lock for
//!   the write, so only one thread can write an object at a time.
//! - [`CopyMethod::PwriteAndMap`] (the default with several threads): one thread `pwrite`s 4 MiB
//!   pieces taken from a shared queue while the others pre-fault and copy pieces from the same
//!   queue: the two above together, each where it is best. The writer does about twice the work
//!   of a mapping thread per unit of time (measured: one `pwrite` thread 2.0-2.2 GB/s, one
//!   pre-fault + copy thread 1.1-1.2 GB/s, 2-core VM), the mappers add what the inode lock keeps
//!   from a second writer, and the queue balances the two kinds of thread without tuning.
//! - [`CopyMethod::FallocateSplit`]: `fallocate` allocates every page first (one thread, under the
//!   inode lock), then threads map and copy their pieces; only worth it where page allocation is
//!   cheap and the mapping work dominates.
//!
//! With [`CopyPlan::huge_pages`], the region gets `MADV_HUGEPAGE` before anything touches it: where
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled` is `advise` (or `within_size`, `always`)
//! every fault then allocates a 2 MiB page, and the per-page costs above shrink 512-fold, leaving
//! the zeroing and the copy; where it is `never` the advice is harmless.
//!
//! Running out of memory is an [`Error`], not a `SIGBUS`: `pwrite`, `fallocate` and
//! `MADV_POPULATE_WRITE` report it (only the page-touching fallback of pre-5.14 kernels cannot).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread::ScopedJoinHandle;

use rustix::fd::BorrowedFd;
use rustix::fs::FallocateFlags;
use rustix::io::Errno;
use rustix::mm::Advice;

use crate::anon::AnonymousKind;
use crate::error::{Error, Result};
use crate::object;
use crate::region::SharedRegion;

/// The least a copy must have per thread to get one: below this, starting a thread costs more
/// than it saves; also the piece [`CopyMethod::PwriteAndMap`] threads take from their queue. A
/// multiple of the x86-64 huge page size (2 MiB), so no two threads fault the same huge page.
pub const MIN_CHUNK: usize = 4 << 20;

/// How much of its piece a [`CopyMethod::PrefaultSplit`] thread pre-faults before copying it:
/// small enough that the freshly zeroed lines are still in the core's caches when the copy
/// overwrites them, large enough that the system call is amortised over 128 pages.
pub const PREFAULT_STEP: usize = 512 << 10;

const PAGE: usize = 4096;
const HUGE_PAGE: usize = 2 << 20;

/// Set once `MADV_POPULATE_WRITE` turned out to be unsupported, to stop trying.
static POPULATE_UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// How a copy fills a new shared region (see the [module docs](self) for what each costs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// Each thread pre-faults (`MADV_POPULATE_WRITE`) and copies its own contiguous piece.
    PrefaultSplit,
    /// One `pwrite` of the whole buffer, by the calling thread (the thread count is ignored).
    Pwrite,
    /// One thread `pwrite`s pieces while the others pre-fault and copy pieces, all from one queue.
    PwriteAndMap,
    /// `fallocate` the whole object, then each thread pre-faults and copies its own piece.
    FallocateSplit,
}

/// Everything that decides how [`SharedRegion::copy_from_bytes_with`] works: the switch between
/// the copy methods, kept in one place so that they can be compared (the `shm_bench` binary
/// prints them all) and the default changed on evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPlan {
    /// How the bytes get in.
    pub method: CopyMethod,
    /// At most this many threads (at least one; fewer where a thread would get less than
    /// [`MIN_CHUNK`] bytes).
    pub threads: usize,
    /// Advise transparent huge pages (`MADV_HUGEPAGE`) on the new region.
    pub huge_pages: bool,
    /// The kind of object to create.
    pub object: AnonymousKind,
}

impl CopyPlan {
    /// The plan [`SharedRegion::copy_from_bytes`] uses: [`CopyPlan::with_threads`] of
    /// [`parallelism()`].
    pub fn new() -> Self {
        Self::with_threads(parallelism())
    }

    /// The default plan for at most `threads` threads: with one, [`CopyMethod::Pwrite`] (no
    /// zeroing, no page-table work); with more, [`CopyMethod::PwriteAndMap`] (one writer at
    /// `pwrite`'s speed plus mapping threads, which nothing serialises on the object). Huge pages
    /// advised, memfd object. This is the one switch to change if measurements on a machine say
    /// otherwise (`shm_bench` prints every method side by side).
    pub fn with_threads(threads: usize) -> Self {
        let threads = threads.max(1);
        Self {
            method: if threads == 1 {
                CopyMethod::Pwrite
            } else {
                CopyMethod::PwriteAndMap
            },
            threads,
            huge_pages: true,
            object: AnonymousKind::Memfd,
        }
    }

    /// The threads a copy of `len` bytes actually uses.
    pub fn threads_for(&self, len: usize) -> usize {
        match self.method {
            CopyMethod::Pwrite => 1,
            _ => self.threads.clamp(1, len.div_ceil(MIN_CHUNK).max(1)),
        }
    }
}

impl Default for CopyPlan {
    fn default() -> Self {
        Self::new()
    }
}

impl SharedRegion {
    /// Copies `src` into a new anonymous shared region (memfd sealed against shrinking, see
    /// [`SharedRegion::create_anonymous`]) as fast as the [module docs](self) describe, with the
    /// default [`CopyPlan`]. The region keeps its fd, ready to be sent.
    ///
    /// ```
    /// use tensormem_shm::SharedRegion;
    ///
    /// let tensor = vec![7u8; 1 << 20];
    /// let shared = SharedRegion::copy_from_bytes(&tensor)?;
    /// assert_eq!(shared.to_vec()?, tensor);
    /// # Ok::<(), tensormem_shm::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSize`] for an empty `src`; errors of [`SharedRegion::create_anonymous`];
    /// [`Error::Os`] if the memory cannot be allocated (`ENOMEM`, `ENOSPC`).
    #[doc(alias = "share_memory_")]
    pub fn copy_from_bytes(src: &[u8]) -> Result<Self> {
        Self::copy_from_bytes_with(src, &CopyPlan::new())
    }

    /// [`copy_from_bytes`](Self::copy_from_bytes) with at most `threads` threads (the default
    /// plan for that many, [`CopyPlan::with_threads`]).
    ///
    /// # Errors
    ///
    /// As [`copy_from_bytes`](Self::copy_from_bytes).
    pub fn copy_from_bytes_with_threads(src: &[u8], threads: usize) -> Result<Self> {
        Self::copy_from_bytes_with(src, &CopyPlan::with_threads(threads))
    }

    /// [`copy_from_bytes`](Self::copy_from_bytes) the way `plan` says.
    ///
    /// ```
    /// use tensormem_shm::copy::{CopyMethod, CopyPlan};
    /// use tensormem_shm::SharedRegion;
    ///
    /// let tensor = vec![3u8; 5 << 20];
    /// let plan = CopyPlan { method: CopyMethod::PrefaultSplit, ..CopyPlan::with_threads(2) };
    /// let shared = SharedRegion::copy_from_bytes_with(&tensor, &plan)?;
    /// assert_eq!(shared.to_vec()?, tensor);
    /// # Ok::<(), tensormem_shm::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`copy_from_bytes`](Self::copy_from_bytes).
    pub fn copy_from_bytes_with(src: &[u8], plan: &CopyPlan) -> Result<Self> {
        let mut region = Self::create_anonymous_as(src.len() as u64, plan.object)?;
        if plan.huge_pages {
            object::advise_huge_pages(region.mapping());
        }
        fill_fresh_region(&mut region, src, plan)?;
        Ok(region)
    }
}

/// Copies `src` into the start of `region`, an anonymous region just created by the caller whose
/// fd has not been shared yet and whose pages were never touched, the way `plan` says (its
/// `object` and `huge_pages` are the caller's business). The pool's cold path uses it too.
pub(crate) fn fill_fresh_region(
    region: &mut SharedRegion,
    src: &[u8],
    plan: &CopyPlan,
) -> Result<()> {
    let threads = plan.threads_for(src.len());
    let (fd, map) = region.fd_and_mapping_mut();
    let fd = fd.ok_or_else(|| Error::NoFd {
        object: "new anonymous region".to_owned(),
    })?;
    let region_len = map.len();
    // SAFETY: the caller just created the region and its fd has not left this process, so
    // no other process can reach the object (a memfd has no name; the shm fallback was
    // unlinked at once): nobody else reads, writes or truncates it while `dst` lives.
    let all = unsafe { map.try_as_mut_slice()? };
    let dst = all.get_mut(..src.len()).ok_or(Error::OutOfBounds {
        offset: 0,
        len: src.len(),
        region_len,
    })?;
    match plan.method {
        CopyMethod::PrefaultSplit => copy_split(dst, src, threads)?,
        CopyMethod::Pwrite => pwrite_all(fd, src, 0)?,
        CopyMethod::PwriteAndMap => copy_queue(Some(fd), dst, src, threads)?,
        CopyMethod::FallocateSplit => {
            fallocate(fd, src.len())?;
            copy_split(dst, src, threads)?;
        }
    }
    tracing::debug!(
        len = src.len(),
        ?plan,
        "copied a buffer into a new shared region"
    );
    Ok(())
}

/// Copies `src` into `dst` (same length) with up to `threads` threads, each pre-faulting and
/// copying its own contiguous piece: [`CopyMethod::PrefaultSplit`] for any fresh destination (a
/// mapping, a new `Vec`).
///
/// # Errors
///
/// [`Error::Os`] if pre-faulting fails (`ENOMEM`: the memory cannot be allocated).
///
/// # Panics
///
/// If `dst` and `src` differ in length.
pub fn copy_prefaulted(dst: &mut [u8], src: &[u8], threads: usize) -> Result<()> {
    assert_eq!(dst.len(), src.len(), "copies need equally long buffers");
    let threads = threads.clamp(1, src.len().div_ceil(MIN_CHUNK).max(1));
    copy_split(dst, src, threads)
}

/// How many threads a copy may use: `std::thread::available_parallelism`, 1 if unknown.
pub fn parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// [`CopyMethod::PrefaultSplit`]: `threads` contiguous pieces (the calling thread takes the
/// first), each pre-faulted and copied in [`PREFAULT_STEP`] steps.
fn copy_split(dst: &mut [u8], src: &[u8], threads: usize) -> Result<()> {
    debug_assert_eq!(dst.len(), src.len());
    let piece = src
        .len()
        .div_ceil(threads.max(1))
        .next_multiple_of(HUGE_PAGE);
    let mut pieces = dst.chunks_mut(piece).zip(src.chunks(piece));
    let Some((first_dst, first_src)) = pieces.next() else {
        return Ok(());
    };
    std::thread::scope(|scope| {
        let others: Vec<_> = pieces
            .map(|(d, s)| scope.spawn(move || prefault_and_copy_steps(d, s)))
            .collect();
        join_pieces(prefault_and_copy_steps(first_dst, first_src), others)
    })
}

/// Waits for the threads of `others`, each working on a piece of a split job; the calling
/// thread's own piece gave `first`. Returns the first error in piece order; a thread's panic
/// goes on in the caller.
pub(crate) fn join_pieces(
    first: Result<()>,
    others: Vec<ScopedJoinHandle<'_, Result<()>>>,
) -> Result<()> {
    let mut result = first;
    for handle in others {
        let theirs = handle
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        result = result.and(theirs);
    }
    result
}

fn prefault_and_copy_steps(dst: &mut [u8], src: &[u8]) -> Result<()> {
    for (d, s) in dst.chunks_mut(PREFAULT_STEP).zip(src.chunks(PREFAULT_STEP)) {
        prefault_write(d)?;
        d.copy_from_slice(s);
    }
    Ok(())
}

/// [`CopyMethod::PwriteAndMap`] (and, without `fd`, a queue of pre-fault-and-copy pieces): pieces
/// of [`MIN_CHUNK`] bytes from a shared queue; with `fd` (the object `dst` maps, at offset 0), the
/// calling thread `pwrite`s its pieces and the others pre-fault and copy.
fn copy_queue(
    fd: Option<BorrowedFd<'_>>,
    dst: &mut [u8],
    src: &[u8],
    threads: usize,
) -> Result<()> {
    assert_eq!(dst.len(), src.len(), "copies need equally long buffers");
    let queue = Mutex::new(
        dst.chunks_mut(MIN_CHUNK)
            .zip(src.chunks(MIN_CHUNK))
            .enumerate(),
    );
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let next = || {
        if failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            return None;
        }
        queue.lock().unwrap_or_else(PoisonError::into_inner).next()
    };
    let fail = |err: Error| {
        failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(err);
    };
    let mapper = || {
        while let Some((_, (d, s))) = next() {
            if let Err(err) = prefault_and_copy_steps(d, s) {
                fail(err);
            }
        }
    };
    let writer = |fd: BorrowedFd<'_>| {
        // The piece of `dst` handed out with each index is left untouched: the kernel fills the
        // same pages through the fd, and nothing reads them through `dst` until every thread
        // has finished.
        while let Some((index, (_untouched, s))) = next() {
            if let Err(err) = pwrite_all(fd, s, (index * MIN_CHUNK) as u64) {
                fail(err);
            }
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(mapper);
        }
        match fd {
            Some(fd) => writer(fd),
            None => mapper(),
        }
    });
    match failure.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// `fallocate(fd, 0, 0, len)`: allocates every page of the object.
fn fallocate(fd: BorrowedFd<'_>, len: usize) -> Result<()> {
    loop {
        match rustix::fs::fallocate(fd, FallocateFlags::empty(), 0, len as u64) {
            Ok(()) => return Ok(()),
            Err(Errno::INTR) => {}
            Err(errno) => return Err(Error::from_errno(errno, "fallocate", "new shared region")),
        }
    }
}

fn pwrite_all(fd: BorrowedFd<'_>, mut data: &[u8], mut offset: u64) -> Result<()> {
    while !data.is_empty() {
        match rustix::io::pwrite(fd, data, offset) {
            Ok(0) => {
                return Err(Error::from_errno(
                    Errno::NOSPC,
                    "pwrite",
                    "new shared region",
                ))
            }
            Ok(n) => {
                data = &data[n..];
                offset += n as u64;
            }
            Err(Errno::INTR) => {}
            Err(errno) => return Err(Error::from_errno(errno, "pwrite", "new shared region")),
        }
    }
    Ok(())
}

/// Faults in every page of `buf` for writing: `MADV_POPULATE_WRITE` on the page-aligned part, or
/// a write to each page where the kernel lacks it.
pub(crate) fn prefault_write(buf: &mut [u8]) -> Result<()> {
    let start = buf.as_mut_ptr() as usize;
    let aligned = start.next_multiple_of(PAGE);
    let end = start + buf.len();
    if !POPULATE_UNSUPPORTED.load(Ordering::Relaxed) && end > aligned {
        let len = (end - aligned) / PAGE * PAGE;
        if len > 0 {
            // SAFETY: `aligned..aligned + len` lies inside `buf`, memory this thread may write;
            // MADV_POPULATE_WRITE only faults pages in (as a write would) and changes no data.
            let advised =
                unsafe { rustix::mm::madvise(aligned as *mut _, len, Advice::LinuxPopulateWrite) };
            match advised {
                Ok(()) => return Ok(()),
                // EINVAL: a kernel without MADV_POPULATE_WRITE (before 5.14).
                Err(Errno::INVAL) => {
                    tracing::debug!("MADV_POPULATE_WRITE unavailable; touching pages");
                    POPULATE_UNSUPPORTED.store(true, Ordering::Relaxed);
                }
                Err(errno) => {
                    return Err(Error::from_errno(
                        errno,
                        "madvise(MADV_POPULATE_WRITE)",
                        "copy destination",
                    ))
                }
            }
        }
    }
    for i in (0..buf.len()).step_by(PAGE) {
        // SAFETY: `i < buf.len()`; a volatile write of the byte's own value faults the page in
        // for writing without the compiler removing it.
        unsafe {
            let p = buf.as_mut_ptr().add(i);
            p.write_volatile(p.read_volatile());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn copies_every_byte_with_any_thread_count() {
        let src = pattern((9 << 20) + 12345);
        for threads in [1, 2, 3, 8] {
            let mut dst = vec![0u8; src.len()];
            copy_prefaulted(&mut dst, &src, threads).unwrap();
            assert!(dst == src, "threads = {threads}");
        }
    }

    #[test]
    fn every_plan_fills_a_region() {
        let src = pattern((13 << 20) + 4097);
        let methods = [
            CopyMethod::PrefaultSplit,
            CopyMethod::Pwrite,
            CopyMethod::PwriteAndMap,
            CopyMethod::FallocateSplit,
        ];
        for method in methods {
            for threads in [1, 2, 4] {
                for (huge_pages, object) in [
                    (true, AnonymousKind::Memfd),
                    (false, AnonymousKind::UnlinkedShm),
                ] {
                    let plan = CopyPlan {
                        method,
                        threads,
                        huge_pages,
                        object,
                    };
                    let region = SharedRegion::copy_from_bytes_with(&src, &plan).unwrap();
                    assert!(region.to_vec().unwrap() == src, "{plan:?}");
                    assert!(region.fd().is_some(), "{plan:?}");
                }
            }
        }
    }

    #[test]
    fn default_plan_and_thread_counts() {
        assert_eq!(CopyPlan::with_threads(1).method, CopyMethod::Pwrite);
        assert_eq!(CopyPlan::with_threads(0).threads, 1);
        let plan = CopyPlan::with_threads(8);
        assert_eq!(plan.method, CopyMethod::PwriteAndMap);
        assert_eq!(plan.threads_for(1), 1);
        assert_eq!(plan.threads_for(3 * MIN_CHUNK), 3);
        assert_eq!(plan.threads_for(1 << 30), 8);
        let pwrite = CopyPlan {
            method: CopyMethod::Pwrite,
            ..plan
        };
        assert_eq!(pwrite.threads_for(1 << 30), 1);
    }

    #[test]
    fn empty_source_is_an_error() {
        assert!(matches!(
            SharedRegion::copy_from_bytes(&[]),
            Err(Error::InvalidSize { .. })
        ));
    }

    #[test]
    fn small_and_unaligned_buffers() {
        let src = [1u8, 2, 3];
        let mut dst = [0u8; 3];
        copy_prefaulted(&mut dst, &src, 4).unwrap();
        assert_eq!(dst, src);
        let big: Vec<u8> = vec![9; 3 * PAGE + 17];
        let mut out = vec![0u8; 3 * PAGE + 18];
        copy_prefaulted(&mut out[1..], &big, 2).unwrap();
        assert_eq!(&out[1..], &big[..]);
        assert_eq!(out[0], 0);
    }
}
