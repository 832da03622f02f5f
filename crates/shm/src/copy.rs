//! Moving a private buffer into shared memory quickly (PyTorch's `share_memory_`, which makes a
//! new fd-backed storage and `storage_copy`s into it).
//!
//! Copying into fresh shared memory costs more than a `memcpy`: every destination page is
//! faulted in, allocated and zeroed by the kernel first. Three things make it fast:
//! - **pre-faulting** each destination chunk with `MADV_POPULATE_WRITE` (Linux 5.14+), which
//!   allocates the pages in one system call instead of one trap per 4 KiB page (older kernels:
//!   each page is touched instead);
//! - **transparent huge pages** (`MADV_HUGEPAGE`), where
//!   `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows them for shared memory: one fault
//!   per 2 MiB;
//! - **several threads** taking [`MIN_CHUNK`]-sized pieces from a shared queue, each pre-faulting
//!   and copying its piece, so faults and copies of different pieces run in parallel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use rustix::mm::Advice;

use crate::error::Result;
use crate::mapping::Mapping;
use crate::region::SharedRegion;

/// The piece of a copy one thread takes at a time, and the least a copy must have per thread
/// to get one: below this, starting a thread costs more than it saves. A multiple of the
/// x86-64 huge page size (2 MiB), so no two threads fault the same huge page.
pub const MIN_CHUNK: usize = 4 << 20;

const PAGE: usize = 4096;

/// Set once `MADV_POPULATE_WRITE` turned out to be unsupported, to stop trying.
static POPULATE_UNSUPPORTED: AtomicBool = AtomicBool::new(false);

impl SharedRegion {
    /// Copies `src` into a new anonymous shared region (memfd sealed against shrinking, see
    /// [`SharedRegion::create_anonymous`]), pre-faulting the destination and copying with
    /// several threads for large buffers. The region keeps its fd, ready to be sent.
    ///
    /// ```
    /// use tensormem_shm::SharedRegion;
    ///
    /// let tensor = vec![7u8; 1 << 20];
    /// let shared = SharedRegion::copy_from_bytes(&tensor)?;
    /// assert_eq!(shared.as_slice(), &tensor[..]);
    /// # Ok::<(), tensormem_shm::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSize`](crate::Error::InvalidSize) for an empty `src`; errors of
    /// [`SharedRegion::create_anonymous`].
    pub fn copy_from_bytes(src: &[u8]) -> Result<Self> {
        let mut region = Self::create_anonymous(src.len() as u64)?;
        advise_huge_pages(region.mapping());
        let dst = region.as_mut_slice();
        copy_prefaulted(dst, src, parallelism());
        Ok(region)
    }
}

/// Copies `src` into `dst` (same length), pre-faulting each destination chunk and using up to
/// `threads` threads, each taking at least [`MIN_CHUNK`] bytes.
///
/// Useful on its own to fill any fresh mapping (e.g. `SharedRegion::as_mut_slice`) as fast as
/// [`SharedRegion::copy_from_bytes`] does.
///
/// # Panics
///
/// If `dst` and `src` differ in length.
pub fn copy_prefaulted(dst: &mut [u8], src: &[u8], threads: usize) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_prefaulted needs equally long buffers"
    );
    let threads = threads.clamp(1, (src.len() / MIN_CHUNK).max(1));
    if threads == 1 {
        copy_chunk(dst, src);
        return;
    }
    // Threads take MIN_CHUNK-sized pieces from a shared queue rather than one fixed share each:
    // a thread the scheduler delays (busy machine) then holds up at most one piece.
    let work = Mutex::new(dst.chunks_mut(MIN_CHUNK).zip(src.chunks(MIN_CHUNK)));
    let worker = || loop {
        let next = work.lock().unwrap_or_else(PoisonError::into_inner).next();
        match next {
            Some((d, s)) => copy_chunk(d, s),
            None => break,
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(worker);
        }
        worker();
    });
}

/// How many threads a copy may use: `std::thread::available_parallelism`, 1 if unknown.
pub fn parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn copy_chunk(dst: &mut [u8], src: &[u8]) {
    prefault_write(dst);
    dst.copy_from_slice(src);
}

/// Faults in every page of `buf` for writing: `MADV_POPULATE_WRITE` on the page-aligned part, or
/// a write to each page where the kernel lacks it.
fn prefault_write(buf: &mut [u8]) {
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
                Ok(()) => return,
                Err(errno) => {
                    tracing::debug!(%errno, "MADV_POPULATE_WRITE unavailable; touching pages");
                    POPULATE_UNSUPPORTED.store(true, Ordering::Relaxed);
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
}

/// `madvise(MADV_HUGEPAGE)` on the whole mapping; failures (no THP support) are only traced,
/// since huge pages are an optimisation.
pub(crate) fn advise_huge_pages(map: &Mapping) {
    // SAFETY: the range is exactly the mapping `map` owns; MADV_HUGEPAGE only changes how the
    // kernel backs it, never its contents.
    let advised =
        unsafe { rustix::mm::madvise(map.base_ptr().cast(), map.map_len(), Advice::LinuxHugepage) };
    if let Err(errno) = advised {
        tracing::trace!(%errno, "MADV_HUGEPAGE refused; using normal pages");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_with_any_thread_count() {
        let src: Vec<u8> = (0..(9 << 20) + 12345)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        for threads in [1, 2, 3, 8] {
            let mut dst = vec![0u8; src.len()];
            copy_prefaulted(&mut dst, &src, threads);
            assert!(dst == src, "threads = {threads}");
        }
    }

    #[test]
    fn small_and_unaligned_buffers() {
        let src = [1u8, 2, 3];
        let mut dst = [0u8; 3];
        copy_prefaulted(&mut dst, &src, 4);
        assert_eq!(dst, src);
        let big: Vec<u8> = vec![9; 3 * PAGE + 17];
        let mut out = vec![0u8; 3 * PAGE + 18];
        copy_prefaulted(&mut out[1..], &big, 2);
        assert_eq!(&out[1..], &big[..]);
        assert_eq!(out[0], 0);
    }
}
