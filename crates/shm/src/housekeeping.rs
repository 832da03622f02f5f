//! Housekeeping of `/dev/shm`: which shared memory objects exist, who made them, who still uses
//! them, and removing the ones nobody can reach any more (what `tensormem shm list` and
//! `tensormem shm gc` print).
//!
//! An object is garbage when its name says which process created it
//! (`/<prefix>_<pid>_<random>_<counter>`, tensormem's and PyTorch's shape), that process is
//! gone, and no live process maps the object or holds a descriptor of it (checked in
//! `/proc/*/maps` and `/proc/*/fd`). Objects whose names have another shape are never removed.
//!
//! Limits: processes whose `/proc` entries this user cannot read (other users' processes, for a
//! non-root caller) are not inspected, and [`GcReport::uninspected`] counts them; a name
//! handed to a peer that has not opened it yet looks unused. Run `gc` when the jobs that share
//! memory are stopped, or accept that risk for objects whose creator died.
//!
//! # PID namespaces
//!
//! A name records its creator's pid as the creator saw it, in its own PID namespace, and
//! `/proc` shows only the processes of one namespace (and those below it). Run in a container
//! that shares `/dev/shm` with the host or with other containers (`--ipc=host`, a shared
//! volume), `gc` would see the creators and users outside as dead or absent and unlink memory
//! they still map. So `gc` removes objects only where `/proc` is the initial PID namespace's
//! and shows this process ([`current_pid_namespace`]); anywhere else it keeps every object it
//! would have removed ([`KeepReason::OtherNamespace`]) unless told that every process using
//! these objects runs in this namespace ([`GcOptions::this_namespace_only`]: a container with
//! a `/dev/shm` of its own). Names keep the shape PyTorch reads, so they carry no namespace.
//!
//! ```no_run
//! use tensormem_shm::housekeeping::{collect_garbage, list, DEFAULT_PREFIXES};
//!
//! for object in list(DEFAULT_PREFIXES)? {
//!     println!("{} {} bytes, creator alive: {:?}", object.name, object.size, object.creator_alive());
//! }
//! let report = collect_garbage(DEFAULT_PREFIXES, true)?; // dry run
//! println!("would remove {} objects", report.removed.len());
//! # Ok::<(), tensormem_shm::Error>(())
//! ```

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rustix::fs::FileType;

use crate::error::{Error, Result};
use crate::name::{ShmName, DEFAULT_PREFIX, SHM_DIR, TORCH_PREFIX};

/// The prefixes `list` and `gc` look at unless told otherwise: tensormem's and PyTorch's.
pub const DEFAULT_PREFIXES: &[&str] = &[DEFAULT_PREFIX, TORCH_PREFIX];

/// The process that created an object, as its name tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Creator {
    /// Its pid.
    pub pid: u32,
    /// Whether a live (non-zombie) process has that pid now. A reused pid reads as alive, which
    /// errs on the side of keeping the object.
    pub alive: bool,
}

/// A shared memory object in `/dev/shm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmObject {
    /// Its name (`/torch_4242_1234_0`).
    pub name: ShmName,
    /// Its size in bytes.
    pub size: u64,
    /// The owner's uid.
    pub owner_uid: u32,
    /// The owner's user name, when `/etc/passwd` has it.
    pub owner: Option<String>,
    /// The creating process, for names of the generated shape.
    pub creator: Option<Creator>,
    /// Live processes that map the object or hold a descriptor of it, ascending.
    pub users: Vec<u32>,
}

impl ShmObject {
    /// Whether the creator lives; `None` when the name does not say who created it.
    pub fn creator_alive(&self) -> Option<bool> {
        self.creator.map(|c| c.alive)
    }

    /// Whether `gc` would remove the object, and if not, why.
    pub fn verdict(&self) -> Verdict {
        match self.creator {
            None => Verdict::Keep(KeepReason::UnknownCreator),
            Some(Creator { alive: true, .. }) => Verdict::Keep(KeepReason::CreatorAlive),
            Some(_) if !self.users.is_empty() => Verdict::Keep(KeepReason::InUse),
            Some(_) => Verdict::Garbage,
        }
    }
}

/// What `gc` decides about an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The creator is dead and nobody uses it: remove.
    Garbage,
    /// Keep it, for this reason.
    Keep(KeepReason),
}

/// Why `gc` keeps an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepReason {
    /// The name does not have the `<prefix>_<pid>_<random>_<counter>` shape.
    UnknownCreator,
    /// The creating process still runs.
    CreatorAlive,
    /// A live process maps it or holds a descriptor of it.
    InUse,
    /// Its creator looks dead and nobody seems to use it, but `gc` runs where `/proc` does not
    /// show every process that may (outside the initial PID namespace): not removed.
    OtherNamespace,
}

impl std::fmt::Display for KeepReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::UnknownCreator => "name does not say who created it",
            Self::CreatorAlive => "creator alive",
            Self::InUse => "in use by a live process",
            Self::OtherNamespace => "creator and users may be in another PID namespace",
        })
    }
}

/// What [`collect_garbage`] did (or, in a dry run, would do).
#[derive(Debug, Default)]
pub struct GcReport {
    /// Whether this was a dry run (nothing was unlinked).
    pub dry_run: bool,
    /// Objects removed (or that would be).
    pub removed: Vec<ShmObject>,
    /// Objects kept, with the reason.
    pub kept: Vec<(ShmObject, KeepReason)>,
    /// Objects that should have gone but could not be unlinked (another user's, usually).
    pub failed: Vec<(ShmObject, Error)>,
    /// Processes whose `/proc` entries could not be read, so whose mappings were not seen.
    pub uninspected: usize,
    /// The PID namespace `/proc` showed (objects are removed only in the initial one, unless
    /// [`GcOptions::this_namespace_only`]).
    pub namespace: PidNamespace,
}

/// How [`collect_garbage_with`] runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcOptions {
    /// Only report what would be removed.
    pub dry_run: bool,
    /// Every process that uses these objects runs in this PID namespace (a container with a
    /// `/dev/shm` of its own): remove orphans even outside the initial namespace. Wrong where
    /// `/dev/shm` is shared with processes outside (`--ipc=host`, a shared volume): their live
    /// regions would be unlinked.
    pub this_namespace_only: bool,
}

/// The PID namespace whose processes `/proc` shows, as far as `gc` is concerned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PidNamespace {
    /// The initial (host) namespace, and `/proc` shows this process: every process of the
    /// machine is visible.
    Initial,
    /// Another namespace (a container's), by the inode of its `/proc/self/ns/pid`: processes
    /// outside it are invisible.
    Other {
        /// The namespace's inode number (as `readlink /proc/self/ns/pid` prints it).
        inode: u64,
    },
    /// Unknown: no readable `/proc/self/ns/pid`, or a `/proc` mounted for another namespace
    /// than this process's (`/proc/self` is not this process).
    #[default]
    Unknown,
}

impl std::fmt::Display for PidNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Initial => f.write_str("the initial PID namespace"),
            Self::Other { inode } => write!(f, "PID namespace pid:[{inode}]"),
            Self::Unknown => f.write_str("an unknown PID namespace"),
        }
    }
}

/// Inode of the initial PID namespace (`PROC_PID_INIT_INO` in the kernel's `proc_ns.h`,
/// fixed since Linux 3.8).
const INITIAL_PID_NAMESPACE_INODE: u64 = 0xEFFF_FFFC;

/// The PID namespace of this process, and whether `/proc` shows it: `stat` of
/// `/proc/self/ns/pid` and `readlink` of `/proc/self`.
pub fn current_pid_namespace() -> PidNamespace {
    let Ok(ns) = rustix::fs::stat("/proc/self/ns/pid") else {
        return PidNamespace::Unknown;
    };
    // `/proc/self` names this process's pid in the namespace `/proc` was mounted for.
    let shows_us = fs::read_link("/proc/self").ok().and_then(|link| {
        link.to_str()
            .and_then(|pid| pid.parse::<u32>().ok())
            .map(|pid| pid == std::process::id())
    });
    if shows_us != Some(true) || FileType::from_raw_mode(ns.st_mode) != FileType::RegularFile {
        return PidNamespace::Unknown;
    }
    match ns.st_ino {
        INITIAL_PID_NAMESPACE_INODE => PidNamespace::Initial,
        inode => PidNamespace::Other { inode },
    }
}

/// The objects in `/dev/shm` whose names start with `<prefix>_` for one of `prefixes`, sorted
/// by name, with their creators and users.
///
/// # Errors
///
/// [`Error::Os`] when `/dev/shm` cannot be read. Objects that vanish during the scan are
/// skipped.
pub fn list(prefixes: &[&str]) -> Result<Vec<ShmObject>> {
    Ok(scan(prefixes)?.0)
}

/// Unlinks the objects (of `prefixes`) whose creator is dead and that no live process uses;
/// with `dry_run`, only reports what it would unlink.
///
/// # Errors
///
/// [`Error::Os`] when `/dev/shm` cannot be read; failures to unlink single objects are
/// reported in [`GcReport::failed`], not as an error.
pub fn collect_garbage(prefixes: &[&str], dry_run: bool) -> Result<GcReport> {
    collect_garbage_with(
        prefixes,
        GcOptions {
            dry_run,
            ..GcOptions::default()
        },
    )
}

/// [`collect_garbage`] with options: run outside the initial PID namespace, it keeps the
/// objects it would remove ([`KeepReason::OtherNamespace`]) unless
/// [`GcOptions::this_namespace_only`] says nobody outside uses them (see the
/// [module docs](self)).
///
/// # Errors
///
/// As [`collect_garbage`].
pub fn collect_garbage_with(prefixes: &[&str], options: GcOptions) -> Result<GcReport> {
    collect_garbage_in(prefixes, options, current_pid_namespace())
}

/// [`collect_garbage_with`] for `/proc` of `namespace` (the probe, given by tests).
fn collect_garbage_in(
    prefixes: &[&str],
    options: GcOptions,
    namespace: PidNamespace,
) -> Result<GcReport> {
    let dry_run = options.dry_run;
    let (objects, uninspected) = scan(prefixes)?;
    let mut report = GcReport {
        dry_run,
        uninspected,
        namespace,
        ..GcReport::default()
    };
    let trusted = namespace == PidNamespace::Initial || options.this_namespace_only;
    for object in objects {
        match object.verdict() {
            Verdict::Keep(reason) => report.kept.push((object, reason)),
            Verdict::Garbage if !trusted => {
                tracing::warn!(
                    name = %object.name,
                    namespace = %namespace,
                    "gc kept an object that looks orphaned: outside the initial PID namespace, \
                     its creator and users may be invisible"
                );
                report.kept.push((object, KeepReason::OtherNamespace));
            }
            Verdict::Garbage if dry_run => report.removed.push(object),
            Verdict::Garbage => match crate::unlink_shm(&object.name) {
                Ok(()) => {
                    tracing::info!(
                        name = %object.name,
                        creator = object.creator.map(|c| c.pid),
                        size = object.size,
                        "gc unlinked an orphaned shared memory object"
                    );
                    report.removed.push(object);
                }
                // Someone else removed it meanwhile: nothing left to collect.
                Err(Error::NotFound { .. }) => {}
                Err(e) => report.failed.push((object, e)),
            },
        }
    }
    Ok(report)
}

/// Lists matching objects and fills in creators and users; also returns how many processes
/// could not be inspected.
fn scan(prefixes: &[&str]) -> Result<(Vec<ShmObject>, usize)> {
    let entries = fs::read_dir(SHM_DIR).map_err(|source| Error::Os {
        object: SHM_DIR.to_owned(),
        op: "read_dir",
        source,
    })?;
    let wanted: Vec<String> = prefixes.iter().map(|p| format!("{p}_")).collect();
    let users = ProcessScan::take();
    let passwd = Passwd::read();
    let mut objects = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let file_name = entry.file_name();
        let Some(text) = file_name.to_str() else {
            continue;
        };
        if !wanted.iter().any(|w| text.starts_with(w.as_str())) {
            continue;
        }
        let Ok(name) = ShmName::from_file_name(&file_name) else {
            continue;
        };
        // Not following symlinks: a link planted in /dev/shm is not an object.
        let Ok(meta) = fs::symlink_metadata(entry.path()) else {
            continue; // gone meanwhile
        };
        if !meta.file_type().is_file() {
            continue;
        }
        let creator = name.parse_generated().map(|g| Creator {
            pid: g.pid,
            alive: process_alive(g.pid),
        });
        objects.push(ShmObject {
            users: users.users_of(text),
            size: meta.len(),
            owner_uid: meta.uid(),
            owner: passwd.user_name(meta.uid()),
            creator,
            name,
        });
    }
    objects.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((objects, users.uninspected))
}

/// Whether `pid` is a live process: `/proc/<pid>` exists and is not a zombie.
fn process_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_none_or(|(_, rest)| !rest.starts_with(['Z', 'X'])),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        // Unreadable but present (hidepid, another user): alive.
        Err(_) => Path::new(&format!("/proc/{pid}")).exists(),
    }
}

/// Which processes use which `/dev/shm` objects, from `/proc/*/maps` and `/proc/*/fd`.
#[derive(Debug, Default)]
struct ProcessScan {
    /// File name in /dev/shm -> pids.
    users: HashMap<String, BTreeSet<u32>>,
    /// Processes whose maps or fds could not be read.
    uninspected: usize,
}

impl ProcessScan {
    fn take() -> ProcessScan {
        let mut scan = ProcessScan::default();
        let Ok(entries) = fs::read_dir("/proc") else {
            return scan;
        };
        for pid in entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
            let maps = fs::read_to_string(format!("/proc/{pid}/maps"));
            let fds = fs::read_dir(format!("/proc/{pid}/fd"));
            match (&maps, &fds) {
                (Err(e), _) | (_, Err(e)) if e.kind() == io::ErrorKind::NotFound => continue,
                (Err(_), _) | (_, Err(_)) => scan.uninspected += 1,
                _ => {}
            }
            if let Ok(maps) = maps {
                for line in maps.lines() {
                    if let Some(name) = shm_file_name(line) {
                        scan.add(name, pid);
                    }
                }
            }
            if let Ok(fds) = fds {
                for fd in fds.filter_map(|e| e.ok()) {
                    if let Ok(target) = fs::read_link(fd.path()) {
                        if let Some(name) = target.to_str().and_then(shm_file_name) {
                            scan.add(name, pid);
                        }
                    }
                }
            }
        }
        scan
    }

    fn add(&mut self, name: &str, pid: u32) {
        self.users.entry(name.to_owned()).or_default().insert(pid);
    }

    fn users_of(&self, file_name: &str) -> Vec<u32> {
        self.users
            .get(file_name)
            .map(|pids| pids.iter().copied().collect())
            .unwrap_or_default()
    }
}

/// The `/dev/shm` file name a maps line or an fd link refers to; `None` for other files and for
/// objects already unlinked (`(deleted)`: their name may belong to a new object by now).
fn shm_file_name(text: &str) -> Option<&str> {
    let start = text.find("/dev/shm/")? + "/dev/shm/".len();
    let name = &text[start..];
    if name.ends_with(" (deleted)") || name.is_empty() || name.contains('/') {
        return None;
    }
    Some(name)
}

/// uid -> user name, from `/etc/passwd`.
struct Passwd(HashMap<u32, String>);

impl Passwd {
    fn read() -> Passwd {
        let text = fs::read_to_string("/etc/passwd").unwrap_or_default();
        Passwd(
            text.lines()
                .filter_map(|line| {
                    let mut fields = line.split(':');
                    let name = fields.next()?;
                    let uid = fields.nth(1)?.parse().ok()?;
                    Some((uid, name.to_owned()))
                })
                .collect(),
        )
    }

    fn user_name(&self, uid: u32) -> Option<String> {
        self.0.get(&uid).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CreateMode, MapOptions};

    /// A pid that belonged to a process which has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    /// Creates `/<prefix>_<pid>_<random>_0` (4096 bytes), unmapped.
    fn make(prefix: &str, pid: u32) -> ShmName {
        let name = ShmName::new(format!("/{prefix}_{pid}_{}_0", rand::random::<u32>())).unwrap();
        MapOptions::new()
            .create(CreateMode::CreateExclusive)
            .len(4096)
            .map_shm(&name)
            .unwrap();
        name
    }

    fn dry_run() -> GcOptions {
        GcOptions {
            dry_run: true,
            ..GcOptions::default()
        }
    }

    fn unique_prefix(tag: &str) -> String {
        format!("tmhk-{tag}-{}", std::process::id())
    }

    struct Cleanup(Vec<ShmName>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for name in &self.0 {
                let _ = crate::unlink_shm(name);
            }
        }
    }

    #[test]
    fn maps_lines_and_fd_links_name_shm_objects() {
        let line = "7f1c2a000000-7f1c2a001000 rw-s 00000000 00:1a 123 /dev/shm/torch_1_2_3";
        assert_eq!(shm_file_name(line), Some("torch_1_2_3"));
        assert_eq!(
            shm_file_name("/dev/shm/with space_1_2_3"),
            Some("with space_1_2_3")
        );
        assert_eq!(shm_file_name("/dev/shm/torch_1_2_3 (deleted)"), None);
        assert_eq!(shm_file_name("/tmp/torch_1_2_3"), None);
        assert_eq!(shm_file_name("/memfd:x (deleted)"), None);
    }

    #[test]
    fn list_shows_size_owner_and_whether_the_creator_lives() {
        let prefix = unique_prefix("list");
        let dead = make(&prefix, dead_pid());
        let alive = make(&prefix, std::process::id());
        let _cleanup = Cleanup(vec![dead.clone(), alive.clone()]);
        let objects = list(&[&prefix]).unwrap();
        assert_eq!(objects.len(), 2);
        let find = |n: &ShmName| objects.iter().find(|o| &o.name == n).unwrap();
        let (d, a) = (find(&dead), find(&alive));
        assert_eq!(d.creator_alive(), Some(false));
        assert_eq!(a.creator_alive(), Some(true));
        assert_eq!(a.creator.unwrap().pid, std::process::id());
        assert_eq!(d.size, 4096);
        assert_eq!(d.owner_uid, rustix::process::geteuid().as_raw());
        assert!(d.users.is_empty(), "{:?}", d.users);
        assert_eq!(d.verdict(), Verdict::Garbage);
        assert_eq!(a.verdict(), Verdict::Keep(KeepReason::CreatorAlive));
        // Other prefixes are not listed.
        assert!(list(&["tmhk-nothing-here"]).unwrap().is_empty());
    }

    #[test]
    fn gc_removes_orphans_and_dry_run_only_reports() {
        let prefix = unique_prefix("gc");
        let orphan = make(&prefix, dead_pid());
        let odd = ShmName::new(format!("/{prefix}_not-generated")).unwrap();
        MapOptions::new()
            .create(CreateMode::CreateExclusive)
            .len(10)
            .map_shm(&odd)
            .unwrap();
        let _cleanup = Cleanup(vec![orphan.clone(), odd.clone()]);

        let dry = collect_garbage_in(&[&prefix], dry_run(), PidNamespace::Initial).unwrap();
        assert!(dry.dry_run);
        assert_eq!(dry.removed.len(), 1);
        assert_eq!(dry.removed[0].name, orphan);
        assert!(orphan.path().exists(), "a dry run removed {orphan}");
        assert_eq!(dry.kept.len(), 1);
        assert_eq!(dry.kept[0].1, KeepReason::UnknownCreator);

        let real =
            collect_garbage_in(&[&prefix], GcOptions::default(), PidNamespace::Initial).unwrap();
        assert_eq!(real.removed.len(), 1);
        assert!(real.failed.is_empty(), "{:?}", real.failed);
        assert!(!orphan.path().exists());
        assert!(
            odd.path().exists(),
            "an object of unknown origin was removed"
        );
    }

    #[test]
    fn gc_keeps_objects_a_live_process_maps_or_holds_open() {
        let prefix = unique_prefix("inuse");
        let mapped = make(&prefix, dead_pid());
        let held = make(&prefix, dead_pid());
        let _cleanup = Cleanup(vec![mapped.clone(), held.clone()]);
        let mapping = MapOptions::new().map_shm(&mapped).unwrap();
        let file = fs::File::open(held.path()).unwrap();

        let report =
            collect_garbage_in(&[&prefix], GcOptions::default(), PidNamespace::Initial).unwrap();
        assert!(report.removed.is_empty(), "{:?}", report.removed);
        assert_eq!(report.kept.len(), 2);
        for (object, reason) in &report.kept {
            assert_eq!(*reason, KeepReason::InUse);
            assert_eq!(object.users, vec![std::process::id()]);
        }
        assert!(mapped.path().exists() && held.path().exists());

        drop((mapping, file));
        let report =
            collect_garbage_in(&[&prefix], GcOptions::default(), PidNamespace::Initial).unwrap();
        assert_eq!(report.removed.len(), 2);
    }

    #[test]
    fn gc_outside_the_initial_pid_namespace_keeps_what_looks_orphaned() {
        let prefix = unique_prefix("pidns");
        let orphan = make(&prefix, dead_pid());
        let _cleanup = Cleanup(vec![orphan.clone()]);
        let container = PidNamespace::Other { inode: 4026532178 };
        for namespace in [container, PidNamespace::Unknown] {
            for options in [GcOptions::default(), dry_run()] {
                let report = collect_garbage_in(&[&prefix], options, namespace).unwrap();
                assert!(
                    report.removed.is_empty(),
                    "{namespace}: {:?}",
                    report.removed
                );
                assert_eq!(report.kept.len(), 1);
                assert_eq!(report.kept[0].1, KeepReason::OtherNamespace);
                assert_eq!(report.namespace, namespace);
                assert!(orphan.path().exists(), "{namespace}: gc removed {orphan}");
            }
        }
        // Told that nobody outside the namespace uses these objects, gc collects them.
        let trusting = GcOptions {
            dry_run: true,
            this_namespace_only: true,
        };
        let report = collect_garbage_in(&[&prefix], trusting, container).unwrap();
        assert_eq!(report.removed.len(), 1);
        let report =
            collect_garbage_in(&[&prefix], GcOptions::default(), PidNamespace::Initial).unwrap();
        assert_eq!(report.removed.len(), 1);
        assert!(!orphan.path().exists());
    }

    #[test]
    fn the_probe_reads_this_process_namespace() {
        let Ok(ns) = rustix::fs::stat("/proc/self/ns/pid") else {
            eprintln!("skipped: no /proc/self/ns/pid here");
            return;
        };
        match current_pid_namespace() {
            PidNamespace::Initial => assert_eq!(ns.st_ino, INITIAL_PID_NAMESPACE_INODE),
            PidNamespace::Other { inode } => assert_eq!(inode, ns.st_ino),
            // `/proc` mounted for another namespace than this process's.
            PidNamespace::Unknown => assert_ne!(
                fs::read_link("/proc/self").ok(),
                Some(std::process::id().to_string().into())
            ),
        }
    }
}
