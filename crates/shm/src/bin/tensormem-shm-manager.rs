//! `tensormem-shm-manager`: the daemon that unlinks the managed shared-memory names of dead
//! processes (tensormem's `torch_shm_manager`).
//!
//! Clients start it on demand with `--daemonize`; people run it by hand with `--foreground` to
//! watch what it does. See `docs/shm-manager.md`.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use tensormem_shm::manager::{serve, ManagerConfig, ManagerError, Startup, ENV_LOG};

const USAGE: &str = "\
usage: tensormem-shm-manager [--foreground | --daemonize] [--dir DIR] [--quiet-ms MS] [--log FILE]

  --foreground   serve in this process, logging to stderr (default)
  --daemonize    start a detached daemon, print `ready <pid>` or `running` once one listens, exit
  --dir DIR      runtime directory for the socket and lock (default: TENSORMEM_SHM_MANAGER_DIR,
                 $XDG_RUNTIME_DIR/tensormem, or /tmp/tensormem-<uid>)
  --quiet-ms MS  exit after MS milliseconds without clients (default 5000)
  --log FILE     with --daemonize: append the daemon's log to FILE (default: TENSORMEM_SHM_MANAGER_LOG)
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Foreground,
    Daemonize,
    /// Internal: the process `--daemonize` starts.
    Detached,
}

#[derive(Debug)]
struct Args {
    mode: Mode,
    config: ManagerConfig,
}

/// Parses the command line; `Ok(None)` when help was asked for.
fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Option<Args>, ManagerError> {
    let mut mode = Mode::Foreground;
    let mut dir = None;
    let mut quiet = None;
    let mut log = None;
    let mut args = args.into_iter();
    let usage = |problem: String| ManagerError::Usage(format!("{problem}\n{USAGE}"));
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| {
            args.next()
                .ok_or_else(|| usage(format!("{flag} needs a value")))
        };
        match arg.to_str() {
            Some("--foreground") => mode = Mode::Foreground,
            Some("--daemonize") => mode = Mode::Daemonize,
            Some("--detached") => mode = Mode::Detached,
            Some("--dir") => dir = Some(PathBuf::from(value("--dir")?)),
            Some("--quiet-ms") => {
                let ms = value("--quiet-ms")?;
                let ms = ms
                    .to_str()
                    .and_then(|s| s.parse::<u64>().ok())
                    .ok_or_else(|| usage(format!("--quiet-ms takes milliseconds, got {ms:?}")))?;
                quiet = Some(Duration::from_millis(ms));
            }
            Some("--log") => log = Some(PathBuf::from(value("--log")?)),
            Some("-h" | "--help") => return Ok(None),
            _ => return Err(usage(format!("unknown argument {arg:?}"))),
        }
    }
    let mut config = ManagerConfig::from_env()?;
    if let Some(dir) = dir {
        config = ManagerConfig::new(dir).with_quiet_period(config.quiet_period());
    }
    if let Some(quiet) = quiet {
        config = config.with_quiet_period(quiet);
    }
    if let Some(log) = log {
        config = config.with_log_file(log);
    }
    Ok(Some(Args { mode, config }))
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args_os().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("tensormem-shm-manager: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match args.mode {
        Mode::Daemonize => daemonize(&args.config),
        Mode::Foreground => run(&args.config, false),
        Mode::Detached => run(&args.config, true),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensormem-shm-manager: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Starts `--detached` with stdout piped back to us, relays its first line, and exits: the
/// caller reaps us at once and the daemon is re-parented to init (or the subreaper).
fn daemonize(config: &ManagerConfig) -> Result<(), ManagerError> {
    let exe = std::env::current_exe().map_err(|e| ManagerError::Io {
        what: "cannot find this executable to re-run it detached".to_owned(),
        source: e,
    })?;
    let stderr = match config.log_file() {
        Some(path) => Stdio::from(
            OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| ManagerError::Io {
                    what: format!("cannot open the log file {} ({ENV_LOG})", path.display()),
                    source: e,
                })?,
        ),
        None => Stdio::null(),
    };
    let mut child = Command::new(&exe)
        .arg("--detached")
        .args(config.daemon_args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(|e| ManagerError::Io {
            what: format!("cannot start {}", exe.display()),
            source: e,
        })?;
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

/// Serves until the quiet period ends; `detached` starts a new session first and reports
/// startup on stdout as one line (`ready <pid>`, `running`, or `error <message>`).
fn run(config: &ManagerConfig, detached: bool) -> Result<(), ManagerError> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(!detached)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TENSORMEM_SHM_MANAGER_LOG_LEVEL")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if detached {
        // A new session: no controlling terminal, so no SIGHUP or terminal signals meant for
        // the process group that started us.
        if let Err(e) = rustix::process::setsid() {
            tracing::warn!(error = %e, "setsid failed; staying in the caller's session");
        }
        // Do not keep the caller's working directory (and its filesystem) busy.
        let _ = std::env::set_current_dir("/");
    }
    let mut reported = false;
    let result = serve(config, |startup| {
        reported = true;
        let line = match startup {
            Startup::Listening { pid } => format!("ready {pid}"),
            Startup::AlreadyRunning => "running".to_owned(),
        };
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    });
    if let Err(e) = &result {
        tracing::error!(error = %e, "shm manager stopped");
        if detached && !reported {
            // One line: the launcher relays it to the client.
            let message = e.to_string().replace('\n', " ");
            let _ = writeln!(std::io::stdout(), "error {message}");
        }
    }
    result
}
