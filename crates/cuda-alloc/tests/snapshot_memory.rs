//! What the pickle reader holds stays within `ReadLimits::max_memory_bytes`, measured by a global
//! allocator that counts this thread's live bytes, and memory the system refuses is a typed error,
//! not an abort (the counting allocator refuses large blocks on request).

#![cfg(feature = "snapshot-io")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::path::PathBuf;

use tensormem_cuda_alloc::snapshot::{ReadLimits, Snapshot, SnapshotError};

struct Counting;

thread_local! {
    /// Bytes this thread holds now (by the layouts asked for).
    static LIVE: Cell<usize> = const { Cell::new(0) };
    /// The most it held since the last `reset_peak`.
    static PEAK: Cell<usize> = const { Cell::new(0) };
    /// Allocations of at least this many bytes are refused (null), as under an address-space cap.
    static REFUSE_FROM: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn grew(bytes: usize) {
    // `try_with`: the slots may be gone while the thread exits; const-initialised cells never
    // allocate.
    let _ = LIVE.try_with(|live| {
        live.set(live.get() + bytes);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(live.get())));
    });
}

fn shrank(bytes: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(bytes)));
}

fn refused(size: usize) -> bool {
    REFUSE_FROM
        .try_with(|from| size >= from.get())
        .unwrap_or(false)
}

// SAFETY: every call is forwarded unchanged to the system allocator, which upholds `GlobalAlloc`'s
// contract, or answered with null, which `GlobalAlloc` allows for any allocation; the wrapper
// only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if refused(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout, as the caller's obligations require.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrank(layout.size());
        // SAFETY: `ptr` came from `System.alloc` with this layout (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && refused(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: as for `dealloc`, and `new_size` is the caller's.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            // Counted as if the old and the new block existed at once, as a moving realloc has them.
            grew(new_size);
            shrank(layout.size());
        }
        new
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `read` and returns its result with the most bytes this thread held meanwhile, above what
/// it held before.
fn measured<T>(read: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(before));
    let out = read();
    (out, PEAK.with(Cell::get) - before)
}

/// Slack for what a refusal itself allocates (its message, a backtrace-free error).
const SLACK: usize = 64 << 10;

/// A protocol-4 pickle of one list holding `count` copies of the opcodes `item`.
fn list_of(item: &[u8], count: usize) -> Vec<u8> {
    let mut pickle = b"\x80\x04](".to_vec();
    for _ in 0..count {
        pickle.extend_from_slice(item);
    }
    pickle.extend_from_slice(b"e.");
    pickle
}

/// A protocol-4 pickle of one dict of `count` distinct int keys, each mapping to 1.
fn dict_of_int_keys(count: u32) -> Vec<u8> {
    let mut pickle = b"\x80\x04}(".to_vec();
    for key in 0..count {
        pickle.push(b'J');
        pickle.extend_from_slice(&key.to_le_bytes());
        pickle.extend_from_slice(b"K\x01");
    }
    pickle.extend_from_slice(b"u.");
    pickle
}

/// One-entry dicts (`{1: 2}`), 6 bytes of pickle each: the shape that built the most memory per
/// byte of input.
const ONE_ENTRY_DICT: &[u8] = b"}K\x01K\x02s";

fn memory_limit(bytes: u64) -> ReadLimits {
    ReadLimits::DEFAULT.with_max_memory_bytes(bytes)
}

fn assert_memory_refusal(result: Result<Snapshot, SnapshotError>) {
    match result {
        Err(SnapshotError::TooLarge {
            limit: "max_memory_bytes",
            ..
        }) => {}
        Err(other) => panic!("expected the max_memory_bytes refusal, got {other}"),
        Ok(_) => panic!("expected the max_memory_bytes refusal, got a snapshot"),
    }
}

/// Reads `bomb` under a `limit` of `max_memory_bytes`: refused, having held at most the limit plus
/// `beyond` bytes (and the allocator's slack).
fn refused_within(bomb: &[u8], limit: u64, beyond: usize) {
    let (result, peak) =
        measured(|| Snapshot::from_pickle_bytes_with_limits(bomb, &memory_limit(limit)));
    assert_memory_refusal(result);
    let bound = limit as usize + beyond + SLACK;
    assert!(
        peak <= bound,
        "held {peak} bytes, bound {bound} (limit {limit})"
    );
}

#[test]
fn one_entry_dicts_stop_at_max_memory_bytes() {
    // 300 000 dicts: 900 000 values, far below the default max_values.
    let bomb = list_of(ONE_ENTRY_DICT, 300_000);
    refused_within(&bomb, 8 << 20, 0);
}

#[test]
fn a_dict_of_many_int_keys_stops_at_max_memory_bytes() {
    let bomb = dict_of_int_keys(300_000);
    refused_within(&bomb, 8 << 20, 0);
}

#[test]
fn a_gzip_bomb_of_small_dicts_stops_at_max_memory_bytes() {
    let plain = list_of(ONE_ENTRY_DICT, 1 << 20);
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(&plain).unwrap();
    let bomb = encoder.finish().unwrap();
    assert!(
        bomb.len() < plain.len() / 100,
        "{} bytes of gzip",
        bomb.len()
    );
    // The decompressed pickle is held too (bounded by max_decompressed_bytes); a read buffer may
    // hold twice its length while it grows.
    refused_within(&bomb, 8 << 20, 2 * plain.len());
}

#[test]
fn memo_copies_count_their_bytes() {
    // A list of 64 one-entry dicts in the memo, then 2 000 references to it: 4 bytes of pickle per
    // copy of 64 dicts.
    let mut bomb = b"\x80\x04]\x94(".to_vec();
    for _ in 0..64 {
        bomb.extend_from_slice(ONE_ENTRY_DICT);
    }
    bomb.extend_from_slice(b"e(");
    for _ in 0..2000 {
        bomb.extend_from_slice(b"h\x00");
    }
    bomb.extend_from_slice(b"l.");
    let limit = 4 << 20;
    let (result, peak) = measured(|| {
        let limits = memory_limit(limit).with_max_values(u64::MAX);
        Snapshot::from_pickle_bytes_with_limits(&bomb, &limits)
    });
    match result {
        Err(SnapshotError::TooLarge { .. } | SnapshotError::UnsupportedPickle { .. }) => {}
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("expected a refusal, got a snapshot"),
    }
    assert!(
        peak <= limit as usize + SLACK,
        "held {peak} bytes under a limit of {limit}"
    );
}

#[test]
fn memory_the_system_refuses_is_an_error_not_an_abort() {
    let bombs = [
        dict_of_int_keys(200_000),
        list_of(ONE_ENTRY_DICT, 200_000),
        list_of(b"K\x01", 200_000),
    ];
    for bomb in bombs {
        REFUSE_FROM.with(|from| from.set(1 << 20));
        let result = Snapshot::from_pickle_bytes_with_limits(&bomb, &ReadLimits::UNLIMITED);
        REFUSE_FROM.with(|from| from.set(usize::MAX));
        match result {
            Err(SnapshotError::OutOfMemory { bytes }) => assert!(bytes >= 1 << 20, "{bytes}"),
            Err(other) => panic!("expected OutOfMemory, got {other}"),
            Ok(_) => panic!("expected OutOfMemory, got a snapshot"),
        }
    }
}

fn traces_dir() -> PathBuf {
    std::env::var_os("TENSORMEM_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces"))
}

#[test]
fn real_snapshots_read_within_twice_the_memory_they_take() {
    let mut read = 0;
    for entry in std::fs::read_dir(traces_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "pickle") {
            continue;
        }
        let data = std::fs::read(&path).unwrap();
        let (snapshot, peak) = measured(|| Snapshot::from_pickle_bytes(&data));
        snapshot.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // What the reader counts is close to what it really holds (the whole read measured here,
        // the typed snapshot included, comes within 10% of the least budget that reads it): a
        // budget of twice the measure reads the file.
        let limits = memory_limit(2 * peak as u64);
        Snapshot::from_pickle_bytes_with_limits(&data, &limits)
            .unwrap_or_else(|e| panic!("{}: {e} (measured {peak} bytes)", path.display()));
        read += 1;
    }
    assert!(read > 0, "no snapshot in {}", traces_dir().display());
}
