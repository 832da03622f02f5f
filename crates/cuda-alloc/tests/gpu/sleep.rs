//! Pools that sleep and wake on a real GPU: the memory goes back to the device (`cuMemGetInfo`),
//! the addresses stay, and the contents come back from host memory (staged, and pinned while
//! the pool sleeps).

use tensormem_cuda_alloc::backend::cuda::{CudaBackend, CudaPinnedSource};
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::host::HostCachingAllocator;
use tensormem_cuda_alloc::{CachingAllocator, Device, DeviceAddress, MempoolId, StreamId};

use crate::harness::{gpu, mib};

const MIB: usize = 1 << 20;
const POOL: MempoolId = MempoolId(0, 0x51ee9);

/// Bytes of a block's pattern: a word per 4 bytes, depending on the block and the offset.
fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len / 4)
        .flat_map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed)
                .to_le_bytes()
        })
        .collect()
}

fn read(device: &CudaBackend, at: DeviceAddress, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `[at, at + len)` lies in an allocated block of the pool, mapped; no work is queued.
    unsafe { device.copy_to_host(at, out.as_mut_ptr(), len).unwrap() };
    out
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn a_pool_sleeps_returning_its_memory_and_wakes_with_its_contents_at_the_same_addresses() {
    let Some(gpus) = gpu() else { return };
    drop(gpus.devices);
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let alloc = CachingAllocator::with_config(CudaBackend::new(0).unwrap(), config);
    let host_device = CudaBackend::new(0).unwrap();
    let source = CudaPinnedSource::host_alloc(&host_device);
    let host: &'static HostCachingAllocator<CudaBackend> =
        Box::leak(Box::new(HostCachingAllocator::new(host_device, source)));
    let device = alloc.device();

    alloc.create_or_incref_pool(POOL).unwrap();
    alloc.begin_allocate_to_pool(POOL, |_| true).unwrap();
    let sizes = [512 * MIB, 300 * MIB + 12345, 64 * MIB, 700 * 1024];
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&s| alloc.allocate(s, StreamId::DEFAULT).unwrap())
        .collect();
    alloc.end_allocate_to_pool(POOL).unwrap();
    // Fill every block: a pattern per block, written from the host.
    let filled: Vec<Vec<u8>> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let data = pattern(i as u32 * 7919 + 1, b.size() / 4 * 4);
            // SAFETY: the block is allocated, mapped and unused by queued work.
            unsafe { device.copy_from_host(data.as_ptr(), b.ptr(), data.len()) }.unwrap();
            data
        })
        .collect();
    let reserved = alloc.memory_stats().reserved_bytes.all.current as u64;
    let allocated = alloc.memory_stats().allocated_bytes.all.current;
    device.synchronize().unwrap();
    let free_before = device.mem_info().unwrap().free;

    let slept = alloc.sleep_pool(POOL, Some(Box::new(host))).unwrap();
    let free_asleep = device.mem_info().unwrap().free;
    let returned = free_asleep.saturating_sub(free_before);
    assert_eq!(
        slept.released_bytes, reserved,
        "every mapped byte of the pool"
    );
    assert_eq!(slept.backed_up_bytes, reserved);
    assert!(
        returned * 100 >= slept.released_bytes * 95,
        "cuMemGetInfo free memory rose by {} for a pool of {}",
        mib(returned),
        mib(slept.released_bytes)
    );
    assert!(alloc.is_pool_asleep(POOL));
    assert_eq!(
        alloc.memory_stats().reserved_bytes.all.current as u64,
        reserved - slept.released_bytes,
        "reserved bytes leave with the physical memory"
    );
    assert_eq!(alloc.memory_stats().allocated_bytes.all.current, allocated);

    let woke = alloc.wake_pool(POOL).unwrap();
    assert_eq!(woke.mapped_bytes, slept.released_bytes);
    assert_eq!(woke.restored_bytes, slept.backed_up_bytes);
    let free_awake = device.mem_info().unwrap().free;
    assert!(
        free_awake <= free_before + slept.released_bytes / 20,
        "the memory is taken again: {} free before, {} after waking",
        mib(free_before),
        mib(free_awake)
    );
    for ((block, data), &size) in blocks.iter().zip(&filled).zip(&sizes) {
        assert!(block.size() >= size);
        assert!(
            read(device, block.ptr(), data.len()) == *data,
            "the contents of the block at {} came back",
            block.ptr()
        );
    }
    // The same addresses serve new work: write and read at them.
    let fresh = pattern(99, 4 * MIB);
    // SAFETY: the first block is allocated and mapped again.
    unsafe { device.copy_from_host(fresh.as_ptr(), blocks[0].ptr(), fresh.len()) }.unwrap();
    assert!(read(device, blocks[0].ptr(), fresh.len()) == fresh);

    // Again with contents, the pool left asleep until the background threads moved its staged
    // backup into pinned memory: the wake copies every piece straight from pinned memory.
    for (block, data) in blocks.iter().zip(&filled) {
        // SAFETY: the block is allocated and mapped; no work is queued.
        unsafe { device.copy_from_host(data.as_ptr(), block.ptr(), data.len()) }.unwrap();
    }
    let slept = alloc.sleep_pool(POOL, Some(Box::new(host))).unwrap();
    let started = std::time::Instant::now();
    while alloc.asleep_staged_bytes(Some(POOL)) > 0 {
        assert!(
            started.elapsed().as_secs() < 120,
            "the staged backup was not pinned"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let woke = alloc.wake_pool(POOL).unwrap();
    assert_eq!(woke.restored_bytes, slept.backed_up_bytes);
    assert_eq!(
        woke.staged_bytes, 0,
        "every piece came back from pinned memory"
    );
    for (block, data) in blocks.iter().zip(&filled) {
        assert!(read(device, block.ptr(), data.len()) == *data);
    }

    // Without contents: the memory is returned and comes back mapped (contents undefined).
    let free_awake = device.mem_info().unwrap().free;
    let slept = alloc.sleep_pool(POOL, None).unwrap();
    assert_eq!(slept.backed_up_bytes, 0);
    let returned = device.mem_info().unwrap().free.saturating_sub(free_awake);
    assert!(
        returned * 100 >= slept.released_bytes * 95,
        "{} returned of {}",
        mib(returned),
        mib(slept.released_bytes)
    );
    alloc.wake_pool(POOL).unwrap();
    let _ = read(device, blocks[3].ptr(), 4096);

    for b in blocks {
        alloc.free(b).unwrap();
    }
    alloc.release_pool(POOL).unwrap();
    alloc.release_pool(POOL).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.memory_stats().reserved_bytes.all.current, 0);
    host.empty_cache().unwrap();
}
