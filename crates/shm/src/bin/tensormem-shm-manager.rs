//! `tensormem-shm-manager`: the daemon that unlinks the managed shared-memory names of dead
//! processes (tensormem's `torch_shm_manager`).
//!
//! Programs that link `tensormem-shm` start the daemon from their own image and need no binary;
//! this one is for programs that cannot (the library inside a shared object: point
//! `TENSORMEM_SHM_MANAGER` at it) and for people who run it by hand with `--foreground` to watch
//! what it does. The logic is the library's (`tensormem_shm::manager::run`); this file parses the
//! command line. See `docs/shm-manager.md`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tensormem_shm::manager::{run, ManagerConfig, ManagerError, RunMode as Mode};

const USAGE: &str = "\
usage: tensormem-shm-manager [--foreground | --daemonize] [--dir DIR] [--quiet-ms MS] [--log FILE]

  --foreground   serve in this process, logging to stderr (default)
  --daemonize    start a detached daemon, print `ready <pid>` or `running` once one listens, exit
  --dir DIR      runtime directory for the socket and lock (default: TENSORMEM_SHM_MANAGER_DIR,
                 $XDG_RUNTIME_DIR/tensormem, or /tmp/tensormem-<uid>)
  --quiet-ms MS  exit after MS milliseconds without clients (default 5000)
  --log FILE     with --daemonize: append the daemon's log to FILE (default: TENSORMEM_SHM_MANAGER_LOG)
";

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
    match run(&args.config, args.mode) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensormem-shm-manager: {e}");
            ExitCode::FAILURE
        }
    }
}
