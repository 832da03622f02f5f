//! Names shared by PyTorch carry the socket of its `torch_shm_manager`; opening one registers
//! with that manager in its own protocol. A stand-in manager here records the `AllocInfo`
//! records it receives (pid i32, free u8, 60-byte NUL-ended name, padding: 68 bytes).

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::sync::mpsc;

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
