//! Storages shared between real processes: by descriptor over a socket, by name, a creator that
//! exits while a consumer holds the name, a creator killed with `kill -9`.
//!
//! Children are this test binary run again on one test (tests/common/child.rs); each test first
//! asks whether it is a child and if so plays its role. The manager daemon is served by a thread
//! of the parent (tests/common).

mod common;

use std::os::unix::net::UnixListener;

use common::child::{role, spawn};
use tensormem_storage::{FilenameHandle, ShmName, Storage, StorageKind};
use tensormem_test_support::child::{hold, next_report, report};

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

#[test]
fn fd_sharing_across_processes() {
    common::manager();
    if let Some((role, socket)) = role() {
        assert_eq!(role, "fd_consumer");
        let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        let storage = Storage::recv_shared_fd(&stream).unwrap();
        assert_eq!(storage.to_vec().unwrap(), pattern(1 << 20));
        storage.write_at(0, &[0xEE]).unwrap();
        report("written");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (mut child, mut out) = spawn(
        "fd_sharing_across_processes",
        "fd_consumer",
        path.to_str().unwrap(),
    );
    let (stream, _) = listener.accept().unwrap();
    let storage = Storage::from_vec(pattern(1 << 20));
    storage.send_shared_fd(&stream).unwrap(); // moves it into shared memory first
    assert!(matches!(storage.kind(), StorageKind::CpuFd { .. }));
    assert_eq!(next_report(&mut out), "written");
    assert_eq!(storage.to_vec().unwrap()[0], 0xEE);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn filename_sharing_across_processes() {
    common::manager();
    if let Some((role, arg)) = role() {
        assert_eq!(role, "filename_consumer");
        let (name, size) = arg.split_once(' ').unwrap();
        let handle = FilenameHandle {
            manager_handle: Vec::new(),
            name: ShmName::new(name).unwrap(),
            size: size.parse().unwrap(),
        };
        let storage = Storage::new_shared_filename(&handle).unwrap();
        storage.shared_decref().unwrap(); // take over the sender's reference
        assert_eq!(storage.to_vec().unwrap(), pattern(4096));
        storage.write_at(4095, &[0xAB]).unwrap();
        report("written");
        return;
    }
    let storage = Storage::from_vec(pattern(4096));
    let handle = storage.share_filename().unwrap();
    storage.shared_incref().unwrap(); // the reference of the message in transit
    let (mut child, mut out) = spawn(
        "filename_sharing_across_processes",
        "filename_consumer",
        &format!("{} {}", handle.name, handle.size),
    );
    assert_eq!(next_report(&mut out), "written");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    assert_eq!(storage.to_vec().unwrap()[4095], 0xAB);
    // The child opened (+1), decrefed (-1) and exited (-1): only our own reference is left.
    assert_eq!(storage.shared_refcount(), Some(1));
    drop(storage);
    assert!(!handle.name.path().exists());
}

#[test]
fn a_name_survives_its_creator_while_another_process_holds_it() {
    common::manager();
    if let Some((role, _)) = role() {
        assert_eq!(role, "creator");
        let storage = Storage::from_vec(pattern(10_000));
        let handle = storage.share_filename().unwrap();
        storage.shared_incref().unwrap();
        report(&format!("{} {}", handle.name, handle.size));
        hold();
        drop(storage);
        report("dropped");
        return;
    }
    let (mut child, mut out) = spawn(
        "a_name_survives_its_creator_while_another_process_holds_it",
        "creator",
        "",
    );
    let line = next_report(&mut out);
    let (name, size) = line.split_once(' ').unwrap();
    let handle = FilenameHandle {
        manager_handle: Vec::new(),
        name: ShmName::new(name).unwrap(),
        size: size.parse().unwrap(),
    };
    let storage = Storage::new_shared_filename(&handle).unwrap();
    storage.shared_decref().unwrap();
    drop(child.stdin.take()); // the creator drops its storage and exits
    assert_eq!(next_report(&mut out), "dropped");
    assert!(child.wait().unwrap().success());
    assert!(handle.name.path().exists(), "we still hold it");
    // Another process could still open it by name now.
    let again = Storage::new_shared_filename(&handle).unwrap();
    assert_eq!(again.to_vec().unwrap(), pattern(10_000));
    drop(again);
    drop(storage);
    assert!(!handle.name.path().exists(), "the last user unlinked it");
}

#[test]
fn a_killed_creator_leaks_nothing() {
    common::manager();
    if let Some((role, _)) = role() {
        assert_eq!(role, "victim");
        let storage = Storage::new_shared_filename_storage(1 << 16).unwrap();
        storage.shared_incref().unwrap(); // even a reference in transit
        report(storage.shared_name().unwrap().as_str());
        hold();
        return;
    }
    let (mut child, mut out) = spawn("a_killed_creator_leaks_nothing", "victim", "");
    let name = ShmName::new(next_report(&mut out)).unwrap();
    assert!(name.path().exists());
    child.kill9(); // SIGKILL: no destructor runs
    assert!(
        common::eventually(|| !name.path().exists()),
        "the manager unlinked the dead creator's name"
    );
}
