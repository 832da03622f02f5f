//! Pointers the allocator never handed out, and pointers freed twice (also by racing threads):
//! each is a typed error and leaves the state consistent.

mod common;

use common::*;
use tensormem_cuda_alloc::{DeviceAddress, Error};

/// Pointers that no allocation can have: the pointer index's empty-slot key, unaligned
/// addresses, addresses inside a block, past every segment.
fn hostile(live: DeviceAddress) -> Vec<DeviceAddress> {
    vec![
        DeviceAddress(u64::MAX),
        DeviceAddress(u64::MAX - 511),
        DeviceAddress(!511),
        DeviceAddress(1),
        DeviceAddress(live.0 + 1),
        DeviceAddress(live.0 + 512),
        DeviceAddress(live.0 - 512),
        DeviceAddress(live.0 + (64 << 20)),
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
            matches!(
                a.record_stream_ptr(bad, S1),
                Err(Error::InvalidPointer { .. })
            ),
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
        a.raw_free(DeviceAddress(u64::MAX)),
        Err(Error::InvalidPointer { .. })
    ));
    checked(&a);
    a.free(x).unwrap();
    assert_eq!(checked(&a).allocation.all.current, 0);
}

/// Double `raw_free`s racing reuse of the same addresses on 8 threads (on 64 streams that the
/// threads share and first use mid-run): every call is `Ok` or [`Error::InvalidPointer`], and the state is consistent whenever it
/// is checked, mid-run included.
#[test]
fn racing_double_frees_never_corrupt_the_state() {
    use rand::{Rng, SeedableRng};
    use std::sync::atomic::{AtomicBool, Ordering};
    use tensormem_cuda_alloc::StreamId;

    for seed in 0..4u64 {
        let a = sim(GIB);
        let done = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..8u64)
                .map(|t| {
                    let a = &a;
                    scope.spawn(move || {
                        let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 100 + t);
                        let mut freed: Vec<DeviceAddress> = Vec::new();
                        let mut live: Vec<DeviceAddress> = Vec::new();
                        for _ in 0..2000 {
                            match rng.gen_range(0..10) {
                                0..=3 => {
                                    let size = 512 * rng.gen_range(1..64usize);
                                    // Streams first used mid-run, shared between threads.
                                    let stream = StreamId(1 + rng.gen_range(0..64));
                                    live.push(a.raw_alloc(size, stream).unwrap());
                                }
                                4..=6 if !live.is_empty() => {
                                    let p = live.swap_remove(rng.gen_range(0..live.len()));
                                    // Another thread may already have freed it (a double free
                                    // of ours that met its reuse).
                                    match a.raw_free(p) {
                                        Ok(()) | Err(Error::InvalidPointer { .. }) => {}
                                        Err(e) => panic!("raw_free: {e}"),
                                    }
                                    freed.push(p);
                                }
                                _ if !freed.is_empty() => {
                                    // A deliberate double free, possibly of an address some
                                    // thread has been handed again meanwhile.
                                    let p = freed[rng.gen_range(0..freed.len())];
                                    match a.raw_free(p) {
                                        Ok(()) | Err(Error::InvalidPointer { .. }) => {}
                                        Err(e) => panic!("double raw_free: {e}"),
                                    }
                                    if rng.gen_bool(0.1) {
                                        let other = StreamId(1 + rng.gen_range(0..64));
                                        let _ = a.record_stream_ptr(p, other);
                                    }
                                }
                                _ => {}
                            }
                        }
                        for p in live {
                            let _ = a.raw_free(p);
                        }
                    })
                })
                .collect();
            scope.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    if let Err(e) = a.check_invariants() {
                        panic!("seed {seed}: mid-run: {e}");
                    }
                    // Let the workers through between checks (each takes every lock).
                    std::thread::sleep(std::time::Duration::from_micros(300));
                }
            });
            for w in workers {
                w.join().unwrap();
            }
            done.store(true, Ordering::Relaxed);
        });
        a.device().complete_all_work();
        a.check_invariants().unwrap();
        a.empty_cache().unwrap();
        let s = checked(&a);
        assert_eq!(s.allocated_bytes.all.current, 0, "seed {seed}");
        assert_eq!(s.reserved_bytes.all.current, 0, "seed {seed}");
    }
}

/// A handle freed (or recorded) on an allocator that did not make it is refused, and neither
/// allocator changes.
#[test]
fn a_handle_of_another_allocator_is_refused() {
    let (a, b) = (sim(GIB), sim(GIB));
    assert_ne!(a.id(), b.id());
    let x = a.allocate(4096, S0).unwrap();
    let y = b.allocate(4096, S0).unwrap();
    assert_eq!(x.allocator_id(), a.id());
    assert!(matches!(
        b.record_stream(&x, S1),
        Err(Error::ForeignAllocation { owner, this, .. }) if owner == a.id() && this == b.id()
    ));
    assert!(matches!(b.free(x), Err(Error::ForeignAllocation { .. })));
    assert_eq!(
        checked(&a).allocation.all.current,
        1,
        "a's block still allocated"
    );
    assert_eq!(
        checked(&b).allocation.all.current,
        1,
        "b's own block untouched"
    );
    b.free(y).unwrap();
    // The zero-sized allocation belongs to no allocator.
    let z = a.allocate(0, S0).unwrap();
    b.free(z).unwrap();
}

/// Two simulated devices never hand out the same address, so a pointer of one is unknown to the
/// other's allocator.
#[test]
fn pointers_of_another_device_are_refused() {
    let (dev0, dev1) = (sim(GIB), sim(GIB));
    let p0 = dev0.raw_alloc(4096, S0).unwrap();
    let p1 = dev1.raw_alloc(4096, S0).unwrap();
    assert_ne!(p0, p1);
    assert!(matches!(
        dev1.raw_free(p0),
        Err(Error::InvalidPointer { .. })
    ));
    assert!(matches!(
        dev1.base_allocation(p0),
        Err(Error::InvalidPointer { .. })
    ));
    assert_eq!(checked(&dev1).allocation.all.current, 1);
    dev0.raw_free(p0).unwrap();
    dev1.raw_free(p1).unwrap();
}

/// The simulated device keeps accepting any stream number (trace replay makes streams from the
/// numbers a trace recorded).
#[test]
fn the_simulated_device_accepts_any_stream_number() {
    use tensormem_cuda_alloc::StreamId;
    let a = sim(GIB);
    for stream in [
        StreamId(0xdead),
        StreamId(u64::MAX),
        StreamId(0x7f12_3456_7000),
    ] {
        let x = a.allocate(4096, stream).unwrap();
        a.record_stream(&x, StreamId(0xbeef)).unwrap();
        a.free(x).unwrap();
    }
    a.device().complete_all_work();
    assert_eq!(checked(&a).allocation.all.current, 0);
}
