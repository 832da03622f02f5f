//! [`PoolBuffer`]: a region lent by the pool to the producer, and the parallel fills and copies
//! that keep a warm region at memory speed.

use std::fmt;
use std::sync::Arc;

use rustix::fd::BorrowedFd;

use super::Inner;
use crate::copy::{join_pieces, prefault_write, MIN_CHUNK};
use crate::error::{Error, Result};
use crate::mapping::Mapping;
use crate::region::SharedRegion;

/// A shared-memory buffer lent by a [`ShmPool`](super::ShmPool): `len` bytes at the start of a
/// region of [`capacity`](Self::capacity) bytes (its size class). Send it with a
/// [`PoolSender`](super::PoolSender); dropping it gives the producer's share back, and the region
/// returns to the pool once every consumer lease is released too.
///
/// Access is by copies (`read_at`, `write_at`, `fill`, `copy_from`: safe, as for [`Mapping`]) or
/// through the `unsafe` slices, whose contract is [`Mapping::as_slice`]'s.
pub struct PoolBuffer {
    pool: Arc<Inner>,
    id: u64,
    /// `Some` until `Drop` hands it back.
    region: Option<SharedRegion>,
    len: usize,
    /// The region was made for this buffer (never lent before): past `len` it reads as zeros.
    fresh: bool,
}

impl PoolBuffer {
    pub(crate) fn new(
        pool: Arc<Inner>,
        id: u64,
        region: SharedRegion,
        len: usize,
        fresh: bool,
    ) -> Self {
        debug_assert!(len <= region.len());
        Self {
            pool,
            id,
            region: Some(region),
            len,
            fresh,
        }
    }

    fn region(&self) -> &SharedRegion {
        self.region
            .as_ref()
            .expect("a PoolBuffer holds its region until dropped")
    }

    fn region_mut(&mut self) -> &mut SharedRegion {
        self.region
            .as_mut()
            .expect("a PoolBuffer holds its region until dropped")
    }

    /// The region's id in its pool (what a consumer that knows the region receives).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: buffers hold at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the region behind it (its size class; what a consumer maps).
    pub fn capacity(&self) -> usize {
        self.region().len()
    }

    /// The region's descriptor (a sealed memfd).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.region().fd()
    }

    /// The whole region's mapping (all [`capacity`](Self::capacity) bytes).
    pub fn mapping(&self) -> &Mapping {
        self.region().mapping()
    }

    /// Copies `buf.len()` bytes from `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if the range is not inside the buffer's `len` bytes.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        self.region().read_at(offset, buf)
    }

    /// Copies `data` in at `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if the range is not inside the buffer's `len` bytes.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        self.region_mut().write_at(offset, data)
    }

    /// One byte, read with a volatile load.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if `offset >= len()`.
    pub fn read_volatile(&self, offset: usize) -> Result<u8> {
        self.check(offset, 1)?;
        self.region().read_volatile(offset)
    }

    /// A copy of the buffer's bytes.
    ///
    /// # Errors
    ///
    /// As [`Mapping::read_at`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        self.region().read_at(0, &mut out)?;
        Ok(out)
    }

    /// Sets every byte of the buffer to `value`, with the pool's threads for large buffers.
    ///
    /// # Errors
    ///
    /// As [`Mapping::fill`].
    pub fn fill(&mut self, value: u8) -> Result<()> {
        let threads = self.pool.config.threads;
        let len = self.len;
        let map = self.region_mut().mapping_mut();
        if map.is_truncatable() {
            return fill_guarded(map, len, value);
        }
        let base = map.as_mut_ptr() as usize;
        parallel_pieces(len, threads, |at, n| {
            // SAFETY: `at + n <= len <= map.len()`: inside the writable mapping, which is sealed
            // against shrinking; raw writes, no reference to the shared bytes is made, and the
            // pieces of the threads are disjoint.
            unsafe { std::ptr::write_bytes((base + at) as *mut u8, value, n) };
            Ok(())
        })
    }

    /// Copies `src` to the start of the buffer, with the pool's threads for large copies.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if `src` is longer than the buffer.
    pub fn copy_from(&mut self, src: &[u8]) -> Result<()> {
        self.check(0, src.len())?;
        let threads = self.pool.config.threads;
        let map = self.region_mut().mapping_mut();
        if map.is_truncatable() {
            return map.write_at(0, src);
        }
        let base = map.as_mut_ptr() as usize;
        parallel_pieces(src.len(), threads, |at, n| {
            // SAFETY: `at + n <= src.len() <= map.len()`: inside the writable mapping (sealed,
            // so it cannot shrink) and inside `src`; private and shared memory cannot overlap;
            // the threads' pieces are disjoint.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr().add(at), (base + at) as *mut u8, n)
            };
            Ok(())
        })
    }

    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.region().as_ptr()
    }

    /// Mutable pointer to the first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.region_mut().as_mut_ptr()
    }

    /// The buffer's `len` bytes as a slice.
    ///
    /// # Safety
    ///
    /// As [`Mapping::as_slice`]: no process writes the bytes or truncates the object while the
    /// slice lives (a consumer holding a lease may write, if it mapped the region writable).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `len <= capacity`, the range is mapped while `self` lives; the rest is the
        // caller's obligation.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The buffer's `len` bytes, writable.
    ///
    /// # Safety
    ///
    /// As [`Mapping::try_as_mut_slice`]: no other process reads or writes the bytes while the
    /// slice lives (true before the buffer is sent, and after every lease on it was released).
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: as above; pool regions are mapped read-write and `&mut self` excludes other
        // references in this process.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

impl PoolBuffer {
    /// Whether this buffer was lent by `pool` (or a clone of it).
    pub fn is_from(&self, pool: &super::ShmPool) -> bool {
        Arc::ptr_eq(&self.pool, pool.inner())
    }

    /// Takes the region out of the pool for good and gives it to the caller, for a region whose
    /// users can no longer be accounted for (its descriptor is about to be handed out raw, as
    /// PyTorch's `_share_fd_cpu_` does): the pool never lends it again, and its memory is freed
    /// normally once the returned region and every mapping of it are gone. Leases already sent
    /// stay valid; consumers caching the region are told to forget it once those are released.
    ///
    /// The bytes past [`len`](Self::len) (the rest of the size class, which may hold what an
    /// earlier use of the region wrote) are cleared first if the region was lent before, so
    /// whoever receives the descriptor sees nothing of the region's earlier uses (a region made
    /// for this buffer reads as zeros there already, and is not touched). The region returned is
    /// [`capacity`](Self::capacity) bytes long.
    pub fn detach(mut self) -> SharedRegion {
        let mut region = self
            .region
            .take()
            .expect("a PoolBuffer holds its region until dropped");
        if !self.fresh {
            clear_tail(&mut region, self.len);
        }
        self.pool.detach(self.id);
        tracing::debug!(id = self.id, "pooled region detached from its pool");
        region
    }
}

/// Zeroes `region` from `from` to its end.
fn clear_tail(region: &mut SharedRegion, from: usize) {
    let map = region.mapping_mut();
    let len = map.len();
    if from >= len {
        return;
    }
    if map.is_truncatable() {
        let zeros = vec![0u8; (len - from).min(1 << 20)];
        let mut at = from;
        while at < len {
            let n = zeros.len().min(len - at);
            if let Err(err) = map.write_at(at, &zeros[..n]) {
                // Truncated by a peer: the pages are gone, so nothing is left to expose.
                tracing::debug!(error = %err, "could not clear a detached region's tail");
                return;
            }
            at += n;
        }
        return;
    }
    let base = map.as_mut_ptr() as usize;
    // SAFETY: `from..len` lies inside the writable mapping, which is sealed against shrinking;
    // a raw write, no reference to the shared bytes is made.
    unsafe { std::ptr::write_bytes((base + from) as *mut u8, 0, len - from) };
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            self.pool.put_back(self.id, region);
        }
    }
}

impl fmt::Debug for PoolBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBuffer")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("capacity", &self.region.as_ref().map(|r| r.len()))
            .finish()
    }
}

/// Faults every page of a new region in for writing, with up to `threads` threads.
pub(crate) fn prefault(region: &mut SharedRegion, threads: usize) -> Result<()> {
    let map = region.mapping_mut();
    let len = map.len();
    let base = map.as_mut_ptr() as usize;
    parallel_pieces(len, threads, |at, n| {
        // SAFETY: the region was just created by the pool and has not been sent anywhere, so no
        // other process reaches it; the threads' pieces are disjoint and inside the mapping.
        let piece = unsafe { std::slice::from_raw_parts_mut((base + at) as *mut u8, n) };
        prefault_write(piece)
    })
}

/// Runs `work(offset, len)` over `len` bytes split into at most `threads` contiguous pieces of
/// at least [`MIN_CHUNK`] bytes (the calling thread takes the first).
fn parallel_pieces(
    len: usize,
    threads: usize,
    work: impl Fn(usize, usize) -> Result<()> + Sync,
) -> Result<()> {
    let threads = threads.clamp(1, len.div_ceil(MIN_CHUNK).max(1));
    if threads == 1 {
        return work(0, len);
    }
    let piece = len.div_ceil(threads).next_multiple_of(2 << 20);
    let work = &work;
    std::thread::scope(|scope| {
        let others: Vec<_> = (piece..len)
            .step_by(piece)
            .map(|at| scope.spawn(move || work(at, piece.min(len - at))))
            .collect();
        join_pieces(work(0, piece.min(len)), others)
    })
}

fn fill_guarded(map: &mut Mapping, len: usize, value: u8) -> Result<()> {
    let chunk = vec![value; len.min(1 << 20)];
    let mut at = 0;
    while at < len {
        let n = chunk.len().min(len - at);
        map.write_at(at, &chunk[..n])?;
        at += n;
    }
    Ok(())
}

impl PoolBuffer {
    pub(crate) fn pool(&self) -> &Arc<Inner> {
        &self.pool
    }
}
