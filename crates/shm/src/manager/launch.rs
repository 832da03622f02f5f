//! Starting the daemon: the launcher that detaches it, the detached daemon's `main`, and the
//! library's own way to start a daemon when no binary is configured.
//!
//! # How a client starts a daemon
//!
//! The client runs a *launcher* process and reads one line from it (`ready <pid>`, `running`, or
//! `error <message>`). The launcher re-runs its own image as the *daemon* with stdout piped back,
//! relays the daemon's first line, and exits; the client reaps the launcher at once and the
//! daemon is re-parented to init (or the nearest subreaper). The daemon never holds the client's
//! stdio, so `cmd | tee` and test harnesses do not wait for it.
//!
//! Both processes are started with `fork` + `exec` (`std::process::Command`), so nothing but
//! async-signal-safe work happens between the two in a multithreaded client, and the daemon runs
//! in a fresh process image: it inherits none of the client's threads, locks, mappings (shared
//! memory it would keep alive) or descriptors (`O_CLOEXEC` everywhere in Rust's std).
//!
//! The image is, in order of preference:
//!
//! 1. the binary configured with `TENSORMEM_SHM_MANAGER` / [`ManagerConfig::with_binary`];
//! 2. **this program itself**, when the library is linked into its main executable: a function
//!    in the `.init_array` section (run by the dynamic loader or libc start-up *before* `main`,
//!    as C++ static constructors are) looks for `TENSORMEM_SHM_MANAGER_ROLE`. When the variable
//!    is absent, which is every ordinary start of the program, it returns at once after
//!    recording that it ran. When it is `launch` or `daemon`, it runs the launcher or the daemon
//!    from the library and exits, so the program's own `main` never runs. Nothing of the
//!    program runs except what runs at every start of it anyway (other start-up constructors);
//!    `exec` of `/proc/self/exe` reaches the very file this process runs, even if it was
//!    replaced or deleted since. The client uses this only after checking that the hook ran in
//!    its own process and that the hook lives in the main executable (not in a shared library
//!    loaded into some other program, whose `main` the hook could not intercept);
//! 3. when option 2 is unavailable and this process has a single thread, a forked grandchild
//!    that runs the daemon loop without `exec` ([`fork_daemon`]: sound because no other thread
//!    can hold a lock at the `fork`);
//! 4. a `tensormem-shm-manager` binary next to the current executable or in `PATH`.
//!
//! A program that embeds tensormem-shm therefore needs no extra binary, no `main` cooperation
//! and no configuration. Only a multithreaded program with the library in a shared object (e.g.
//! a Python extension) needs the binary: point `TENSORMEM_SHM_MANAGER` at it.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fd::AsFd;

use super::config::{ManagerConfig, ENV_DIR, ENV_LOG, ENV_QUIET_MS};
use super::daemon::{serve, Startup};
use super::error::{ManagerError, ManagerResult};
use super::log::{open_log_file, DaemonLog};

/// Environment variable that makes a process started from this program's image act as the
/// manager's launcher (`launch`) or daemon (`daemon`) before `main`.
pub const ENV_ROLE: &str = "TENSORMEM_SHM_MANAGER_ROLE";
const ROLE_LAUNCH: &str = "launch";
const ROLE_DAEMON: &str = "daemon";

/// How [`run`] runs the daemon (the modes of the `tensormem-shm-manager` binary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunMode {
    /// Serve in this process, logging to stderr, until the quiet period ends.
    Foreground,
    /// Start a detached daemon (this program's image re-run with `--detached`), print its
    /// first line (`ready <pid>` or `running`) and return once a daemon listens.
    Daemonize,
    /// The process `Daemonize` starts: a new session in `/`, reporting one line on stdout.
    Detached,
}

/// How a launcher re-runs its own image as the detached daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Image {
    /// The `tensormem-shm-manager` binary: `current_exe --detached --dir D --quiet-ms MS`.
    Binary,
    /// An embedding program: `/proc/self/exe` with `TENSORMEM_SHM_MANAGER_ROLE=daemon`.
    SelfExe,
}

/// Runs the manager daemon as `mode` says: the `main` of `tensormem-shm-manager`, for programs
/// that ship the daemon in a binary of their own.
///
/// # Errors
///
/// An unusable runtime directory or log file, a daemon that could not start, or (in the
/// foreground) a socket that cannot be bound.
pub fn run(config: &ManagerConfig, mode: RunMode) -> ManagerResult<()> {
    run_as(config, mode, Image::Binary)
}

fn run_as(config: &ManagerConfig, mode: RunMode, image: Image) -> ManagerResult<()> {
    match mode {
        RunMode::Daemonize => daemonize(config, image),
        RunMode::Foreground => serve_logged(config, false),
        RunMode::Detached => serve_logged(config, true),
    }
}

/// Starts the detached daemon with stdout piped back, relays its first line, and returns: the
/// caller reaps us at once and the daemon is re-parented.
fn daemonize(config: &ManagerConfig, image: Image) -> ManagerResult<()> {
    let stderr = match config.log_file() {
        Some(path) => Stdio::from(open_log_file(path)?),
        None => Stdio::null(),
    };
    let mut command = match image {
        Image::Binary => {
            let exe = std::env::current_exe().map_err(|e| {
                ManagerError::io("cannot find this executable to re-run it detached", e)
            })?;
            let mut command = Command::new(exe);
            command.arg("--detached").args(config.daemon_args());
            command
        }
        Image::SelfExe => {
            let mut command = Command::new("/proc/self/exe");
            command.envs(role_env(config, ROLE_DAEMON));
            command
        }
    };
    command.env_remove(ENV_LOG);
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(|e| ManagerError::io("cannot start the detached shm manager", e))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        // Returns when the daemon reports or exits (closing the pipe).
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let line = line.trim_end();
    let mut stdout = std::io::stdout();
    if line.starts_with("ready ") {
        // The daemon keeps running; not waiting for it is the point.
        let _ = writeln!(stdout, "{line}");
        return Ok(());
    }
    // It is exiting: reap it.
    let status = child.wait().ok();
    if line == "running" {
        let _ = writeln!(stdout, "{line}");
        return Ok(());
    }
    let message = match line.strip_prefix("error ") {
        Some(message) => message.to_owned(),
        None => format!(
            "the daemon exited ({}) before it listened{}",
            status.map_or_else(|| "status unknown".to_owned(), |s| s.to_string()),
            config
                .log_file()
                .map_or_else(String::new, |log| format!("; see {}", log.display()))
        ),
    };
    Err(ManagerError::Usage(message))
}

/// The environment that hands `config` to a process of this program's image in `role`.
fn role_env(config: &ManagerConfig, role: &str) -> Vec<(&'static str, OsString)> {
    let mut env = vec![
        (ENV_ROLE, OsString::from(role)),
        (ENV_DIR, config.dir().as_os_str().to_owned()),
        (
            ENV_QUIET_MS,
            config.quiet_period().as_millis().to_string().into(),
        ),
    ];
    if let Some(log) = config.log_file() {
        env.push((ENV_LOG, log.as_os_str().to_owned()));
    }
    env
}

/// Serves until the quiet period ends; `detached` starts a new session first and reports
/// startup on stdout as one line (`ready <pid>`, `running`, or `error <message>`).
fn serve_logged(config: &ManagerConfig, detached: bool) -> ManagerResult<()> {
    DaemonLog::from_env(!detached).install();
    serve_reporting(config, detached, &mut |line| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    })
}

/// [`serve`], reporting startup (or an error before it) through `report` as one line.
fn serve_reporting(
    config: &ManagerConfig,
    detached: bool,
    report: &mut dyn FnMut(&str),
) -> ManagerResult<()> {
    if detached {
        // A new session: no controlling terminal, so no SIGHUP or terminal signals meant for
        // the process group that started us.
        if let Err(e) = rustix::process::setsid() {
            tracing::warn!(error = %e, "setsid failed; staying in the caller's session");
        }
        // Do not keep the caller's working directory (and its filesystem) busy.
        let _ = std::env::set_current_dir("/");
        // Started from an embedding program's image, `ps` would show that program's name: name
        // the process for what it is (`comm`, 15 bytes at most).
        let _ = rustix::thread::set_name(c"tm-shm-manager");
    }
    let mut reported = false;
    let result = serve(config, |startup| {
        reported = true;
        match startup {
            Startup::Listening { pid } => report(&format!("ready {pid}")),
            Startup::AlreadyRunning => report("running"),
        }
    });
    if let Err(e) = &result {
        tracing::error!(error = %e, "shm manager stopped");
        if detached && !reported {
            // One line: the launcher relays it to the client.
            report(&format!("error {}", e.to_string().replace('\n', " ")));
        }
    }
    result
}

/// Starts the daemon in a grandchild of this process that runs the daemon loop from the library,
/// without `exec`, and returns the first line it reported (`ready <pid>`, `running`,
/// `error <message>`, or empty if it died first).
///
/// Sound only because this process has a single thread when it forks: the child's copy of the
/// allocator, of std's and `tracing`'s locks and of everything else was not caught half-way by
/// another thread. With more threads it returns `Ok(None)` (or, when `required`, a usage error)
/// and forks nothing. The grandchild then makes itself independent of the client: a new
/// session, stdin `/dev/null`, stdout the pipe to the client, stderr the log file (or
/// `/dev/null`), every other descriptor closed (the client's sockets and files), every shared
/// mapping unmapped (the client's shared memory must not stay alive in the daemon), `/` as its
/// directory, its own `tracing` subscriber for its threads, and `_exit` at the end (no `atexit`
/// handler or destructor of the client runs in it).
pub(crate) fn fork_daemon(config: &ManagerConfig, required: bool) -> ManagerResult<Option<String>> {
    match thread_count() {
        Some(1) => {}
        other => {
            if required {
                return Err(ManagerError::Usage(format!(
                    "StartMethod::Fork needs a single-threaded process; this one has {}",
                    other.map_or_else(|| "an unknown number of".to_owned(), |n| n.to_string())
                )));
            }
            return Ok(None);
        }
    }
    let io = |what: &str| {
        let what = what.to_owned();
        move |e: rustix::io::Errno| ManagerError::io(what, e)
    };
    let log = config.log_file().map(open_log_file).transpose()?;
    let null = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(io("cannot open /dev/null"))?;
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(io("cannot create a pipe to the daemon"))?;
    let dispatch = tracing::Dispatch::new(DaemonLog::from_env(false));
    // SAFETY: this process has exactly one thread (checked above; only this thread could have
    // started another since), so the child starts with consistent memory and locks. The child
    // never returns into the caller's code: it ends in `_exit`.
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: as above; still one thread.
        if unsafe { libc::setsid() } < 0 || unsafe { libc::fork() } != 0 {
            // The first child (or a failed second fork): done; the client reaps it.
            // SAFETY: `_exit` ends the process without running the caller's handlers.
            unsafe { libc::_exit(0) };
        }
        let log_fd = log.as_ref().map_or_else(|| null.as_fd(), AsFd::as_fd);
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            daemon_grandchild(config, &dispatch, null.as_fd(), write_end.as_fd(), log_fd)
        }))
        .unwrap_or(101);
        // SAFETY: ends the daemon without running the client's atexit handlers or destructors.
        unsafe { libc::_exit(code) };
    }
    if child < 0 {
        return Err(ManagerError::io(
            "cannot fork the shm manager",
            std::io::Error::last_os_error(),
        ));
    }
    drop(write_end);
    let mut status = 0;
    // SAFETY: `child` is our child; `status` is a valid out-pointer.
    while unsafe { libc::waitpid(child, &mut status, 0) } < 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
    {}
    let mut line = String::new();
    let _ = BufReader::new(std::fs::File::from(read_end)).read_line(&mut line);
    Ok(Some(line.trim_end().to_owned()))
}

/// The forked daemon: takes its descriptors, drops the client's, serves, returns the exit code.
fn daemon_grandchild(
    config: &ManagerConfig,
    dispatch: &tracing::Dispatch,
    null: rustix::fd::BorrowedFd<'_>,
    report: rustix::fd::BorrowedFd<'_>,
    log: rustix::fd::BorrowedFd<'_>,
) -> i32 {
    use rustix::fd::AsRawFd;
    // SAFETY: plain descriptor calls on descriptors this process owns; 0, 1 and 2 are replaced.
    unsafe {
        libc::dup2(null.as_raw_fd(), 0);
        libc::dup2(report.as_raw_fd(), 1);
        libc::dup2(log.as_raw_fd(), 2);
    }
    close_from(3);
    unmap_shared_mappings();
    tracing::dispatcher::with_default(dispatch, || {
        // Raw writes to fd 1: std's stdout may hold bytes the client buffered before the fork.
        let mut report = |line: &str| {
            let _ = rustix::io::write(
                // SAFETY: fd 1 is the pipe to the client, open for the whole process.
                unsafe { rustix::fd::BorrowedFd::borrow_raw(1) },
                format!("{line}\n").as_bytes(),
            );
        };
        match serve_reporting(config, true, &mut report) {
            Ok(()) => 0,
            Err(_) => 1,
        }
    })
}

/// Closes every descriptor from `first` up (`close_range`, or one by one from `/proc/self/fd`).
fn close_from(first: u32) {
    // SAFETY: closing descriptors this process owns; nothing in it uses them afterwards (the
    // daemon opens its own).
    if unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) } == 0 {
        return;
    }
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds.into_iter().filter(|&fd| fd >= first as i32) {
        // SAFETY: as above.
        unsafe { libc::close(fd) };
    }
}

/// Unmaps every `MAP_SHARED` mapping this process inherited (the client's shared memory).
fn unmap_shared_mappings() {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return;
    };
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        if perms.as_bytes().get(3) != Some(&b's') {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(end, 16),
        ) else {
            continue;
        };
        // SAFETY: the range is a shared mapping inherited from the client; this process never
        // returns into the client's code that refers to it.
        unsafe { libc::munmap(start as *mut libc::c_void, end - start) };
    }
}

/// Threads of this process (`/proc/self/task`).
fn thread_count() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/task").ok()?.count())
}

/// Set by [`self_start_hook`] in every process whose start-up ran it.
static HOOK_RAN: AtomicBool = AtomicBool::new(false);

/// The pre-`main` entry point (see the [module docs](self)). Registered in `.init_array`, so the
/// C runtime calls it once while the program starts, on the main thread, before `main`.
extern "C" fn self_start_hook() {
    HOOK_RAN.store(true, Ordering::Relaxed);
    let Some(role) = std::env::var_os(ENV_ROLE) else {
        return;
    };
    let mode = match role.to_str() {
        Some(ROLE_LAUNCH) => RunMode::Daemonize,
        Some(ROLE_DAEMON) => RunMode::Detached,
        _ => return,
    };
    // Unwinding out of an `extern "C"` function would abort; turn a panic into an exit status.
    let outcome = std::panic::catch_unwind(|| {
        ManagerConfig::from_env().and_then(|config| run_as(&config, mode, Image::SelfExe))
    });
    let code = match outcome {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            let _ = writeln!(std::io::stderr(), "tensormem-shm-manager: {e}");
            1
        }
        Err(_) => 101,
    };
    std::process::exit(code);
}

// SAFETY: `.init_array` holds pointers to `extern "C" fn()`s the C runtime calls once at start-up
// (glibc passes argc/argv/envp, which the C calling convention lets a callee ignore; musl passes
// nothing). The hook only reads the environment and, when asked to by `ENV_ROLE`, runs the
// daemon and exits; it touches no state of the program it is linked into.
#[allow(unsafe_code)]
#[used]
#[link_section = ".init_array"]
static SELF_START: extern "C" fn() = self_start_hook;

/// A command that starts the launcher from this program's image, if that image carries the
/// start-up hook: it ran in this process, and it lives in the main executable (a hook inside a
/// shared library would not run before the `main` of `/proc/self/exe`).
pub(crate) fn self_launcher(config: &ManagerConfig) -> Option<Command> {
    if !HOOK_RAN.load(Ordering::Relaxed) || !hook_in_main_executable() {
        return None;
    }
    let mut command = Command::new("/proc/self/exe");
    command.envs(role_env(config, ROLE_LAUNCH));
    if config.log_file().is_none() {
        command.env_remove(ENV_LOG);
    }
    Some(command)
}

/// Whether the code of [`self_start_hook`] is mapped from the file `/proc/self/exe` names.
fn hook_in_main_executable() -> bool {
    let Ok(exe) = std::fs::read_link("/proc/self/exe") else {
        return false;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let hook = self_start_hook as *const () as usize;
    mapping_path_of(&maps, hook).is_some_and(|path| Path::new(path) == exe)
}

/// The path of the mapping in `/proc/<pid>/maps` text that contains `addr`.
fn mapping_path_of(maps: &str, addr: usize) -> Option<&str> {
    maps.lines().find_map(|line| {
        let (range, rest) = line.split_once(' ')?;
        let (start, end) = range.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        if !(start..end).contains(&addr) {
            return None;
        }
        // perms offset dev inode path: the path starts after the fifth field.
        let mut fields = rest.splitn(5, ' ');
        let path = fields.nth(4)?.trim_start();
        (!path.is_empty()).then_some(path)
    })
}

/// Where the daemon image comes from, for messages.
pub(crate) fn describe_self() -> PathBuf {
    std::fs::read_link("/proc/self/exe").unwrap_or_else(|_| PathBuf::from("/proc/self/exe"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_ran_and_is_found_in_the_test_executable() {
        assert!(
            HOOK_RAN.load(Ordering::Relaxed),
            "the .init_array hook did not run"
        );
        assert!(hook_in_main_executable());
    }

    #[test]
    fn mapping_paths_are_parsed() {
        let maps = "\
55d0c0000000-55d0c0001000 r--p 00000000 08:01 123 /usr/bin/prog
55d0c0001000-55d0c0002000 r-xp 00001000 08:01 123 /usr/bin/my prog (deleted)
7ffc00000000-7ffc00001000 rw-p 00000000 00:00 0 
";
        assert_eq!(mapping_path_of(maps, 0x55d0c0000010), Some("/usr/bin/prog"));
        assert_eq!(
            mapping_path_of(maps, 0x55d0c0001010),
            Some("/usr/bin/my prog (deleted)")
        );
        assert_eq!(mapping_path_of(maps, 0x7ffc00000010), None);
        assert_eq!(mapping_path_of(maps, 0x10), None);
    }
}
