//! Running out of memory: releasing cached blocks, callbacks, retries, the error and its message,
//! memory fraction and garbage collection.

mod common;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use tensormem_cuda_alloc::oom::Reporter;
use tensormem_cuda_alloc::snapshot::TraceAction;
use tensormem_cuda_alloc::{Error, ProcessMemory, StreamId};

#[test]
fn out_of_memory_after_releasing_everything_with_pytorchs_message() {
    let a = sim(40 * MIB);
    a.record_history(true, 100);
    let _held = a.allocate(30 * MIB, S0).unwrap();
    // A cached small segment: released before giving up.
    let small = a.allocate(512, S0).unwrap();
    a.free(small).unwrap();
    let observed = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&observed);
    a.attach_oom_observer(Box::new(move |e| sink.lock().unwrap().push(*e)));
    let err = a.allocate(20 * MIB, S0).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("expected out of memory, got {err}")
    };
    assert_eq!(
        err.to_string(),
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 40.00 MiB of \
         which 10.00 MiB is free. Of the allocated memory 30.00 MiB is allocated by tensormem, and 0 \
         bytes is reserved by tensormem but unallocated. If reserved but unallocated memory is large try \
         setting TENSORMEM_ALLOC_CONF=expandable_segments:True (or PYTORCH_CUDA_ALLOC_CONF, read when \
         TENSORMEM_ALLOC_CONF is unset) to avoid fragmentation.  See the allocator's settings \
         (https://docs.rs/tensormem-cuda-alloc/latest/tensormem_cuda_alloc/config/)"
    );
    assert_eq!(
        (oom.alloc_size, oom.device_free),
        (20 * MIB as u64, 10 * MIB as u64)
    );
    let s = checked(&a);
    assert_eq!(s.num_ooms, 1);
    assert_eq!(
        s.num_alloc_retries, 1,
        "the last attempt is the counted retry"
    );
    assert_eq!(
        s.num_sync_all_streams, 1,
        "release_cached_blocks synchronized"
    );
    assert_eq!(
        s.segment.small_pool.current, 0,
        "the cached small segment was released"
    );
    assert_eq!(s.num_device_free, 1);
    assert_eq!(
        observed.lock().unwrap().as_slice(),
        [tensormem_cuda_alloc::oom::OomEvent {
            device: 0,
            alloc_size: 20 * MIB as u64,
            device_total: 40 * MIB as u64,
            device_free: 10 * MIB as u64,
        }]
    );
    let trace = a.trace();
    let oom_entry = trace.iter().find(|e| e.action == TraceAction::Oom).unwrap();
    assert_eq!(
        (oom_entry.device_free(), oom_entry.size),
        (Some(10 * MIB as u64), 20 * MIB as u64)
    );
}

#[test]
fn the_devices_process_list_is_in_the_error_in_either_wording() {
    let a = sim(40 * MIB);
    let this = std::process::id();
    a.device().set_process_memory(Some(vec![
        ProcessMemory {
            pid: 31337,
            used_bytes: 3 * MIB as u64,
            this_process: false,
        },
        ProcessMemory {
            pid: this,
            used_bytes: 30 * MIB as u64,
            this_process: true,
        },
    ]));
    let _held = a.allocate(30 * MIB, S0).unwrap();
    let err = a.allocate(20 * MIB, S0).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("expected out of memory, got {err}")
    };
    assert_eq!(oom.processes.len(), 2);
    assert_eq!(
        oom.message_for(Reporter::PyTorch),
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 40.00 MiB of \
         which 10.00 MiB is free. Process 31337 has 3.00 MiB memory in use. Including non-PyTorch \
         memory, this process has 30.00 MiB memory in use. Of the allocated memory 30.00 MiB is \
         allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but \
         unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to \
         avoid fragmentation.  See documentation for Memory Management  \
         (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    );
    assert!(
        err.to_string().contains(
            "is free. Process 31337 has 3.00 MiB memory in use. Including non-tensormem memory, this \
             process has 30.00 MiB memory in use. Of the allocated memory 30.00 MiB is allocated by \
             tensormem,"
        ),
        "{err}"
    );
}

#[test]
fn requests_of_an_exabyte_are_refused_outright() {
    let a = sim(GIB);
    let err = a.allocate(1 << 60, S0).unwrap_err();
    assert!(matches!(err, Error::TooLarge { .. }));
    assert_eq!(
        err.to_string(),
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
    assert!(
        a.allocate((1 << 60) - 1, S0).is_err(),
        "out of memory, not refused"
    );
    assert_eq!(checked(&a).num_ooms, 1, "only the second was tried");
}

#[test]
fn free_memory_callbacks_run_before_a_new_segment() {
    let a = Arc::new(sim(GIB));
    let held = Arc::new(Mutex::new(Some(a.allocate(4 * MIB, S0).unwrap())));
    let calls = Arc::new(AtomicUsize::new(0));
    {
        let (weak, held, calls) = (Arc::downgrade(&a), Arc::clone(&held), Arc::clone(&calls));
        a.add_free_memory_callback(Arc::new(move || {
            calls.fetch_add(1, Ordering::SeqCst);
            match (weak.upgrade(), held.lock().unwrap().take()) {
                (Some(a), Some(block)) => {
                    a.free(block).unwrap();
                    true
                }
                _ => false,
            }
        }));
    }
    // The 20 MiB segment's remainder (16 MiB) is free: found without callbacks.
    let x = a.allocate(4 * MIB, S0).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // 20 MiB: nothing cached fits; the callback frees the held block, which merges into a 20 MiB
    // free block that then fits.
    a.free(x).unwrap();
    let y = a.allocate(17 * MIB, S0).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        checked(&a).segment.all.current,
        1,
        "served by the freed memory"
    );
    a.free(y).unwrap();
}

#[test]
fn cached_oversize_blocks_are_released_to_make_room() {
    // One block large enough.
    let a = sim_with("max_split_size_mb:20", 45 * MIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let y = a.allocate(10 * MIB, S0).unwrap();
    let s = checked(&a);
    assert_eq!(
        (s.num_device_free, s.num_alloc_retries, s.num_ooms),
        (1, 0, 0)
    );
    assert_eq!(s.reserved_bytes.all.current, 10 * MIB as i64);
    a.free(y).unwrap();
    // Several, largest first, until the request is covered.
    let b = sim_with("max_split_size_mb:20", 50 * MIB);
    let p = b.allocate(24 * MIB, S0).unwrap();
    let q = b.allocate(22 * MIB, S0).unwrap();
    b.free(p).unwrap();
    b.free(q).unwrap();
    let r = b.allocate(30 * MIB, S0).unwrap();
    let s = checked(&b);
    assert_eq!((s.num_device_free, s.num_alloc_retries), (2, 0));
    b.free(r).unwrap();
}

#[test]
fn memory_fraction_caps_reserved_memory() {
    let a = sim(100 * MIB);
    a.set_memory_fraction(0.5).unwrap();
    assert!((a.memory_fraction().unwrap() - 0.5).abs() < 1e-12);
    let x = a.allocate(40 * MIB, S0).unwrap();
    let err = a.allocate(20 * MIB, S0).unwrap_err();
    assert!(
        err.to_string().contains(
            "of which 60.00 MiB is free. 50.00 MiB allowed; Of the allocated memory 40.00 MiB"
        ),
        "{err}"
    );
    assert_eq!(
        a.device().counters().live_allocations,
        1,
        "the device was never asked"
    );
    let y = a.allocate(10 * MIB, S0).unwrap();
    assert!(matches!(
        a.set_memory_fraction(1.5),
        Err(Error::InvalidFraction { .. })
    ));
    a.free(x).unwrap();
    a.free(y).unwrap();
}

#[test]
fn garbage_collection_releases_the_oldest_cached_blocks() {
    let a = sim_with("garbage_collection_threshold:0.5", 100 * MIB);
    a.set_memory_fraction(1.0).unwrap();
    let x = a.allocate(20 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let y = a.allocate(22 * MIB, S0).unwrap(); // the 20 MiB block is too small: new segment
    a.free(y).unwrap();
    let _z = a.allocate(24 * MIB, S0).unwrap(); // 42 MiB reserved: under the 50 MiB threshold
    assert_eq!(checked(&a).num_device_free, 0);
    // 66 MiB reserved, over the threshold: the older block (20 MiB, idle for 3 lookups) goes, the
    // younger (22 MiB, idle for 2, below the average of 2.5) stays.
    let _w = a.allocate(30 * MIB, S0).unwrap();
    let s = checked(&a);
    assert_eq!(s.num_device_free, 1);
    assert_eq!(a.largest_cached_block(), 22 * MIB as u64);
    assert_eq!(s.reserved_bytes.all.current, (22 + 24 + 30) * MIB as i64);
}

#[test]
fn garbage_collection_needs_a_memory_fraction() {
    let a = sim_with("garbage_collection_threshold:0.5", 100 * MIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let _y = a.allocate(50 * MIB, S0).unwrap();
    assert_eq!(
        checked(&a).num_device_free,
        0,
        "no fraction set: no collection"
    );
}

#[test]
fn device_failures_other_than_out_of_memory_are_reported() {
    let a = sim(GIB);
    // A queued address that is not 512-byte aligned makes the simulated malloc fail.
    a.device().push_addresses([0x1000_0001]);
    let err = a.allocate(512, S0).unwrap_err();
    assert!(matches!(err, Error::Device(_)), "{err}");
    assert_eq!(checked(&a).num_ooms, 0);
}

#[test]
fn observers_and_callbacks_see_every_stream() {
    let a = sim(8 * MIB);
    let seen = Arc::new(AtomicU64::new(0));
    let sink = Arc::clone(&seen);
    a.attach_oom_observer(Box::new(move |e| {
        sink.fetch_add(e.alloc_size, Ordering::SeqCst);
    }));
    let _x = a.allocate(6 * MIB, StreamId(5)).unwrap_err();
    assert_eq!(
        seen.load(Ordering::SeqCst),
        20 * MIB as u64,
        "a 20 MiB segment was wanted"
    );
}

#[test]
fn observers_may_call_back_into_the_allocator() {
    let a = Arc::new(sim(8 * MIB));
    let weak = Arc::downgrade(&a);
    let seen = Arc::new(AtomicU64::new(0));
    let sink = Arc::clone(&seen);
    a.attach_oom_observer(Box::new(move |_| {
        if let Some(a) = weak.upgrade() {
            sink.store(a.memory_stats().num_ooms as u64, Ordering::SeqCst);
            a.attach_oom_observer(Box::new(|_| {}));
        }
    }));
    assert!(a.allocate(16 * MIB, S0).is_err());
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "the observer saw the counted OOM"
    );
}
