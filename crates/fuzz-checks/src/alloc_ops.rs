//! Operation sequences on the allocator over the simulated device, with hostile pointers.
//!
//! The input is decoded (with [`arbitrary`]) into a configuration and up to [`MAX_OPS`] operations:
//! allocations by handle and by pointer on a few streams (one of them `u64::MAX`), frees, frees by
//! pointer of live, already freed, interior, foreign and made-up pointers (`u64::MAX` among them),
//! `record_stream` by handle and by pointer, stream work completing, `empty_cache`, memory fractions
//! (NaN and out-of-range ones too) and peak resets. A model beside the allocator knows which
//! addresses are live, so every call's outcome is checked, not just its absence of panics:
//!
//! - a pointer the model holds frees `Ok`; any other pointer is refused with `InvalidPointer`;
//! - a handle whose memory was freed by pointer is refused; a live handle frees `Ok`;
//! - a handle or pointer of another allocator is refused and frees nothing;
//! - live allocations never overlap, are 512-byte aligned and at least as large as asked;
//! - after every operation, [`CachingAllocator::check_invariants`] passes;
//! - a twin allocator with the fast path off ([`CachingAllocator::set_fast_path_enabled`]) gets
//!   every call too, and gives the same outcome (address, size, error), the same statistics after
//!   every operation and the same snapshot (segments and blocks) after a few of them and at the end.

use std::collections::BTreeMap;

use arbitrary::{Arbitrary, Unstructured};
use tensormem_cuda_alloc::backend::sim::SimDevice;
use tensormem_cuda_alloc::config::AllocatorConfig;
use tensormem_cuda_alloc::{Allocation, CachingAllocator, DeviceAddress, Error, StreamId};

/// Most operations one input runs.
pub const MAX_OPS: usize = 200;

/// Streams the operations use: four ordinary ones and a hostile handle.
const STREAMS: [u64; 5] = [0, 1, 2, 7, u64::MAX];

/// Configurations an input starts from.
const CONFIGS: [&str; 6] = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:40",
    "roundup_power2_divisions:4,garbage_collection_threshold:0.5",
    "expandable_segments:True,roundup_power2_divisions:[256:2,>:8]",
    "max_split_size_mb:20,max_non_split_rounding_mb:512",
];

/// A request size: mostly small, some large, a few absurd.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Size {
    Small(u16),
    Medium(u32),
    Large(u8),
    Absurd(u64),
}

impl Size {
    fn bytes(self) -> usize {
        match self {
            Size::Small(n) => usize::from(n),
            Size::Medium(n) => (n % (24 << 20)) as usize,
            Size::Large(n) => (usize::from(n) + 1) << 20,
            Size::Absurd(n) => n as usize,
        }
    }
}

/// Which pointer a pointer-based call names.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Target {
    /// A live allocation's address (handle or raw), by index.
    Live(u16),
    /// An address freed before (possibly handed out again since).
    Freed(u16),
    /// Inside a live allocation, `offset` bytes past its start.
    Interior(u16, u32),
    /// `u64::MAX`, the pointer index's old empty-slot key.
    Max,
    /// Memory another allocator (another simulated device) handed out.
    Foreign,
    /// Null (ignored by design).
    Null,
    /// Anything.
    Made(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Op {
    Allocate { size: Size, stream: u8 },
    RawAlloc { size: Size, stream: u8 },
    Free { which: u16 },
    RawFree { target: Target },
    RecordStream { which: u16, stream: u8 },
    RecordStreamPtr { target: Target, stream: u8 },
    BaseAllocation { target: Target },
    FreeForeignHandle,
    CompleteStream { stream: u8 },
    CompleteAll,
    EmptyCache,
    SetFraction { fraction: u8 },
    ResetPeaks,
}

/// A live allocation as the model sees it.
#[derive(Debug)]
struct Live {
    size: usize,
    /// The handle, unless the memory was allocated (or converted) to a raw pointer.
    handle: Option<Allocation>,
}

/// The allocator, its model, and another allocator whose memory is foreign to it.
struct Harness {
    alloc: CachingAllocator<SimDevice>,
    /// The same allocator with the fast path off: the plain path, which the fast path must match.
    plain: CachingAllocator<SimDevice>,
    /// Live allocations of `plain`, by address (the same addresses as `alloc`'s).
    plain_live: BTreeMap<u64, Option<Allocation>>,
    other: CachingAllocator<SimDevice>,
    foreign_ptr: DeviceAddress,
    foreign_handle: Option<Allocation>,
    /// Live allocations by address.
    live: BTreeMap<u64, Live>,
    /// Handles whose memory was freed by pointer: freeing or recording them must fail.
    stale: Vec<Allocation>,
    /// Addresses freed so far.
    freed: Vec<u64>,
}

/// Runs the operations `data` decodes to and checks every outcome (see the module docs).
///
/// # Panics
/// When the allocator panics, gives a wrong outcome, or fails its invariant check.
pub fn check(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let config_index = u.choose_index(CONFIGS.len()).unwrap_or(0);
    let config = AllocatorConfig::parse(CONFIGS[config_index]).expect("a valid configuration");
    let mut harness = Harness::new(config);
    for _ in 0..MAX_OPS {
        let Ok(op) = Op::arbitrary(&mut u) else {
            break;
        };
        harness.run(op);
        harness.run_plain(op);
        if let Err(violation) = harness.alloc.check_invariants() {
            panic!("after {op:?}: {violation:?}");
        }
        harness.compare(op);
        harness.check_model();
        if u.is_empty() {
            break;
        }
    }
    harness.finish();
}

/// The fraction `SetFraction { fraction }` asks for: NaN, out of range, the bounds, or in between.
fn fraction_value(fraction: u8) -> f64 {
    match fraction % 8 {
        0 => f64::NAN,
        1 => -0.5,
        2 => 1.5,
        3 => f64::INFINITY,
        4 => 0.0,
        5 => 1.0,
        _ => f64::from(fraction) / 255.0,
    }
}

fn stream(index: u8) -> StreamId {
    StreamId(STREAMS[usize::from(index) % STREAMS.len()])
}

/// Whether an allocation failure is an acceptable outcome (running out, or more streams than the
/// allocator serves).
fn acceptable_alloc_error(error: &Error) -> bool {
    matches!(
        error,
        Error::OutOfMemory(_) | Error::TooLarge { .. } | Error::TooManyStreams { .. }
    )
}

impl Harness {
    fn new(config: AllocatorConfig) -> Self {
        // 1 GiB, four streams (the fifth one, u64::MAX included, is refused when it comes).
        let alloc = CachingAllocator::with_stream_capacity(
            SimDevice::with_fixed_addresses(0, 1 << 30),
            config.clone(),
            4,
        );
        let plain = CachingAllocator::with_stream_capacity(
            SimDevice::with_fixed_addresses(0, 1 << 30),
            config,
            4,
        );
        plain.set_fast_path_enabled(false);
        // One stream: a table for the default 1024 would cost more than the rest of a short input.
        let other = CachingAllocator::with_stream_capacity(
            SimDevice::new(64 << 20),
            AllocatorConfig::default(),
            1,
        );
        let foreign_ptr = other
            .raw_alloc(4096, StreamId(0))
            .expect("the other allocator has room");
        let foreign_handle = Some(
            other
                .allocate(1 << 20, StreamId(0))
                .expect("the other allocator has room"),
        );
        Harness {
            alloc,
            plain,
            plain_live: BTreeMap::new(),
            other,
            foreign_ptr,
            foreign_handle,
            live: BTreeMap::new(),
            stale: Vec::new(),
            freed: Vec::new(),
        }
    }

    /// The address `target` names.
    fn address(&self, target: Target) -> u64 {
        let nth = |i: u16| {
            (!self.live.is_empty()).then(|| {
                *self
                    .live
                    .keys()
                    .nth(usize::from(i) % self.live.len())
                    .expect("in range")
            })
        };
        match target {
            Target::Live(i) => nth(i).unwrap_or(512),
            Target::Freed(i) if !self.freed.is_empty() => {
                self.freed[usize::from(i) % self.freed.len()]
            }
            Target::Freed(_) => 1 << 40,
            Target::Interior(i, offset) => nth(i).map_or(u64::MAX - 511, |addr| {
                let size = self.live[&addr].size.max(2) as u64;
                addr + 1 + u64::from(offset) % (size - 1)
            }),
            Target::Max => u64::MAX,
            Target::Foreign => self.foreign_ptr.0,
            Target::Null => 0,
            Target::Made(addr) => addr,
        }
    }

    fn record_new(&mut self, addr: u64, size: usize, requested: usize, handle: Option<Allocation>) {
        if size == 0 {
            assert_eq!(requested, 0, "a request of {requested} bytes got 0");
            return;
        }
        assert!(size >= requested, "{size} bytes handed out for {requested}");
        assert_eq!(addr % 512, 0, "address {addr:#x} is not 512-byte aligned");
        let previous = self.live.insert(addr, Live { size, handle });
        assert!(previous.is_none(), "address {addr:#x} handed out twice");
    }

    fn run(&mut self, op: Op) {
        match op {
            Op::Allocate { size, stream: s } => {
                let requested = size.bytes();
                match self.alloc.allocate(requested, stream(s)) {
                    Ok(a) => {
                        let (addr, got) = (a.ptr().0, a.size());
                        if got == 0 {
                            assert_eq!(requested, 0, "a request of {requested} bytes got 0");
                            self.alloc.free(a).expect("a zero-sized allocation frees");
                        } else {
                            assert_eq!(a.allocator_id(), self.alloc.id(), "not stamped as ours");
                            self.record_new(addr, got, requested, Some(a));
                        }
                    }
                    Err(e) => assert!(
                        acceptable_alloc_error(&e),
                        "allocate({requested}) failed with {e:?}"
                    ),
                }
            }
            Op::RawAlloc { size, stream: s } => {
                let requested = size.bytes();
                match self.alloc.raw_alloc(requested, stream(s)) {
                    Ok(ptr) => {
                        if requested == 0 {
                            assert_eq!(ptr.0, 0, "raw_alloc(0) is null");
                        } else {
                            // raw_alloc does not say the rounded size; the request is what is known.
                            self.record_new(ptr.0, requested, requested, None);
                        }
                    }
                    Err(e) => assert!(
                        acceptable_alloc_error(&e),
                        "raw_alloc({requested}) failed with {e:?}"
                    ),
                }
            }
            Op::Free { which } => {
                let handles: Vec<u64> = self
                    .live
                    .iter()
                    .filter(|(_, l)| l.handle.is_some())
                    .map(|(&addr, _)| addr)
                    .collect();
                let stale = !self.stale.is_empty() && (which & 1 == 1 || handles.is_empty());
                if stale {
                    let handle = self
                        .stale
                        .swap_remove(usize::from(which >> 1) % self.stale.len());
                    let ptr = handle.ptr();
                    let result = self.alloc.free(handle);
                    assert!(
                        matches!(result, Err(Error::InvalidPointer { .. })),
                        "free of a handle already freed by pointer ({ptr}) gave {result:?}"
                    );
                } else if !handles.is_empty() {
                    let addr = handles[usize::from(which >> 1) % handles.len()];
                    let live = self.live.remove(&addr).expect("listed");
                    let result = self.alloc.free(live.handle.expect("a handle"));
                    assert!(
                        result.is_ok(),
                        "free of a live handle at {addr:#x} gave {result:?}"
                    );
                    self.freed.push(addr);
                }
            }
            Op::RawFree { target } => {
                let addr = self.address(target);
                let result = self.alloc.raw_free(DeviceAddress(addr));
                if addr == 0 {
                    assert!(result.is_ok(), "raw_free(null) gave {result:?}");
                } else if let Some(live) = self.live.remove(&addr) {
                    assert!(result.is_ok(), "raw_free of live {addr:#x} gave {result:?}");
                    self.stale.extend(live.handle);
                    self.freed.push(addr);
                } else {
                    assert!(
                        matches!(result, Err(Error::InvalidPointer { .. })),
                        "raw_free({addr:#x}) of no live allocation ({target:?}) gave {result:?}"
                    );
                }
            }
            Op::RecordStream { which, stream: s } => {
                let live_handle = self
                    .live
                    .values()
                    .filter_map(|l| l.handle.as_ref())
                    .nth(usize::from(which) % self.live.len().max(1));
                if let Some(handle) = live_handle {
                    let result = self.alloc.record_stream(handle, stream(s));
                    assert!(
                        result.is_ok() || matches!(result, Err(Error::TooManyStreams { .. })),
                        "record_stream of a live handle gave {result:?}"
                    );
                } else if let Some(handle) = self.stale.first() {
                    let result = self.alloc.record_stream(handle, stream(s));
                    assert!(
                        matches!(result, Err(Error::InvalidPointer { .. })),
                        "record_stream of a freed handle gave {result:?}"
                    );
                }
            }
            Op::RecordStreamPtr { target, stream: s } => {
                let addr = self.address(target);
                let result = self.alloc.record_stream_ptr(DeviceAddress(addr), stream(s));
                if addr == 0 {
                    assert!(result.is_ok(), "record_stream_ptr(null) gave {result:?}");
                } else if self.live.contains_key(&addr) {
                    assert!(
                        result.is_ok() || matches!(result, Err(Error::TooManyStreams { .. })),
                        "record_stream_ptr of live {addr:#x} gave {result:?}"
                    );
                } else {
                    assert!(
                        matches!(result, Err(Error::InvalidPointer { .. })),
                        "record_stream_ptr({addr:#x}) of no live allocation gave {result:?}"
                    );
                }
            }
            Op::BaseAllocation { target } => {
                let addr = self.address(target);
                let result = self.alloc.base_allocation(DeviceAddress(addr));
                match (self.live.get(&addr), result) {
                    (Some(live), Ok((base, size))) => {
                        assert!(base.0 <= addr && addr + live.size as u64 <= base.0 + size as u64);
                    }
                    (Some(_), Err(Error::ExpandableNotShareable { .. })) => {}
                    (None, Err(Error::InvalidPointer { .. })) => {}
                    (live, result) => {
                        panic!("base_allocation({addr:#x}) (live: {live:?}) gave {result:?}")
                    }
                }
            }
            Op::FreeForeignHandle => {
                if let Some(handle) = self.foreign_handle.as_ref() {
                    let result = self.alloc.record_stream(handle, StreamId(0));
                    assert!(
                        matches!(result, Err(Error::ForeignAllocation { .. })),
                        "record_stream of another allocator's handle gave {result:?}"
                    );
                }
                if let Some(handle) = self.foreign_handle.take() {
                    let result = self.alloc.free(handle);
                    assert!(
                        matches!(result, Err(Error::ForeignAllocation { .. })),
                        "free of another allocator's handle gave {result:?}"
                    );
                }
            }
            Op::CompleteStream { stream: s } => self.alloc.device().complete_stream_work(stream(s)),
            Op::CompleteAll => self.alloc.device().complete_all_work(),
            Op::EmptyCache => self
                .alloc
                .empty_cache()
                .expect("empty_cache on the simulated device"),
            Op::SetFraction { fraction } => {
                let value = fraction_value(fraction);
                let result = self.alloc.set_memory_fraction(value);
                if (0.0..=1.0).contains(&value) {
                    assert!(
                        result.is_ok(),
                        "set_memory_fraction({value}) gave {result:?}"
                    );
                } else {
                    assert!(
                        matches!(result, Err(Error::InvalidFraction { .. })),
                        "set_memory_fraction({value}) gave {result:?}"
                    );
                }
            }
            Op::ResetPeaks => self.alloc.reset_peak_stats(),
        }
    }

    /// Runs `op` on the twin with the fast path off, as [`run`](Self::run) ran it on `alloc`
    /// (which already updated the model): the same calls with the same arguments. Outcomes are
    /// compared through [`compare`](Self::compare) and the model's addresses.
    fn run_plain(&mut self, op: Op) {
        let plain = &self.plain;
        match op {
            Op::Allocate { size, stream: s } => {
                if let Ok(a) = plain.allocate(size.bytes(), stream(s)) {
                    if a.size() == 0 {
                        plain.free(a).expect("a zero-sized allocation frees");
                    } else {
                        let addr = a.ptr().0;
                        assert!(
                            self.live.contains_key(&addr),
                            "the plain path handed out {addr:#x}, the fast path did not"
                        );
                        self.plain_live.insert(addr, Some(a));
                    }
                }
            }
            Op::RawAlloc { size, stream: s } => {
                if let Ok(ptr) = plain.raw_alloc(size.bytes(), stream(s)) {
                    if ptr.0 != 0 {
                        assert!(
                            self.live.contains_key(&ptr.0),
                            "the plain path handed out {ptr}, the fast path did not"
                        );
                        self.plain_live.insert(ptr.0, None);
                    }
                }
            }
            Op::Free { .. } | Op::RawFree { .. } => {
                // Whatever `alloc` freed (by handle or pointer) the model no longer holds.
                let gone: Vec<u64> = self
                    .plain_live
                    .keys()
                    .filter(|addr| !self.live.contains_key(addr))
                    .copied()
                    .collect();
                for addr in gone {
                    let result = match self.plain_live.remove(&addr).expect("listed") {
                        Some(handle) if matches!(op, Op::Free { .. }) => plain.free(handle),
                        Some(handle) => plain.raw_free(handle.into_ptr()),
                        None => plain.raw_free(DeviceAddress(addr)),
                    };
                    assert!(
                        result.is_ok(),
                        "the plain path's free of {addr:#x} gave {result:?}"
                    );
                }
            }
            Op::RecordStream { which, stream: s } => {
                let addr = self
                    .live
                    .iter()
                    .filter(|(_, l)| l.handle.is_some())
                    .map(|(&addr, _)| addr)
                    .nth(usize::from(which) % self.live.len().max(1));
                if let Some(Some(handle)) = addr.and_then(|addr| self.plain_live.get(&addr)) {
                    let _ = plain.record_stream(handle, stream(s));
                }
            }
            Op::RecordStreamPtr { target, stream: s } => {
                let addr = self.address(target);
                let _ = plain.record_stream_ptr(DeviceAddress(addr), stream(s));
            }
            Op::BaseAllocation { .. } | Op::FreeForeignHandle => {}
            Op::CompleteStream { stream: s } => plain.device().complete_stream_work(stream(s)),
            Op::CompleteAll => plain.device().complete_all_work(),
            Op::EmptyCache => plain
                .empty_cache()
                .expect("empty_cache on the simulated device"),
            Op::SetFraction { fraction } => {
                let _ = plain.set_memory_fraction(fraction_value(fraction));
            }
            Op::ResetPeaks => plain.reset_peak_stats(),
        }
    }

    /// The fast path decided as the plain path: the same live addresses, statistics and (after
    /// operations that take every lock anyway) snapshot segments.
    fn compare(&self, op: Op) {
        assert!(
            self.plain_live.keys().eq(self.live.keys()),
            "after {op:?}: live addresses differ with the fast path off"
        );
        assert_eq!(
            self.alloc.memory_stats(),
            self.plain.memory_stats(),
            "after {op:?}: statistics differ with the fast path off"
        );
        if matches!(op, Op::EmptyCache | Op::CompleteAll | Op::ResetPeaks) {
            assert_eq!(
                self.alloc.snapshot().segments,
                self.plain.snapshot().segments,
                "after {op:?}: snapshots differ with the fast path off"
            );
        }
    }

    /// Live allocations never overlap.
    fn check_model(&self) {
        let mut end = 0u64;
        for (&addr, live) in &self.live {
            assert!(addr >= end, "live allocations overlap at {addr:#x}");
            end = addr + live.size as u64;
        }
    }

    /// Frees everything, lets all work complete, empties the cache: nothing may stay reserved, and
    /// the other allocator's memory is untouched.
    fn finish(mut self) {
        for (addr, live) in std::mem::take(&mut self.live) {
            let result = match live.handle {
                Some(handle) => self.alloc.free(handle),
                None => self.alloc.raw_free(DeviceAddress(addr)),
            };
            assert!(result.is_ok(), "final free of {addr:#x} gave {result:?}");
        }
        for (addr, handle) in std::mem::take(&mut self.plain_live) {
            let result = match handle {
                Some(handle) => self.plain.free(handle),
                None => self.plain.raw_free(DeviceAddress(addr)),
            };
            assert!(
                result.is_ok(),
                "final plain free of {addr:#x} gave {result:?}"
            );
        }
        self.alloc.device().complete_all_work();
        self.alloc.empty_cache().expect("empty_cache");
        self.plain.device().complete_all_work();
        self.plain.empty_cache().expect("empty_cache");
        assert_eq!(
            self.alloc.memory_stats(),
            self.plain.memory_stats(),
            "at the end: statistics differ with the fast path off"
        );
        assert_eq!(
            self.alloc.snapshot().segments,
            self.plain.snapshot().segments,
            "at the end: snapshots differ with the fast path off"
        );
        if let Err(violation) = self.alloc.check_invariants() {
            panic!("at the end: {violation:?}");
        }
        let stats = self.alloc.memory_stats();
        assert_eq!(
            stats.allocated_bytes.all.current, 0,
            "bytes still allocated"
        );
        assert_eq!(stats.reserved_bytes.all.current, 0, "bytes still reserved");
        self.other
            .raw_free(self.foreign_ptr)
            .expect("the other allocator still holds its pointer");
        if let Some(handle) = self.foreign_handle.take() {
            self.other
                .free(handle)
                .expect("the other allocator still holds its handle");
        }
        self.other
            .check_invariants()
            .expect("the other allocator is intact");
    }
}
