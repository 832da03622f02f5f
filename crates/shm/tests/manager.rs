//! The manager daemon with real processes: clients killed with `kill -9`, shared names, the
//! quiet period, racing starts.
//!
//! Child processes are this test binary run again on a single test (`--exact NAME`) with
//! `TENSORMEM_MANAGER_TEST_ROLE` set: each test starts by asking whether it is a child, and if
//! so plays its role instead of running the test. Every test has its own runtime directory (so
//! its own daemon) and its own name prefix, so tests run in parallel without seeing each other.

use std::collections::BTreeSet;
use std::fs;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tensormem_shm::manager::{ManagedRegion, Manager, ManagerConfig, ManagerError};
use tensormem_shm::{Access, CreateMode, Error, MapOptions, NameGenerator, ShmName};
use tensormem_test_support::child::{self, hold, report, Peer, MARK};

const ROLE: &str = "TENSORMEM_MANAGER_TEST_ROLE";
const PREFIX: &str = "TENSORMEM_MANAGER_TEST_PREFIX";
const COUNT: &str = "TENSORMEM_MANAGER_TEST_COUNT";
const NAME: &str = "TENSORMEM_MANAGER_TEST_NAME";

/// How long to wait for something the daemon does asynchronously before declaring failure.
const PATIENCE: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------
// The child side.

/// Plays the child role if this process is a child; returns whether it was one.
fn child_role() -> bool {
    let Ok(role) = std::env::var(ROLE) else {
        return false;
    };
    let result = match role.as_str() {
        "create" => child_create(),
        "open" => child_open(),
        "connect" => child_connect(),
        other => panic!("unknown role {other}"),
    };
    if let Err(e) = result {
        println!("{MARK}error {e}");
        std::process::exit(3);
    }
    // Hold everything until the parent closes our stdin (or kills us).
    hold();
    true
}

/// Creates `COUNT` managed regions (through the process-wide manager, configured from the
/// environment), fills each with its name, reports the names, and holds them.
fn child_create() -> Result<(), Error> {
    let names = NameGenerator::with_prefix(std::env::var(PREFIX).unwrap())?;
    let count: usize = std::env::var(COUNT).unwrap().parse().unwrap();
    let manager = Manager::global()?;
    let mut regions = Vec::new();
    for _ in 0..count {
        let mut region = ManagedRegion::create_with(&manager, &names, 4096)?;
        let name = region.name().to_string();
        region.write_at(0, name.as_bytes())?;
        report(&format!("name {name}"));
        regions.push(region);
    }
    report("done");
    std::mem::forget(regions); // held until the process ends
    Ok(())
}

/// Opens the region `NAME`, checks its content, reports, and holds it.
fn child_open() -> Result<(), Error> {
    let name = ShmName::new(std::env::var(NAME).unwrap())?;
    let region = ManagedRegion::open(&name)?;
    let mut head = vec![0u8; name.as_str().len()];
    region.read_at(0, &mut head)?;
    assert_eq!(head, name.as_str().as_bytes(), "content of {name}");
    report("opened");
    std::mem::forget(region);
    Ok(())
}

/// Connects to the manager and reports the daemon's pid.
fn child_connect() -> Result<(), Error> {
    let manager = Manager::global()?;
    report(&format!("daemon {}", manager.daemon_pid()));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The parent side.

/// A test's private world: runtime directory (own daemon) and name prefix.
struct World {
    dir: tempfile::TempDir,
    prefix: String,
    test: &'static str,
    quiet: Duration,
}

impl World {
    fn new(test: &'static str, tag: &str) -> World {
        World::with_quiet(test, tag, Duration::from_secs(1))
    }

    fn with_quiet(test: &'static str, tag: &str, quiet: Duration) -> World {
        // Short path: socket paths are limited to 107 bytes.
        let dir = tempfile::Builder::new()
            .prefix("tmmgr")
            .tempdir_in("/tmp")
            .unwrap();
        World {
            dir,
            prefix: format!("tmtest-{tag}-{}", std::process::id()),
            test,
            quiet,
        }
    }

    fn config(&self) -> ManagerConfig {
        // No binary: the library starts the daemon from this test's own image.
        ManagerConfig::new(self.dir.path())
            .with_quiet_period(self.quiet)
            .with_log_file(self.dir.path().join("daemon.log"))
    }

    fn connect(&self) -> Arc<Manager> {
        Arc::new(Manager::connect(&self.config()).unwrap())
    }

    /// Starts this test's binary as a child playing `role`.
    fn spawn(&self, role: &str, envs: &[(&str, String)]) -> Kid {
        let mut command = child::this_test(self.test);
        command
            .env(ROLE, role)
            .env(PREFIX, &self.prefix)
            .env("TENSORMEM_SHM_MANAGER_DIR", self.dir.path())
            .env_remove("TENSORMEM_SHM_MANAGER")
            .env(
                "TENSORMEM_SHM_MANAGER_QUIET_MS",
                self.quiet.as_millis().to_string(),
            )
            .env(
                "TENSORMEM_SHM_MANAGER_LOG",
                self.dir.path().join("daemon.log"),
            )
            .stdin(Stdio::piped())
            .stderr(Stdio::inherit());
        for (key, value) in envs {
            command.env(key, value);
        }
        let (child, stdout) = child::spawn(&mut command);
        Kid { child, stdout }
    }

    /// Objects in /dev/shm with this test's prefix.
    fn objects(&self) -> BTreeSet<String> {
        let wanted = format!("{}_", self.prefix);
        fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&wanted))
            .collect()
    }

    fn daemon_log(&self) -> String {
        fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Never leave objects behind, even when an assertion failed.
        for name in self.objects() {
            let _ = fs::remove_file(Path::new("/dev/shm").join(name));
        }
    }
}

/// A child process (killed if the test ends first) and its reported lines.
struct Kid {
    child: Peer,
    stdout: BufReader<ChildStdout>,
}

impl Kid {
    /// The next line the child reported (lines from the test harness are skipped).
    fn next_report(&mut self) -> String {
        let report = child::next_report(&mut self.stdout);
        assert!(
            !report.starts_with("error"),
            "child {} failed: {report}",
            self.child.id()
        );
        report
    }

    /// Reads `name ...` reports until `done`.
    fn names(&mut self) -> Vec<String> {
        let mut names = Vec::new();
        loop {
            let report = self.next_report();
            match report.strip_prefix("name ") {
                Some(name) => names.push(name.to_owned()),
                None => {
                    assert_eq!(report, "done");
                    return names;
                }
            }
        }
    }

    fn kill_9(mut self) {
        self.child.kill9();
    }

    /// Closes its stdin so it exits normally, and reaps it.
    fn finish(mut self) {
        drop(self.child.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "child exited with {status}");
    }
}

/// Polls `condition` until it holds or `PATIENCE` runs out.
fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

fn shm_exists(name: &str) -> bool {
    Path::new("/dev/shm")
        .join(name.trim_start_matches('/'))
        .exists()
}

/// Whether `pid` is a live (not zombie) process.
fn process_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
fn kill_9_of_100_clients_leaves_no_object_behind() {
    if child_role() {
        return;
    }
    let world = World::new("kill_9_of_100_clients_leaves_no_object_behind", "kill9");
    const ROUNDS: usize = 100;
    const BATCH: usize = 10;
    let mut seen = 0;
    for _ in 0..ROUNDS / BATCH {
        // Each round: a creator holding 2 regions, and (every other round) a second client
        // holding one of them too. All are killed with SIGKILL.
        let mut creators: Vec<Kid> = (0..BATCH)
            .map(|_| world.spawn("create", &[(COUNT, "2".to_owned())]))
            .collect();
        let names: Vec<Vec<String>> = creators.iter_mut().map(Kid::names).collect();
        let mut openers: Vec<Kid> = names
            .iter()
            .step_by(2)
            .map(|n| world.spawn("open", &[(NAME, n[0].clone())]))
            .collect();
        for opener in &mut openers {
            assert_eq!(opener.next_report(), "opened");
        }
        for name in names.iter().flatten() {
            assert!(shm_exists(name), "{name} missing while its creator lives");
            seen += 1;
        }
        for kid in creators.into_iter().chain(openers) {
            kid.kill_9();
        }
    }
    assert_eq!(seen, ROUNDS * 2);
    eventually("no object with the test's prefix is left", || {
        world.objects().is_empty()
    });
    assert!(
        world.daemon_log().contains("unlinked"),
        "the daemon logged no unlink:\n{}",
        world.daemon_log()
    );
}

#[test]
fn a_shared_name_survives_until_its_last_holder_dies() {
    if child_role() {
        return;
    }
    let world = World::new("a_shared_name_survives_until_its_last_holder_dies", "share");
    let observer = world.connect();
    let mut creator = world.spawn("create", &[(COUNT, "1".to_owned())]);
    let name = creator.names().remove(0);
    let mut opener = world.spawn("open", &[(NAME, name.clone())]);
    assert_eq!(opener.next_report(), "opened");
    let status = observer.status().unwrap();
    assert_eq!((status.clients, status.names), (3, 1));

    creator.kill_9();
    // The daemon has handled the death once the client count drops.
    eventually("the daemon saw the creator die", || {
        observer.status().unwrap().clients == 2
    });
    assert!(
        shm_exists(&name),
        "{name} was unlinked while a holder lives"
    );
    assert_eq!(observer.status().unwrap().names, 1);

    opener.kill_9();
    eventually("the daemon saw the opener die", || {
        observer.status().unwrap().clients == 1
    });
    assert!(!shm_exists(&name), "{name} outlived its last holder");
    assert_eq!(observer.status().unwrap().names, 0);
}

#[test]
fn racing_first_clients_leave_exactly_one_daemon() {
    if child_role() {
        return;
    }
    let world = World::new("racing_first_clients_leave_exactly_one_daemon", "race");
    let mut kids: Vec<Kid> = (0..8).map(|_| world.spawn("connect", &[])).collect();
    let pids: BTreeSet<u32> = kids
        .iter_mut()
        .map(|k| {
            k.next_report()
                .strip_prefix("daemon ")
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(pids.len(), 1, "clients reached different daemons: {pids:?}");
    let daemon = *pids.first().unwrap();
    assert!(process_alive(daemon));

    // Exactly one live manager process serves this directory.
    let dir = world.dir.path().to_string_lossy().into_owned();
    let serving: Vec<u32> = fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // A daemon started from this test's image carries its role and directory in its
            // environment.
            fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                let vars: Vec<String> = env
                    .split(|b| *b == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                vars.iter()
                    .any(|v| v == "TENSORMEM_SHM_MANAGER_ROLE=daemon")
                    && vars.contains(&format!("TENSORMEM_SHM_MANAGER_DIR={dir}"))
            })
        })
        .filter(|pid| process_alive(*pid))
        .collect();
    assert_eq!(serving, vec![daemon], "live daemons for {dir}");
    for kid in kids {
        kid.finish();
    }
}

#[test]
fn the_daemon_exits_after_the_quiet_period_and_not_before() {
    if child_role() {
        return;
    }
    let quiet = Duration::from_millis(300);
    let world = World::with_quiet(
        "the_daemon_exits_after_the_quiet_period_and_not_before",
        "quiet",
        quiet,
    );
    let manager = world.connect();
    let daemon = manager.daemon_pid();
    assert!(world.config().socket_path().exists());
    // A connected client keeps it alive well past the quiet period.
    thread::sleep(quiet * 4);
    assert!(
        process_alive(daemon),
        "the daemon quit while a client was connected"
    );
    assert_eq!(manager.status().unwrap().clients, 1);

    drop(manager);
    eventually("the daemon exits", || !process_alive(daemon));
    assert!(
        !world.config().socket_path().exists(),
        "the exiting daemon left its socket"
    );
    let log = world.daemon_log();
    assert!(log.contains("shm manager started"), "{log}");
    assert!(log.contains("shm manager exiting"), "{log}");

    // The next client starts a fresh daemon.
    let again = world.connect();
    assert_ne!(again.daemon_pid(), daemon);
    assert!(process_alive(again.daemon_pid()));
}

#[test]
fn regions_share_memory_and_the_last_close_unlinks() {
    let world = World::new("regions_share_memory_and_the_last_close_unlinks", "close");
    let names = NameGenerator::with_prefix(&world.prefix).unwrap();
    // Two connections are two clients, as two processes would be.
    let (first, second) = (world.connect(), world.connect());
    assert_eq!(first.daemon_pid(), second.daemon_pid());

    let mut a = ManagedRegion::create_with(&first, &names, 8192).unwrap();
    let b = ManagedRegion::open_with(&second, a.name(), Access::ReadWrite).unwrap();
    let c = ManagedRegion::open_with(&second, a.name(), Access::ReadOnly).unwrap();
    a.write_at(100, b"shared").unwrap();
    let mut got = [0u8; 6];
    c.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"shared");
    assert_eq!(b.len(), 8192);

    let name = a.name().clone();
    assert!(!a.close().unwrap(), "not the last holder");
    assert!(!b.close().unwrap(), "the second client still holds it once");
    assert!(shm_exists(name.as_str()));
    assert!(c.close().unwrap(), "the last close unlinks");
    assert!(!shm_exists(name.as_str()));

    // Opening it now is a plain NotFound.
    let err = ManagedRegion::open_with(&first, &name, Access::ReadWrite).unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    assert_eq!(first.status().unwrap().names, 0);
}

#[test]
fn dropping_a_manager_releases_its_names_and_unlink_forgets() {
    let world = World::new(
        "dropping_a_manager_releases_its_names_and_unlink_forgets",
        "drop",
    );
    let names = NameGenerator::with_prefix(&world.prefix).unwrap();
    let observer = world.connect();

    // A region whose manager connection goes away (as if its process died) is unlinked...
    let client = world.connect();
    let name = names.next_name();
    client.register_new(name.as_str()).unwrap();
    let region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(4096)
        .map_shm(&name)
        .unwrap();
    drop(region); // unmapped, never released: only the disconnect can clean up
    let name = name.to_string();
    assert!(shm_exists(&name));
    drop(client);
    eventually("the daemon saw the connection close", || {
        observer.status().unwrap().clients == 1
    });
    assert!(!shm_exists(&name));

    // ...and an explicitly unlinked one is forgotten for every holder.
    let mut mine = ManagedRegion::create_with(&observer, &names, 4096).unwrap();
    let other = world.connect();
    let theirs = ManagedRegion::open_with(&other, mine.name(), Access::ReadWrite).unwrap();
    mine.unlink().unwrap();
    assert!(!shm_exists(mine.name().as_str()));
    assert_eq!(observer.status().unwrap().names, 0);
    assert!(!theirs.close().unwrap());
    assert!(!mine.close().unwrap());
}

#[test]
fn a_missing_binary_is_a_clear_error() {
    let dir = tempfile::Builder::new()
        .prefix("tmmgr")
        .tempdir_in("/tmp")
        .unwrap();
    let config = ManagerConfig::new(dir.path()).with_binary("/nonexistent/tensormem-shm-manager");
    let err = Manager::connect(&config).unwrap_err();
    assert!(matches!(err, ManagerError::BinaryNotFound { .. }), "{err}");
    let message = err.to_string();
    for place in ["TENSORMEM_SHM_MANAGER", "next to", "PATH"] {
        assert!(message.contains(place), "{message}");
    }
}

#[test]
fn a_socket_directory_of_another_kind_is_refused() {
    let dir = tempfile::Builder::new()
        .prefix("tmmgr")
        .tempdir_in("/tmp")
        .unwrap();
    let file = dir.path().join("not-a-dir");
    fs::write(&file, b"").unwrap();
    let config = ManagerConfig::new(&file).with_binary(env!("CARGO_BIN_EXE_tensormem-shm-manager"));
    assert!(Manager::connect(&config).is_err());

    let long = PathBuf::from(format!("/tmp/{}", "d".repeat(110)));
    let err = Manager::connect(&ManagerConfig::new(long)).unwrap_err();
    assert!(
        matches!(err, ManagerError::SocketPathTooLong { .. }),
        "{err}"
    );
}

#[test]
fn clients_arriving_while_the_daemon_exits_reach_a_new_one() {
    // A quiet period this short makes the daemon exit between almost every pair of
    // connections, so clients keep meeting a daemon on its way out.
    let world = World::with_quiet(
        "clients_arriving_while_the_daemon_exits_reach_a_new_one",
        "restart",
        Duration::from_millis(5),
    );
    let daemons: Vec<BTreeSet<u32>> = thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|worker| {
                let world = &world;
                scope.spawn(move || {
                    let names = NameGenerator::with_prefix(&world.prefix).unwrap();
                    let mut daemons = BTreeSet::new();
                    for round in 0..40u64 {
                        let manager = world.connect();
                        daemons.insert(manager.daemon_pid());
                        let region = ManagedRegion::create_with(&manager, &names, 4096).unwrap();
                        assert!(region.close().unwrap());
                        drop(manager);
                        // Vary the gaps so that some arrivals meet an exiting daemon.
                        thread::sleep(Duration::from_millis((round * 7 + worker * 3) % 31));
                    }
                    daemons
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    // How often the daemon restarted depends on scheduling; what must hold is that every
    // connection and every region above worked, and that nothing is left.
    let seen: BTreeSet<u32> = daemons.into_iter().flatten().collect();
    assert!(!seen.is_empty());
    assert!(world.objects().is_empty(), "{:?}", world.objects());
}

#[test]
fn a_killed_daemon_is_reported_and_replaced() {
    let world = World::new("a_killed_daemon_is_reported_and_replaced", "killd");
    let names = NameGenerator::with_prefix(&world.prefix).unwrap();
    let manager = world.connect();
    let region = ManagedRegion::create_with(&manager, &names, 4096).unwrap();
    let daemon = manager.daemon_pid();
    let pid = rustix::process::Pid::from_raw(daemon as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    eventually("the daemon is dead", || !process_alive(daemon));

    let err = manager.status().unwrap_err();
    assert!(matches!(err, ManagerError::Disconnected(_)), "{err}");
    let err = region.close().unwrap_err();
    assert!(
        matches!(err, Error::Manager(ManagerError::Disconnected(_))),
        "{err}"
    );
    // The dead daemon left its socket behind; the next client starts a new daemon anyway.
    assert!(world.config().socket_path().exists());
    let again = world.connect();
    assert_ne!(again.daemon_pid(), daemon);
    assert_eq!(again.status().unwrap().clients, 1);
}

/// The process image a pid runs.
fn exe_of(pid: u32) -> PathBuf {
    fs::read_link(format!("/proc/{pid}/exe")).unwrap()
}

#[test]
fn with_no_binary_configured_the_daemon_runs_from_this_programs_image() {
    let world = World::new(
        "with_no_binary_configured_the_daemon_runs_from_this_programs_image",
        "selfstart",
    );
    let manager = world.connect();
    let daemon = manager.daemon_pid();
    assert_ne!(daemon, std::process::id());
    assert_eq!(exe_of(daemon), std::env::current_exe().unwrap());
    // Detached: not our child (the launcher was reaped), in a session of its own.
    let stat = fs::read_to_string(format!("/proc/{daemon}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let (ppid, sid): (u32, u32) = (fields[1].parse().unwrap(), fields[3].parse().unwrap());
    assert_ne!(ppid, std::process::id());
    assert_eq!(sid, daemon, "the daemon leads its own session");
    let comm = fs::read_to_string(format!("/proc/{daemon}/comm")).unwrap();
    assert_eq!(comm.trim_end(), "tm-shm-manager", "named for ps");
    // It works like the binary: a region, shared and released.
    let names = NameGenerator::with_prefix(&world.prefix).unwrap();
    let region = ManagedRegion::create_with(&manager, &names, 4096).unwrap();
    let name = region.name().clone();
    assert!(shm_exists(name.as_str()));
    assert!(region.close().unwrap());
    assert!(!shm_exists(name.as_str()));
    let log = fs::read_to_string(world.dir.path().join("daemon.log")).unwrap();
    assert!(log.contains("shm manager started"), "{log}");
}

#[test]
fn a_configured_binary_is_used() {
    let world = World::new("a_configured_binary_is_used", "binary");
    let binary = env!("CARGO_BIN_EXE_tensormem-shm-manager");
    let manager = Manager::connect(&world.config().with_binary(binary)).unwrap();
    assert_eq!(exe_of(manager.daemon_pid()), PathBuf::from(binary));
    let names = NameGenerator::with_prefix(&world.prefix).unwrap();
    let region = ManagedRegion::create_with(&Arc::new(manager), &names, 4096).unwrap();
    assert!(region.close().unwrap());
}

#[test]
fn a_symlink_planted_at_the_log_path_is_refused_not_followed() {
    let world = World::new(
        "a_symlink_planted_at_the_log_path_is_refused_not_followed",
        "loglink",
    );
    let victim = world.dir.path().join("victim");
    fs::write(&victim, b"").unwrap();
    let log = world.dir.path().join("planted.log");
    std::os::unix::fs::symlink(&victim, &log).unwrap();
    for config in [
        world.config().with_log_file(&log),
        world
            .config()
            .with_log_file(&log)
            .with_binary(env!("CARGO_BIN_EXE_tensormem-shm-manager")),
    ] {
        let err = Manager::connect(&config).unwrap_err();
        assert!(matches!(err, ManagerError::StartFailed { .. }), "{err}");
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }
    assert_eq!(
        fs::read(&victim).unwrap(),
        b"",
        "nothing written through the link"
    );
}

#[test]
fn a_foreground_daemon_logging_to_a_pipe_writes_no_colour_codes() {
    let world = World::new(
        "a_foreground_daemon_logging_to_a_pipe_writes_no_colour_codes",
        "nocolour",
    );
    let dir = world.dir.path().to_str().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tensormem-shm-manager"))
        .args(["--foreground", "--dir", dir, "--quiet-ms", "50"])
        .env_remove("NO_COLOR")
        .env_remove("TENSORMEM_SHM_MANAGER_LOG_LEVEL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{log}");
    assert!(!log.contains('\x1b'), "colour codes in a pipe: {log:?}");
    assert!(log.contains("INFO shm manager started"), "{log}");
}
