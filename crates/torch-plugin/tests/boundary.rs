//! The C functions' handling of bad arguments, which needs no GPU: nothing panics, results say failure,
//! and the thread's last error says why.

use std::ffi::{c_char, CStr};
use std::ptr;

use tensormem_torch::native::tensormem_set_allocator_settings;
use tensormem_torch::*;

fn last_error() -> String {
    let err = tensormem_last_error();
    assert!(!err.is_null(), "a failed call keeps its error");
    // SAFETY: non-null: a NUL-terminated string valid until the next failure on this thread.
    unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn freeing_null_is_a_no_op() {
    tensormem_clear_last_error();
    // SAFETY: null is ignored.
    unsafe { tensormem_free(ptr::null_mut(), 0, 0, ptr::null_mut()) };
    assert!(tensormem_last_error().is_null());
}

#[test]
fn a_negative_device_is_refused_by_name() {
    // SAFETY: the default stream.
    let p = unsafe { tensormem_alloc(4096, -1, ptr::null_mut()) };
    assert!(p.is_null());
    assert!(last_error().contains("device -1 is not a CUDA device ordinal"));

    assert!(tensormem_memory_stats_json(-2).is_null());
    assert!(last_error().contains("device -2"));
    assert_eq!(tensormem_reset_peak_stats(-3), -1);
    assert!(last_error().contains("device -3"));

    tensormem_clear_last_error();
    tensormem_set_memory_fraction(0.5, -4);
    assert!(last_error().contains("device -4"));
    tensormem_end_allocate_to_pool(
        -5,
        TorchMempoolId {
            first: 1,
            second: 0,
        },
    );
    assert!(last_error().contains("device -5"));
}

#[test]
fn base_alloc_needs_a_size_pointer_and_a_known_pointer() {
    // SAFETY: a null `size` is refused before any write.
    let base = unsafe { tensormem_base_alloc(0x1000 as *mut _, ptr::null_mut()) };
    assert!(base.is_null());
    assert!(last_error().contains("size is a null pointer"));

    let mut size = 12345usize;
    // SAFETY: `size` is valid for writes.
    let base = unsafe { tensormem_base_alloc(0x7f00_dead_0000 as *mut _, &mut size) };
    assert!(base.is_null());
    assert_eq!(size, 12345, "size is left alone on failure");
    assert!(last_error().contains("was not handed out by tensormem"));
}

#[test]
fn snapshots_need_a_path_and_strings_free_null() {
    // SAFETY: null is refused.
    assert_eq!(unsafe { tensormem_dump_snapshot(ptr::null()) }, -1);
    assert!(last_error().contains("path is a null pointer"));
    let bad = b"/tmp/\xff\xfe.pickle\0";
    // SAFETY: NUL-terminated.
    let rc = unsafe { tensormem_dump_snapshot(bad.as_ptr().cast::<c_char>()) };
    assert_eq!(rc, -1);
    assert!(last_error().contains("not valid UTF-8"));
    // SAFETY: null is ignored.
    unsafe { tensormem_string_free(ptr::null_mut()) };
}

#[test]
fn a_settings_string_that_is_not_utf8_is_refused_as_settings() {
    // SAFETY: null is refused.
    assert_eq!(unsafe { tensormem_set_allocator_settings(ptr::null()) }, -1);
    assert!(last_error().contains("config is a null pointer"));
    let bad = b"expandable_segments:\xffTrue\0";
    // SAFETY: NUL-terminated.
    let rc = unsafe { tensormem_set_allocator_settings(bad.as_ptr().cast::<c_char>()) };
    assert_eq!(rc, -1);
    let err = last_error();
    assert!(
        err.contains("allocator settings string") && err.contains("not valid UTF-8"),
        "{err}"
    );
    assert!(err.contains("'expandable_segments:True'"), "{err}");
    assert!(!err.contains("path"), "{err}");
}

#[test]
fn without_a_gpu_allocation_fails_with_the_reason_and_with_one_it_round_trips() {
    // SAFETY: the default stream.
    let p = unsafe { tensormem_alloc(1 << 20, 0, ptr::null_mut()) };
    if p.is_null() {
        let err = last_error();
        assert!(!err.is_empty());
        eprintln!("no GPU here: {err}");
        assert!(tensormem_memory_stats_json(0).is_null());
        return;
    }
    let json = tensormem_memory_stats_json(0);
    assert!(!json.is_null(), "stats of a device in use");
    // SAFETY: a NUL-terminated string from the library, freed once below.
    let text = unsafe { CStr::from_ptr(json) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: returned by tensormem_memory_stats_json, not freed before.
    unsafe { tensormem_string_free(json) };
    assert!(text.contains("\"allocated_bytes.all.current\":"), "{text}");
    // SAFETY: nothing uses the memory.
    unsafe { tensormem_free(p, 1 << 20, 0, ptr::null_mut()) };
}
