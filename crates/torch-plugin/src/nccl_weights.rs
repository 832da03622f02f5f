//! A model's weights from one rank into the other ranks' own tensors through NCCL, for C callers
//! and `tensormem_torch.nccl_weights`: the C face of [`tensormem_nccl::weights`] (read its docs for
//! the protocol: the layout agreed once, buckets broadcast through two staging buffers registered
//! with the communicator, packing and unpacking pipelined with the transfers).
//!
//! | step | who | call |
//! | --- | --- | --- |
//! | an id | the sending rank | [`tensormem_nccl_unique_id`]; its bytes go to every rank out of band (a `torch.distributed` store, a file, the launcher) |
//! | connect | every rank | [`tensormem_nccl_weights_open`]: a communicator from the id (`ncclCommInitRank`), staging buffers, the layouts checked on every rank |
//! | sync | every rank, per version | [`tensormem_nccl_weights_sync`]: the sender's tensors broadcast, every other rank's tensors written |
//! | close | every rank | [`tensormem_nccl_weights_close`] |
//!
//! Tensors are parallel arrays: a name (UTF-8, NUL-terminated, unique on the rank), the address of
//! the first byte (PyTorch's `data_ptr()`; the tensor is contiguous), the size in bytes, and
//! metadata text that every rank must give alike for the tensor (its element type and shape, e.g.
//! `"float32[768,3072]"`). The sender's tensors, in its order, are the layout; every other rank
//! matches it by name, in any order. Each rank passes its own tensors, on its own device.
//!
//! A weight sync is an opaque handle, checked on every call (a closed or made-up handle is an
//! error naming it). A handle may be used from several threads; calls on one sync take turns.
//!
//! Every rank opens with the same id, world size, sender rank and bucket size; the call returns
//! once every rank has joined and the layouts were compared. The arguments are checked before
//! NCCL is touched: a rank whose arguments are refused never joins, and the others then wait in
//! `ncclCommInitRank`, as for any rank that misses a collective (`tensormem_torch.nccl_weights`
//! checks every rank's arguments through its store before any rank opens).
//!
//! NCCL is loaded when first used (cudarc's dynamic loading), not when this library is: a program
//! that never syncs weights through NCCL never needs it. Where it cannot be loaded, the calls fail
//! with a message saying what to do.
//!
//! Each function returns [`TM_OK`], [`TM_OUT_OF_MEMORY`](crate::native::TM_OUT_OF_MEMORY) (the
//! staging buffers did not fit) or [`TM_ERROR`](crate::native::TM_ERROR); the message is the thread's [`tensormem_last_error`](crate::tensormem_last_error).

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::sys;
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use tensormem_cuda_alloc::backend::cuda::{check, BackendEvent, CudaBackend};
use tensormem_cuda_alloc::{Device, DeviceAddress};
use tensormem_nccl::weights::cuda::CudaWeightSync;
use tensormem_nccl::weights::{
    self, LocalTensor, SyncOptions, SyncReport, WeightLayout, DEFAULT_SYNC_TIMEOUT,
    MIN_BUCKET_BYTES,
};

use crate::args::{items, put, text};
use crate::error::{Error, Result};
use crate::handles::{locked, Table};
use crate::native::{status, TM_OK};

/// The bytes of an NCCL unique id (`ncclUniqueId`).
pub const TM_NCCL_UNIQUE_ID_BYTES: c_int = 128;

const UNIQUE_ID_BYTES: usize = TM_NCCL_UNIQUE_ID_BYTES as usize;
const _: () = assert!(std::mem::size_of::<nccl_sys::ncclUniqueId>() == UNIQUE_ID_BYTES);

/// What one sync moved, as this rank saw it ([`tensormem_nccl_weights_sync`] writes it).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct NcclSyncReport {
    /// The sync's number on this handle, from 1.
    pub sync: u64,
    /// The bytes of all tensors.
    pub bytes: u64,
    /// The broadcasts.
    pub buckets: u64,
    /// The buckets broadcast from or into a tensor directly on this rank (no staging copy).
    pub direct: u64,
    /// From the call until this rank's tensors were done (sent, or holding the new values).
    pub seconds: f64,
}

impl From<SyncReport> for NcclSyncReport {
    fn from(r: SyncReport) -> Self {
        Self {
            sync: r.sync,
            bytes: r.bytes,
            buckets: r.buckets as u64,
            direct: r.direct as u64,
            seconds: r.elapsed.as_secs_f64(),
        }
    }
}

/// The open weight syncs.
static SYNCS: Table<Mutex<Open>> = Table::new("NCCL weight sync", "tensormem_nccl_weights_open");

/// One rank's open weight sync.
struct Open {
    /// Dropped before `comm` (fields drop in order): its staging buffers are freed through it.
    sync: CudaWeightSync,
    comm: Comm,
    device: CudaBackend,
    /// Recorded on the caller's stream, waited for by the sync's own stream.
    ready: BackendEvent,
}

impl Open {
    /// Frees the staging buffers, then the communicator, returning NCCL's error if it has one.
    fn close(self) -> Result<()> {
        let Self { sync, comm, .. } = self;
        drop(sync);
        comm.release()
    }
}

/// A communicator this library made: `ncclCommDestroy` when it is let go, or `ncclCommAbort`
/// after a failure, when the ranks may be out of step (destroying waits for the others).
struct Comm {
    /// The `ncclComm_t`, as an address so that the type is `Send`; 0 once released.
    raw: usize,
    /// A call on it failed other than by a refusal every rank agreed on.
    failed: bool,
}

impl Comm {
    fn release(mut self) -> Result<()> {
        let raw = std::mem::take(&mut self.raw) as nccl_sys::ncclComm_t;
        if raw.is_null() {
            return Ok(());
        }
        // SAFETY: a live communicator this library made, released once (`raw` is now 0); the
        // weight sync that used it was dropped first.
        let (call, result) = unsafe {
            if self.failed {
                ("ncclCommAbort", nccl::comm_abort(raw))
            } else {
                ("ncclCommDestroy", nccl::comm_destroy(raw))
            }
        };
        result.map(drop).map_err(collective(call))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.raw != 0 {
            let comm = Comm {
                raw: std::mem::take(&mut self.raw),
                failed: self.failed,
            };
            if let Err(error) = comm.release() {
                tracing::warn!(%error, "releasing an NCCL communicator");
            }
        }
    }
}

/// NCCL's error for `call`, keeping its result code.
fn collective(call: &'static str) -> impl FnOnce(nccl::NcclError) -> Error {
    move |e| {
        tensormem_nccl::Error::Collective {
            call,
            code: e.0 as i32,
        }
        .into()
    }
}

/// Whether `error` is a refusal every rank met alike, after which the communicator is in step.
fn agreed(error: &tensormem_nccl::Error) -> bool {
    use tensormem_nccl::Error as E;
    matches!(
        error,
        E::Layout { .. } | E::LayoutRejected { .. } | E::BucketSize { .. }
    )
}

/// Succeeds once NCCL's library loads; cudarc's loader would panic on the first call otherwise.
fn nccl_loaded() -> Result<()> {
    static FOUND: AtomicBool = AtomicBool::new(false);
    if FOUND.load(Ordering::Relaxed) {
        return Ok(());
    }
    // SAFETY: only opens (and closes) the library under cudarc's names; calls nothing in it.
    if unsafe { nccl_sys::is_culib_present() } {
        FOUND.store(true, Ordering::Relaxed);
        Ok(())
    } else {
        Err(Error::NcclNotFound)
    }
}

fn id_length(len: usize) -> Result<()> {
    if len == UNIQUE_ID_BYTES {
        return Ok(());
    }
    Err(Error::InvalidWeightsArgument(format!(
        "an NCCL unique id is {UNIQUE_ID_BYTES} bytes, not {len}: pass the bytes \
         tensormem_nccl_unique_id wrote, unchanged"
    )))
}

/// The ranks as NCCL takes them, and the sender as the sync does.
fn ranks(rank: c_int, world_size: c_int, src: c_int) -> Result<(c_int, c_int, usize)> {
    let bad = |what: String| Err(Error::InvalidWeightsArgument(what));
    if world_size < 1 {
        return bad(format!(
            "world_size is {world_size}: pass the number of processes taking part, at least 1"
        ));
    }
    let last = world_size - 1;
    if !(0..world_size).contains(&rank) {
        return bad(format!(
            "rank {rank} is not a rank of a world of {world_size}: pass 0 to {last}, another on \
             every process"
        ));
    }
    if !(0..world_size).contains(&src) {
        return bad(format!(
            "src {src} (the sending rank) is not a rank of a world of {world_size}: pass 0 to \
             {last}, the same on every process"
        ));
    }
    Ok((rank, world_size, src as usize))
}

/// The tensors the parallel arrays describe (see the module's docs).
///
/// # Safety
///
/// Unless `count` is 0: `names`, `ptrs`, `sizes` and `metas` are valid for `count` reads, and
/// each name and metadata string is NUL-terminated.
unsafe fn described(
    count: usize,
    names: *const *const c_char,
    ptrs: *const u64,
    sizes: *const u64,
    metas: *const *const c_char,
) -> Result<Vec<LocalTensor>> {
    // SAFETY: each array is valid for `count` reads (the caller's obligation).
    let (names, ptrs, sizes, metas) = unsafe {
        (
            items(names, count, "names")?,
            items(ptrs, count, "ptrs")?,
            items(sizes, count, "sizes")?,
            items(metas, count, "metas")?,
        )
    };
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: NUL-terminated strings (the caller's obligation).
        let (name, meta) = unsafe { (text(names[i], "names", i)?, text(metas[i], "metas", i)?) };
        if ptrs[i] == 0 && sizes[i] > 0 {
            return Err(Error::InvalidWeightsArgument(format!(
                "ptrs[{i}] (tensor {name:?}) is null for {} bytes: pass the address of the \
                 tensor's first byte (data_ptr())",
                sizes[i]
            )));
        }
        out.push(LocalTensor {
            name: name.to_owned(),
            ptr: DeviceAddress(ptrs[i]),
            bytes: sizes[i],
            meta: meta.to_owned(),
        });
    }
    // Refused here, before this rank joins, rather than after the others wait for it.
    WeightLayout::of(&out)?;
    Ok(out)
}

/// Checks that work on `stream` can be ordered before the sync's: a stream of `device`'s context.
///
/// # Safety
///
/// `stream` is null, `0x1` (legacy), `0x2` (per-thread) or a live stream handle.
unsafe fn check_stream(device: &CudaBackend, stream: sys::CUstream) -> Result<()> {
    if (stream as u64) <= 2 {
        // The default streams of the current context, which is `device`'s (made current first).
        return Ok(());
    }
    let mut ctx = std::ptr::null_mut();
    // SAFETY: a live stream handle (the caller's obligation); `ctx` is a valid out-parameter.
    check("cuStreamGetCtx", unsafe {
        sys::cuStreamGetCtx(stream, &mut ctx)
    })?;
    if ctx != device.cudarc_context().cu_ctx() {
        return Err(Error::ForeignStream {
            stream: stream as u64,
            device: device.ordinal(),
        });
    }
    Ok(())
}

/// Writes a new NCCL unique id (`ncclGetUniqueId`), [`TM_NCCL_UNIQUE_ID_BYTES`] bytes, to `out`.
///
/// The sending rank makes it and sends its bytes to every other rank, which pass them to
/// [`tensormem_nccl_weights_open`]. It names a rendezvous at this process's address (NCCL's
/// bootstrap listens on the interface `NCCL_SOCKET_IFNAME` names), so make it on a rank that
/// takes part. Needs NCCL, not a GPU.
///
/// # Safety
///
/// `out` is valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn tensormem_nccl_unique_id(out: *mut u8, len: usize) -> c_int {
    status("tensormem_nccl_unique_id", || {
        if out.is_null() {
            return Err(Error::NullArgument { what: "out" });
        }
        id_length(len)?;
        nccl_loaded()?;
        let id = nccl::get_uniqueid().map_err(collective("ncclGetUniqueId"))?;
        for (i, &byte) in id.internal.iter().enumerate() {
            // SAFETY: `i < UNIQUE_ID_BYTES == len`, and `out` is valid for `len` writes.
            unsafe { out.add(i).write(byte as u8) };
        }
        Ok(())
    })
}

/// Connects this rank's end of a weight sync and writes its handle to `*out` (null on failure):
/// a communicator of `world_size` ranks from the sending rank's `unique_id` (`ncclCommInitRank`,
/// as rank `rank`, on device `device`), two staging buffers of `bucket_bytes` from
/// `ncclMemAlloc` registered with it, and the layout exchange: rank `src`'s `count` tensors (the
/// parallel arrays of the module's docs) are the layout, every other rank matches its own tensors
/// to it by name. Returns once every rank has done so.
///
/// Every rank calls it with the same `unique_id`, `world_size`, `src` and `bucket_bytes` (at
/// least 1 MiB; 256 MiB is the Rust API's default). `timeout_ms`: how long this rank waits for
/// the collectives of one exchange before it gives the other ranks up (a rank that died or
/// stopped syncing) with an error, after which the sync is broken and its communicator aborted
/// when closed; 0 for the default, ten minutes. Refused before NCCL is touched: a null
/// pointer, a unique id of another length, a rank or `src` outside the world, a bucket size
/// below 1 MiB, a name given twice, a null address with bytes. Refused on every rank alike once
/// the layouts were compared: a tensor missing on a rank, one the sender does not send, another
/// size or metadata, another bucket size (the message on the rank that differs names each
/// difference; the others say another rank refused). Nothing of the tensors is read or written
/// here.
///
/// # Safety
///
/// `unique_id` is valid for `unique_id_len` reads; the arrays are as the module's docs say;
/// `out` is valid for a write. Each tensor is device memory of this process on `device`, `sizes`
/// bytes from its address, and stays allocated until the sync is closed.
#[no_mangle]
pub unsafe extern "C" fn tensormem_nccl_weights_open(
    device: c_int,
    unique_id: *const u8,
    unique_id_len: usize,
    rank: c_int,
    world_size: c_int,
    src: c_int,
    count: usize,
    names: *const *const c_char,
    ptrs: *const u64,
    sizes: *const u64,
    metas: *const *const c_char,
    bucket_bytes: usize,
    timeout_ms: u64,
    out: *mut *mut c_void,
) -> c_int {
    status("tensormem_nccl_weights_open", || {
        // SAFETY: valid for a write (the caller's obligation); null is refused.
        unsafe { put(out, std::ptr::null_mut(), "out")? };
        let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
        id_length(unique_id_len)?;
        // SAFETY: valid for `unique_id_len` reads (the caller's obligation); null is refused.
        let id_bytes = unsafe { items(unique_id, unique_id_len, "unique_id")? };
        let (rank, world_size, root) = ranks(rank, world_size, src)?;
        if bucket_bytes < MIN_BUCKET_BYTES {
            return Err(tensormem_nccl::Error::BucketTooSmall {
                bytes: bucket_bytes,
                min: MIN_BUCKET_BYTES,
            }
            .into());
        }
        // SAFETY: the arrays are as documented (the caller's obligation).
        let tensors = unsafe { described(count, names, ptrs, sizes, metas)? };
        nccl_loaded()?;
        let mut id = nccl_sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        for (to, &from) in id.internal.iter_mut().zip(id_bytes) {
            *to = from as c_char;
        }
        let backend = CudaBackend::new(ordinal)?;
        let stream = backend.create_stream()?;
        let ready = Device::create_event(&backend)?;
        backend.make_current()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-parameter; the device's context is current, where NCCL
        // makes the communicator.
        unsafe { nccl::comm_init_rank(&mut raw, world_size, id, rank) }
            .map_err(collective("ncclCommInitRank"))?;
        let mut comm = Comm {
            raw: raw as usize,
            failed: false,
        };
        let options = SyncOptions {
            bucket_bytes,
            timeout: match timeout_ms {
                0 => DEFAULT_SYNC_TIMEOUT,
                ms => Duration::from_millis(ms),
            },
        };
        // SAFETY: `raw` is a live communicator of `stream`'s device, released (by `comm`) only
        // after the sync is dropped.
        match unsafe { weights::cuda::connect(raw, stream, root, &tensors, options) } {
            Ok(sync) => {
                let open = Open {
                    sync,
                    comm,
                    device: backend,
                    ready,
                };
                let handle = SYNCS.insert(Mutex::new(open));
                // SAFETY: checked non-null above, valid for a write.
                unsafe { out.write(handle) };
                Ok(())
            }
            Err(error) => {
                comm.failed = !agreed(&error);
                Err(error.into())
            }
        }
    })
}

/// Moves the weights once: on the sending rank, its tensors' values as written by the work
/// queued so far on `stream`; every other rank's tensors then hold them. Every rank calls it,
/// once per version, with the stream its tensors are written (the sender) or read (the others)
/// on: the sync's copies and broadcasts run on streams of its own, after the work queued on
/// `stream` so far, and the call returns once they are done (the sender may write its tensors
/// again; the others' hold the new values). Writes what it moved to `*report` unless it is null.
///
/// Each sync first checks that every rank holds the same plan (one small all-reduce); a rank
/// whose plan differs gets an error on every rank, nothing sent, and the sync may be called again.
/// After any other failure the sync is broken: later calls fail, and closing it aborts the
/// communicator.
///
/// # Safety
///
/// `stream` is null (the legacy default stream), `0x1`, `0x2` or a live stream of the sync's
/// device. The tensors given to [`tensormem_nccl_weights_open`] are still allocated, and no
/// other stream writes them (nor, on a receiving rank, reads them) until the call returns.
/// `report` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_nccl_weights_sync(
    sync: *mut c_void,
    stream: sys::CUstream,
    report: *mut NcclSyncReport,
) -> c_int {
    status("tensormem_nccl_weights_sync", || {
        let entry = SYNCS.get(sync)?;
        let mut open = locked(&entry);
        let open = &mut *open;
        open.device.make_current()?;
        // SAFETY: `stream` is a default stream or a live handle (the caller's obligation).
        unsafe { check_stream(&open.device, stream)? };
        // SAFETY: a default stream of the current context, the event's, or a live stream of it
        // (checked above).
        unsafe { open.ready.record_raw(stream)? };
        open.sync.engine().stream().wait_event(&open.ready)?;
        // SAFETY: the tensors are live and used by no other stream during the call (the caller's
        // obligation); the sync's stream runs after the caller's queued work (the event above).
        let done = match unsafe { open.sync.sync() } {
            Ok(done) => done,
            Err(error) => {
                if !matches!(error, tensormem_nccl::Error::LayoutRejected { .. }) {
                    open.comm.failed = true;
                }
                return Err(error.into());
            }
        };
        if !report.is_null() {
            // SAFETY: non-null, valid for a write (the caller's obligation).
            unsafe { report.write(done.into()) };
        }
        Ok(())
    })
}

/// Closes the sync: its staging buffers are freed and its communicator destroyed
/// (`ncclCommDestroy`; `ncclCommAbort` after a failure). Every rank closes its own. A call on the
/// sync that runs in another thread meanwhile finishes first; the handle is dead from here on.
/// Null is ignored.
#[no_mangle]
pub extern "C" fn tensormem_nccl_weights_close(sync: *mut c_void) -> c_int {
    if sync.is_null() {
        return TM_OK;
    }
    status("tensormem_nccl_weights_close", || {
        let entry = SYNCS.remove(sync)?;
        match Arc::try_unwrap(entry) {
            Ok(open) => open.into_inner().unwrap_or_else(|e| e.into_inner()).close(),
            // Another thread's call holds it: the last one out drops it (a failure is logged).
            Err(_) => Ok(()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::last_error_string;
    use std::ffi::CString;

    #[test]
    fn ranks_are_checked_against_the_world() {
        assert_eq!(ranks(1, 2, 0).unwrap(), (1, 2, 0));
        for (rank, world, src, words) in [
            (0, 0, 0, "world_size is 0"),
            (2, 2, 0, "rank 2 is not a rank of a world of 2: pass 0 to 1"),
            (-1, 2, 0, "rank -1"),
            (0, 2, 2, "src 2 (the sending rank)"),
        ] {
            let e = ranks(rank, world, src).unwrap_err().to_string();
            assert!(e.contains(words), "{e}");
        }
    }

    #[test]
    fn descriptions_refuse_duplicates_and_null_addresses() {
        let names = [CString::new("w").unwrap(), CString::new("w").unwrap()];
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        let meta = CString::new("float32[4]").unwrap();
        let metas = [meta.as_ptr(), meta.as_ptr()];
        let describe = |ptrs: [u64; 2], sizes: [u64; 2]| {
            // SAFETY: every array holds two entries; the strings live until the end.
            unsafe {
                described(
                    2,
                    name_ptrs.as_ptr(),
                    ptrs.as_ptr(),
                    sizes.as_ptr(),
                    metas.as_ptr(),
                )
            }
        };
        let e = describe([0x1000, 0x2000], [16, 16]).unwrap_err();
        assert!(e.to_string().contains("two tensors are named \"w\""), "{e}");
        let e = describe([0, 0x2000], [16, 16]).unwrap_err();
        assert!(e.to_string().contains("ptrs[0]"), "{e}");
    }

    #[test]
    fn a_stale_handle_is_an_error_naming_it() {
        let bogus = 0x5eed_usize as *mut c_void;
        // SAFETY: the handle is refused before the stream or the report is used.
        let rc = unsafe {
            tensormem_nccl_weights_sync(bogus, std::ptr::null_mut(), std::ptr::null_mut())
        };
        assert_eq!(rc, crate::native::TM_ERROR);
        let e = last_error_string().unwrap();
        assert!(e.contains("not a live NCCL weight sync handle"), "{e}");
        assert!(e.contains("tensormem_nccl_weights_open"), "{e}");
    }
}
