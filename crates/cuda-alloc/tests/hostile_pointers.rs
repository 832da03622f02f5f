//! Pointers the allocator never handed out, and pointers freed twice (also by racing threads):
//! each is a typed error and leaves the state consistent.

mod common;

use common::*;
use tensormem_cuda_alloc::{DevicePtr, Error};

/// Pointers that no allocation can have: the pointer index's empty-slot key, unaligned
/// addresses, addresses inside a block, past every segment.
fn hostile(live: DevicePtr) -> Vec<DevicePtr> {
    vec![
        DevicePtr(u64::MAX),
        DevicePtr(u64::MAX - 511),
        DevicePtr(u64::MAX & !511),
        DevicePtr(1),
        DevicePtr(live.0 + 1),
        DevicePtr(live.0 + 512),
        DevicePtr(live.0 - 512),
        DevicePtr(live.0 + (64 << 20)),
    ]
}

#[test]
fn raw_free_of_a_pointer_never_handed_out_is_refused() {
    let a = sim(GIB);
    let p = a.raw_alloc(4096, S0).unwrap();
    for bad in hostile(p) {
        assert!(
            matches!(a.raw_free(bad), Err(Error::InvalidPointer { ptr }) if ptr == bad),
            "raw_free({bad}) was accepted"
        );
        let s = checked(&a);
        assert_eq!(s.allocation.all.current, 1, "after raw_free({bad})");
    }
    // The allocator still works: allocations do not overlap the live block, which frees once.
    let q = a.raw_alloc(4096, S0).unwrap();
    assert!(q.0 >= p.0 + 4096 || q.0 + 4096 <= p.0, "{q} overlaps {p}");
    a.raw_free(p).unwrap();
    a.raw_free(q).unwrap();
    assert!(matches!(a.raw_free(p), Err(Error::InvalidPointer { .. })));
    assert_eq!(checked(&a).allocation.all.current, 0);
}

#[test]
fn pointer_lookups_of_hostile_pointers_are_refused() {
    let a = sim(GIB);
    let p = a.raw_alloc(4096, S0).unwrap();
    for bad in hostile(p) {
        assert!(
            matches!(a.record_stream_ptr(bad, S1), Err(Error::InvalidPointer { .. })),
            "record_stream_ptr({bad})"
        );
        assert!(
            matches!(a.base_allocation(bad), Err(Error::InvalidPointer { .. })),
            "base_allocation({bad})"
        );
    }
    checked(&a);
    a.raw_free(p).unwrap();
}

#[test]
fn hostile_frees_before_any_pointer_call_are_refused() {
    // The first pointer-based call builds the index from blocks allocated by handle.
    let a = sim(GIB);
    let x = a.allocate(4096, S0).unwrap();
    assert!(matches!(
        a.raw_free(DevicePtr(u64::MAX)),
        Err(Error::InvalidPointer { .. })
    ));
    checked(&a);
    a.free(x).unwrap();
    assert_eq!(checked(&a).allocation.all.current, 0);
}
