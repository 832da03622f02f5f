//! A model's weights from a producer process into a consumer process's own tensors, version after
//! version, for C callers and `tensormem_torch.weights`: the C face of
//! [`tensormem::ipc::weights`] (read its docs for the protocol).
//!
//! | side | calls |
//! | --- | --- |
//! | producer | [`tensormem_weights_publish`] once, [`tensormem_weights_message`] per consumer, then per version [`tensormem_weights_announce`] and [`tensormem_weights_wait_installed`]; [`tensormem_weights_holders`]; [`tensormem_weights_release`] or [`tensormem_weights_drop_publisher`] at the end |
//! | consumer | [`tensormem_weights_open`] with the message's bytes, [`tensormem_weights_sources`] (the producer's tensors mapped here), [`tensormem_weights_prepare`] once per layout of its own tensors, then per version [`tensormem_weights_install`] (batched copies, the stream synchronized), or [`tensormem_weights_begin`] ... its own copies ... [`tensormem_weights_finish`]; [`tensormem_weights_close_subscription`] at the end |
//!
//! Tensors are described by parallel arrays: a name (UTF-8, NUL-terminated), the address of the
//! first element (PyTorch's `data_ptr()`), the element type by PyTorch's name (`"bfloat16"` for
//! `torch.bfloat16`), the number of dimensions, and the sizes and strides (in elements) of all
//! tensors one after another.
//!
//! Publishers and subscriptions are opaque handles: numbers handed out once, never reused, and
//! looked up in the process's table of live ones on every call, so that a handle released or
//! dropped before (or one of the other kind) is an error naming it, never a use of freed memory.
//! A handle may be used from several threads; calls on one subscription take turns.
//!
//! Each function returns [`TM_OK`], [`TM_WEIGHTS_TIMED_OUT`] (a wait ran out of time; nothing
//! changed, wait again), [`TM_WEIGHTS_CLOSED`] (the producer closed the publication or exited),
//! [`TM_OUT_OF_MEMORY`] or [`TM_ERROR`]; the message is the thread's
//! [`tensormem_last_error`](crate::tensormem_last_error). A timeout in milliseconds below 0 waits
//! without limit.
//!
//! Neither side needs tensormem to be PyTorch's allocator: a producer on PyTorch's own caching
//! allocator publishes its tensors as well, with or without expandable segments (memory of
//! `cuMemAlloc` by its memory handles, memory of `cuMemCreate` by its chunks' file descriptors, see
//! [`WeightPublisher::new`]), and a consumer's destinations may be any device memory of its own.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use cudarc::driver::sys;
use tensormem::ipc::driver::cuda::CudaIpcDriver;
use tensormem::ipc::weights::{
    DType, PlacedTensor, PlanOptions, PublishedTensor, TensorMeta, WeightPublisher,
    WeightSubscriber, WeightsMessage, MAX_DIMS,
};
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::{DeviceAddress, StreamId};

use crate::args::{items, put, text};
use crate::boundary::call;
use crate::error::{Error, Result};
use crate::handles::{locked, Table};
use crate::status::{TM_ERROR, TM_OK, TM_OUT_OF_MEMORY};

/// A wait ran out of time (the producer's [`tensormem_weights_wait_installed`] or
/// [`tensormem_weights_release`], a consumer's [`tensormem_weights_begin`] or
/// [`tensormem_weights_install`]); nothing was changed by it: wait again, or close.
pub const TM_WEIGHTS_TIMED_OUT: c_int = 3;
/// The publication is closed: its producer closed it or exited (a consumer's wait), or the
/// publisher was closed (a new message). No new version will come.
pub const TM_WEIGHTS_CLOSED: c_int = 4;

type Publisher = WeightPublisher<CudaBackend, CudaIpcDriver>;
type Subscriber = WeightSubscriber<CudaIpcDriver>;

/// A live publisher.
struct PublisherEntry {
    /// Written only to close it ([`tensormem_weights_release`]); every other call reads.
    publisher: RwLock<Publisher>,
    /// The encoded message of the last consumer slot taken, until a call wrote it out (so that a
    /// call that only measures does not give a slot away).
    pending: Mutex<Option<Vec<u8>>>,
}

static PUBLISHERS: Table<PublisherEntry> =
    Table::new("weights publisher", "tensormem_weights_publish");
/// Subscriptions; a C plan id is the subscriber's own plan number ([`PlanId::index`](tensormem::ipc::weights::PlanId::index)).
static SUBSCRIPTIONS: Table<Mutex<Subscriber>> =
    Table::new("weights subscription", "tensormem_weights_open");

/// Runs `body` at the C boundary: [`TM_OK`], or the code of its error (see the module's docs).
fn status(name: &'static str, body: impl FnOnce() -> Result<()>) -> c_int {
    let mut code = TM_ERROR;
    let ok = call(name, false, || match body() {
        Ok(()) => Ok(true),
        Err(error) => {
            code = code_of(&error);
            Err(error)
        }
    });
    if ok {
        TM_OK
    } else {
        code
    }
}

fn code_of(error: &Error) -> c_int {
    use tensormem::ipc::Error as IpcError;
    match error {
        Error::Ipc(IpcError::WeightsTimedOut { .. }) => TM_WEIGHTS_TIMED_OUT,
        Error::Ipc(IpcError::PublicationClosed { .. }) => TM_WEIGHTS_CLOSED,
        e if e.is_out_of_memory() => TM_OUT_OF_MEMORY,
        _ => TM_ERROR,
    }
}

/// A timeout in milliseconds; below 0, none.
fn timeout(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

fn runtime_error(err: tensormem_runtime::Error) -> Error {
    tensormem::cuda::Error::from(err).into()
}

fn stream_id(stream: sys::CUstream) -> StreamId {
    StreamId(stream as u64)
}

/// The tensors the parallel arrays describe (see the module's docs).
///
/// # Safety
///
/// Unless `count` is 0: `names`, `ptrs`, `dtypes` and `ndims` are valid for `count` reads, each
/// name and type name is a NUL-terminated string, and `shapes` and `strides` are valid for as many
/// reads as `ndims` adds up to.
#[allow(clippy::too_many_arguments)]
unsafe fn described(
    count: usize,
    names: *const *const c_char,
    ptrs: *const u64,
    dtypes: *const *const c_char,
    ndims: *const u64,
    shapes: *const u64,
    strides: *const u64,
) -> Result<Vec<PublishedTensor>> {
    // SAFETY: each array is valid for `count` reads (the caller's obligation).
    let (names, ptrs, dtypes, ndims) = unsafe {
        (
            items(names, count, "names")?,
            items(ptrs, count, "ptrs")?,
            items(dtypes, count, "dtypes")?,
            items(ndims, count, "ndims")?,
        )
    };
    let mut total = 0usize;
    for (i, &n) in ndims.iter().enumerate() {
        if n > MAX_DIMS as u64 {
            return Err(Error::InvalidWeightsArgument(format!(
                "ndims[{i}] is {n}: a tensor has at most {MAX_DIMS} dimensions"
            )));
        }
        total += n as usize;
    }
    // SAFETY: valid for as many reads as the dimensions add up to (the caller's obligation).
    let (shapes, strides) = unsafe {
        (
            items(shapes, total, "shapes")?,
            items(strides, total, "strides")?,
        )
    };
    let mut out = Vec::with_capacity(count);
    let mut at = 0usize;
    for i in 0..count {
        // SAFETY: NUL-terminated strings (the caller's obligation).
        let (name, dtype) = unsafe { (text(names[i], "names", i)?, text(dtypes[i], "dtypes", i)?) };
        let dtype = DType::from_name(dtype).ok_or_else(|| Error::UnknownDType {
            name: dtype.to_owned(),
            tensor: name.to_owned(),
        })?;
        let n = ndims[i] as usize;
        out.push(PublishedTensor {
            name: name.to_owned(),
            ptr: DeviceAddress(ptrs[i]),
            meta: TensorMeta {
                dtype,
                shape: shapes[at..at + n].to_vec(),
                strides: strides[at..at + n].to_vec(),
            },
        });
        at += n;
    }
    Ok(out)
}

// ---- the producer ----

/// Publishes `count` tensors of `device` (see the module's docs for the arrays) and writes the
/// publisher's handle to `*out` (null on failure). No version is announced yet.
///
/// The tensors' memory may be of `cuMemAlloc` or of expandable segments (`cuMemCreate` chunks made
/// exportable as file descriptors, as PyTorch's and tensormem's caching allocators make them); the
/// publication refuses other memory, naming what the driver answered (see [`WeightPublisher::new`]).
///
/// # Safety
///
/// The arrays are as the module's docs say; each tensor's bytes are device memory of this process
/// on `device` and stay allocated until the publisher is released
/// ([`tensormem_weights_release`] succeeded) or, if it is dropped instead, until no consumer holds
/// it. `out` is valid for a write of one pointer.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_publish(
    device: c_int,
    count: usize,
    names: *const *const c_char,
    ptrs: *const u64,
    dtypes: *const *const c_char,
    ndims: *const u64,
    shapes: *const u64,
    strides: *const u64,
    out: *mut *mut c_void,
) -> c_int {
    status("tensormem_weights_publish", || {
        // SAFETY: valid for a write (the caller's obligation); null is refused.
        unsafe { put(out, std::ptr::null_mut(), "out")? };
        let ordinal = u32::try_from(device).map_err(|_| Error::InvalidDevice { device })?;
        // SAFETY: the arrays are as documented (the caller's obligation).
        let tensors = unsafe { described(count, names, ptrs, dtypes, ndims, shapes, strides)? };
        let producer = tensormem_runtime::producer().map_err(runtime_error)?;
        // SAFETY: the tensors are memory of this process on `device` that stays allocated while
        // published (the caller's obligation).
        let publisher = unsafe { WeightPublisher::new(producer, ordinal, &tensors)? };
        let handle = PUBLISHERS.insert(PublisherEntry {
            publisher: RwLock::new(publisher),
            pending: Mutex::new(None),
        });
        // SAFETY: checked non-null above, valid for a write.
        unsafe { out.write(handle) };
        Ok(())
    })
}

/// Writes the message for one more consumer (its bytes, which the consumer passes to
/// [`tensormem_weights_open`]) to `out` if it fits in `capacity` bytes, and its length to `*len`
/// either way, as `snprintf` does. Each message written holds a consumer slot of its own: a call
/// whose buffer is too small keeps the message it made for the next call, which writes that one.
///
/// # Safety
///
/// `out` is valid for writes of `capacity` bytes (null when `capacity` is 0); `len` for a write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_message(
    publisher: *mut c_void,
    out: *mut u8,
    capacity: usize,
    len: *mut usize,
) -> c_int {
    status("tensormem_weights_message", || {
        if len.is_null() || (out.is_null() && capacity > 0) {
            return Err(Error::NullArgument { what: "out or len" });
        }
        let entry = PUBLISHERS.get(publisher)?;
        let mut pending = locked(&entry.pending);
        let bytes = match pending.take() {
            Some(bytes) => bytes,
            None => read(&entry.publisher).message()?.encode(),
        };
        // SAFETY: non-null (checked above), valid for a write (the caller's obligation).
        unsafe { len.write(bytes.len()) };
        if bytes.len() <= capacity && !out.is_null() {
            // SAFETY: `out` is valid for `capacity >= bytes.len()` bytes (the caller's
            // obligation) and cannot overlap the vector.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, bytes.len()) };
        } else {
            *pending = Some(bytes);
        }
        Ok(())
    })
}

fn read(lock: &RwLock<Publisher>) -> std::sync::RwLockReadGuard<'_, Publisher> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

/// Announces a new version of the weights, written by the work queued on `stream` so far (the
/// publication's event is recorded there), and writes its number (1, 2, ...) to `*version`.
/// Write the weights again only after [`tensormem_weights_wait_installed`] for it.
///
/// # Safety
///
/// `stream` is a live stream of the publication's device (or null, the legacy default stream);
/// `version` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_announce(
    publisher: *mut c_void,
    stream: sys::CUstream,
    version: *mut u64,
) -> c_int {
    status("tensormem_weights_announce", || {
        if version.is_null() {
            return Err(Error::NullArgument { what: "version" });
        }
        let entry = PUBLISHERS.get(publisher)?;
        let v = read(&entry.publisher).publish(stream_id(stream))?;
        // SAFETY: non-null (checked above), valid for a write (the caller's obligation).
        unsafe { version.write(v) };
        Ok(())
    })
}

/// Waits until every subscribed consumer installed `version` (consumers that died are skipped), at
/// most `timeout_ms` milliseconds (below 0: no limit); [`TM_WEIGHTS_TIMED_OUT`] after that.
#[no_mangle]
pub extern "C" fn tensormem_weights_wait_installed(
    publisher: *mut c_void,
    version: u64,
    timeout_ms: i64,
) -> c_int {
    status("tensormem_weights_wait_installed", || {
        let entry = PUBLISHERS.get(publisher)?;
        let publisher = read(&entry.publisher);
        Ok(publisher.wait_installed(version, timeout(timeout_ms))?)
    })
}

/// Writes to `*count` how many consumers hold the publication's memory now (consumers that died
/// are not counted: their holds are reclaimed here).
///
/// # Safety
///
/// `count` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_holders(
    publisher: *mut c_void,
    count: *mut usize,
) -> c_int {
    status("tensormem_weights_holders", || {
        let entry = PUBLISHERS.get(publisher)?;
        let holders = read(&entry.publisher).holders();
        // SAFETY: valid for a write (the caller's obligation); null is refused.
        unsafe { put(count, holders, "count") }
    })
}

/// Closes the publication (consumers' waits end with [`TM_WEIGHTS_CLOSED`], no new message is
/// made) and waits until no consumer holds its memory, at most `timeout_ms` milliseconds (below 0:
/// no limit). Then the handle is freed and the tensors' memory may be freed. After
/// [`TM_WEIGHTS_TIMED_OUT`] the publication stays closed and the handle live: call again, or drop
/// it.
#[no_mangle]
pub extern "C" fn tensormem_weights_release(publisher: *mut c_void, timeout_ms: i64) -> c_int {
    status("tensormem_weights_release", || {
        let entry = PUBLISHERS.get(publisher)?;
        entry
            .publisher
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .wait_released(timeout(timeout_ms))?;
        // Another thread may have dropped or released it meanwhile: that is no error here.
        let _ = PUBLISHERS.remove(publisher);
        Ok(())
    })
}

/// Drops the publisher without waiting: the publication is closed, and consumers still subscribed
/// keep the memory mapped (a warning says how many); free the tensors only after they let go.
/// Null is ignored.
#[no_mangle]
pub extern "C" fn tensormem_weights_drop_publisher(publisher: *mut c_void) -> c_int {
    if publisher.is_null() {
        return TM_OK;
    }
    status("tensormem_weights_drop_publisher", || {
        PUBLISHERS.remove(publisher).map(drop)
    })
}

// ---- the consumer ----

/// Opens the publication whose message (from [`tensormem_weights_message`], `len` bytes at
/// `bytes`) this process received: maps the producer's memory, joins its version channel, and
/// writes the subscription's handle to `*out` (null on failure). `stream` is where this process
/// uses the memory; it is synchronized before the subscription lets go.
///
/// # Safety
///
/// `bytes` is valid for reads of `len` bytes; `stream` is a live stream of the publication's
/// device (or null) that outlives the subscription; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_open(
    bytes: *const u8,
    len: usize,
    stream: sys::CUstream,
    out: *mut *mut c_void,
) -> c_int {
    status("tensormem_weights_open", || {
        // SAFETY: valid for a write (the caller's obligation); null is refused.
        unsafe { put(out, std::ptr::null_mut(), "out")? };
        if bytes.is_null() {
            return Err(Error::NullArgument { what: "bytes" });
        }
        // SAFETY: non-null, valid for `len` reads (the caller's obligation).
        let message = WeightsMessage::decode(unsafe { std::slice::from_raw_parts(bytes, len) })?;
        let consumer = tensormem_runtime::consumer().map_err(runtime_error)?;
        let subscriber = WeightSubscriber::open(consumer, &message, stream_id(stream))?;
        let handle = SUBSCRIPTIONS.insert(Mutex::new(subscriber));
        // SAFETY: checked non-null above, valid for a write.
        unsafe { out.write(handle) };
        Ok(())
    })
}

/// Writes to `*count` how many tensors the publication has and, if they fit in `capacity`, the
/// address here of each one's first element to `ptrs`, in the order of the message (the
/// producer's order). They alias the producer's memory: read them only between
/// [`tensormem_weights_begin`] and [`tensormem_weights_finish`]. Tensors without bytes give 0.
///
/// # Safety
///
/// `ptrs` is valid for writes of `capacity` values (null when `capacity` is 0); `count` for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_sources(
    subscription: *mut c_void,
    capacity: usize,
    ptrs: *mut u64,
    count: *mut usize,
) -> c_int {
    status("tensormem_weights_sources", || {
        if count.is_null() || (ptrs.is_null() && capacity > 0) {
            return Err(Error::NullArgument {
                what: "ptrs or count",
            });
        }
        let entry = SUBSCRIPTIONS.get(subscription)?;
        let entry = locked(&entry);
        let tensors = entry.tensors();
        let n = tensors.len();
        // SAFETY: non-null (checked above), valid for a write (the caller's obligation).
        unsafe { count.write(n) };
        if n <= capacity && !ptrs.is_null() {
            for (i, t) in tensors.enumerate() {
                // SAFETY: `i < n <= capacity`, and `ptrs` is valid for `capacity` writes.
                unsafe { ptrs.add(i).write(t.ptr.0) };
            }
        }
        Ok(())
    })
}

/// Checks this process's tensors (the destinations, described as the module's docs say) against
/// the published ones by name, element type, shape and strides, and plans the copies of an
/// install: writes the plan's id to `*plan` and the number of copies it makes to `*copies`
/// (adjacent tensors merge). Preparing the same destinations again gives the same plan at once.
///
/// Every mismatch is an error naming the tensors, before anything is written: a destination that
/// was not published, a published tensor without destination (unless `allow_unused` is nonzero),
/// another element type, shape or strides, a tensor whose elements do not fill their bytes once
/// (a strided slice), a name given twice, destinations that overlap.
///
/// # Safety
///
/// The arrays are as the module's docs say; `plan` and `copies` are valid for a write each.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_prepare(
    subscription: *mut c_void,
    count: usize,
    names: *const *const c_char,
    ptrs: *const u64,
    dtypes: *const *const c_char,
    ndims: *const u64,
    shapes: *const u64,
    strides: *const u64,
    allow_unused: c_int,
    plan: *mut u64,
    copies: *mut usize,
) -> c_int {
    status("tensormem_weights_prepare", || {
        if plan.is_null() || copies.is_null() {
            return Err(Error::NullArgument {
                what: "plan or copies",
            });
        }
        // SAFETY: the arrays are as documented (the caller's obligation).
        let tensors = unsafe { described(count, names, ptrs, dtypes, ndims, shapes, strides)? };
        let destinations: Vec<PlacedTensor<'_>> = tensors
            .iter()
            .map(|t| PlacedTensor {
                name: &t.name,
                ptr: t.ptr,
                meta: &t.meta,
            })
            .collect();
        let options = PlanOptions {
            allow_unused_sources: allow_unused != 0,
        };
        let entry = SUBSCRIPTIONS.get(subscription)?;
        let mut subscriber = locked(&entry);
        let id = subscriber.prepare(&destinations, options)?;
        let n = subscriber.plan(id).copies().len();
        // SAFETY: non-null (checked above), valid for a write each (the caller's obligation).
        unsafe {
            plan.write(id.index() as u64);
            copies.write(n);
        }
        Ok(())
    })
}

/// One whole install: waits for a version newer than the last installed (at most `timeout_ms`
/// milliseconds; below 0 no limit), queues plan `plan`'s copies on `stream` in as few launches as
/// the driver allows (`cuMemcpyBatchAsync` where it has it), synchronizes `stream`, records the
/// version installed and writes it to `*version`.
///
/// # Safety
///
/// The destinations `plan` was prepared for are device memory of this process on `stream`'s
/// device, still allocated and not used by other work while the copies run; `stream` is a live
/// stream of the publication's device or of another device of this process (parameters on another
/// GPU: that device is given peer access to the publication's, and the copies run there), or null;
/// `version` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_install(
    subscription: *mut c_void,
    plan: u64,
    stream: sys::CUstream,
    timeout_ms: i64,
    version: *mut u64,
) -> c_int {
    status("tensormem_weights_install", || {
        if version.is_null() {
            return Err(Error::NullArgument { what: "version" });
        }
        let entry = SUBSCRIPTIONS.get(subscription)?;
        let mut subscriber = locked(&entry);
        let id = usize::try_from(plan)
            .ok()
            .and_then(|i| subscriber.plan_id(i))
            .ok_or(Error::UnknownPlan {
                plan,
                plans: subscriber.plan_count(),
            })?;
        // SAFETY: the destinations are live device memory of this process, idle during the copies
        // (the caller's obligation); the plan was prepared for them on this subscription.
        let v = unsafe { subscriber.install(id, stream_id(stream), timeout(timeout_ms))? };
        // SAFETY: non-null (checked above), valid for a write (the caller's obligation).
        unsafe { version.write(v) };
        Ok(())
    })
}

/// Waits for a version newer than the last installed (at most `timeout_ms` milliseconds; below 0
/// no limit), orders `stream` after the producer's writes of it (no host wait), and writes it to
/// `*version`. Copy from [`tensormem_weights_sources`]' tensors on `stream`, wait for the copies,
/// then call [`tensormem_weights_finish`] with the version.
///
/// # Safety
///
/// `stream` is a live stream of the publication's device (or null) that outlives the
/// subscription; `version` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn tensormem_weights_begin(
    subscription: *mut c_void,
    stream: sys::CUstream,
    timeout_ms: i64,
    version: *mut u64,
) -> c_int {
    status("tensormem_weights_begin", || {
        if version.is_null() {
            return Err(Error::NullArgument { what: "version" });
        }
        let entry = SUBSCRIPTIONS.get(subscription)?;
        let v = locked(&entry).begin(stream_id(stream), timeout(timeout_ms))?;
        // SAFETY: non-null (checked above), valid for a write (the caller's obligation).
        unsafe { version.write(v) };
        Ok(())
    })
}

/// Records that `version` (from [`tensormem_weights_begin`]) is installed: the copies that read it
/// have completed, and the producer may write the weights again.
#[no_mangle]
pub extern "C" fn tensormem_weights_finish(subscription: *mut c_void, version: u64) -> c_int {
    status("tensormem_weights_finish", || {
        let entry = SUBSCRIPTIONS.get(subscription)?;
        locked(&entry).finish(version);
        Ok(())
    })
}

/// Closes the subscription: the streams it was used on are synchronized, the producer's memory is
/// unmapped here (once no other subscription of this process maps it) and the producer's hold is
/// given back. Null is ignored.
#[no_mangle]
pub extern "C" fn tensormem_weights_close_subscription(subscription: *mut c_void) -> c_int {
    if subscription.is_null() {
        return TM_OK;
    }
    status("tensormem_weights_close_subscription", || {
        SUBSCRIPTIONS.remove(subscription).map(drop)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::last_error_string;
    use std::ffi::CString;

    #[test]
    fn stale_and_foreign_handles_are_errors_naming_them() {
        let bogus = 0xdead_beef_usize as *mut c_void;
        assert_eq!(tensormem_weights_wait_installed(bogus, 1, 0), TM_ERROR);
        let e = last_error_string().unwrap();
        assert!(e.contains("not a live weights publisher"), "{e}");
        assert_eq!(tensormem_weights_finish(bogus, 1), TM_ERROR);
        assert!(last_error_string()
            .unwrap()
            .contains("weights subscription"));
        assert_eq!(
            tensormem_weights_drop_publisher(std::ptr::null_mut()),
            TM_OK
        );
        assert_eq!(tensormem_weights_close_subscription(bogus), TM_ERROR);
        assert_eq!(
            (timeout(-1), timeout(1500)),
            (None, Some(Duration::from_millis(1500)))
        );
    }

    #[test]
    fn descriptions_are_checked_before_anything_is_published() {
        let names = [CString::new("w").unwrap(), CString::new("b").unwrap()];
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        let types = [
            CString::new("bfloat16").unwrap(),
            CString::new("torch.float").unwrap(),
        ];
        let mut type_ptrs: Vec<*const c_char> = types.iter().map(|n| n.as_ptr()).collect();
        let ptrs = [0x1000u64, 0x2000];
        let ndims = [2u64, 1];
        let shapes = [4u64, 3, 7];
        let strides = [1u64, 4, 1];
        let describe = |types: &[*const c_char]| {
            // SAFETY: every array holds what the counts say.
            unsafe {
                described(
                    2,
                    name_ptrs.as_ptr(),
                    ptrs.as_ptr(),
                    types.as_ptr(),
                    ndims.as_ptr(),
                    shapes.as_ptr(),
                    strides.as_ptr(),
                )
            }
        };
        let ok = describe(&type_ptrs).unwrap();
        assert_eq!(ok[0].meta.shape, [4, 3]);
        assert_eq!(ok[0].meta.strides, [1, 4]);
        assert_eq!(ok[1].meta.dtype, DType::Float32);
        assert_eq!(ok[1].ptr, DeviceAddress(0x2000));
        let complex = CString::new("complex64").unwrap();
        type_ptrs[1] = complex.as_ptr();
        let err = describe(&type_ptrs).unwrap_err().to_string();
        assert!(err.contains("complex64") && err.contains("\"b\""), "{err}");

        let mut out = std::ptr::null_mut();
        let too_deep = [65u64];
        // SAFETY: the arrays hold one tensor's worth; the dimension count is refused before the
        // shapes are read.
        let rc = unsafe {
            tensormem_weights_publish(
                0,
                1,
                name_ptrs.as_ptr(),
                ptrs.as_ptr(),
                type_ptrs.as_ptr(),
                too_deep.as_ptr(),
                shapes.as_ptr(),
                strides.as_ptr(),
                &mut out,
            )
        };
        assert_eq!(rc, TM_ERROR);
        assert!(out.is_null());
        assert!(last_error_string()
            .unwrap()
            .contains("at most 64 dimensions"));
    }

    #[test]
    fn garbage_is_not_opened() {
        let mut out = std::ptr::null_mut();
        let bytes = b"not a weights message";
        // SAFETY: `bytes` holds `len` bytes; null stream.
        let rc = unsafe {
            tensormem_weights_open(bytes.as_ptr(), bytes.len(), std::ptr::null_mut(), &mut out)
        };
        assert_eq!(rc, TM_ERROR);
        assert!(out.is_null());
        let e = last_error_string().unwrap();
        assert!(e.contains("malformed weights message"), "{e}");
    }
}
