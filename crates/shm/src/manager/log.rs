//! The daemon's log: a minimal `tracing` subscriber that writes one line per event to stderr
//! (which is the log file, or `/dev/null`, for a detached daemon). The level is coloured only on a
//! terminal, and not when `NO_COLOR` is set.
//!
//! A few dozen lines here keep `tracing-subscriber` (and its regex and formatting machinery) out
//! of the dependency tree of every program that embeds `tensormem-shm`: the daemon needs
//! "timestamp, level, message, fields" and a level filter, nothing more.

use std::fmt::{self, Write as _};
use std::fs::File;
use std::io::{self, IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{FileType, Mode, OFlags};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use super::error::{ManagerError, ManagerResult};

/// Environment variable holding the daemon's log level (`error`, `warn`, `info`, `debug`,
/// `trace`); `info` by default.
pub const ENV_LOG_LEVEL: &str = "TENSORMEM_SHM_MANAGER_LOG_LEVEL";

/// Writes events at or above a level to stderr, one line each.
#[derive(Debug)]
pub(crate) struct DaemonLog {
    max: Level,
    ansi: bool,
    next_span: AtomicU64,
}

impl DaemonLog {
    /// A log at the level `TENSORMEM_SHM_MANAGER_LOG_LEVEL` names (`info` if unset or unknown).
    /// `may_colour`: whether the level may be coloured, which it then is only if stderr is a
    /// terminal now and `NO_COLOR` is unset or empty (a log file or a pipe gets plain text).
    pub(crate) fn from_env(may_colour: bool) -> Self {
        let max = std::env::var(ENV_LOG_LEVEL)
            .ok()
            .and_then(|level| level.trim().parse::<Level>().ok())
            .unwrap_or(Level::INFO);
        Self {
            max,
            ansi: may_colour && colour_for(&io::stderr()),
            next_span: AtomicU64::new(1),
        }
    }

    /// Installs this log as the process's global subscriber (the daemon is its own process);
    /// does nothing if one is installed already.
    pub(crate) fn install(self) {
        let _ = tracing::subscriber::set_global_default(self);
    }
}

impl Subscriber for DaemonLog {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= self.max
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(self.max.into())
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let level = *event.metadata().level();
        let mut fields = Fields::default();
        event.record(&mut fields);
        let level = if self.ansi {
            let color = match level {
                Level::ERROR => "31",
                Level::WARN => "33",
                Level::INFO => "32",
                _ => "34",
            };
            format!("\x1b[{color}m{level:>5}\x1b[0m")
        } else {
            format!("{level:>5}")
        };
        // "<time> <LEVEL> <message> key=value ...", written with one call so lines from
        // several threads do not interleave.
        let line = format!("{} {level} {}{}\n", utc_now(), fields.message, fields.rest);
        let _ = io::stderr().write_all(line.as_bytes());
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}

/// Whether output to `stream` may carry colour codes: only a terminal, and not when `NO_COLOR` is
/// set to a non-empty value (<https://no-color.org>).
fn colour_for(stream: &impl IsTerminal) -> bool {
    stream.is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty())
}

/// Collects an event's fields: the message apart, the others as ` key=value`.
#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for now.
fn utc_now() -> String {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's `civil_from_days`.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Opens the daemon's log file for appending, safely against files planted by other users:
/// `O_NOFOLLOW` (a symlink at the path is refused, not followed), `O_NONBLOCK` while opening (a
/// FIFO planted there cannot block the daemon) and only regular files owned by this user.
/// Created `0600` if missing.
///
/// # Errors
///
/// [`ManagerError::Io`] naming the path and what was wrong.
pub(crate) fn open_log_file(path: &Path) -> ManagerResult<File> {
    let what = |problem: &str| {
        format!(
            "cannot use {} as the shm manager log: {problem}",
            path.display()
        )
    };
    let fd = rustix::fs::open(
        path,
        OFlags::WRONLY
            | OFlags::APPEND
            | OFlags::CREATE
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| {
        let problem = match e {
            rustix::io::Errno::LOOP => {
                "it is a symbolic link (refused: a link planted by someone else would redirect \
                 the log)"
            }
            // O_NONBLOCK write-only open of a FIFO nobody reads.
            rustix::io::Errno::NXIO => "it is not a regular file (a FIFO)",
            _ => "open failed",
        };
        ManagerError::io(what(problem), e)
    })?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| ManagerError::io(what("fstat failed"), e))?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(ManagerError::io(
            what("it is not a regular file"),
            io::Error::from(io::ErrorKind::InvalidInput),
        ));
    }
    if stat.st_uid != rustix::process::geteuid().as_raw() {
        return Err(ManagerError::io(
            what(&format!("it belongs to uid {}, not to you", stat.st_uid)),
            io::Error::from(io::ErrorKind::PermissionDenied),
        ));
    }
    rustix::fs::fcntl_setfl(&fd, OFlags::APPEND)
        .map_err(|e| ManagerError::io(what("fcntl(F_SETFL) failed"), e))?;
    Ok(File::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }

    #[test]
    fn files_and_pipes_are_not_coloured() {
        let file = tempfile::tempfile().unwrap();
        assert!(!colour_for(&file));
        let (read_end, write_end) = rustix::pipe::pipe().unwrap();
        assert!(!colour_for(&read_end));
        assert!(!colour_for(&write_end));
    }

    #[test]
    fn log_files_behind_symlinks_or_fifos_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("victim");
        std::fs::write(&target, b"").unwrap();
        let link = tmp.path().join("daemon.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = open_log_file(&link).unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"");

        let fifo = tmp.path().join("fifo.log");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let err = open_log_file(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");

        let fresh = tmp.path().join("fresh.log");
        let mut file = open_log_file(&fresh).unwrap();
        file.write_all(b"x\n").unwrap();
        let mode = std::fs::metadata(&fresh).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.permissions().mode() & 0o777, 0o600);
    }
}
