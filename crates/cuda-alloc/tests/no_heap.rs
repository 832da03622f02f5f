//! The warm allocation path allocates no heap memory (counted by a global allocator wrapper).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::*;

struct Counting;

thread_local! {
    /// Heap allocations made by this thread (other threads, such as the test harness's, do not count).
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: the slot may be gone while the thread exits; a const-initialised `Cell` never allocates.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

fn allocations() -> usize {
    ALLOCATIONS.with(Cell::get)
}

// SAFETY: every call is forwarded unchanged to the system allocator, which upholds `GlobalAlloc`'s
// contract; the wrapper only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's layout, as the caller's obligations require.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as for `dealloc`, and `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn warm_allocations_and_frees_allocate_no_heap_memory() {
    let a = sim(GIB);
    let sizes = [512, 3000, 64 * KIB, MIB, 3 * MIB, 12 * MIB, 64 * MIB];
    let round = || {
        for &size in &sizes {
            let x = a.allocate(size, S0).unwrap();
            a.free(x).unwrap();
        }
        let (x, y) = (a.allocate(512, S0).unwrap(), a.allocate(1024, S0).unwrap());
        a.free(x).unwrap();
        a.free(y).unwrap();
    };
    // Warm up: segments, blocks and free-set entries exist after the first rounds (and every
    // `tracing` call site on the path has registered itself).
    for _ in 0..2 {
        let held: Vec<_> = sizes.iter().map(|&s| a.allocate(s, S0).unwrap()).collect();
        for x in held {
            a.free(x).unwrap();
        }
        round();
    }
    let before = allocations();
    for _ in 0..1000 {
        round();
    }
    let after = allocations();
    assert_eq!(after - before, 0, "heap allocations on the warm path");
}
