//! Interoperation with a real PyTorch: a refcounted region made here is opened by PyTorch's own
//! `RefcountedMapAllocator` (through `THManagedMapAllocator`, the file_system strategy's
//! allocator), which must find the refcount at offset 0 and the data at offset 64.
//!
//! `#[ignore]`d: `cargo xtask test-gpu` runs it with `--include-ignored` (or run
//! `cargo test -p tensormem-shm --test torch_interop -- --include-ignored` where `python3 -c 'import torch'`
//! works). Run without torch, it prints why it did nothing and passes, unless
//! `TENSORMEM_REQUIRE_TORCH=1`.

use tensormem_shm::{NameGenerator, RefcountHeader, RefcountedRegion, TORCH_PREFIX};
use tensormem_test_support::{python, torch};

const SCRIPT: &str = r#"
import struct, sys, torch
name, size = sys.argv[1].encode(), int(sys.argv[2])
storage = torch.UntypedStorage._new_shared_filename_cpu(b"", name, size)
assert storage.nbytes() == size, storage.nbytes()
print(bytes(storage[i] for i in range(9)).decode())
with open("/dev/shm/" + sys.argv[1].lstrip("/"), "rb") as f:
    print(struct.unpack("i", f.read(4))[0])
storage[9] = 33
del storage  # closes PyTorch's mapping: refcount - 1
"#;

#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorch_opens_a_refcounted_region() {
    if !torch::python_with_torch() {
        return;
    }
    let name = NameGenerator::with_prefix(TORCH_PREFIX)
        .unwrap()
        .next_name();
    let mut region = RefcountedRegion::create(&name, 4096).unwrap();
    region.write_at(0, b"tensormem").unwrap();

    let out = python::command()
        .args(["-c", SCRIPT, name.as_str(), "4096"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.first(),
        Some(&"tensormem"),
        "PyTorch read the data at offset 64"
    );
    assert_eq!(
        lines.get(1),
        Some(&"2"),
        "PyTorch added itself to the refcount at offset 0"
    );
    assert_eq!(
        region.to_vec().unwrap()[9],
        33,
        "PyTorch's write is visible here"
    );
    // PyTorch closed its mapping on exit: the count is back to ours alone.
    let raw = std::fs::read(name.path()).map(|bytes| RefcountHeader::decode(&bytes).unwrap());
    if let Ok(header) = raw {
        assert_eq!(header.refcount, 1);
    }
    // PyTorch's torch_shm_manager may already have unlinked the name when its client exited
    // (it assumes it owns names registered with it), so both outcomes of the last close are fine.
    match region.close() {
        Ok(unlinked) => assert!(unlinked),
        Err(tensormem_shm::Error::NotFound { .. }) => {}
        Err(other) => panic!("{other}"),
    }
}
