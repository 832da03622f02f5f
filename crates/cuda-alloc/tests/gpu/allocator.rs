//! The caching allocator on a real GPU: memory is real and disjoint, `record_stream` defers reuse until
//! the other stream's work is done, out-of-memory behaves as PyTorch's (message, retry), the memory
//! fraction is enforced, expandable segments grow in place on real virtual memory.

use std::sync::mpsc;
use std::time::Duration;

use tensormem_cuda_alloc::backend::cuda::{BackendStream, CudaBackend};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::size::format_size;
use tensormem_cuda_alloc::snapshot::BlockState;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, Device, DeviceAddress, Error};

use crate::harness::{gpu, mib};

const MIB: usize = 1 << 20;

fn allocator(config: &str) -> CachingAllocator<CudaBackend> {
    let config = AllocatorConfig::parse(config).unwrap();
    CachingAllocator::with_config(CudaBackend::new(0).unwrap(), config)
}

/// Frees what is left and returns every cached byte to the device, checking nothing stays reserved.
fn release_all(alloc: &CachingAllocator<CudaBackend>, live: Vec<Allocation>) {
    for a in live {
        alloc.free(a).unwrap();
    }
    alloc.device().synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(
        alloc.reserved_bytes(),
        0,
        "empty_cache left memory reserved"
    );
}

fn read_back(stream: &BackendStream, ptr: DeviceAddress, len: usize) -> Vec<u8> {
    let mut back = vec![0u8; len];
    // SAFETY: the callers pass live allocations of at least `len` bytes, idle once the copy synchronises.
    unsafe { stream.copy_to_host(&mut back, ptr).unwrap() };
    back
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn allocations_are_usable_device_memory_and_never_overlap() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator("");
    let stream = alloc.device().create_stream().unwrap();
    let sizes: Vec<usize> = (0..48)
        .map(|i| [512, 3000, 65_536, 600_000, MIB, 3 * MIB, 12 * MIB, 40 * MIB][i % 8] + i)
        .collect();
    let live: Vec<Allocation> = sizes
        .iter()
        .map(|&s| alloc.allocate(s, stream.id()).unwrap())
        .collect();

    let mut spans: Vec<(u64, u64)> = live
        .iter()
        .map(|a| (a.ptr().addr(), a.ptr().addr() + a.size() as u64))
        .collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "blocks {:#x}..{:#x} and {:#x}..{:#x} overlap",
            pair[0].0,
            pair[0].1,
            pair[1].0,
            pair[1].1
        );
    }
    // The device writes a different byte into each block (in allocation order), then every block is read
    // back whole: any overlap or unusable memory shows as a wrong byte.
    for (i, a) in live.iter().enumerate() {
        assert!(a.size() >= a.requested_size());
        // SAFETY: `a` is a live allocation of `a.size()` bytes on this stream.
        unsafe {
            stream
                .memset_d8(a.ptr(), (i % 251) as u8 + 1, a.size())
                .unwrap()
        };
    }
    for (i, a) in live.iter().enumerate() {
        let back = read_back(&stream, a.ptr(), a.size());
        assert!(
            back.iter().all(|&b| b == (i % 251) as u8 + 1),
            "block {i} at {} does not hold its own bytes",
            a.ptr()
        );
    }
    let stats = alloc.memory_stats();
    assert_eq!(stats.allocation.all.current, live.len() as i64);
    assert_eq!(
        stats.allocated_bytes.all.current,
        live.iter().map(|a| a.size() as i64).sum::<i64>()
    );
    release_all(&alloc, live);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_block_used_by_another_stream_is_reused_only_after_that_stream_is_done() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator("");
    let home = alloc.device().create_stream().unwrap();
    let other = alloc.device().create_stream().unwrap();

    let first = alloc.allocate(MIB, home.id()).unwrap();
    let first_ptr = first.ptr();
    // Hold `other` busy until the test says so, then mark the block as used by it and free it.
    let (release, wait) = mpsc::channel::<()>();
    // SAFETY: the host function only waits on a channel; it makes no CUDA call.
    unsafe {
        other.launch_host_fn(move || {
            let _ = wait.recv_timeout(Duration::from_secs(60));
        })
    }
    .unwrap();
    alloc.record_stream(&first, other.id()).unwrap();
    alloc.free(first).unwrap();

    let snapshot = alloc.snapshot();
    let pending = snapshot
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.address == first_ptr.addr())
        .unwrap();
    assert_eq!(pending.state, BlockState::ActivePendingFree);

    // While `other` is busy, the same request gets other memory, however often it is asked. These
    // blocks stay live, so that once `first` is free it is the only free block of its size.
    let mut meanwhile = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(20));
        let a = alloc.allocate(MIB, home.id()).unwrap();
        assert_ne!(
            a.ptr(),
            first_ptr,
            "the block was handed out again while another stream still used it"
        );
        meanwhile.push(a);
    }

    release.send(()).unwrap();
    other.synchronize().unwrap();
    // Once the work is done the block is free again, the only free block that fits, and handed out.
    let again = alloc.allocate(MIB, home.id()).unwrap();
    assert_eq!(
        again.ptr(),
        first_ptr,
        "the block was not reused after the other stream finished"
    );
    meanwhile.push(again);
    release_all(&alloc, meanwhile);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn out_of_memory_retries_after_releasing_the_cache_then_fails_with_pytorchs_message() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator("");
    let stream = alloc.device().create_stream().unwrap();
    let info = alloc.device().mem_info().unwrap();
    let free = info.free as usize;

    // Cache 40% of the free memory, then ask for 70%: the device refuses while the cache holds its
    // segment, so the allocator must release the cache and retry.
    let cached = alloc.allocate(free / 10 * 4, stream.id()).unwrap();
    alloc.free(cached).unwrap();
    let before = alloc.memory_stats();
    let big = alloc.allocate(free / 10 * 7, stream.id()).unwrap();
    let after = alloc.memory_stats();
    assert!(
        after.num_alloc_retries > before.num_alloc_retries,
        "no retry recorded: {} -> {}",
        before.num_alloc_retries,
        after.num_alloc_retries
    );
    assert!(
        after.num_device_free > before.num_device_free,
        "the cached segment was not released"
    );

    // Twice the device's capacity cannot be had: PyTorch's error, with this device's real figures.
    let request = info.total as usize * 2;
    let err = alloc.allocate(request, stream.id()).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("expected OutOfMemory, got {err:?}")
    };
    let message = err.to_string();
    assert_eq!(oom.device, 0);
    assert_eq!(oom.device_total, info.total);
    assert!(oom.alloc_size >= request as u64);
    assert!(oom.device_free <= info.total);
    assert_eq!(oom.allocated, big.size() as u64);
    assert!(
        message.starts_with(&format!(
            "CUDA out of memory. Tried to allocate {}. ",
            format_size(oom.alloc_size)
        )),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "GPU 0 has a total capacity of {} of which {} is free.",
            format_size(info.total),
            format_size(oom.device_free)
        )),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "Of the allocated memory {} is allocated by tensormem",
            format_size(big.size() as u64)
        )),
        "{message}"
    );
    assert_eq!(alloc.memory_stats().num_ooms, 1);

    // The device and the allocator still work.
    let small = alloc.allocate(MIB, stream.id()).unwrap();
    // SAFETY: a live 1 MiB allocation on this stream.
    unsafe { stream.memset_d8(small.ptr(), 0x11, MIB).unwrap() };
    assert!(read_back(&stream, small.ptr(), MIB)
        .iter()
        .all(|&b| b == 0x11));
    release_all(&alloc, vec![big, small]);
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_memory_fraction_of_one_half_is_enforced() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator("");
    let stream = alloc.device().create_stream().unwrap();
    let total = alloc.device().mem_info().unwrap().total as usize;
    alloc.set_memory_fraction(0.5).unwrap();
    assert!((alloc.memory_fraction().unwrap() - 0.5).abs() < 1e-6);

    let err = alloc.allocate(total / 10 * 6, stream.id()).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("60% under a 0.5 fraction gave {err:?}")
    };
    let allowed = oom.allowed.expect("the error names the allowed maximum");
    assert_eq!(
        allowed,
        total as u64 / 2,
        "allowed {} of {}",
        mib(allowed),
        mib(total as u64)
    );
    assert!(
        err.to_string()
            .contains(&format!("{} allowed;", format_size(allowed))),
        "{err}"
    );

    let first = alloc.allocate(total / 10 * 3, stream.id()).unwrap();
    let second = alloc.allocate(total / 10 * 3, stream.id());
    assert!(
        matches!(second, Err(Error::OutOfMemory(_))),
        "30% + 30% went past a 0.5 fraction"
    );
    assert!(alloc.reserved_bytes() <= total as u64 / 2);
    release_all(&alloc, vec![first]);
    assert!(matches!(
        alloc.set_memory_fraction(1.5),
        Err(Error::InvalidFraction { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn expandable_segments_grow_in_place_and_empty_cache_unmaps_them() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let alloc = allocator("expandable_segments:True");
    let stream = alloc.device().create_stream().unwrap();
    let free_at_start = alloc.device().mem_info().unwrap().free;

    let a = alloc.allocate(30 * MIB, stream.id()).unwrap();
    let first = alloc.snapshot();
    let large: Vec<_> = first
        .segments
        .iter()
        .filter(|s| s.is_expandable && s.blocks.iter().any(|b| b.address == a.ptr().addr()))
        .collect();
    assert_eq!(
        large.len(),
        1,
        "the block is not in one expandable segment: {:?}",
        first.segments
    );
    let (base, size_before) = (large[0].address, large[0].total_size);

    let b = alloc.allocate(30 * MIB, stream.id()).unwrap();
    let c = alloc.allocate(100 * MIB, stream.id()).unwrap();
    let grown = alloc.snapshot();
    let segment = grown
        .segments
        .iter()
        .find(|s| s.address == base)
        .expect("the segment moved");
    assert!(segment.is_expandable);
    let in_use = (a.size() + b.size() + c.size()) as u64;
    assert!(
        segment.total_size > size_before && segment.total_size >= in_use,
        "the segment grew from {size_before} to {} bytes for {in_use} bytes in use",
        segment.total_size
    );
    for x in [&b, &c] {
        assert!(
            x.ptr().addr() >= base && x.ptr().addr() + x.size() as u64 <= base + segment.total_size,
            "{} is outside the grown segment",
            x.ptr()
        );
    }
    // Grown in place: each new block was mapped right after the previous one.
    assert_eq!(
        b.ptr(),
        a.ptr().offset(a.size()),
        "the second block is not right after the first"
    );
    assert_eq!(
        c.ptr(),
        b.ptr().offset(b.size()),
        "the third block is not right after the second"
    );
    // The mapped memory is real: the device writes across all three blocks in one go.
    let span = a.size() + b.size() + c.size();
    // SAFETY: the three live allocations are contiguous (checked above) and cover `[a, a + span)`.
    unsafe { stream.memset_d8(a.ptr(), 0x77, span).unwrap() };
    assert!(read_back(&stream, a.ptr(), span).iter().all(|&x| x == 0x77));

    let mapped = alloc.device().mem_info().unwrap().free;
    assert!(mapped + 150 * MIB as u64 <= free_at_start + 4 * MIB as u64);
    let stats = alloc.memory_stats();
    release_all(&alloc, vec![a, b, c]);
    let after = alloc.memory_stats();
    assert!(
        after.num_device_free > stats.num_device_free,
        "empty_cache unmapped nothing"
    );
    assert!(alloc
        .snapshot()
        .segments
        .iter()
        .all(|s| s.total_size == 0 || !s.is_expandable || s.address != base));
    let free_at_end = alloc.device().mem_info().unwrap().free;
    assert!(
        free_at_end + 4 * MIB as u64 >= free_at_start,
        "unmapped memory did not return to the device: {} before, {} after",
        mib(free_at_start),
        mib(free_at_end)
    );
}
