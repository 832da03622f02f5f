//! The C interface of the NCCL weight sync (`src/nccl_weights.rs`) refuses what cannot be right,
//! with a message, before NCCL or a device is touched: null pointers, an id of another length,
//! arrays missing for a count, ranks outside the world, a bucket below the minimum, duplicate
//! names, null addresses, text that is not UTF-8, stale handles. Runs anywhere: without NCCL or a
//! GPU, arguments that are right fail cleanly too (saying what is missing); with them, a world of
//! one rank opens, syncs nothing and closes.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::{null, null_mut};

use tensormem_torch::native::{TM_ERROR, TM_OK};
use tensormem_torch::nccl_weights::{
    tensormem_nccl_unique_id, tensormem_nccl_weights_close, tensormem_nccl_weights_open,
    tensormem_nccl_weights_sync, NcclSyncReport, TM_NCCL_UNIQUE_ID_BYTES,
};
use tensormem_torch::{tensormem_clear_last_error, tensormem_last_error};

const ID: usize = TM_NCCL_UNIQUE_ID_BYTES as usize;
const MIB: usize = 1 << 20;

/// The calling thread's last error message.
fn last_error() -> String {
    let ptr = tensormem_last_error();
    assert!(!ptr.is_null(), "a failed call left no message");
    // SAFETY: non-null: a NUL-terminated string, valid until the next failing call here.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts that `rc` is a failure whose message contains each of `words`.
fn refused(rc: c_int, words: &[&str]) {
    assert_eq!(
        rc, TM_ERROR,
        "accepted; expected a refusal saying {words:?}"
    );
    let message = last_error();
    assert!(!message.contains("panicked"), "{message}");
    for word in words {
        assert!(message.contains(word), "{word:?} not in: {message}");
    }
}

/// One rank's arguments to `tensormem_nccl_weights_open`, each field changeable.
struct Args {
    device: c_int,
    id: Vec<u8>,
    id_ptr: Option<*const u8>,
    rank: c_int,
    world_size: c_int,
    src: c_int,
    count: usize,
    names: Vec<*const c_char>,
    ptrs: Vec<u64>,
    sizes: Vec<u64>,
    metas: Vec<*const c_char>,
    bucket_bytes: usize,
    no_out: bool,
}

/// Strings that outlive the arguments pointing at them.
struct Strings {
    names: Vec<CString>,
    meta: CString,
}

impl Strings {
    fn new() -> Self {
        Self {
            names: ["wte.weight", "ln_f.bias"]
                .into_iter()
                .map(|n| CString::new(n).unwrap())
                .collect(),
            meta: CString::new("float32[4]").unwrap(),
        }
    }

    /// Two tensors of rank 1 of a world of two, bucket 1 MiB: every argument right.
    fn args(&self) -> Args {
        Args {
            device: 0,
            id: vec![7; ID],
            id_ptr: None,
            rank: 1,
            world_size: 2,
            src: 0,
            count: 2,
            names: self.names.iter().map(|n| n.as_ptr()).collect(),
            ptrs: vec![0x7000_0000, 0x7000_1000],
            sizes: vec![4096, 16],
            metas: vec![self.meta.as_ptr(); 2],
            bucket_bytes: MIB,
            no_out: false,
        }
    }
}

/// A change to the arguments.
type Change = Box<dyn Fn(&mut Args)>;

/// Opens with `a`; returns the status and the handle written (which must be null on failure).
fn open(a: &Args) -> (c_int, *mut c_void) {
    let mut out = std::ptr::dangling_mut::<c_void>(); // overwritten with null first, whatever comes next
    let out_ptr = if a.no_out { null_mut() } else { &mut out };
    let array = |v: &Vec<u64>| if v.is_empty() { null() } else { v.as_ptr() };
    let strings = |v: &Vec<*const c_char>| if v.is_empty() { null() } else { v.as_ptr() };
    // SAFETY: every array holds at least `count` entries or is null (which is refused); the
    // strings live in `Strings`; `out_ptr` is null or valid for a write.
    let rc = unsafe {
        tensormem_nccl_weights_open(
            a.device,
            a.id_ptr.unwrap_or(a.id.as_ptr()),
            a.id.len(),
            a.rank,
            a.world_size,
            a.src,
            a.count,
            strings(&a.names),
            array(&a.ptrs),
            array(&a.sizes),
            strings(&a.metas),
            a.bucket_bytes,
            0,
            out_ptr,
        )
    };
    if rc != TM_OK && !a.no_out {
        assert!(out.is_null(), "a failed open left a handle");
    }
    (rc, out)
}

#[test]
fn open_refuses_bad_arguments_before_touching_nccl() {
    let s = Strings::new();
    let bad_utf8 = [0xffu8, 0xfe, 0];
    let cases: Vec<(&str, Change, Vec<&str>)> = vec![
        (
            "no out",
            Box::new(|a| a.no_out = true),
            vec!["out is a null pointer"],
        ),
        ("device", Box::new(|a| a.device = -1), vec!["device -1"]),
        (
            "id length",
            Box::new(|a| a.id.truncate(127)),
            vec!["128 bytes, not 127"],
        ),
        (
            "null id",
            Box::new(|a| a.id_ptr = Some(null())),
            vec!["unique_id is a null pointer"],
        ),
        (
            "rank",
            Box::new(|a| a.rank = 2),
            vec!["rank 2 is not a rank of a world of 2"],
        ),
        ("negative rank", Box::new(|a| a.rank = -1), vec!["rank -1"]),
        (
            "world",
            Box::new(|a| a.world_size = 0),
            vec!["world_size is 0"],
        ),
        (
            "src",
            Box::new(|a| a.src = 3),
            vec!["src 3 (the sending rank)"],
        ),
        (
            "bucket",
            Box::new(|a| a.bucket_bytes = MIB - 1),
            vec!["1048575 bytes is below the minimum of 1048576"],
        ),
        (
            "no names",
            Box::new(|a| a.names.clear()),
            vec!["names is a null pointer"],
        ),
        (
            "no ptrs",
            Box::new(|a| a.ptrs.clear()),
            vec!["ptrs is a null pointer"],
        ),
        (
            "no sizes",
            Box::new(|a| a.sizes.clear()),
            vec!["sizes is a null pointer"],
        ),
        (
            "no metas",
            Box::new(|a| a.metas.clear()),
            vec!["metas is a null pointer"],
        ),
        (
            "a null name",
            Box::new(|a| a.names[1] = null()),
            vec!["names is a null pointer"],
        ),
        (
            "a null address",
            Box::new(|a| a.ptrs[0] = 0),
            vec!["ptrs[0] (tensor \"wte.weight\") is null for 4096 bytes"],
        ),
        (
            "a name twice",
            Box::new(|a| a.names[1] = a.names[0]),
            vec!["two tensors are named \"wte.weight\""],
        ),
        (
            "metadata not UTF-8",
            Box::new(move |a| a.metas[1] = bad_utf8.as_ptr().cast()),
            vec!["metas[1]", "not valid UTF-8"],
        ),
    ];
    for (case, change, words) in cases {
        let mut a = s.args();
        change(&mut a);
        tensormem_clear_last_error();
        let (rc, _) = open(&a);
        assert_eq!(rc, TM_ERROR, "{case}: accepted");
        let message = last_error();
        for word in words {
            assert!(message.contains(word), "{case}: {word:?} not in: {message}");
        }
    }
}

#[test]
fn the_unique_id_call_checks_its_buffer() {
    let mut id = [0u8; ID];
    // SAFETY: null is refused before any write.
    refused(
        unsafe { tensormem_nccl_unique_id(null_mut(), ID) },
        &["out is a null pointer"],
    );
    // SAFETY: `id` holds 64 bytes and more; the length is refused before any write.
    refused(
        unsafe { tensormem_nccl_unique_id(id.as_mut_ptr(), 64) },
        &["128 bytes, not 64"],
    );
    // SAFETY: `id` holds `ID` bytes.
    match unsafe { tensormem_nccl_unique_id(id.as_mut_ptr(), ID) } {
        TM_OK => assert!(id.iter().any(|&b| b != 0), "NCCL wrote an id of zeros"),
        rc => refused(rc, &["NCCL"]),
    }
}

/// Right arguments: without NCCL or a device, a clean refusal saying which is missing; with them,
/// a world of one rank (no tensors) opens, syncs nothing, and closes once.
#[test]
fn a_world_of_one_opens_or_says_what_is_missing() {
    let mut id = [0u8; ID];
    // SAFETY: `id` holds `ID` bytes.
    let made = unsafe { tensormem_nccl_unique_id(id.as_mut_ptr(), ID) } == TM_OK;
    let s = Strings::new();
    let mut a = s.args();
    (a.id, a.rank, a.world_size, a.count) = (id.to_vec(), 0, 1, 0);
    (a.names, a.ptrs, a.sizes, a.metas) = (vec![], vec![], vec![], vec![]);
    let (rc, sync) = open(&a);
    if rc != TM_OK {
        let message = last_error();
        assert!(!message.contains("panicked"), "{message}");
        let missing = ["NCCL could not be loaded", "CUDA", "driver", "device"];
        assert!(
            missing.iter().any(|w| message.contains(w)),
            "a refusal that names neither NCCL nor the device: {message}"
        );
        assert!(
            !made || !message.contains("NCCL could not be loaded"),
            "{message}"
        );
        eprintln!("no NCCL world here: {message}");
        return;
    }
    assert!(!sync.is_null());
    let mut report = NcclSyncReport::default();
    // SAFETY: a live handle; the legacy default stream; `report` is valid for a write.
    let rc = unsafe { tensormem_nccl_weights_sync(sync, null_mut(), &mut report) };
    assert_eq!(rc, TM_OK, "{}", last_error());
    assert_eq!((report.sync, report.bytes, report.buckets), (1, 0, 0));
    assert_eq!(
        tensormem_nccl_weights_close(sync),
        TM_OK,
        "{}",
        last_error()
    );
    refused(
        tensormem_nccl_weights_close(sync),
        &["not a live NCCL weight sync handle"],
    );
}

#[test]
fn stale_handles_are_refused_and_null_is_ignored_on_close() {
    let bogus = 0xdead_0000_usize as *mut c_void;
    let mut report = NcclSyncReport::default();
    // SAFETY: the handle is refused before the stream or the report is used.
    let rc = unsafe { tensormem_nccl_weights_sync(bogus, null_mut(), &mut report) };
    refused(rc, &["0xdead0000 is not a live NCCL weight sync handle"]);
    assert_eq!(report, NcclSyncReport::default(), "written on a refusal");
    refused(
        tensormem_nccl_weights_close(bogus),
        &["pass the handle tensormem_nccl_weights_open gave"],
    );
    assert_eq!(tensormem_nccl_weights_close(null_mut()), TM_OK);
}
