//! `tensormem shm list` and `tensormem shm gc` as a user runs them: the real binary on real
//! objects in /dev/shm, each test under its own name prefix.

use std::fs::File;
use std::process::{Child, Command, Output, Stdio};

use serde_json::Value;
use tensormem_shm::{CreateMode, MapOptions, ShmName};

fn tensormem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensormem"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout_of(args: &[&str]) -> String {
    let output = tensormem(args);
    assert!(
        output.status.success(),
        "tensormem {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn json_of(args: &[&str]) -> Value {
    serde_json::from_str(&stdout_of(args)).unwrap()
}

/// Every object and process of these tests lives in the test's own PID namespace, so gc may
/// collect even where that is not the initial one (a CI container).
const OURS: &str = "--this-namespace-only";

/// A prefix no other test (or process) uses.
fn prefix(tag: &str) -> String {
    format!("tmcli-{tag}-{}", std::process::id())
}

/// The pid of a process that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// Creates `/<prefix>_<pid>_<random>_0` of 4096 bytes, not mapped by anyone; unlinked on drop.
struct Object(ShmName);

impl Object {
    fn new(prefix: &str, pid: u32) -> Object {
        let name = ShmName::new(format!("/{prefix}_{pid}_{}_0", std::process::id())).unwrap();
        MapOptions::new()
            .create(CreateMode::CreateExclusive)
            .len(4096)
            .map_shm(&name)
            .unwrap();
        Object(name)
    }

    fn exists(&self) -> bool {
        self.0.path().exists()
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let _ = tensormem_shm::unlink_shm(&self.0);
    }
}

/// A live process (not this one) holding the object open on its stdin; killed on drop.
struct Holder(Child);

impl Holder {
    fn new(object: &Object) -> Holder {
        let child = Command::new("sleep")
            .arg("600")
            .stdin(File::open(object.0.path()).unwrap())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn list_shows_a_dead_creator() {
    let prefix = prefix("list");
    let pid = dead_pid();
    let object = Object::new(&prefix, pid);

    let listed = json_of(&["shm", "list", "--prefix", &prefix, "--json"]);
    let entries = listed.as_array().unwrap();
    assert_eq!(entries.len(), 1, "{listed}");
    let entry = &entries[0];
    assert_eq!(entry["name"], object.0.as_str());
    assert_eq!(entry["size"], 4096);
    assert_eq!(entry["creator_pid"], pid);
    assert_eq!(entry["creator_alive"], false);
    assert_eq!(entry["garbage"], true);

    let table = stdout_of(&["shm", "list", "--prefix", &prefix]);
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with(object.0.as_str()))
        .unwrap_or_else(|| panic!("{table}"))
        .split_whitespace()
        .collect();
    // NAME, SIZE (number and unit), OWNER, CREATOR, ALIVE, USERS
    assert_eq!(row.len(), 7, "{table}");
    assert_eq!(row[1..3], ["4.0", "KiB"]);
    assert_eq!(row[4..], [pid.to_string().as_str(), "no", "0"]);
}

#[test]
fn gc_dry_run_reports_and_gc_removes() {
    let prefix = prefix("gc");
    let object = Object::new(&prefix, dead_pid());
    let alive = Object::new(&prefix, std::process::id());

    let dry = stdout_of(&["shm", "gc", "--dry-run", "--prefix", &prefix, OURS]);
    assert!(dry.contains(&format!("would remove {}", object.0)), "{dry}");
    assert!(object.exists(), "--dry-run removed the object");

    let report = json_of(&["shm", "gc", "--prefix", &prefix, "--json", OURS]);
    assert_eq!(report["dry_run"], false);
    assert_eq!(report["removed"][0]["name"], object.0.as_str());
    assert_eq!(report["kept"][0]["name"], alive.0.as_str());
    assert_eq!(report["kept"][0]["reason"], "creator_alive");
    assert!(!object.exists(), "gc left the orphan");
    assert!(alive.exists(), "gc removed an object whose creator lives");

    let again = stdout_of(&["shm", "gc", "--prefix", &prefix, OURS]);
    assert!(again.contains("removed 0 objects"), "{again}");
}

#[test]
fn gc_keeps_an_object_a_live_process_holds() {
    let prefix = prefix("held");
    let object = Object::new(&prefix, dead_pid());
    let sleeper = Holder::new(&object);

    let report = json_of(&["shm", "gc", "--prefix", &prefix, "--json"]);
    assert_eq!(report["removed"].as_array().unwrap().len(), 0, "{report}");
    assert_eq!(report["kept"][0]["reason"], "in_use");
    assert_eq!(report["kept"][0]["users"][0], sleeper.0.id());
    assert!(object.exists());

    drop(sleeper);
    let report = json_of(&["shm", "gc", "--prefix", &prefix, "--json", OURS]);
    assert_eq!(report["removed"][0]["name"], object.0.as_str());
    assert!(!object.exists());
}

#[test]
fn bad_arguments_fail_with_one_line() {
    let output = tensormem(&["shm", "list", "--prefix", "a/b"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("tensormem: error: invalid name prefix"),
        "{stderr}"
    );

    let output = tensormem(&["shm", "frobnicate"]);
    assert_eq!(output.status.code(), Some(2));
}

/// Regression: names with escape sequences or newlines reached the terminal raw.
#[test]
fn list_and_gc_escape_hostile_names() {
    let prefix = prefix("esc");
    let path = std::path::PathBuf::from(format!("/dev/shm/{prefix}_a\u{1b}[2Jb\nforged line"));
    File::create(&path).unwrap();
    let list = stdout_of(&["shm", "list", "--prefix", &prefix]);
    let gc = stdout_of(&["shm", "gc", "--dry-run", "--prefix", &prefix]);
    let _ = std::fs::remove_file(&path);
    for out in [&list, &gc] {
        assert!(!out.contains('\u{1b}'), "{out:?}");
        assert!(!out.contains("\nforged line"), "{out:?}");
    }
    assert!(list.contains("a\\u{1b}[2Jb\\nforged line"), "{list}");
}

#[test]
fn gc_in_another_pid_namespace_keeps_memory_it_cannot_see_used() {
    let probe = Command::new("unshare")
        .args(["-p", "-f", "--mount-proc", "true"])
        .output();
    match &probe {
        Ok(output) if output.status.success() => {}
        Ok(output) => {
            eprintln!(
                "SKIPPED: `unshare -p -f --mount-proc` is not permitted here: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
            return;
        }
        Err(err) => {
            eprintln!("SKIPPED: no `unshare` here ({err})");
            return;
        }
    }
    let prefix = prefix("pidns");
    let object = Object::new(&prefix, dead_pid());
    // A live process on this side of the namespace boundary holds it open.
    let holder = Holder::new(&object);
    let gc_inside = |extra: &[&str]| {
        let output = Command::new("unshare")
            .args(["-p", "-f", "--mount-proc", env!("CARGO_BIN_EXE_tensormem")])
            .args(["shm", "gc", "--prefix", &prefix])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "gc in a new PID namespace failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    };

    let report: Value = serde_json::from_str(&gc_inside(&["--json"])).unwrap();
    assert_eq!(report["removed"].as_array().unwrap().len(), 0, "{report}");
    assert_eq!(report["kept"][0]["reason"], "other_namespace", "{report}");
    assert_ne!(report["pid_namespace"], "initial", "{report}");
    assert!(
        object.exists(),
        "gc in another PID namespace removed live memory"
    );
    let text = gc_inside(&["--dry-run"]);
    assert!(text.contains("--this-namespace-only"), "{text}");
    assert!(object.exists());

    // Outside, the holder is seen.
    let report = json_of(&["shm", "gc", "--prefix", &prefix, "--json"]);
    assert_eq!(report["kept"][0]["reason"], "in_use", "{report}");
    drop(holder);
}
