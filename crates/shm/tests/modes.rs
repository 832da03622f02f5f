//! The MapAllocator flag combinations and the refcounted layout, observed from outside.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::fresh_name;
use tensormem_shm::{
    Access, Backing, CreateMode, MapOptions, NameGenerator, RefcountHeader, RefcountedRegion,
    SharedRegion, ShmName, REFCOUNT_HEADER_LEN,
};

#[test]
fn exclusive_create_is_private_and_sized() {
    let (name, _cleanup) = fresh_name();
    let region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(10_000)
        .map_shm(&name)
        .unwrap();
    let meta = std::fs::metadata(name.path()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), 10_000);
    assert_eq!(region.len(), 10_000);
    assert!(region.fd().is_none(), "fd closed unless keep_fd");
    assert_eq!(region.name(), Some(&name));
    assert!(region.to_vec().unwrap().iter().all(|&b| b == 0));
}

#[test]
fn keep_fd_unlink_after_map_is_the_fd_strategy() {
    let (name, _cleanup) = fresh_name();
    let mut region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(4096)
        .keep_fd(true)
        .unlink_after_map(true)
        .map_shm(&name)
        .unwrap();
    assert!(!name.path().exists());
    assert_eq!(
        region.backing(),
        &Backing::Shm {
            name: name.clone(),
            unlinked: true
        }
    );
    region.write_at(0, b"still here").unwrap();
    // The kept fd reaches the same memory.
    let again = MapOptions::new().map_fd(region.fd().unwrap()).unwrap();
    assert_eq!(&again.to_vec().unwrap()[..10], b"still here");
    assert_eq!(again.backing(), &Backing::Fd { sealed: false });
    region.unlink().unwrap(); // already unlinked: nothing to do
}

#[test]
fn open_or_create_grows_and_open_existing_maps_whole_object() {
    let (name, _cleanup) = fresh_name();
    let first = MapOptions::new()
        .create(CreateMode::OpenOrCreate)
        .len(4096)
        .map_shm(&name)
        .unwrap();
    let second = MapOptions::new()
        .create(CreateMode::OpenOrCreate)
        .len(8192)
        .map_shm(&name)
        .unwrap();
    assert_eq!(second.len(), 8192);
    assert_eq!(first.len(), 4096);
    let whole = MapOptions::new().map_shm(&name).unwrap();
    assert_eq!(whole.len(), 8192);
    let part = MapOptions::new()
        .len(100)
        .read_only()
        .map_shm(&name)
        .unwrap();
    assert_eq!(part.len(), 100);
    assert_eq!(part.access(), Access::ReadOnly);
}

#[test]
fn files_by_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("storage.bin");
    let mut writer = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(5000)
        .populate(true)
        .huge_pages(true)
        .map_path(&path)
        .unwrap();
    writer.write_at(4999, &[3]).unwrap();
    let reader = MapOptions::new().read_only().map_path(&path).unwrap();
    assert_eq!(reader.len(), 5000);
    assert_eq!(reader.to_vec().unwrap()[4999], 3);
    assert_eq!(std::fs::read(&path).unwrap()[4999], 3);
    writer.unlink().unwrap();
    assert!(!path.exists());
}

#[test]
fn refcounted_layout_is_pytorchs() {
    let (name, _cleanup) = fresh_name();
    let mut region = RefcountedRegion::create(&name, 1000).unwrap();
    assert_eq!(region.len(), 1000);
    region.write_at(0, b"data").unwrap();
    let second = RefcountedRegion::open(&name).unwrap();
    // What a PyTorch process maps: 64 + 1000 bytes, refcount (native i32) at 0, data at 64.
    let raw = MapOptions::new().read_only().map_shm(&name).unwrap();
    assert_eq!(raw.len(), REFCOUNT_HEADER_LEN + 1000);
    let header = RefcountHeader::decode(&raw.to_vec().unwrap()).unwrap();
    assert_eq!(header.refcount, 2);
    assert_eq!(&raw.to_vec().unwrap()[..4], &2i32.to_ne_bytes());
    assert_eq!(&raw.to_vec().unwrap()[64..68], b"data");
    drop(second);
    assert_eq!(
        RefcountHeader::decode(&raw.to_vec().unwrap())
            .unwrap()
            .refcount,
        1
    );
    assert!(region.close().unwrap());
    assert!(!name.path().exists());
}

#[test]
fn refcounted_open_of_a_dying_region_is_refused() {
    let (name, _cleanup) = fresh_name();
    // An object whose count already reached 0 (its last user is unlinking it).
    let mut raw = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(REFCOUNT_HEADER_LEN as u64 + 16)
        .map_shm(&name)
        .unwrap();
    raw.write_at(0, &RefcountHeader { refcount: 0 }.encode())
        .unwrap();
    assert!(matches!(
        RefcountedRegion::open(&name),
        Err(tensormem_shm::Error::RefcountGone { refcount: 0, .. })
    ));
    assert_eq!(
        RefcountHeader::decode(&raw.to_vec().unwrap())
            .unwrap()
            .refcount,
        0
    );
    // Too small to hold the header and a byte.
    let (small, _cleanup2) = fresh_name();
    let _tiny = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(64)
        .map_shm(&small)
        .unwrap();
    assert!(matches!(
        RefcountedRegion::open(&small),
        Err(tensormem_shm::Error::TooSmall { .. })
    ));
}

#[test]
fn anonymous_regions_and_copies() {
    let data: Vec<u8> = (0..(5 << 20)).map(|i| (i % 253) as u8).collect();
    let region = SharedRegion::copy_from_bytes(&data).unwrap();
    assert_eq!(region.to_vec().unwrap(), &data[..]);
    assert!(region.is_sealed_against_shrink());
    assert!(region.name().is_none());
    assert!(
        region.describe().starts_with("fd "),
        "{}",
        region.describe()
    );
}

#[test]
fn generated_names_are_unique_and_parse() {
    let generator = NameGenerator::with_prefix("torch").unwrap();
    let a = generator.next_name();
    let b = generator.next_name();
    assert_ne!(a, b);
    let (pa, pb) = (a.parse_generated().unwrap(), b.parse_generated().unwrap());
    assert_eq!(pa.prefix, "torch");
    assert_eq!(pa.pid, std::process::id());
    assert!(pb.counter > pa.counter);
    assert!(ShmName::new("/not_generated")
        .unwrap()
        .parse_generated()
        .is_none());
    let with_underscores = NameGenerator::with_prefix("my_app").unwrap().next_name();
    assert_eq!(with_underscores.parse_generated().unwrap().prefix, "my_app");
}
