//! Snapshots and history for the C++ layer (PyTorch's `snapshot`, `recordHistory`), behind
//! `torch.cuda.memory._snapshot()`, `_dump_snapshot()`, `_record_memory_history()` and
//! `memory_summary()`.
//!
//! A snapshot is taken once ([`tensormem_snapshot_take`]) and read field by field through `repr(C)`
//! structs, so no Rust type crosses the boundary.

use std::ffi::{c_char, c_int, CString};

use tensormem::cuda::{self, AsyncUnsupported};
use tensormem_cuda_alloc::snapshot::{BlockState, SegmentType, Snapshot};
use tensormem_cuda_alloc::MempoolId;

use super::hooks::TorchTraceEntry;
use super::{check_layout, pool_id, status};
use crate::boundary::call;
use crate::devices;
use crate::error::{Error, Result};

/// A snapshot of every device the process opened, with its traces (one list per device ordinal) and the
/// allocator settings of the first device.
#[derive(Debug)]
pub struct TorchSnapshot {
    snapshot: Snapshot,
    /// `device_traces` in PyTorch's form, by device ordinal.
    traces: Vec<Vec<TorchTraceEntry>>,
    settings: CString,
    config: TorchConfigInfo,
}

/// One segment (PyTorch's `SegmentInfo`, without its blocks).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchSegmentInfo {
    /// The device ordinal.
    pub device: i64,
    /// The start address.
    pub address: u64,
    /// Bytes in all.
    pub total_size: u64,
    /// Bytes asked for by the allocations in it.
    pub requested_size: u64,
    /// Bytes handed out.
    pub allocated_size: u64,
    /// Bytes in active blocks.
    pub active_size: u64,
    /// The stream, as PyTorch's raw handle.
    pub stream: u64,
    /// 1 for the large pool's segments.
    pub is_large: u8,
    /// 1 for an expandable segment.
    pub is_expandable: u8,
    /// The owning private pool (0, 0 for the default pools).
    pub pool_first: u64,
    /// The second half of the owning pool's id.
    pub pool_second: u64,
    /// How many blocks [`tensormem_snapshot_block`] reads.
    pub block_count: u64,
}

/// One block (PyTorch's `BlockInfo`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TorchBlockInfo {
    /// Bytes.
    pub size: u64,
    /// Bytes asked for.
    pub requested_size: u64,
    /// 1 if handed out.
    pub allocated: u8,
    /// 1 if handed out or still used by a stream's queued work.
    pub active: u8,
}

/// The settings PyTorch reports with a snapshot (`AllocatorConfigInfo`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TorchConfigInfo {
    /// `garbage_collection_threshold`.
    pub garbage_collection_threshold: f64,
    /// `max_split_size` in bytes.
    pub max_split_size: u64,
    /// `pinned_num_register_threads`.
    pub pinned_num_register_threads: u64,
    /// `expandable_segments`.
    pub expandable_segments: u8,
    /// `release_lock_on_cudamalloc`.
    pub release_lock_on_malloc: u8,
    /// `pinned_use_cuda_host_register`.
    pub pinned_use_host_register: u8,
    /// `graph_capture_record_stream_reuse`.
    pub graph_capture_record_stream_reuse: u8,
    /// The configuration string last applied (NUL-terminated, owned by the snapshot).
    pub last_allocator_settings: *const c_char,
    /// `roundup_power2_divisions`, one per power-of-two interval.
    pub roundup_power2_divisions: [u64; 16],
}

impl Default for TorchConfigInfo {
    fn default() -> Self {
        Self {
            garbage_collection_threshold: 0.0,
            max_split_size: 0,
            pinned_num_register_threads: 0,
            expandable_segments: 0,
            release_lock_on_malloc: 0,
            pinned_use_host_register: 0,
            graph_capture_record_stream_reuse: 0,
            last_allocator_settings: std::ptr::null(),
            roundup_power2_divisions: [0; 16],
        }
    }
}

/// Takes a snapshot of every device the process opened (PyTorch's `snapshot(mempool_id, include_traces)`):
/// the segments of private pool (`first`, `second`) only, unless it is (0, 0); the traces (one list
/// per device, whole: PyTorch does not filter them by pool) when `include_traces` is nonzero, else
/// none (no device lists: `device_traces` is `[]` as in PyTorch). Returns null on error (under
/// `backend:cudaMallocAsync`, PyTorch's "Calling snapshot with backend:cudaMallocAsync is not
/// meaningful"). Free it with [`tensormem_snapshot_free`].
#[no_mangle]
pub extern "C" fn tensormem_snapshot_take(
    first: u64,
    second: u64,
    include_traces: c_int,
) -> *mut TorchSnapshot {
    call("tensormem_snapshot_take", std::ptr::null_mut(), || {
        Ok(Box::into_raw(Box::new(take(
            pool_id(first, second),
            include_traces != 0,
        )?)))
    })
}

fn take(pool: MempoolId, include_traces: bool) -> Result<TorchSnapshot> {
    let mut merged = Snapshot::default();
    let mut traces = Vec::new();
    let mut config = None;
    for allocator in devices::used_native(AsyncUnsupported::Snapshot)? {
        let ordinal = allocator.device().ordinal();
        // Filtered by pool, and the trace left uncopied without `include_traces`, as PyTorch does.
        let snapshot = allocator.snapshot_with(Some(pool), include_traces);
        merged.segments.extend(snapshot.segments);
        if include_traces {
            let slot = ordinal as usize;
            if traces.len() <= slot {
                traces.resize_with(slot + 1, Vec::new);
            }
            if let Some(trace) = snapshot.device_traces.first() {
                traces[slot] = trace
                    .iter()
                    .filter_map(|entry| TorchTraceEntry::from_entry(ordinal, entry))
                    .collect();
            }
        }
        if config.is_none() {
            config = Some((allocator.config(), snapshot.allocator_settings));
        }
    }
    // Without traces PyTorch's `device_traces` is an empty list; with them, one list per device.
    if include_traces && traces.len() < cuda::device_count().unwrap_or(0) as usize {
        traces.resize_with(cuda::device_count().unwrap_or(0) as usize, Vec::new);
    }
    let (settings, mut info) = match config {
        Some((config, settings)) => {
            let text = settings.and_then(|s| s.config_string).unwrap_or_default();
            let mut divisions = [0u64; 16];
            for (slot, &d) in divisions.iter_mut().zip(&config.roundup_power2_divisions) {
                *slot = d as u64;
            }
            let info = TorchConfigInfo {
                garbage_collection_threshold: config.garbage_collection_threshold,
                max_split_size: config.max_split_size as u64,
                pinned_num_register_threads: config.pinned_num_register_threads as u64,
                expandable_segments: u8::from(config.expandable_segments),
                release_lock_on_malloc: u8::from(config.release_lock_on_cudamalloc),
                pinned_use_host_register: u8::from(config.pinned_use_cuda_host_register),
                graph_capture_record_stream_reuse: u8::from(
                    config.graph_capture_record_stream_reuse,
                ),
                last_allocator_settings: std::ptr::null(),
                roundup_power2_divisions: divisions,
            };
            (text, info)
        }
        None => (String::new(), TorchConfigInfo::default()),
    };
    let settings = CString::new(settings.replace('\0', " ")).unwrap_or_default();
    info.last_allocator_settings = settings.as_ptr();
    Ok(TorchSnapshot {
        snapshot: merged,
        traces,
        settings,
        config: info,
    })
}

/// The snapshot behind `snapshot`, or an error for null.
///
/// # Safety
///
/// `snapshot` is null or from [`tensormem_snapshot_take`], not freed.
unsafe fn get<'a>(snapshot: *const TorchSnapshot) -> Result<&'a TorchSnapshot> {
    // SAFETY: null or live (the caller's obligation).
    unsafe { snapshot.as_ref() }.ok_or(Error::NullArgument { what: "snapshot" })
}

/// How many segments the snapshot has.
///
/// # Safety
///
/// `snapshot` is from [`tensormem_snapshot_take`], not freed.
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_segment_count(snapshot: *const TorchSnapshot) -> u64 {
    call("tensormem_snapshot_segment_count", 0, || {
        // SAFETY: a live snapshot (the caller's obligation).
        let snapshot = unsafe { get(snapshot) }?;
        Ok(snapshot.snapshot.segments.len() as u64)
    })
}

/// Segment `index` into `*out` (`size`: the caller's `sizeof`).
///
/// # Safety
///
/// `snapshot` is from [`tensormem_snapshot_take`], not freed; `out` is valid for a write of `size`
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_segment(
    snapshot: *const TorchSnapshot,
    index: u64,
    out: *mut TorchSegmentInfo,
    size: usize,
) -> c_int {
    status("tensormem_snapshot_segment", || {
        check_layout(out, size)?;
        // SAFETY: the caller's obligation.
        let snapshot = unsafe { get(snapshot) }?;
        let s = usize::try_from(index)
            .ok()
            .and_then(|i| snapshot.snapshot.segments.get(i))
            .ok_or(Error::IndexOutOfRange { index })?;
        let info = TorchSegmentInfo {
            device: s.device,
            address: s.address,
            total_size: s.total_size,
            requested_size: s.requested_size,
            allocated_size: s.allocated_size,
            active_size: s.active_size,
            stream: s.stream,
            is_large: u8::from(s.segment_type == SegmentType::Large),
            is_expandable: u8::from(s.is_expandable),
            pool_first: s.segment_pool_id.0,
            pool_second: s.segment_pool_id.1,
            block_count: s.blocks.len() as u64,
        };
        // SAFETY: non-null, of the right size (checked above), valid for writes.
        unsafe { out.write(info) };
        Ok(())
    })
}

/// Block `block` of segment `segment` into `*out`.
///
/// # Safety
///
/// As [`tensormem_snapshot_segment`].
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_block(
    snapshot: *const TorchSnapshot,
    segment: u64,
    block: u64,
    out: *mut TorchBlockInfo,
    size: usize,
) -> c_int {
    status("tensormem_snapshot_block", || {
        check_layout(out, size)?;
        // SAFETY: the caller's obligation.
        let snapshot = unsafe { get(snapshot) }?;
        let b = usize::try_from(segment)
            .ok()
            .and_then(|i| snapshot.snapshot.segments.get(i))
            .and_then(|s| usize::try_from(block).ok().and_then(|j| s.blocks.get(j)))
            .ok_or(Error::IndexOutOfRange { index: block })?;
        let info = TorchBlockInfo {
            size: b.size,
            requested_size: b.requested_size,
            allocated: u8::from(b.state == BlockState::ActiveAllocated),
            active: u8::from(b.state != BlockState::Inactive),
        };
        // SAFETY: non-null, of the right size (checked above), valid for writes.
        unsafe { out.write(info) };
        Ok(())
    })
}

/// How many trace entries device `device` has in the snapshot (0 past the devices it has).
///
/// # Safety
///
/// `snapshot` is from [`tensormem_snapshot_take`], not freed.
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_trace_count(
    snapshot: *const TorchSnapshot,
    device: c_int,
) -> u64 {
    call("tensormem_snapshot_trace_count", 0, || {
        // SAFETY: the caller's obligation.
        let snapshot = unsafe { get(snapshot) }?;
        Ok(usize::try_from(device)
            .ok()
            .and_then(|d| snapshot.traces.get(d))
            .map_or(0, |t| t.len() as u64))
    })
}

/// How many devices the snapshot's traces cover (PyTorch's `device_traces` length).
///
/// # Safety
///
/// `snapshot` is from [`tensormem_snapshot_take`], not freed.
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_trace_devices(snapshot: *const TorchSnapshot) -> c_int {
    call("tensormem_snapshot_trace_devices", 0, || {
        // SAFETY: the caller's obligation.
        let snapshot = unsafe { get(snapshot) }?;
        Ok(c_int::try_from(snapshot.traces.len()).unwrap_or(c_int::MAX))
    })
}

/// Trace entry `index` of device `device` into `*out`.
///
/// # Safety
///
/// As [`tensormem_snapshot_segment`].
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_trace(
    snapshot: *const TorchSnapshot,
    device: c_int,
    index: u64,
    out: *mut TorchTraceEntry,
    size: usize,
) -> c_int {
    status("tensormem_snapshot_trace", || {
        check_layout(out, size)?;
        // SAFETY: the caller's obligation.
        let snapshot = unsafe { get(snapshot) }?;
        let entry = usize::try_from(device)
            .ok()
            .and_then(|d| snapshot.traces.get(d))
            .and_then(|t| usize::try_from(index).ok().and_then(|i| t.get(i)))
            .ok_or(Error::IndexOutOfRange { index })?;
        // SAFETY: non-null, of the right size (checked above), valid for writes.
        unsafe { out.write(*entry) };
        Ok(())
    })
}

/// The allocator settings reported with the snapshot into `*out`; its string stays valid until the
/// snapshot is freed.
///
/// # Safety
///
/// As [`tensormem_snapshot_segment`].
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_config(
    snapshot: *const TorchSnapshot,
    out: *mut TorchConfigInfo,
    size: usize,
) -> c_int {
    status("tensormem_snapshot_config", || {
        check_layout(out, size)?;
        // SAFETY: the caller's obligation.
        let snapshot = unsafe { get(snapshot) }?;
        debug_assert_eq!(
            snapshot.config.last_allocator_settings,
            snapshot.settings.as_ptr()
        );
        // SAFETY: non-null, of the right size (checked above), valid for writes.
        unsafe { out.write(snapshot.config) };
        Ok(())
    })
}

/// Frees a snapshot. Null is ignored.
///
/// # Safety
///
/// `snapshot` is null or from [`tensormem_snapshot_take`], not freed before.
#[no_mangle]
pub unsafe extern "C" fn tensormem_snapshot_free(snapshot: *mut TorchSnapshot) {
    if !snapshot.is_null() {
        // SAFETY: from `Box::into_raw` in `tensormem_snapshot_take`, freed once.
        drop(unsafe { Box::from_raw(snapshot) });
    }
}

/// Starts (`enabled != 0`) or stops recording every device's allocator events, at most `max_entries`
/// each (PyTorch's `recordHistory`). Stacks are not recorded: PyTorch's Python stacks are gathered by
/// PyTorch's own allocator only.
#[no_mangle]
pub extern "C" fn tensormem_history(enabled: c_int, max_entries: usize) -> c_int {
    status("tensormem_history", || history(enabled != 0, max_entries))
}

/// The history switch of [`tensormem_history`] and of the Python package's
/// [`tensormem_record_history`](crate::tensormem_record_history).
pub(crate) fn history(enabled: bool, max_entries: usize) -> Result<()> {
    cuda::record_memory_history(enabled, max_entries)?;
    Ok(())
}

/// Whether any device the process opened is recording its history: 1 yes, 0 no (and 0 under
/// `backend:cudaMallocAsync`, which records none; the C++ layer asks
/// [`tensormem_backend_supports`](super::tensormem_backend_supports) first, as PyTorch refuses).
#[no_mangle]
pub extern "C" fn tensormem_history_enabled() -> c_int {
    call("tensormem_history_enabled", 0, || {
        Ok(c_int::from(
            devices::used_native(AsyncUnsupported::RecordHistory)?
                .any(|allocator| allocator.is_history_enabled()),
        ))
    })
}
