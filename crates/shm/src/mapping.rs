//! [`Mapping`]: shared memory mapped into this process, and safe ways to reach its bytes.
//!
//! # Memory that other processes change
//!
//! A shared mapping is, by design, memory that other processes may write (or, for objects that
//! are not sealed, truncate) at any time. Rust's references promise that nothing changes the
//! bytes behind a `&[u8]` while it lives, and that nobody else touches the bytes behind a
//! `&mut [u8]`: a promise no library can keep for memory a peer writes. So this crate splits the
//! API along that line:
//!
//! - **Safe**: [`Mapping::read_at`] / [`Mapping::write_at`] copy bytes in and out through raw
//!   pointers, never creating a reference to the shared bytes (a concurrent peer write may make
//!   the copy see a mix of old and new bytes, which is the worst that happens);
//!   [`Mapping::to_vec`] and [`Mapping::fill`] are copies too; [`Mapping::read_volatile`] /
//!   [`Mapping::write_volatile`] poll or set single bytes; [`Mapping::atomic`] places an atomic
//!   integer in the region, sound under concurrent access from any process.
//! - **`unsafe`**: [`Mapping::as_slice`] and [`Mapping::as_mut_slice`] create references, so the
//!   caller promises what the compiler cannot check: no process writes (for `as_mut_slice`: reads
//!   or writes) the bytes while the slice lives, and nobody truncates the object under it. That
//!   is the obligation `memmap2` puts on `Mmap::map`; here it sits on the view rather than the
//!   mapping, because attaching alone is harmless while the copies above are the whole access.
//!   Typical ways to meet it: the consumer reads through a slice only after the producer's
//!   message and the producer writes again only after the consumer's answer; or the region is an
//!   anonymous (sealed) region this process created and has not shared yet.
//! - [`Mapping::as_ptr`] / [`Mapping::as_mut_ptr`] give raw pointers for everything else; using
//!   them is `unsafe` as usual.
//!
//! Taking a slice without `unsafe` does not compile:
//!
//! ```compile_fail,E0133
//! let region = tensormem_shm::SharedRegion::create_anonymous(4096).unwrap();
//! let bytes: &[u8] = region.as_slice(); // error: call to unsafe function
//! # let _ = bytes;
//! ```
//!
//! What truncation by a peer does to each access, per sharing mode, is described in the crate
//! docs (section "Truncation and `SIGBUS`").

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{
    AtomicI16, AtomicI32, AtomicI64, AtomicI8, AtomicU16, AtomicU32, AtomicU64, AtomicU8,
};

use rustix::fd::AsFd;
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// Whether a mapping may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Readable and writable (`PROT_READ | PROT_WRITE`, object opened `O_RDWR`).
    #[default]
    ReadWrite,
    /// Readable only (`PROT_READ`, object opened `O_RDONLY`); writes are refused with
    /// [`Error::ReadOnly`].
    ReadOnly,
}

impl Access {
    /// Whether writes are allowed.
    pub fn is_writable(self) -> bool {
        self == Self::ReadWrite
    }
}

/// A `MAP_SHARED` mapping of a file or shared memory object; `Drop` unmaps it.
///
/// The bytes the mapping exposes start `offset` bytes into the mapped range (non-zero for
/// refcounted regions, whose header precedes the data).
pub struct Mapping {
    /// Start of the mapped range, page aligned, valid for `map_len` bytes until `Drop`.
    base: NonNull<u8>,
    /// Length of the whole mapped range (what `munmap` gets).
    map_len: usize,
    /// Where the exposed bytes start within the range; `offset < map_len`.
    offset: usize,
    /// How the range was mapped.
    access: Access,
    /// Whether another process can truncate the object under the mapping (it is not sealed
    /// against shrinking); copies then go through the kernel, which reports a lost page as
    /// an error instead of raising `SIGBUS` (see [`guarded_copy`]).
    truncatable: bool,
}

// SAFETY: a `Mapping` owns its address range exclusively within this process (nothing else
// unmaps it); moving the owner to another thread changes nothing about the memory's validity.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` only hands out copies, atomics and (through `unsafe fn as_slice`) read-only
// views; writes need `&mut Mapping` or raw pointers whose use is the caller's unsafe
// responsibility. Concurrent copies from several threads are no different from a peer process's.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `mmap(NULL, map_len, prot, MAP_SHARED [| MAP_POPULATE], fd, 0)`.
    ///
    /// The caller has checked that the object behind `fd` holds at least `map_len` bytes and that
    /// `0 < map_len <= isize::MAX` and `offset < map_len`.
    pub(crate) fn map(
        fd: impl AsFd,
        map_len: usize,
        offset: usize,
        access: Access,
        populate: bool,
    ) -> rustix::io::Result<Self> {
        debug_assert!(map_len > 0 && offset < map_len);
        let prot = match access {
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
            Access::ReadOnly => ProtFlags::READ,
        };
        let mut flags = MapFlags::SHARED;
        if populate {
            flags |= MapFlags::POPULATE;
        }
        // SAFETY: a null hint lets the kernel pick an unused range, so no existing mapping is
        // replaced; the range becomes owned by the returned `Mapping`, which unmaps it once.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), map_len, prot, flags, fd, 0)? };
        let base = NonNull::new(ptr.cast::<u8>()).ok_or(rustix::io::Errno::NOMEM)?;
        Ok(Self {
            base,
            map_len,
            offset,
            access,
            // Until told otherwise: the safe assumption.
            truncatable: true,
        })
    }

    /// Number of bytes exposed (the mapped range minus any header).
    pub fn len(&self) -> usize {
        self.map_len - self.offset
    }

    /// Always `false`: regions hold at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How the memory was mapped.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Pointer to the first exposed byte; valid for [`len`](Self::len) bytes while `self` lives.
    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: `offset < map_len`, so the result stays inside the mapped range.
        unsafe { self.base.as_ptr().add(self.offset) }
    }

    /// Mutable pointer to the first exposed byte. Writing through it is allowed only for
    /// [`Access::ReadWrite`] mappings (a write to a read-only mapping raises SIGSEGV).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: as in `as_ptr`.
        unsafe { self.base.as_ptr().add(self.offset) }
    }

    /// The exposed bytes as a slice.
    ///
    /// Prefer [`read_at`](Self::read_at) or [`to_vec`](Self::to_vec), which copy and are safe;
    /// a slice is for reading a large region in place when the protocol guarantees quiet.
    ///
    /// # Safety
    ///
    /// For as long as the returned slice lives:
    /// - no process (this one through raw pointers or atomics included) writes the exposed bytes;
    /// - no process truncates the object below the mapped length (sealed anonymous regions
    ///   cannot be truncated; named, file-backed and unsealed objects can be, by anyone holding
    ///   a writable descriptor, and touching a lost page raises `SIGBUS`).
    ///
    /// Shared memory offers no way to check either from here; your protocol must ensure it (see
    /// the [module docs](self)).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the range is mapped readable for `len()` bytes until `self` is dropped, and the
        // returned borrow cannot outlive `self`; within this process, writes through this
        // `Mapping` need `&mut self`. That no other writer or truncation meets the slice while
        // it lives is the caller's obligation (this function's `# Safety`).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// The exposed bytes, writable.
    ///
    /// Prefer [`write_at`](Self::write_at) or [`fill`](Self::fill), which copy and are safe.
    ///
    /// # Panics
    ///
    /// If the mapping is read-only; [`try_as_mut_slice`](Self::try_as_mut_slice) returns an
    /// error instead.
    ///
    /// # Safety
    ///
    /// As [`try_as_mut_slice`](Self::try_as_mut_slice).
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the caller upholds `try_as_mut_slice`'s obligations, which are ours.
        match unsafe { self.try_as_mut_slice() } {
            Ok(slice) => slice,
            Err(err) => panic!("{err}"),
        }
    }

    /// The exposed bytes, writable.
    ///
    /// # Errors
    ///
    /// [`Error::ReadOnly`] if the mapping is read-only.
    ///
    /// # Safety
    ///
    /// For as long as the returned slice lives, no other process reads or writes the exposed
    /// bytes (a peer's access would race with this exclusive borrow) and none truncates the
    /// object below the mapped length (see [`as_slice`](Self::as_slice)).
    pub unsafe fn try_as_mut_slice(&mut self) -> Result<&mut [u8]> {
        if !self.access.is_writable() {
            return Err(Error::ReadOnly);
        }
        let len = self.len();
        // SAFETY: the range is mapped writable for `len` bytes; `&mut self` guarantees no other
        // reference into it exists in this process for the borrow's lifetime, and the caller
        // guarantees no other process touches it meanwhile.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) })
    }

    /// A copy of all exposed bytes (what [`read_at`](Self::read_at) gives for the whole region).
    ///
    /// # Errors
    ///
    /// As [`read_at`](Self::read_at).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len()];
        self.read_at(0, &mut out)?;
        Ok(out)
    }

    /// Sets every exposed byte to `value`, without creating a reference to the shared bytes.
    ///
    /// # Errors
    ///
    /// [`Error::ReadOnly`] for read-only mappings.
    pub fn fill(&mut self, value: u8) -> Result<()> {
        if !self.access.is_writable() {
            return Err(Error::ReadOnly);
        }
        let len = self.len();
        if self.truncatable {
            let chunk = vec![value; len.min(1 << 20)];
            let mut at = 0;
            while at < len {
                let n = chunk.len().min(len - at);
                self.write_at(at, &chunk[..n])?;
                at += n;
            }
            return Ok(());
        }
        // SAFETY: the whole exposed range lies inside a writable mapping owned by `self` that no
        // process can shrink; `&mut self` excludes other references to it in this process.
        unsafe { std::ptr::write_bytes(self.as_mut_ptr(), value, len) };
        Ok(())
    }

    /// Copies `buf.len()` bytes starting at `offset` into `buf`, without creating a reference to
    /// the shared bytes.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if the range does not fit in the region.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len())?;
        if self.truncatable {
            // SAFETY: the range lies inside the mapping (checked above) and `buf` is private
            // memory of `buf.len()` bytes.
            return unsafe {
                guarded_copy(
                    Direction::Read,
                    self.as_ptr().add(offset).cast_mut(),
                    buf.as_mut_ptr(),
                    buf.len(),
                    offset,
                )
            };
        }
        // SAFETY: the range was checked to lie inside the mapping, which no process can shrink
        // (sealed); `buf` is private memory that cannot overlap a shared mapping we own.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), buf.as_mut_ptr(), buf.len());
        }
        Ok(())
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// # Errors
    ///
    /// [`Error::ReadOnly`] for read-only mappings, [`Error::OutOfBounds`] if the range does not
    /// fit.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        self.write_at_shared(offset, data)
    }

    /// [`write_at`](Self::write_at) through a shared reference, for handles that share one
    /// mapping (the pool's consumer leases). No reference to the shared bytes is created, so this
    /// is no different from a peer process writing them: `as_slice`'s contract (no writer while
    /// the slice lives) already covers it.
    pub(crate) fn write_at_shared(&self, offset: usize, data: &[u8]) -> Result<()> {
        if !self.access.is_writable() {
            return Err(Error::ReadOnly);
        }
        self.check_range(offset, data.len())?;
        let dst = self.as_ptr().cast_mut();
        if self.truncatable {
            // SAFETY: the range lies inside a writable mapping (checked above); `data` is
            // private memory of `data.len()` bytes.
            return unsafe {
                guarded_copy(
                    Direction::Write,
                    dst.add(offset),
                    data.as_ptr().cast_mut(),
                    data.len(),
                    offset,
                )
            };
        }
        // SAFETY: the range was checked to lie inside a writable mapping no process can shrink;
        // the copy goes through raw pointers (no reference to the shared bytes exists here) and
        // `data` is private memory, which cannot overlap a shared mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst.add(offset), data.len());
        }
        Ok(())
    }

    /// Reads the byte at `offset` with a volatile load: the compiler neither caches nor elides it,
    /// which is what polling a byte another process writes needs when no atomic is used.
    ///
    /// # Errors
    ///
    /// [`Error::OutOfBounds`] if `offset >= len()`.
    pub fn read_volatile(&self, offset: usize) -> Result<u8> {
        self.check_range(offset, 1)?;
        if self.truncatable {
            // The kernel's copy is a load the compiler cannot elide or cache either.
            let mut byte = [0u8; 1];
            self.read_at(offset, &mut byte)?;
            return Ok(byte[0]);
        }
        // SAFETY: `offset` is inside the readable mapping.
        Ok(unsafe { self.as_ptr().add(offset).read_volatile() })
    }

    /// Writes the byte at `offset` with a volatile store.
    ///
    /// # Errors
    ///
    /// [`Error::ReadOnly`] or [`Error::OutOfBounds`].
    pub fn write_volatile(&mut self, offset: usize, value: u8) -> Result<()> {
        if !self.access.is_writable() {
            return Err(Error::ReadOnly);
        }
        self.check_range(offset, 1)?;
        if self.truncatable {
            return self.write_at(offset, &[value]);
        }
        // SAFETY: `offset` is inside the writable mapping.
        unsafe { self.as_mut_ptr().add(offset).write_volatile(value) };
        Ok(())
    }

    /// An atomic integer living at `offset` in the region, for words several processes update
    /// concurrently (refcounts, flags, sequence numbers). Sound under any concurrent access;
    /// on a [truncatable](Self::is_truncatable) region a peer's `ftruncate` below `offset` makes
    /// the next access through it fault (`SIGBUS`), which no check here can prevent:
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// # let region = tensormem_shm::SharedRegion::create_anonymous(4096)?;
    /// let counter: &AtomicU64 = region.atomic(8)?;
    /// counter.fetch_add(1, Ordering::AcqRel);
    /// # Ok::<(), tensormem_shm::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::ReadOnly`] for read-only mappings (an atomic could be stored to),
    /// [`Error::Misaligned`] if `offset` is not a multiple of the atomic's size,
    /// [`Error::OutOfBounds`] if it does not fit.
    pub fn atomic<A: SharedAtomic>(&self, offset: usize) -> Result<&A> {
        if !self.access.is_writable() {
            return Err(Error::ReadOnly);
        }
        let size = std::mem::size_of::<A>();
        self.check_range(offset, size)?;
        // The base is page aligned, so alignment within the region is alignment in memory
        // provided the header offset is itself aligned (it is 0 or 64).
        let addr = self.as_ptr() as usize + offset;
        if !addr.is_multiple_of(std::mem::align_of::<A>()) {
            return Err(Error::Misaligned {
                offset,
                align: std::mem::align_of::<A>(),
            });
        }
        // SAFETY: the address is inside a writable shared mapping, aligned for `A`, and lives as
        // long as `&self`. Atomic types have the layout of their integer and every bit pattern
        // is valid; atomics are the sound way to access memory other processes write.
        Ok(unsafe { &*(addr as *const A) })
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: self.len(),
            }),
        }
    }

    /// Whether another process can truncate the object under this mapping (it is not sealed
    /// against shrinking). Copies from and to such mappings ([`read_at`](Self::read_at),
    /// [`write_at`](Self::write_at), the volatile and `to_vec`/`fill` forms) go through the
    /// kernel and return [`Error::Truncated`] for lost pages; atomics, slices and raw pointers
    /// would fault (`SIGBUS`).
    pub fn is_truncatable(&self) -> bool {
        self.truncatable
    }

    /// Records whether the object can be truncated by others (see [`is_truncatable`]).
    ///
    /// [`is_truncatable`]: Self::is_truncatable
    pub(crate) fn set_truncatable(&mut self, truncatable: bool) {
        self.truncatable = truncatable;
    }

    /// Checks, through the kernel, that the first `len` bytes of the whole mapped range (header
    /// included) are still backed by the object, for callers about to touch them with atomics.
    /// A truncation after the check still faults: this narrows the window, it cannot close it.
    pub(crate) fn probe_start(&self, len: usize) -> Result<()> {
        if !self.truncatable {
            return Ok(());
        }
        let len = len.min(self.map_len);
        let mut scratch = vec![0u8; len];
        // SAFETY: `len <= map_len`, so the range lies inside the mapping; `scratch` is private.
        unsafe {
            guarded_copy(
                Direction::Read,
                self.base.as_ptr(),
                scratch.as_mut_ptr(),
                len,
                0,
            )
        }
    }

    /// Start of the whole mapped range, header included.
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length of the whole mapped range, header included.
    pub(crate) fn map_len(&self) -> usize {
        self.map_len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`map_len` describe exactly the range `mmap` returned, unmapped only here;
        // every borrow of it has ended because they borrow `self`.
        if let Err(errno) = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.map_len) } {
            tracing::error!(
                addr = ?self.base,
                len = self.map_len,
                error = %errno,
                "munmap of a shared region failed; the address range stays mapped (leaked)"
            );
        }
    }
}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping")
            .field("base", &self.base)
            .field("len", &self.len())
            .field("offset", &self.offset)
            .field("access", &self.access)
            .field("truncatable", &self.truncatable)
            .finish()
    }
}

/// Which way a [`guarded_copy`] moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// From the shared mapping into private memory.
    Read,
    /// From private memory into the shared mapping.
    Write,
}

/// Whether `process_vm_readv` works here (seccomp filters may refuse it); cleared on the first
/// `ENOSYS` / `EPERM`.
static KERNEL_COPY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Copies `len` bytes between `shared` (inside a mapping of a truncatable object) and `private`
/// through the kernel: `process_vm_readv` / `process_vm_writev` on this very process. The kernel
/// resolves the shared pages with `get_user_pages`, which reports a page beyond the object's end
/// as `EFAULT` (or a short count) instead of raising `SIGBUS`, so a peer's `ftruncate` becomes
/// [`Error::Truncated`]. Where the calls are unavailable, falls back to a plain copy (which would
/// fault, as PyTorch's accesses do).
///
/// # Safety
///
/// `shared` is valid for `len` bytes inside a live mapping (writable for [`Direction::Write`]);
/// `private` is valid for `len` bytes of memory no other thread accesses meanwhile.
#[doc(alias = "process_vm_readv")]
#[doc(alias = "process_vm_writev")]
unsafe fn guarded_copy(
    direction: Direction,
    shared: *mut u8,
    private: *mut u8,
    len: usize,
    offset: usize,
) -> Result<()> {
    use std::sync::atomic::Ordering;
    if len == 0 {
        return Ok(());
    }
    let mut done = 0;
    while done < len && KERNEL_COPY.load(Ordering::Relaxed) {
        // SAFETY: `done < len`, so both offsets stay inside the ranges the caller vouches for.
        let (private_at, shared_at) = unsafe { (private.add(done), shared.add(done)) };
        let local = libc::iovec {
            iov_base: private_at.cast(),
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: shared_at.cast(),
            iov_len: len - done,
        };
        // SAFETY: both iovecs describe memory valid for their lengths (the caller's contract);
        // the kernel checks every page of the remote range itself and never faults us.
        let n = unsafe {
            match direction {
                Direction::Read => libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0),
                Direction::Write => {
                    libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0)
                }
            }
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(Error::Truncated {
                    offset: offset + done,
                    len: len - done,
                })
            }
            _ => match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EFAULT) => {
                    return Err(Error::Truncated {
                        offset: offset + done,
                        len: len - done,
                    })
                }
                Some(libc::ENOSYS | libc::EPERM) => {
                    tracing::debug!("process_vm_readv unavailable; copies of truncatable shared memory are unguarded");
                    KERNEL_COPY.store(false, Ordering::Relaxed);
                }
                _ => {
                    return Err(Error::Os {
                        object: "shared mapping".to_owned(),
                        op: match direction {
                            Direction::Read => "process_vm_readv",
                            Direction::Write => "process_vm_writev",
                        },
                        source: std::io::Error::last_os_error(),
                    })
                }
            },
        }
    }
    if done < len {
        // SAFETY: the caller's contract; without the kernel's help a truncation faults here.
        unsafe {
            match direction {
                Direction::Read => {
                    std::ptr::copy_nonoverlapping(shared.add(done), private.add(done), len - done)
                }
                Direction::Write => {
                    std::ptr::copy_nonoverlapping(private.add(done), shared.add(done), len - done)
                }
            }
        }
    }
    Ok(())
}

mod sealed {
    pub trait Sealed {}
}

/// Atomic integer types that [`Mapping::atomic`] can place in shared memory.
///
/// Implemented for `AtomicU8` .. `AtomicU64` and `AtomicI8` .. `AtomicI64`; sealed, because the
/// soundness of `atomic` relies on every bit pattern being a valid value of the type.
pub trait SharedAtomic: sealed::Sealed + Sync {}

macro_rules! shared_atomic {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl SharedAtomic for $t {}
    )*};
}
shared_atomic!(
    AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicI8, AtomicI16, AtomicI32, AtomicI64
);
