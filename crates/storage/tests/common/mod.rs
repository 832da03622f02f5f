//! Shared by the integration tests: a manager daemon for the file_system strategy, served by a
//! thread of the test process (no daemon binary needed), name helpers, the child-process
//! side of the tests that run again as another process ([`child`]), and what the pooled tests
//! share ([`pooled`]).
#![allow(dead_code, unreachable_pub)]

pub mod child;
pub mod pooled;

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

use tensormem_shm::manager::{serve, ManagerConfig, Startup, ENV_DIR};

/// The runtime directory of this test binary's daemon.
static DAEMON_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Makes `Manager::global()` (in this process and in children that inherit the environment)
/// reach a daemon served by a thread of this process, started on first call.
pub fn manager() {
    DAEMON_DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os(ENV_DIR) {
            // A child process: the parent's daemon serves it.
            return PathBuf::from(dir);
        }
        sweep_stale_daemon_dirs();
        let dir = std::env::temp_dir().join(format!(
            "{DAEMON_DIR_PREFIX}{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let config = ManagerConfig::new(&dir).with_quiet_period(Duration::from_secs(3600));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let result = serve(&config, |startup| {
                let _ = tx.send(startup);
            });
            if let Err(e) = result {
                eprintln!("test shm manager stopped: {e}");
            }
        });
        let startup = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the test shm manager starts");
        assert!(matches!(startup, Startup::Listening { .. }), "{startup:?}");
        // Set before any Manager::global() call of this process: every test calls manager()
        // first, and this initialiser runs once.
        std::env::set_var(ENV_DIR, &dir);
        dir
    });
}

/// The start of a test daemon's directory name, followed by the test process's pid.
const DAEMON_DIR_PREFIX: &str = "tensormem-storage-test-";

/// Removes the daemon directories of test processes that have ended: the daemon is a thread of
/// its test process, which exits without a chance to remove its socket and lock.
fn sweep_stale_daemon_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(DAEMON_DIR_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Waits (bounded) until `cond` holds; returns whether it did.
pub fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while std::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}
