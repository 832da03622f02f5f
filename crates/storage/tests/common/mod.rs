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
        let dir = std::env::temp_dir().join(format!(
            "tensormem-storage-test-{}-{}",
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
