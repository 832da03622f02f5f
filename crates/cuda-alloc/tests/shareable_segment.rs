//! `CachingAllocator::shareable_segment`: what another process maps to use an allocation. Plain
//! segments give their device allocation; expandable ones give the chunks under the block, each
//! exported once as a file descriptor that stays open while the chunk is mapped.

mod common;

use std::os::fd::{AsRawFd, BorrowedFd};

use common::*;
use tensormem_cuda_alloc::backend::sim::SimChunk;
use tensormem_cuda_alloc::{ShareableSegment, StreamId};

const MIB: usize = 1 << 20;

fn chunks(segment: ShareableSegment) -> tensormem_cuda_alloc::ChunkExport {
    match segment {
        ShareableSegment::Chunks(export) => export,
        other => panic!("expected chunks, got {other:?}"),
    }
}

fn fd_open(fd: i32) -> bool {
    rustix::io::fcntl_getfd(unsafe_borrow(fd)).is_ok()
}

fn unsafe_borrow(fd: i32) -> BorrowedFd<'static> {
    // SAFETY: only used to ask whether `fd` is open (fcntl(F_GETFD) on a closed fd fails with
    // EBADF); nothing reads or closes through it.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

#[test]
fn a_plain_segment_gives_its_device_allocation() {
    let alloc = sim_with("", 8 * GIB);
    let a = alloc.allocate(1000, StreamId(0)).unwrap();
    let b = alloc.allocate(3000, StreamId(0)).unwrap();
    let (base, size) = alloc.base_allocation(b.ptr()).unwrap();
    assert_eq!(
        alloc.shareable_segment(b.ptr()).unwrap(),
        ShareableSegment::Allocation { base, size }
    );
    assert_eq!(base, a.ptr(), "both lie in one 2 MiB small segment");
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
}

#[test]
fn an_expandable_block_gives_the_chunks_under_it_and_the_same_fds_every_time() {
    let alloc = sim_with("expandable_segments:True", 8 * GIB);
    // Large pool: 20 MiB chunks. A 25 MiB block after a 4 MiB one spans chunks 0 and 1.
    let first = alloc.allocate(4 * MIB, StreamId(0)).unwrap();
    let second = alloc.allocate(25 * MIB + 7, StreamId(0)).unwrap();
    let export = chunks(alloc.shareable_segment(second.ptr()).unwrap());
    assert_eq!(export.chunk_size, 20 * MIB as u64);
    assert_eq!(
        export.base,
        first.ptr(),
        "the range starts at the first chunk's start"
    );
    assert_eq!(export.fds.len(), 2, "{export:?}");
    for (i, &fd) in export.fds.iter().enumerate() {
        let named = SimChunk::read_exported(unsafe_borrow(fd)).unwrap();
        assert_eq!(named.size, 20 * MIB, "chunk {i}");
    }
    // Sharing again (or sharing the other block of chunk 0) names the same descriptors.
    let again = chunks(alloc.shareable_segment(second.ptr()).unwrap());
    assert_eq!(again, export);
    let of_first = chunks(alloc.shareable_segment(first.ptr()).unwrap());
    assert_eq!(of_first.fds, export.fds[..1]);
    assert_eq!(
        alloc.device().counters().exports,
        2,
        "each chunk exported once"
    );

    // Freed and the cache emptied: the chunks are unmapped and their descriptors closed.
    alloc.free(first).unwrap();
    alloc.free(second).unwrap();
    alloc.empty_cache().unwrap();
    for fd in export.fds {
        assert!(
            !fd_open(fd),
            "fd {fd} still open after its chunk was unmapped"
        );
    }
}

#[test]
fn a_small_expandable_block_gives_one_2_mib_chunk() {
    let alloc = sim_with("expandable_segments:True", 8 * GIB);
    let a = alloc.allocate(1000, StreamId(0)).unwrap();
    let export = chunks(alloc.shareable_segment(a.ptr()).unwrap());
    assert_eq!(export.chunk_size, 2 * MIB as u64);
    assert_eq!(export.fds.len(), 1);
    assert_eq!(export.base, a.ptr());
    let fd = export.fds[0];
    assert!(fd_open(fd) && fd != std::io::stdin().as_raw_fd());
    alloc.free(a).unwrap();
}

#[test]
fn an_unknown_pointer_is_refused() {
    let alloc = sim_with("expandable_segments:True", 8 * GIB);
    let a = alloc.allocate(4 * MIB, StreamId(0)).unwrap();
    let inside = a.ptr().offset(512);
    assert!(matches!(
        alloc.shareable_segment(inside),
        Err(tensormem_cuda_alloc::Error::InvalidPointer { .. })
    ));
    alloc.free(a).unwrap();
}
