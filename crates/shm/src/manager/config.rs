//! Where the daemon lives (runtime directory, socket, lock file, binary) and how long it waits.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::error::{ManagerError, ManagerResult};

/// Environment variable naming the daemon binary; searched first.
pub const ENV_BINARY: &str = "TENSORMEM_SHM_MANAGER";
/// Environment variable naming the runtime directory holding the socket and the lock file.
pub const ENV_DIR: &str = "TENSORMEM_SHM_MANAGER_DIR";
/// Environment variable setting the quiet period, in milliseconds, of a daemon started by this
/// process.
pub const ENV_QUIET_MS: &str = "TENSORMEM_SHM_MANAGER_QUIET_MS";
/// Environment variable naming a file the daemon appends its log to (otherwise it logs nowhere).
pub const ENV_LOG: &str = "TENSORMEM_SHM_MANAGER_LOG";

/// The daemon binary's file name.
pub const BINARY_NAME: &str = "tensormem-shm-manager";
/// File name of the socket inside the runtime directory.
pub const SOCKET_NAME: &str = "manager.sock";
/// File name of the lock file inside the runtime directory; the live daemon holds `flock` on it.
pub const LOCK_NAME: &str = "manager.lock";

/// How long a daemon with no clients waits before it exits, unless configured.
pub const DEFAULT_QUIET_PERIOD: Duration = Duration::from_secs(5);
/// How long a client keeps trying to reach (and start) a daemon, unless configured.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `sun_path` holds 108 bytes including the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

/// How to find, start and reach the shared-memory manager daemon.
///
/// [`ManagerConfig::from_env`] reads the `TENSORMEM_SHM_MANAGER*` variables; the builder methods
/// override single settings. Two configs with the same [`dir`](Self::dir) reach the same daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerConfig {
    dir: PathBuf,
    quiet_period: Duration,
    connect_timeout: Duration,
    binary: Option<PathBuf>,
    log_file: Option<PathBuf>,
    start: StartMethod,
}

/// How a client that finds no daemon starts one (see `docs/shm-manager.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StartMethod {
    /// The configured binary; else this program's own image (when the library is linked into
    /// its main executable); else, in a process with a single thread, a forked grandchild
    /// running the daemon loop; else a `tensormem-shm-manager` found next to the executable or
    /// in `PATH`.
    #[default]
    Auto,
    /// Only the forked grandchild, which requires this process to have a single thread
    /// ([`ManagerError::Usage`] otherwise). For programs that know they are single-threaded
    /// when they first connect, and for tests of that path.
    Fork,
}

impl ManagerConfig {
    /// A config for the daemon whose socket lives in `dir`, with default timings; the binary is
    /// searched as [`locate_binary`](Self::locate_binary) says.
    ///
    /// A relative `dir` is made absolute against the current directory (the daemon runs in
    /// `/`).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        ManagerConfig {
            dir: std::path::absolute(&dir).unwrap_or(dir),
            quiet_period: DEFAULT_QUIET_PERIOD,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            binary: None,
            log_file: None,
            start: StartMethod::Auto,
        }
    }

    /// The config the environment describes:
    ///
    /// - directory: `TENSORMEM_SHM_MANAGER_DIR`, else the first usable of
    ///   `$XDG_RUNTIME_DIR/tensormem`, `$TMPDIR/tensormem-<uid>` and `$HOME/.cache/tensormem-run`
    ///   (usable: absent, or a directory of this user; a directory another user planted is
    ///   skipped);
    /// - quiet period: `TENSORMEM_SHM_MANAGER_QUIET_MS` (milliseconds), else 5 s;
    /// - binary: `TENSORMEM_SHM_MANAGER`, else searched (see [`locate_binary`](Self::locate_binary));
    /// - daemon log: `TENSORMEM_SHM_MANAGER_LOG`, else none.
    ///
    /// # Errors
    ///
    /// [`ManagerError::Usage`] when `TENSORMEM_SHM_MANAGER_QUIET_MS` is not a number.
    pub fn from_env() -> ManagerResult<Self> {
        let dir = match env::var_os(ENV_DIR).filter(|d| !d.is_empty()) {
            Some(dir) => PathBuf::from(dir),
            None => default_dir(),
        };
        let mut config = ManagerConfig::new(dir);
        if let Some(ms) = env::var_os(ENV_QUIET_MS) {
            config.quiet_period = parse_millis(&ms, ENV_QUIET_MS)?;
        }
        config.binary = env::var_os(ENV_BINARY)
            .filter(|b| !b.is_empty())
            .map(PathBuf::from);
        config.log_file = env::var_os(ENV_LOG)
            .filter(|l| !l.is_empty())
            .map(PathBuf::from);
        Ok(config)
    }

    /// Sets how long a daemon started through this config stays up with no clients.
    #[must_use]
    pub fn with_quiet_period(mut self, quiet_period: Duration) -> Self {
        self.quiet_period = quiet_period;
        self
    }

    /// Sets how long a client keeps trying to reach or start the daemon.
    #[must_use]
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Uses this daemon binary instead of searching for one.
    #[must_use]
    pub fn with_binary(mut self, binary: impl Into<PathBuf>) -> Self {
        self.binary = Some(binary.into());
        self
    }

    /// Chooses how a missing daemon is started (default [`StartMethod::Auto`]).
    #[must_use]
    pub fn with_start(mut self, start: StartMethod) -> Self {
        self.start = start;
        self
    }

    /// How a missing daemon is started.
    pub fn start_method(&self) -> StartMethod {
        self.start
    }

    /// Makes a daemon started through this config append its log to `path`.
    #[must_use]
    pub fn with_log_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.log_file = Some(path.into());
        self
    }

    /// The runtime directory (mode 0700) holding the socket and the lock file.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The daemon's Unix socket.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.join(SOCKET_NAME)
    }

    /// The lock file a live daemon holds `flock` on.
    pub fn lock_path(&self) -> PathBuf {
        self.dir.join(LOCK_NAME)
    }

    /// How long the daemon stays up with no clients.
    pub fn quiet_period(&self) -> Duration {
        self.quiet_period
    }

    /// The command-line arguments that hand this configuration's directory and quiet period to a
    /// `tensormem-shm-manager` process (`--dir DIR --quiet-ms MS`), for the client that starts the
    /// daemon and for the daemon re-running itself detached.
    pub fn daemon_args(&self) -> [OsString; 4] {
        [
            "--dir".into(),
            self.dir.clone().into_os_string(),
            "--quiet-ms".into(),
            self.quiet_period.as_millis().to_string().into(),
        ]
    }

    /// How long a client keeps trying to reach or start the daemon.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The daemon's log file, if any.
    pub fn log_file(&self) -> Option<&Path> {
        self.log_file.as_deref()
    }

    /// The binary set with [`with_binary`](Self::with_binary) or `TENSORMEM_SHM_MANAGER`, if any.
    pub fn configured_binary(&self) -> Option<&Path> {
        self.binary.as_deref()
    }

    /// `binary` if it is an executable file, else [`ManagerError::BinaryNotFound`] naming it.
    pub(crate) fn check_binary<'a>(&self, binary: &'a Path) -> ManagerResult<&'a Path> {
        if is_executable(binary) {
            Ok(binary)
        } else {
            Err(ManagerError::BinaryNotFound {
                searched: format!(
                    "{ENV_BINARY}={} is not an executable file",
                    binary.display()
                ),
            })
        }
    }

    /// Finds a daemon binary: the configured path (`TENSORMEM_SHM_MANAGER`), else
    /// `tensormem-shm-manager` next to the current executable (or one level up when that is
    /// cargo's `deps/` directory), else the first executable of that name in `PATH`.
    ///
    /// Clients need a binary only when no binary is configured and this program cannot start the
    /// daemon from its own image (the library lives in a shared object): see
    /// `docs/shm-manager.md`.
    ///
    /// # Errors
    ///
    /// [`ManagerError::BinaryNotFound`] naming the places searched when none has it.
    pub fn locate_binary(&self) -> ManagerResult<PathBuf> {
        if let Some(binary) = &self.binary {
            return self.check_binary(binary).map(Path::to_path_buf);
        }
        let exe_dir = env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(Path::to_path_buf));
        if let Some(dir) = &exe_dir {
            let mut candidates = vec![dir.join(BINARY_NAME)];
            if dir.file_name().is_some_and(|n| n == "deps") {
                if let Some(parent) = dir.parent() {
                    candidates.push(parent.join(BINARY_NAME));
                }
            }
            if let Some(found) = candidates.into_iter().find(|c| is_executable(c)) {
                return Ok(found);
            }
        }
        if let Some(found) = env::var_os("PATH")
            .iter()
            .flat_map(env::split_paths)
            .map(|dir| dir.join(BINARY_NAME))
            .find(|c| is_executable(c))
        {
            return Ok(found);
        }
        Err(ManagerError::BinaryNotFound {
            searched: format!(
                "{ENV_BINARY} is not set, this program cannot run the daemon from its own image \
                 (tensormem-shm is not linked into its main executable), the binary is not next \
                 to the current executable ({}), and no directory of PATH has it",
                exe_dir.map_or_else(|| "unknown".to_owned(), |d| d.display().to_string())
            ),
        })
    }
}

/// The first usable of [`default_dir_candidates`]: one that does not exist yet, or is a real
/// directory (not a symlink) owned by this user. Every process of the user walks the same list
/// and so meets the same daemon; a directory another user planted at a predictable path
/// (`/tmp/tensormem-<uid>`) is skipped, with a warning, instead of making every managed region
/// fail. If none is usable the first is returned, and [`prepare_dir`] explains what is wrong
/// with it and how to choose another (`TENSORMEM_SHM_MANAGER_DIR`).
fn default_dir() -> PathBuf {
    let uid = rustix::process::getuid().as_raw();
    let candidates = default_dir_candidates(
        env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
        env::temp_dir(),
        env::var_os("HOME").map(PathBuf::from),
        uid,
    );
    choose_dir(&candidates)
}

/// `$XDG_RUNTIME_DIR/tensormem` when that variable names an absolute directory, then
/// `$TMPDIR/tensormem-<uid>` (`/tmp` by default), then `$HOME/.cache/tensormem-run` when `HOME`
/// is absolute.
fn default_dir_candidates(
    xdg_runtime: Option<PathBuf>,
    temp: PathBuf,
    home: Option<PathBuf>,
    uid: u32,
) -> Vec<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(runtime) = xdg_runtime.filter(|r| r.is_absolute() && r.is_dir()) {
        candidates.push(runtime.join("tensormem"));
    }
    candidates.push(temp.join(format!("tensormem-{uid}")));
    if let Some(home) = home.filter(|h| h.is_absolute()) {
        candidates.push(home.join(".cache").join("tensormem-run"));
    }
    candidates
}

fn choose_dir(candidates: &[PathBuf]) -> PathBuf {
    let own = rustix::process::getuid().as_raw();
    for dir in candidates {
        match fs::symlink_metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return dir.clone(),
            Ok(meta) if meta.file_type().is_dir() && meta.uid() == own => return dir.clone(),
            Ok(meta) => tracing::warn!(
                dir = %dir.display(),
                owner = meta.uid(),
                is_dir = meta.file_type().is_dir(),
                "skipping a runtime directory that is not a directory of ours (planted by \
                 another user?); set TENSORMEM_SHM_MANAGER_DIR to choose one"
            ),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "skipping a runtime directory")
            }
        }
    }
    candidates
        .first()
        .cloned()
        .unwrap_or_else(|| PathBuf::from("/tmp/tensormem"))
}

pub(crate) fn parse_millis(value: &OsString, what: &str) -> ManagerResult<Duration> {
    value
        .to_str()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(Duration::from_millis)
        .ok_or_else(|| {
            ManagerError::Usage(format!(
                "{what} must be a whole number of milliseconds, got {value:?}"
            ))
        })
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Creates the runtime directory (mode 0700) if missing and checks that it is safe: a real
/// directory (not a symlink), owned by this user, closed to everyone else. A directory of ours
/// that is open to others is closed (chmod 0700); one owned by someone else is refused.
pub(crate) fn prepare_dir(dir: &Path) -> ManagerResult<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| {
            ManagerError::io(
                format!(
                    "cannot create the shm manager directory {}; set {ENV_DIR} to a directory \
                     only you can write",
                    dir.display()
                ),
                e,
            )
        })?;
    let insecure = |problem: String| ManagerError::InsecureDir {
        dir: dir.to_owned(),
        problem,
    };
    let meta = fs::symlink_metadata(dir)
        .map_err(|e| ManagerError::io(format!("cannot inspect {}", dir.display()), e))?;
    if !meta.file_type().is_dir() {
        return Err(insecure("not a directory (a symlink or a file)".to_owned()));
    }
    let own = rustix::process::getuid().as_raw();
    if meta.uid() != own {
        return Err(insecure(format!(
            "owned by uid {}, not by you (uid {own})",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|e| {
            insecure(format!(
                "open to other users (mode {:o}) and cannot be closed: {e}",
                meta.mode() & 0o777
            ))
        })?;
    }
    Ok(())
}

/// Checks that the socket path fits in `sockaddr_un`.
pub(crate) fn check_socket_path(path: &Path) -> ManagerResult<()> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(ManagerError::SocketPathTooLong {
            path: path.to_owned(),
            len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepare_dir_creates_a_private_directory_and_closes_an_open_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        prepare_dir(&dir).unwrap();
        let mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        prepare_dir(&dir).unwrap();
        let mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn prepare_dir_refuses_symlinks_and_files() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        fs::create_dir(&target).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(
            prepare_dir(&link),
            Err(ManagerError::InsecureDir { .. })
        ));
        let file = tmp.path().join("file");
        fs::write(&file, b"x").unwrap();
        assert!(prepare_dir(&file).is_err());
    }

    /// Regression: another user pre-creating `/tmp/tensormem-<uid>` made every managed
    /// region fail.
    #[test]
    fn a_planted_default_directory_is_skipped_consistently() {
        let tmp = tempfile::tempdir().unwrap();
        let candidates = default_dir_candidates(
            Some(tmp.path().join("no-such-runtime-dir")),
            tmp.path().to_owned(),
            Some(tmp.path().join("home")),
            4242,
        );
        assert_eq!(
            candidates,
            vec![
                tmp.path().join("tensormem-4242"),
                tmp.path().join("home/.cache/tensormem-run")
            ]
        );
        // Absent: the first is used (and created later, mode 0700).
        assert_eq!(choose_dir(&candidates), candidates[0]);
        // A symlink planted there: skipped.
        let elsewhere = tmp.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &candidates[0]).unwrap();
        assert_eq!(choose_dir(&candidates), candidates[1]);
        // A directory owned by another user (needs root to stage): skipped too.
        fs::remove_file(&candidates[0]).unwrap();
        fs::create_dir(&candidates[0]).unwrap();
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&candidates[0], Some(65534), Some(65534)).unwrap();
            assert_eq!(choose_dir(&candidates), candidates[1]);
            prepare_dir(&choose_dir(&candidates)).unwrap();
        } else {
            assert_eq!(choose_dir(&candidates), candidates[0], "ours: kept");
        }
        // Nothing usable: the first, whose check then explains the way out.
        let all_bad = vec![elsewhere.join("file")];
        fs::write(&all_bad[0], b"").unwrap();
        assert_eq!(choose_dir(&all_bad), all_bad[0]);
        let err = prepare_dir(&all_bad[0]).unwrap_err().to_string();
        assert!(err.contains("TENSORMEM_SHM_MANAGER_DIR"), "{err}");
    }

    #[test]
    fn overlong_socket_paths_are_refused() {
        let long = PathBuf::from(format!("/{}", "d".repeat(120))).join(SOCKET_NAME);
        assert!(matches!(
            check_socket_path(&long),
            Err(ManagerError::SocketPathTooLong { .. })
        ));
        check_socket_path(Path::new("/tmp/x/manager.sock")).unwrap();
    }

    #[test]
    fn a_configured_binary_that_does_not_exist_is_named_in_the_error() {
        let config = ManagerConfig::new("/tmp/x").with_binary("/nonexistent/tensormem-shm-manager");
        let err = config.locate_binary().unwrap_err().to_string();
        assert!(err.contains("/nonexistent/tensormem-shm-manager"), "{err}");
        assert!(err.contains(ENV_BINARY), "{err}");
    }

    #[test]
    fn bad_quiet_period_is_a_usage_error() {
        let err = parse_millis(&OsString::from("5s"), ENV_QUIET_MS).unwrap_err();
        assert!(matches!(err, ManagerError::Usage(_)));
        assert_eq!(
            parse_millis(&OsString::from("250"), ENV_QUIET_MS).unwrap(),
            Duration::from_millis(250)
        );
    }
}
