//! Callbacks into the C++ layer: PyTorch's allocator trace trackers (`attachAllocatorTraceTracker`,
//! which `ProcessGroupNCCL` uses to register segments with NCCL), out-of-memory observers
//! (`attachOutOfMemoryObserver`), and PyTorch's free-memory callbacks (`FreeCudaMemoryCallbacksRegistry`,
//! which collects memory other processes no longer use through CUDA IPC) run before an out-of-memory
//! error, as PyTorch's allocator runs them.
//!
//! The C++ layer registers one function of each kind, which fans out to PyTorch's list. They are
//! attached to every caching allocator the process opens, whoever opens it (from the plugin's first
//! use of a device on, the runtime tells it of each), and to those opened already when they are set.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, Once};

use tensormem_cuda_alloc::oom::OomEvent;
use tensormem_cuda_alloc::snapshot::{TraceAction, TraceEntry};

use tensormem::cuda::{self, AsyncUnsupported};

use super::{status, TM_OK};
use crate::devices::Allocator;

/// One trace entry as the C++ layer turns it into PyTorch's `TraceEntry`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchTraceEntry {
    /// PyTorch's `TraceEntry::Action`: 0 alloc, 1 free requested, 2 free completed, 3 segment alloc,
    /// 4 segment free, 5 segment map, 6 segment unmap, 7 snapshot, 8 out of memory.
    pub action: c_int,
    /// The device ordinal.
    pub device: c_int,
    /// The address (for an out-of-memory entry, the device's free bytes).
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// The stream, as PyTorch's raw handle.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// The memory pool of the block or segment (PyTorch's `TraceEntry::mempool_`), first half:
    /// `(0, 0)` for the default pools and for entries that name no pool.
    pub pool_first: u64,
    /// The memory pool's second half.
    pub pool_second: u64,
}

impl TorchTraceEntry {
    /// The entry as PyTorch has it, or `None` for entries PyTorch's trace has no action for (user
    /// annotations, which PyTorch keeps apart).
    pub(crate) fn from_entry(device: u32, entry: &TraceEntry) -> Option<Self> {
        let action = match entry.action {
            TraceAction::Alloc => 0,
            TraceAction::FreeRequested => 1,
            TraceAction::FreeCompleted => 2,
            TraceAction::SegmentAlloc => 3,
            TraceAction::SegmentFree => 4,
            TraceAction::SegmentMap => 5,
            TraceAction::SegmentUnmap => 6,
            TraceAction::Snapshot => 7,
            TraceAction::Oom => 8,
            _ => return None,
        };
        Some(Self {
            action,
            device: c_int::try_from(device).unwrap_or(c_int::MAX),
            addr: entry.addr,
            size: entry.size,
            stream: entry.stream,
            time_us: entry.time_us,
            pool_first: entry.pool_id.map_or(0, |(first, _)| first),
            pool_second: entry.pool_id.map_or(0, |(_, second)| second),
        })
    }
}

/// The C++ layer's trace fan-out.
pub type TraceFn = unsafe extern "C" fn(entry: *const TorchTraceEntry);
/// The C++ layer's out-of-memory fan-out: device, the size that failed, the device's total (or the
/// fraction's limit) and free bytes.
pub type OomFn = unsafe extern "C" fn(device: c_int, size: u64, total: u64, free: u64);
/// The C++ layer's run of PyTorch's free-memory callbacks; nonzero if any freed something.
pub type FreeMemoryFn = unsafe extern "C" fn() -> c_int;

static TRACE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static OOM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static FREE_MEMORY: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// The ordinals of the devices each hook is attached to (each once).
static ATTACHED: Mutex<Vec<(u8, u32)>> = Mutex::new(Vec::new());

const TRACE_HOOK: u8 = 0;
const OOM_HOOK: u8 = 1;
const FREE_MEMORY_HOOK: u8 = 2;

fn load<F: Copy>(slot: &AtomicPtr<c_void>, cast: fn(*mut c_void) -> F) -> Option<F> {
    let raw = slot.load(Ordering::Acquire);
    (!raw.is_null()).then(|| cast(raw))
}

/// Attaches every hook set so far to `allocator` (each hook once per device).
///
/// The runtime calls it with its settings lock held (as each caching allocator opens): it takes only
/// [`ATTACHED`] and the allocator's own locks, and never calls back into the runtime.
pub(crate) fn attach(allocator: &'static Allocator) {
    let ordinal = allocator.device().ordinal();
    let mut attached = ATTACHED.lock().unwrap_or_else(|e| e.into_inner());
    let mut first = |hook: u8| {
        let new = !attached.contains(&(hook, ordinal));
        if new {
            attached.push((hook, ordinal));
        }
        new
    };
    if !TRACE.load(Ordering::Acquire).is_null() && first(TRACE_HOOK) {
        allocator.attach_allocator_trace_tracker(Box::new(move |entry: &TraceEntry| {
            // SAFETY: the pointer was set from a `TraceFn` by `tensormem_attach_trace_tracker`.
            let Some(f) = load(&TRACE, |p| unsafe {
                std::mem::transmute::<*mut c_void, TraceFn>(p)
            }) else {
                return;
            };
            if let Some(entry) = TorchTraceEntry::from_entry(ordinal, entry) {
                // SAFETY: the C++ layer's function takes a pointer to an entry valid for the call.
                unsafe { f(&entry) };
            }
        }));
    }
    if !OOM.load(Ordering::Acquire).is_null() && first(OOM_HOOK) {
        allocator.attach_oom_observer(Box::new(|event: &OomEvent| {
            // SAFETY: the pointer was set from an `OomFn` by `tensormem_set_oom_observer`.
            if let Some(f) = load(&OOM, |p| unsafe {
                std::mem::transmute::<*mut c_void, OomFn>(p)
            }) {
                let device = c_int::try_from(event.device).unwrap_or(c_int::MAX);
                // SAFETY: a plain C function of value arguments.
                unsafe {
                    f(
                        device,
                        event.alloc_size,
                        event.device_total,
                        event.device_free,
                    )
                };
            }
        }));
    }
    if !FREE_MEMORY.load(Ordering::Acquire).is_null() && first(FREE_MEMORY_HOOK) {
        allocator.add_free_memory_callback(Arc::new(|| {
            // SAFETY: the pointer was set from a `FreeMemoryFn` by `tensormem_set_free_memory_hook`.
            load(&FREE_MEMORY, |p| unsafe {
                std::mem::transmute::<*mut c_void, FreeMemoryFn>(p)
            })
            // SAFETY: a plain C function without arguments; it runs without allocator locks.
            .is_some_and(|f| unsafe { f() } != 0)
        }));
    }
}

fn set(slot: &AtomicPtr<c_void>, raw: *mut c_void, name: &'static str) -> c_int {
    status(name, || {
        if raw.is_null() {
            return Err(crate::Error::NullArgument { what: "function" });
        }
        slot.store(raw, Ordering::Release);
        // Allocators the process opens later get the hook as they open, whoever opens them (the
        // runtime calls `attach`; registering initialises nothing); those opened so far get it
        // here. In a bad fork none can be used, and none gets it.
        static WATCHING: Once = Once::new();
        WATCHING.call_once(|| {
            let watched = tensormem_runtime::on_caching_allocator(Arc::new(attach));
            if let Err(err) = watched {
                tracing::warn!(%err, "the C++ layer's hooks will not reach allocators opened later");
            }
        });
        if let Ok(opened) = tensormem_runtime::opened_caching_allocators() {
            opened.for_each(attach);
        }
        Ok(())
    })
}

/// Sends every trace entry of every device to `f` from now on (PyTorch's
/// `attachAllocatorTraceTracker`; the C++ layer passes its own fan-out once, when the first tracker is
/// attached). `f` runs with the allocator's locks held and must not call into the plugin.
///
/// Refused under `backend:cudaMallocAsync` with PyTorch's message ("cudaMallocAsync does not yet
/// support attachAllocatorTraceTracker").
#[no_mangle]
pub extern "C" fn tensormem_attach_trace_tracker(f: Option<TraceFn>) -> c_int {
    let refused = status("tensormem_attach_trace_tracker", || {
        Ok(cuda::backend_supports(
            AsyncUnsupported::AttachAllocatorTraceTracker,
        )?)
    });
    if refused != TM_OK {
        return refused;
    }
    set(
        &TRACE,
        f.map_or(std::ptr::null_mut(), |f| f as *mut c_void),
        "tensormem_attach_trace_tracker",
    )
}

/// Calls `f` on every out-of-memory error of every device, before the error is returned (the C++
/// layer's fan-out to PyTorch's `attachOutOfMemoryObserver` observers, set when it is installed; under
/// `backend:cudaMallocAsync` it is kept and never called, and the C++ layer refuses the observers).
#[no_mangle]
pub extern "C" fn tensormem_set_oom_observer(f: Option<OomFn>) -> c_int {
    set(
        &OOM,
        f.map_or(std::ptr::null_mut(), |f| f as *mut c_void),
        "tensormem_set_oom_observer",
    )
}

/// Runs `f` when a device runs short, before cached blocks are released and before an out-of-memory
/// error (PyTorch's `FreeCudaMemoryCallbacksRegistry`). `f` runs without allocator locks and may free
/// memory of the plugin.
#[no_mangle]
pub extern "C" fn tensormem_set_free_memory_hook(f: Option<FreeMemoryFn>) -> c_int {
    let rc = set(
        &FREE_MEMORY,
        f.map_or(std::ptr::null_mut(), |f| f as *mut c_void),
        "tensormem_set_free_memory_hook",
    );
    debug_assert!(rc == TM_OK || f.is_none());
    rc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_keeps_its_pool_and_names_the_default_pool_when_it_has_none() {
        let entry = TraceEntry {
            action: TraceAction::SegmentAlloc,
            addr: 0x7000,
            size: 2 << 20,
            stream: 9,
            time_us: 12,
            pool_id: Some((1, 3)),
            ..TraceEntry::default()
        };
        let torch = TorchTraceEntry::from_entry(2, &entry).unwrap();
        assert_eq!(
            torch,
            TorchTraceEntry {
                action: 3,
                device: 2,
                addr: 0x7000,
                size: 2 << 20,
                stream: 9,
                time_us: 12,
                pool_first: 1,
                pool_second: 3,
            }
        );
        let unnamed = TraceEntry {
            pool_id: None,
            ..entry
        };
        let torch = TorchTraceEntry::from_entry(0, &unnamed).unwrap();
        assert_eq!((torch.pool_first, torch.pool_second), (0, 0));
        // The C++ layer's `TmTraceEntry` static_asserts the same size.
        assert_eq!(std::mem::size_of::<TorchTraceEntry>(), 56);
    }
}
