//! Two GPUs of one host, a rank on each: a thread per rank, each with a communicator made from one
//! unique id (`ncclCommInitRank`, as separate processes or machines make theirs). Rank 0 sends a
//! GPT-2-small-like state dict (150 fp32 tensors, 498 MB) into rank 1's own tensors, allocated in
//! the reverse order, twice (two versions); rank 1 checks every byte of every tensor. A layout
//! that differs is refused on both ranks. A rank that stops syncing is a timeout on the other,
//! not a hang. `#[ignore]`d (the bundle's run.sh runs it with
//! `--include-ignored`); without two devices or without NCCL it says `skipped: ...`, and fails
//! instead with `TENSORMEM_REQUIRE_GPU=1`. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`).

use std::ffi::c_int;

use cudarc::nccl::{result, sys};
use tensormem_cuda_alloc::backend::cuda::{BackendStream, CudaBackend};
use tensormem_cuda_alloc::{Allocation, CachingAllocator};
use tensormem_nccl::weights::{self, LocalTensor, SyncOptions};
use tensormem_nccl::{Error, Mismatch};

mod common;
use common::two_gpus_and_nccl;

/// A bucket size that gives several buckets, `wte` alone in the first two.
const BUCKET: usize = 64 << 20;

/// GPT-2 small's state dict (names and fp32 shapes, in order) and two small extra tensors: 150.
fn gpt2() -> Vec<(String, Vec<usize>)> {
    let (d, v) = (768, 50257);
    let mut out = vec![
        ("wte.weight".to_owned(), vec![v, d]),
        ("wpe.weight".to_owned(), vec![1024, d]),
    ];
    for i in 0..12 {
        for (name, shape) in [
            ("ln_1.weight", vec![d]),
            ("ln_1.bias", vec![d]),
            ("attn.c_attn.weight", vec![d, 3 * d]),
            ("attn.c_attn.bias", vec![3 * d]),
            ("attn.c_proj.weight", vec![d, d]),
            ("attn.c_proj.bias", vec![d]),
            ("ln_2.weight", vec![d]),
            ("ln_2.bias", vec![d]),
            ("mlp.c_fc.weight", vec![d, 4 * d]),
            ("mlp.c_fc.bias", vec![4 * d]),
            ("mlp.c_proj.weight", vec![4 * d, d]),
            ("mlp.c_proj.bias", vec![d]),
        ] {
            out.push((format!("h.{i}.{name}"), shape));
        }
    }
    out.extend([
        ("ln_f.weight".to_owned(), vec![d]),
        ("ln_f.bias".to_owned(), vec![d]),
        ("score.weight".to_owned(), vec![3, d]),
        ("temperature".to_owned(), vec![1]),
    ]);
    assert_eq!(out.len(), 150);
    out
}

fn bytes_of(shape: &[usize]) -> usize {
    shape.iter().product::<usize>() * 4
}

/// The bytes of tensor `index` at `version`: no shift of them repeats.
fn pattern(index: usize, version: u64, len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = (0..len.div_ceil(8) as u64)
        .flat_map(|w| {
            (w.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((index as u64) << 40) ^ (version << 56))
                .to_le_bytes()
        })
        .collect();
    out.truncate(len);
    out
}

/// One rank: its device, allocator, stream and communicator.
struct Rank {
    rank: usize,
    stream: BackendStream,
    allocator: CachingAllocator<CudaBackend>,
    comm: sys::ncclComm_t,
}

impl Rank {
    fn new(rank: usize, id: sys::ncclUniqueId) -> Self {
        let device = CudaBackend::new(rank as u32).unwrap();
        device.make_current().unwrap();
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-parameter; both ranks pass the same id, on their devices.
        unsafe { result::comm_init_rank(&mut comm, 2, id, rank as c_int) }.unwrap();
        Self {
            rank,
            stream: device.create_stream().unwrap(),
            allocator: CachingAllocator::new(CudaBackend::new(rank as u32).unwrap()),
            comm,
        }
    }

    /// Tensors of `layout` allocated in `order`; the allocations to free.
    fn tensors(
        &self,
        layout: &[(String, Vec<usize>)],
        order: &[usize],
    ) -> (Vec<LocalTensor>, Vec<Allocation>) {
        order
            .iter()
            .map(|&i| {
                let (name, shape) = &layout[i];
                let bytes = bytes_of(shape);
                let a = self.allocator.allocate(bytes, self.stream.id()).unwrap();
                let t = LocalTensor {
                    name: name.clone(),
                    ptr: a.ptr(),
                    bytes: bytes as u64,
                    meta: format!("f32{shape:?}"),
                };
                (t, a)
            })
            .unzip()
    }

    fn connect(&self, tensors: &[LocalTensor]) -> Result<weights::cuda::CudaWeightSync, Error> {
        self.connect_with(
            tensors,
            SyncOptions {
                bucket_bytes: BUCKET,
                ..SyncOptions::default()
            },
        )
    }

    fn connect_with(
        &self,
        tensors: &[LocalTensor],
        options: SyncOptions,
    ) -> Result<weights::cuda::CudaWeightSync, Error> {
        // SAFETY: `comm` lives on this rank's device and is destroyed in `finish`, after the sync.
        unsafe { weights::cuda::connect(self.comm, self.stream.clone(), 0, tensors, options) }
    }

    fn finish(self, allocations: Vec<Allocation>) {
        for a in allocations {
            self.allocator.free(a).unwrap();
        }
        // SAFETY: a live communicator; the syncs using it were dropped.
        unsafe { result::comm_destroy(self.comm) }.unwrap();
    }
}

/// Runs `f(rank, id)` for ranks 0 and 1, a thread each, with one unique id.
fn two_ranks(f: impl Fn(usize, sys::ncclUniqueId) + Sync) {
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    let id = result::get_uniqueid().unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let ranks: Vec<_> = (0..2).map(|rank| s.spawn(move || f(rank, id))).collect();
        for r in ranks {
            r.join().expect("a rank failed");
        }
    });
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL (cargo xtask test-gpu runs it)"]
fn a_state_dict_lands_in_the_other_ranks_own_tensors_twice() {
    if !two_gpus_and_nccl() {
        return;
    }
    let layout = gpt2();
    let total: usize = layout.iter().map(|t| bytes_of(&t.1)).sum();
    two_ranks(|rank, id| {
        let me = Rank::new(rank, id);
        let order: Vec<usize> = if rank == 0 {
            (0..layout.len()).collect()
        } else {
            (0..layout.len()).rev().collect()
        };
        let (tensors, allocations) = me.tensors(&layout, &order);
        let mut sync = me.connect(&tensors).unwrap();
        for version in 1..=2u64 {
            if me.rank == 0 {
                for (t, &i) in tensors.iter().zip(&order) {
                    let bytes = pattern(i, version, t.bytes as usize);
                    // SAFETY: the tensor's allocation, written by nothing else.
                    unsafe { me.stream.copy_from_host(t.ptr, &bytes) }.unwrap();
                }
            }
            // SAFETY: the tensors are live allocations; no other stream uses them.
            let report = unsafe { sync.sync() }.unwrap();
            assert_eq!(report.bytes, total as u64);
            assert_eq!(report.buckets, total.div_ceil(BUCKET));
            assert!(report.direct >= 2, "wte fills two buckets: {report:?}");
            if me.rank == 1 {
                for (t, &i) in tensors.iter().zip(&order) {
                    let mut got = vec![0u8; t.bytes as usize];
                    // SAFETY: the tensor's allocation; the sync is done.
                    unsafe { me.stream.copy_to_host(&mut got, t.ptr) }.unwrap();
                    let want = pattern(i, version, got.len());
                    if got != want {
                        let first = got.iter().zip(&want).position(|(g, w)| g != w);
                        panic!(
                            "{} differs at version {version} from byte {first:?}",
                            t.name
                        );
                    }
                }
            }
        }
        drop(sync);
        me.finish(allocations);
    });
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL (cargo xtask test-gpu runs it)"]
fn a_layout_that_differs_is_refused_on_both_ranks() {
    if !two_gpus_and_nccl() {
        return;
    }
    let layout = gpt2();
    two_ranks(|rank, id| {
        let me = Rank::new(rank, id);
        // Rank 1 lacks `wpe.weight`.
        let order: Vec<usize> = (0..layout.len()).filter(|&i| rank == 0 || i != 1).collect();
        let (tensors, allocations) = me.tensors(&layout, &order);
        let error = me.connect(&tensors).unwrap_err();
        if rank == 0 {
            assert!(matches!(error, Error::LayoutRejected { .. }), "{error}");
        } else {
            assert_eq!(
                error,
                Error::Layout {
                    mismatches: vec![Mismatch::Missing {
                        name: "wpe.weight".into()
                    }]
                }
            );
        }
        me.finish(allocations);
    });
}

/// Rank 1 connects, syncs once, then stops syncing (as a process that died would): rank 0's next
/// sync ends with `TimedOut` after the timeout, not a hang; the communicators are then aborted,
/// as the error says to.
#[test]
#[ignore = "needs two CUDA GPUs and NCCL (cargo xtask test-gpu runs it)"]
fn a_rank_that_stops_syncing_is_a_timeout_on_the_other_not_a_hang() {
    if !two_gpus_and_nccl() {
        return;
    }
    let layout = gpt2();
    let timeout = std::time::Duration::from_secs(2);
    let sender_done = std::sync::Barrier::new(2);
    two_ranks(|rank, id| {
        let me = Rank::new(rank, id);
        let order: Vec<usize> = (0..layout.len()).collect();
        let (tensors, allocations) = me.tensors(&layout, &order);
        let options = SyncOptions {
            bucket_bytes: BUCKET,
            timeout,
        };
        let mut sync = me.connect_with(&tensors, options).unwrap();
        // SAFETY: the tensors are this rank's allocations, used by nothing else.
        unsafe { sync.sync() }.unwrap();
        if rank == 0 {
            // SAFETY: as above.
            let error = unsafe { sync.sync() }.unwrap_err();
            match error {
                Error::TimedOut { rank: 0, waited } => assert!(waited >= timeout),
                other => panic!("expected a timeout, got {other}"),
            }
        }
        sender_done.wait();
        drop(sync);
        // SAFETY: a live communicator of this rank, aborted once (not destroyed afterwards).
        unsafe { result::comm_abort(me.comm) }.unwrap();
        for a in allocations {
            me.allocator.free(a).unwrap();
        }
    });
}
