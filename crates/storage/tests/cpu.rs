//! Host storages in one process: owners, clones, weak references, every sharing operation and
//! the copies between them.

mod common;

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use tensormem_storage::{storage_copy, Device, Error, FilenameHandle, Storage, StorageKind};

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

fn inode(fd: impl AsFd) -> u64 {
    std::fs::File::from(fd.as_fd().try_clone_to_owned().unwrap())
        .metadata()
        .unwrap()
        .ino()
}

#[test]
fn a_private_storage_reads_writes_and_checks_ranges() {
    let s = Storage::new(16);
    assert_eq!(s.nbytes(), 16);
    assert_eq!(s.device(), Device::Cpu);
    assert_eq!(s.kind(), StorageKind::CpuPrivate);
    assert!(!s.is_shared());
    assert_eq!(s.to_vec().unwrap(), vec![0; 16]);
    s.write_at(14, &[1, 2]).unwrap();
    let mut two = [0; 2];
    s.read_at(14, &mut two).unwrap();
    assert_eq!(two, [1, 2]);
    assert!(matches!(
        s.write_at(15, &[1, 2]),
        Err(Error::OutOfBounds {
            offset: 15,
            len: 2,
            nbytes: 16
        })
    ));
    assert!(matches!(
        s.read_at(usize::MAX, &mut two),
        Err(Error::OutOfBounds { .. })
    ));
    s.fill(9).unwrap();
    assert_eq!(s.to_vec().unwrap(), vec![9; 16]);
}

#[test]
fn clones_share_and_share_memory_moves_every_clone_in_place() {
    let a = Storage::from_vec(pattern(10_000));
    let b = a.clone();
    assert!(a.ptr_eq(&b));
    assert_eq!(a.use_count(), 2);
    a.share_memory_().unwrap();
    assert!(matches!(b.kind(), StorageKind::CpuFd { sealed: true }));
    assert!(b.is_shared());
    assert_eq!(b.to_vec().unwrap(), pattern(10_000));
    b.write_at(0, &[77]).unwrap();
    assert_eq!(a.to_vec().unwrap()[0], 77);

    // Already shared: no-op (the same object stays behind it).
    let before = inode(a.get_shared_fd().unwrap());
    a.share_memory_().unwrap();
    assert_eq!(inode(a.get_shared_fd().unwrap()), before);
}

#[test]
fn weak_references_expire_with_the_last_strong_handle() {
    let s = Storage::from_bytes(b"abc");
    let weak = s.weak_ref();
    assert!(!weak.expired());
    assert!(weak.points_to(&s));
    let again = weak.upgrade().unwrap();
    assert!(again.ptr_eq(&s));
    drop(again);
    let clone_of_weak = weak.clone();
    drop(s);
    assert!(weak.expired());
    assert!(matches!(weak.upgrade(), Err(Error::Expired)));
    assert!(matches!(clone_of_weak.upgrade(), Err(Error::Expired)));
}

#[test]
fn share_fd_moves_a_private_storage_first_and_the_consumer_sees_it() {
    let s = Storage::from_vec(pattern(4096));
    let handle = s.share_fd().unwrap();
    assert!(matches!(s.kind(), StorageKind::CpuFd { .. }));
    assert_eq!(handle.size(), 4096);
    let consumer = Storage::new_shared_fd(handle.fd(), handle.size()).unwrap();
    drop(handle); // the consumer kept its own duplicate
    assert_eq!(consumer.to_vec().unwrap(), pattern(4096));
    consumer.write_at(4095, &[1]).unwrap();
    assert_eq!(s.to_vec().unwrap()[4095], 1);
    // A second share_fd shares the same object.
    assert_eq!(
        inode(s.share_fd().unwrap().fd()),
        inode(consumer.get_shared_fd().unwrap())
    );
}

#[test]
fn new_shared_fd_storage_is_zeroed_and_fd_backed() {
    let s = Storage::new_shared_fd_storage(1 << 20).unwrap();
    assert!(matches!(s.kind(), StorageKind::CpuFd { sealed: true }));
    assert_eq!(s.nbytes(), 1 << 20);
    assert!(s.to_vec().unwrap().iter().all(|&b| b == 0));
    assert!(matches!(
        Storage::new_shared_fd_storage(0),
        Err(Error::Empty { .. })
    ));
}

#[test]
fn a_consumer_may_map_fewer_bytes_than_the_object_holds() {
    let s = Storage::from_vec(pattern(8192));
    let handle = s.share_fd().unwrap();
    let head = Storage::new_shared_fd(handle.fd(), 100).unwrap();
    assert_eq!(head.to_vec().unwrap(), pattern(100));
}

#[test]
fn send_and_receive_over_a_socket() {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let s = Storage::from_vec(pattern(3000));
    s.send_shared_fd(&a).unwrap();
    let r = Storage::recv_shared_fd(&b).unwrap();
    assert_eq!(r.to_vec().unwrap(), pattern(3000));
    s.share_fd().unwrap().send(&a).unwrap();
    let h = tensormem_storage::FdHandle::recv(&b).unwrap();
    assert_eq!(h.size(), 3000);
    let r2 = Storage::new_shared_fd(&h, h.size()).unwrap();
    r2.write_at(0, &[200]).unwrap();
    assert_eq!(r.to_vec().unwrap()[0], 200);
}

#[test]
fn filename_sharing_counts_users_and_the_last_one_unlinks() {
    common::manager();
    let s = Storage::from_vec(pattern(5000));
    let handle = s.share_filename().unwrap();
    assert_eq!(s.kind(), StorageKind::CpuFilename);
    assert_eq!(s.shared_name().as_ref(), Some(&handle.name));
    assert!(handle.manager_handle.is_empty());
    assert_eq!(handle.size, 5000);
    assert_eq!(s.shared_refcount(), Some(1));
    // Sharing again hands out the same name.
    assert_eq!(s.share_filename().unwrap(), handle);

    let consumer = Storage::new_shared_filename(&handle).unwrap();
    assert_eq!(consumer.to_vec().unwrap(), pattern(5000));
    assert_eq!(s.shared_refcount(), Some(2));
    consumer.write_at(0, &[42]).unwrap();
    assert_eq!(s.to_vec().unwrap()[0], 42);

    let path = handle.name.path();
    drop(s);
    assert!(path.exists(), "the consumer still counts");
    drop(consumer);
    assert!(!path.exists(), "the last user unlinked the name");
    assert!(matches!(
        Storage::new_shared_filename(&handle),
        Err(Error::Shm(tensormem_shm::Error::NotFound { .. }))
    ));
}

#[test]
fn incref_keeps_a_name_in_transit_alive_and_decref_hands_it_over() {
    common::manager();
    let producer = Storage::new_shared_filename_storage(64).unwrap();
    producer.write_at(0, b"in transit").unwrap();
    let handle = producer.share_filename().unwrap();
    producer.shared_incref().unwrap(); // the sender's reference for the message
    assert_eq!(producer.shared_refcount(), Some(2));
    drop(producer); // before the receiver got there
    assert!(handle.name.path().exists());

    let receiver = Storage::new_shared_filename(&handle).unwrap();
    receiver.shared_decref().unwrap(); // the receiver takes over the sender's reference
    assert_eq!(receiver.shared_refcount(), Some(1));
    let mut text = [0; 10];
    receiver.read_at(0, &mut text).unwrap();
    assert_eq!(&text, b"in transit");
    // Only the receiver's own mapping counts now: another decref would be an imbalance.
    assert!(matches!(
        receiver.shared_decref(),
        Err(Error::RefcountUnderflow { refcount: 1, .. })
    ));
    drop(receiver);
    assert!(!handle.name.path().exists());
}

#[test]
fn incref_and_decref_do_nothing_for_other_storages() {
    let s = Storage::new(8);
    s.shared_incref().unwrap();
    s.shared_decref().unwrap();
    assert_eq!(s.shared_refcount(), None);
}

#[test]
fn share_fd_of_a_named_storage_moves_it_to_an_fd_and_releases_the_name() {
    common::manager();
    let s = Storage::from_vec(pattern(777));
    let handle = s.share_filename().unwrap();
    let fd = s.share_fd().unwrap();
    assert!(matches!(s.kind(), StorageKind::CpuFd { .. }));
    assert_eq!(s.to_vec().unwrap(), pattern(777));
    assert!(!handle.name.path().exists(), "the only user moved away");
    assert_eq!(
        Storage::new_shared_fd(fd.fd(), 777)
            .unwrap()
            .to_vec()
            .unwrap(),
        pattern(777)
    );
    // share_memory_ of a named storage leaves it alone (it is shared already).
    let named = Storage::new_shared_filename_storage(10).unwrap();
    named.share_memory_().unwrap();
    assert_eq!(named.kind(), StorageKind::CpuFilename);
}

#[test]
fn filename_handles_from_pytorch_bytes_are_validated() {
    assert!(matches!(
        FilenameHandle::from_torch(b"", b"no-leading-slash", 10),
        Err(Error::Shm(tensormem_shm::Error::InvalidName { .. }))
    ));
    let h = FilenameHandle::from_torch(b"/tmp/x/manager.sock", b"/torch_1_2_3", 10).unwrap();
    assert_eq!(h.name.as_str(), "/torch_1_2_3");
    assert_eq!(h.manager_handle, b"/tmp/x/manager.sock");
}

#[test]
fn get_shared_fd_needs_a_descriptor() {
    common::manager();
    assert!(matches!(
        Storage::new(4).get_shared_fd(),
        Err(Error::NotShared { .. })
    ));
    let named = Storage::new_shared_filename_storage(4).unwrap();
    assert!(matches!(
        named.get_shared_fd(),
        Err(Error::NotShared { .. })
    ));
}

#[test]
fn storage_copy_between_every_kind_of_host_memory() {
    common::manager();
    let kinds: Vec<Box<dyn Fn() -> Storage>> = vec![
        Box::new(|| Storage::new(3 << 20)),
        Box::new(|| Storage::new_shared_fd_storage(3 << 20).unwrap()),
        Box::new(|| Storage::new_shared_filename_storage(3 << 20).unwrap()),
    ];
    let data = pattern(3 << 20);
    for make_src in &kinds {
        for make_dst in &kinds {
            let src = make_src();
            src.write_at(0, &data).unwrap();
            let dst = make_dst();
            storage_copy(&dst, &src, false).unwrap();
            assert_eq!(dst.to_vec().unwrap(), data, "{src:?} -> {dst:?}");
        }
    }
}

#[test]
fn storage_copy_refuses_different_sizes_and_copies_nothing() {
    let src = Storage::from_bytes(&[1; 10]);
    let dst = Storage::new(11);
    assert!(matches!(
        storage_copy(&dst, &src, false),
        Err(Error::SizeMismatch { dst: 11, src: 10 })
    ));
    assert_eq!(dst.to_vec().unwrap(), vec![0; 11]);
    // Onto itself: nothing to do.
    storage_copy(&src, &src.clone(), true).unwrap();
    assert_eq!(src.to_vec().unwrap(), vec![1; 10]);
}

#[test]
fn crossed_copies_from_two_threads_do_not_deadlock() {
    let a = Storage::from_bytes(&[1; 4096]);
    let b = Storage::new_shared_fd_storage(4096).unwrap();
    let (a2, b2) = (a.clone(), b.clone());
    let t = std::thread::spawn(move || {
        for _ in 0..2000 {
            storage_copy(&b2, &a2, false).unwrap();
        }
    });
    for _ in 0..2000 {
        storage_copy(&a, &b, false).unwrap();
    }
    t.join().unwrap();
}

#[test]
fn empty_storages_cannot_be_shared() {
    common::manager();
    let empty = Storage::new(0);
    assert!(matches!(empty.share_memory_(), Err(Error::Empty { .. })));
    assert!(matches!(empty.share_fd(), Err(Error::Empty { .. })));
    assert!(matches!(empty.share_filename(), Err(Error::Empty { .. })));
    assert_eq!(empty.kind(), StorageKind::CpuPrivate);
    assert_eq!(empty.to_vec().unwrap(), Vec::<u8>::new());
}

#[test]
fn storages_cross_threads() {
    let s = Storage::new_shared_fd_storage(100).unwrap();
    let weak = s.weak_ref();
    let t = std::thread::spawn(move || {
        let s = weak.upgrade().unwrap();
        s.write_at(99, &[5]).unwrap();
    });
    t.join().unwrap();
    assert_eq!(s.to_vec().unwrap()[99], 5);
}
