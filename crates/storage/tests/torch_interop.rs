//! Storages shared with a real PyTorch, both directions, both CPU strategies:
//!
//! - Rust shares by descriptor, Python opens it with `UntypedStorage._new_shared_fd_cpu`;
//! - Rust shares by name, Python opens it with `UntypedStorage._new_shared_filename_cpu`;
//! - Python shares with `_share_fd_cpu_()`, Rust opens the descriptor (through
//!   `/proc/<pid>/fd/<fd>`, which reopens the same object);
//! - Python shares with `_share_filename_cpu_()`, Rust opens the name, registering with
//!   Python's `torch_shm_manager` in its own protocol.
//!
//! Writes are checked in both directions. The tests are `#[ignore]`d: `cargo xtask test-gpu` and the
//! bundle's run.sh run them with `--include-ignored`. Run where `python3 -c 'import torch'` fails, each
//! says why it did nothing and passes, or fails with `TENSORMEM_REQUIRE_TORCH=1`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::process::{ChildStdout, Stdio};

use tensormem_storage::{FilenameHandle, Storage, StorageKind};
use tensormem_test_support::child::{self, Peer};
use tensormem_test_support::{hex, python, torch};

/// `python3 -c script args...`, its stdin and stdout piped; killed if the test ends first.
fn python(script: &str, args: &[&str]) -> (Peer, BufReader<ChildStdout>) {
    child::spawn(
        python::command()
            .arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped()),
    )
}

fn line(out: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    assert!(out.read_line(&mut line).unwrap() > 0, "python exited early");
    line.trim_end().to_owned()
}

fn finish(mut child: Peer) {
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "python failed: {status}");
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 253) as u8).collect()
}

/// Reads `n` bytes of an UntypedStorage, writes 0x5A at the last byte, reports the first bytes.
const PY_READ_WRITE: &str = r#"
def check(storage, size):
    assert storage.nbytes() == size, storage.nbytes()
    data = bytes(storage.tolist()) if hasattr(storage, "tolist") else bytes(storage[i] for i in range(size))
    print(data[:8].hex(), data[-1], flush=True)
    storage[size - 1] = 0x5A
"#;

#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorch_opens_a_storage_rust_shared_by_descriptor() {
    if !torch::python_with_torch() {
        return;
    }
    let script = format!(
        "{PY_READ_WRITE}\n{}",
        r#"
import socket, sys, torch
path, size = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
msg, fds, flags, addr = socket.recv_fds(s, 256, 1)
storage = torch.UntypedStorage._new_shared_fd_cpu(fds[0], size)
check(storage, size)
sys.stdin.read()
"#
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("torch.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let storage = Storage::from_vec(pattern(1 << 16));
    let (child, mut out) = python(&script, &[path.to_str().unwrap(), "65536"]);
    let (socket, _) = listener.accept().unwrap();
    storage.send_shared_fd(&socket).unwrap();
    let expected = pattern(1 << 16);
    assert_eq!(
        line(&mut out),
        format!("{} {}", hex(&expected[..8]), expected[(1 << 16) - 1])
    );
    finish(child);
    assert_eq!(storage.to_vec().unwrap()[(1 << 16) - 1], 0x5A);
}

#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn pytorch_opens_a_storage_rust_shared_by_name() {
    if !torch::python_with_torch() {
        return;
    }
    common::manager();
    let script = format!(
        "{PY_READ_WRITE}\n{}",
        r#"
import sys, torch
name, size = sys.argv[1].encode(), int(sys.argv[2])
storage = torch.UntypedStorage._new_shared_filename_cpu(b"", name, size)
check(storage, size)
sys.stdin.read()
del storage
"#
    );
    let storage = Storage::from_vec(pattern(4096));
    let handle = storage.share_filename().unwrap();
    assert!(handle.manager_handle.is_empty());
    let (child, mut out) = python(&script, &[handle.name.as_str(), "4096"]);
    let expected = pattern(4096);
    assert_eq!(
        line(&mut out),
        format!("{} {}", hex(&expected[..8]), expected[4095])
    );
    assert_eq!(storage.shared_refcount(), Some(2), "PyTorch counts itself");
    finish(child);
    assert_eq!(storage.to_vec().unwrap()[4095], 0x5A);
    assert_eq!(
        storage.shared_refcount(),
        Some(1),
        "PyTorch closed its mapping"
    );
}

const PY_SHARE: &str = r#"
import os, sys, torch
size = int(sys.argv[1])
storage = torch.UntypedStorage(size)
for i in range(size):
    storage[i] = (i * 3) % 256
"#;

#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn rust_opens_a_storage_pytorch_shared_by_descriptor() {
    if !torch::python_with_torch() {
        return;
    }
    let script = format!(
        "{PY_SHARE}\n{}",
        r#"
fd, n = storage._share_fd_cpu_()
print(os.getpid(), fd, n, flush=True)
sys.stdin.readline()
print(storage[0], flush=True)
"#
    );
    let (mut child, mut out) = python(&script, &["5000"]);
    let reply = line(&mut out);
    let parts: Vec<&str> = reply.split(' ').collect();
    let (pid, fd, size): (u32, i32, u64) = (
        parts[0].parse().unwrap(),
        parts[1].parse().unwrap(),
        parts[2].parse().unwrap(),
    );
    assert_eq!(size, 5000);
    // The same object, reopened through procfs (as a descriptor passed over a socket would be).
    let object = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))
        .unwrap();
    let storage = Storage::new_shared_fd(&object, size).unwrap();
    assert!(matches!(storage.kind(), StorageKind::CpuFd { .. }));
    let expected: Vec<u8> = (0..5000).map(|i| ((i * 3) % 256) as u8).collect();
    assert_eq!(storage.to_vec().unwrap(), expected);
    storage.write_at(0, &[0xA5]).unwrap();
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    assert_eq!(line(&mut out), "165", "PyTorch sees Rust's write");
    finish(child);
}

#[test]
#[ignore = "needs python3 with torch (cargo xtask test-gpu runs it)"]
fn rust_opens_a_storage_pytorch_shared_by_name() {
    if !torch::python_with_torch() {
        return;
    }
    let script = format!(
        "{PY_SHARE}\n{}",
        r#"
manager, name, n = storage._share_filename_cpu_()
print(manager.decode(), name.decode(), n, flush=True)
sys.stdin.readline()
print(storage[1], flush=True)
"#
    );
    let (mut child, mut out) = python(&script, &["3000"]);
    let reply = line(&mut out);
    let parts: Vec<&str> = reply.split(' ').collect();
    let handle = FilenameHandle::from_torch(
        parts[0].as_bytes(),
        parts[1].as_bytes(),
        parts[2].parse().unwrap(),
    )
    .unwrap();
    assert!(
        !handle.manager_handle.is_empty(),
        "PyTorch names its manager"
    );
    let storage = Storage::new_shared_filename(&handle).unwrap();
    assert_eq!(storage.kind(), StorageKind::CpuFilename);
    assert_eq!(storage.shared_refcount(), Some(2));
    let expected: Vec<u8> = (0..3000).map(|i| ((i * 3) % 256) as u8).collect();
    assert_eq!(storage.to_vec().unwrap(), expected);
    storage.write_at(1, &[0x3C]).unwrap();
    drop(storage); // deregisters at PyTorch's manager, count back to 1
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    assert_eq!(line(&mut out), "60", "PyTorch sees Rust's write");
    finish(child);
}
