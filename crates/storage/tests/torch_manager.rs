//! Names shared by PyTorch carry the socket of its `torch_shm_manager`; opening one registers
//! with that manager in its own protocol. A stand-in manager here records the `AllocInfo`
//! records it receives (pid i32, free u8, 60-byte NUL-ended name, padding: 68 bytes).

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::sync::mpsc;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{
    bind, connect, listen, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
};

use tensormem_shm::{NameGenerator, RefcountedRegion, TORCH_PREFIX};
use tensormem_storage::{Error, FilenameHandle, Storage};

/// One received record: (pid, free, name).
type Record = (i32, bool, String);

fn decode(record: &[u8; 68]) -> Record {
    let pid = i32::from_ne_bytes(record[..4].try_into().unwrap());
    let name_bytes = &record[5..65];
    let end = name_bytes.iter().position(|&b| b == 0).unwrap();
    (
        pid,
        record[4] != 0,
        String::from_utf8(name_bytes[..end].to_vec()).unwrap(),
    )
}

/// A manager that answers "OK" to registrations and reports every record.
fn fake_manager() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    mpsc::Receiver<Record>,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("manager.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut record = [0u8; 68];
        while client.read_exact(&mut record).is_ok() {
            let decoded = decode(&record);
            if !decoded.1 {
                client.write_all(b"OK").unwrap();
            }
            if tx.send(decoded).is_err() {
                break;
            }
        }
    });
    (dir, path, rx)
}

#[test]
fn opening_a_pytorch_name_registers_with_its_manager_and_closing_deregisters() {
    let (_dir, socket, records) = fake_manager();
    // What a PyTorch process would have made: a refcounted region named like PyTorch's.
    let name = NameGenerator::with_prefix(TORCH_PREFIX)
        .unwrap()
        .next_name();
    let mut region = RefcountedRegion::create(&name, 256).unwrap();
    region.write_at(0, b"from torch").unwrap();

    let handle = FilenameHandle::from_torch(
        socket.to_str().unwrap().as_bytes(),
        name.as_str().as_bytes(),
        256,
    )
    .unwrap();
    let storage = Storage::new_shared_filename(&handle).unwrap();
    let pid = std::process::id() as i32;
    assert_eq!(
        records.recv().unwrap(),
        (pid, false, name.as_str().to_owned())
    );
    let mut text = [0; 10];
    storage.read_at(0, &mut text).unwrap();
    assert_eq!(&text, b"from torch");
    assert_eq!(region.refcount(), 2);
    // Sharing it again hands PyTorch's manager handle on.
    assert_eq!(storage.share_filename().unwrap(), handle);

    drop(storage);
    assert_eq!(
        records.recv().unwrap(),
        (pid, true, name.as_str().to_owned())
    );
    assert_eq!(region.refcount(), 1);
    assert!(region.close().unwrap());
}

#[test]
fn an_unreachable_pytorch_manager_is_a_typed_error() {
    let name = NameGenerator::with_prefix(TORCH_PREFIX)
        .unwrap()
        .next_name();
    let region = RefcountedRegion::create(&name, 16).unwrap();
    let handle = FilenameHandle::from_torch(
        b"/nonexistent/torch-shm-dir-x/manager.sock",
        name.as_str().as_bytes(),
        16,
    )
    .unwrap();
    assert!(matches!(
        Storage::new_shared_filename(&handle),
        Err(Error::TorchManager { .. })
    ));
    assert_eq!(region.refcount(), 1, "nothing was mapped or counted");
    assert!(region.close().unwrap());
}

/// A Unix socket bound and listening with a backlog of 0 that never accepts, its backlog filled
/// by connections kept open: a further connect waits until it times out.
fn stuck_manager() -> (tempfile::TempDir, std::path::PathBuf, Vec<OwnedFd>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("manager.sock");
    let address = SocketAddrUnix::new(&path).unwrap();
    let listener = socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    bind(&listener, &address).unwrap();
    listen(&listener, 0).unwrap();
    let mut held = vec![listener];
    loop {
        let client = socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .unwrap();
        match connect(&client, &address) {
            Ok(()) => held.push(client),
            Err(Errno::AGAIN) => break,
            Err(other) => panic!("filling the backlog: {other}"),
        }
        assert!(held.len() < 64, "the backlog never filled");
    }
    (dir, path, held)
}

#[test]
fn a_pytorch_manager_that_never_accepts_times_out_without_blocking_other_opens() {
    let (_stuck_dir, stuck, _held) = stuck_manager();
    let name = NameGenerator::with_prefix(TORCH_PREFIX)
        .unwrap()
        .next_name();
    let region = RefcountedRegion::create(&name, 16).unwrap();
    let handle = FilenameHandle::from_torch(
        stuck.to_str().unwrap().as_bytes(),
        name.as_str().as_bytes(),
        16,
    )
    .unwrap();
    let (done_tx, done) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(Storage::new_shared_filename(&handle).map(|_| ()));
    });
    // Give the stuck open time to be inside its connect.
    std::thread::sleep(Duration::from_millis(200));

    // Another manager's name opens meanwhile: the stuck connect holds no process-wide lock.
    let (_dir, good, records) = fake_manager();
    let other = NameGenerator::with_prefix(TORCH_PREFIX)
        .unwrap()
        .next_name();
    let other_region = RefcountedRegion::create(&other, 16).unwrap();
    let other_handle = FilenameHandle::from_torch(
        good.to_str().unwrap().as_bytes(),
        other.as_str().as_bytes(),
        16,
    )
    .unwrap();
    let (open_tx, opened) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = open_tx.send(Storage::new_shared_filename(&other_handle).map(drop));
    });
    opened
        .recv_timeout(Duration::from_secs(60))
        .expect("an open through a live manager waited for the stuck one")
        .unwrap();
    assert!(records.recv_timeout(Duration::from_secs(60)).is_ok());
    assert!(
        done.try_recv().is_err(),
        "the stuck open finished before the other one: the test proves nothing"
    );

    let err = done
        .recv_timeout(Duration::from_secs(60))
        .expect("connecting to a manager that never accepts did not time out")
        .unwrap_err();
    assert!(matches!(err, Error::TorchManager { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("accepted no connection"), "{text}");
    assert!(text.contains("must be running"), "{text}");
    assert_eq!(region.refcount(), 1, "nothing was mapped or counted");
    assert!(region.close().unwrap());
    drop(other_region);
}
