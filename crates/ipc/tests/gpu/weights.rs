//! Weights publications on a real GPU between two processes: every byte of every version installed
//! into the consumer's own parameters (batched copies on a stream of its own), from memory of
//! `cuMemAlloc` and from memory of expandable segments beside it.

use std::io::BufRead;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use tensormem_cuda_alloc::backend::cuda::CudaBackend;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, StreamId};
use tensormem_ipc::driver::cuda::CudaIpcDriver;
use tensormem_ipc::weights::{
    DType, PlacedTensor, PlanOptions, PublishedTensor, TensorMeta, WeightPublisher,
    WeightSubscriber, WeightsMessage,
};
use tensormem_ipc::{IpcConsumer, SegmentMemory};
use tensormem_test_support::{hex, unhex};

use super::{check, current, expandable_gpu, fill, gpu, read, role, Allocator, Peer};

const CONSUMER: &str = "weights_consumer";
const WAIT: Option<Duration> = Some(Duration::from_secs(60));

/// Element types and shapes of a small model: tensors small enough to share segments and large
/// enough to have their own, a transposed matrix, and an empty one.
fn layout() -> Vec<(String, TensorMeta)> {
    let mut out = Vec::new();
    let dtypes = [DType::BFloat16, DType::Float32, DType::Float16, DType::Int8];
    for i in 0..40u64 {
        let dtype = dtypes[i as usize % dtypes.len()];
        let shape = match i % 5 {
            0 => vec![1024, 1024],
            1 => vec![3 * i + 1],
            2 => vec![17, 33, 5],
            3 => vec![4096, 300],
            _ => vec![129],
        };
        out.push((
            format!("layers.{i}.w"),
            TensorMeta::contiguous(dtype, &shape),
        ));
    }
    out.push((
        "head.transposed".into(),
        TensorMeta {
            dtype: DType::Float32,
            shape: vec![512, 256],
            strides: vec![1, 512],
        },
    ));
    out.push((
        "empty".into(),
        TensorMeta::contiguous(DType::Float32, &[0, 8]),
    ));
    out
}

/// The byte tensor `i` holds in version `v`.
fn byte(i: usize, v: u64) -> u8 {
    ((i as u64 * 7 + v * 13) % 251) as u8 + 1
}

fn allocate(allocator: &Allocator, metas: &[(String, TensorMeta)]) -> Vec<Option<Allocation>> {
    metas
        .iter()
        .map(|(_, m)| (m.span() > 0).then(|| allocator.allocate(m.span() as usize, S0).unwrap()))
        .collect()
}

const S0: StreamId = StreamId::DEFAULT;

fn new_stream() -> StreamId {
    current();
    let mut stream = std::ptr::null_mut();
    // SAFETY: `stream` is a valid out-parameter; device 0's context is current.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(
            &mut stream,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    })
    .unwrap();
    StreamId(stream as u64)
}

/// The consumer: `open HEX` (answers `@@opened COPIES`), `install V` (answers `@@installed V
/// WRONG`, the number of tensors whose bytes are not version V's), end of input to finish.
fn weights_consumer() {
    let (allocator, _, _lock) = gpu().expect("the parent found a GPU");
    let driver = std::sync::Arc::new(tensormem_ipc::driver::cuda::CudaIpcDriver::new().unwrap());
    let consumer = IpcConsumer::new(driver);
    let metas = layout();
    let params = allocate(&allocator, &metas);
    for (a, (_, m)) in params.iter().zip(&metas) {
        if let Some(a) = a {
            fill(a.ptr(), 0, m.span() as usize);
        }
    }
    let stream = new_stream();
    let mut sub = None;
    let mut plan = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["open", wire] => {
                let message = WeightsMessage::decode(&unhex(wire)).unwrap();
                let mut opened = WeightSubscriber::open(&consumer, &message, stream).unwrap();
                let destinations: Vec<PlacedTensor<'_>> = metas
                    .iter()
                    .zip(&params)
                    .map(|((name, meta), a)| PlacedTensor {
                        name,
                        ptr: a
                            .as_ref()
                            .map_or(tensormem_cuda_alloc::DeviceAddress(0), |a| a.ptr()),
                        meta,
                    })
                    .collect();
                let id = opened
                    .prepare(&destinations, PlanOptions::default())
                    .unwrap();
                println!("@@opened {}", opened.plan(id).copies().len());
                plan = Some(id);
                sub = Some(opened);
            }
            ["install", v] => {
                let sub = sub.as_mut().unwrap();
                // SAFETY: the destinations are this process's allocations, idle, kept to the end.
                let got = unsafe { sub.install(plan.unwrap(), stream, WAIT) }.unwrap();
                assert_eq!(got.to_string(), *v);
                let wrong = params
                    .iter()
                    .zip(&metas)
                    .enumerate()
                    .filter(|(i, (a, (_, m)))| {
                        a.as_ref().is_some_and(|a| {
                            read(a.ptr(), m.span() as usize)
                                .iter()
                                .any(|&b| b != byte(*i, got))
                        })
                    })
                    .count();
                println!("@@installed {got} {wrong}");
            }
            _ => panic!("unknown command {line:?}"),
        }
    }
    drop(sub);
}

/// Has a consumer process (this binary running `test` as [`CONSUMER`]) open `publisher`'s message
/// and install three versions into its own parameters, the producer writing every tensor of
/// `weights` (laid out as `metas`) before each; checks every byte of each version there.
fn three_versions_reach_a_consumer(
    test: &str,
    publisher: &mut WeightPublisher<CudaBackend, CudaIpcDriver>,
    metas: &[(String, TensorMeta)],
    weights: &[Option<Allocation>],
) {
    let mut peer = Peer::this(test, CONSUMER);
    peer.send(&format!(
        "open {}",
        hex(&publisher.message().unwrap().encode())
    ));
    let copies: usize = peer.expect("opened")[0].parse().unwrap();
    assert!(copies <= metas.len());
    let stream = new_stream();
    for v in 1..=3u64 {
        for (i, (a, (_, m))) in weights.iter().zip(metas).enumerate() {
            if let Some(a) = a {
                fill(a.ptr(), byte(i, v), m.span() as usize);
            }
        }
        assert_eq!(publisher.publish(stream).unwrap(), v);
        peer.send(&format!("install {v}"));
        publisher.wait_installed(v, WAIT).unwrap();
        assert_eq!(peer.expect("installed"), [v.to_string(), "0".to_string()]);
    }
    assert_eq!(publisher.holders(), 1);
    peer.finish();
    publisher.wait_released(WAIT).unwrap();
    assert_eq!(publisher.holders(), 0);
}

/// The published tensors of `weights`, laid out as `metas`.
fn published(
    metas: &[(String, TensorMeta)],
    weights: &[Option<Allocation>],
) -> Vec<PublishedTensor> {
    metas
        .iter()
        .zip(weights)
        .map(|((name, meta), a)| PublishedTensor {
            name: name.clone(),
            ptr: a
                .as_ref()
                .map_or(tensormem_cuda_alloc::DeviceAddress(0), |a| a.ptr()),
            meta: meta.clone(),
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn every_byte_of_every_version_reaches_the_consumers_parameters() {
    const TEST: &str = "weights::every_byte_of_every_version_reaches_the_consumers_parameters";
    if role().as_deref() == Some(CONSUMER) {
        weights_consumer();
        return;
    }
    let Some((allocator, producer, _lock)) = gpu() else {
        return;
    };
    let metas = layout();
    let weights = allocate(&allocator, &metas);
    // SAFETY: the tensors are this test's allocations, kept until the publication is released.
    let mut publisher =
        unsafe { WeightPublisher::new(&producer, 0, &published(&metas, &weights)) }.unwrap();
    three_versions_reach_a_consumer(TEST, &mut publisher, &metas, &weights);
}

/// Memory of expandable segments (chunks of `cuMemCreate`, exported as file descriptors) in one
/// publication with memory of `cuMemAlloc`: every byte of every version reaches the consumer's
/// own parameters, through ranges of chunks the consumer maps in one piece each.
#[test]
#[ignore = "needs a CUDA GPU (cargo xtask test-gpu runs it)"]
fn memory_of_expandable_segments_reaches_the_consumers_parameters() {
    const TEST: &str = "weights::memory_of_expandable_segments_reaches_the_consumers_parameters";
    if role().as_deref() == Some(CONSUMER) {
        weights_consumer();
        return;
    }
    let Some((expandable, producer, _lock)) = expandable_gpu() else {
        return;
    };
    let plain: Allocator = Arc::new(CachingAllocator::new(
        CudaBackend::new(0).expect("opening device 0"),
    ));
    let metas = layout();
    // Every fifth tensor in a device allocation, the others in expandable segments.
    let weights: Vec<Option<Allocation>> = metas
        .iter()
        .enumerate()
        .map(|(i, (_, m))| {
            let allocator = if i % 5 == 4 { &plain } else { &expandable };
            (m.span() > 0).then(|| allocator.allocate(m.span() as usize, S0).unwrap())
        })
        .collect();
    // SAFETY: the tensors are this test's allocations, kept until the publication is released.
    let mut publisher =
        unsafe { WeightPublisher::new(&producer, 0, &published(&metas, &weights)) }.unwrap();
    let message = publisher.message().unwrap();
    let ranges = message
        .batch()
        .segments()
        .iter()
        .filter(|s| matches!(s.memory, SegmentMemory::Chunks(_)))
        .count();
    assert!(
        ranges >= 1 && ranges < message.batch().segments().len(),
        "ranges of chunks beside device allocations: {:?}",
        message.batch().segments()
    );
    // That message's slot is given back unopened.
    IpcConsumer::new(Arc::new(CudaIpcDriver::new().unwrap()))
        .release_batch(message.batch())
        .unwrap();
    three_versions_reach_a_consumer(TEST, &mut publisher, &metas, &weights);
    drop(publisher);
    for (a, (i, _)) in weights.into_iter().zip(metas.iter().enumerate()) {
        if let Some(a) = a {
            let allocator = if i % 5 == 4 { &plain } else { &expandable };
            allocator.free(a).unwrap();
        }
    }
}
