//! The `tensormem` command: one subcommand group per concern, each in its own module.
//!
//! - `tensormem shm list | gc`: shared memory housekeeping ([`shm_cmd`]).
//! - `tensormem replay [TRACE]`: replay a PyTorch allocator trace, recorded and what-if
//!   configurations ([`replay_cmd`]).
//! - `tensormem snapshot summary FILE`: what a memory snapshot holds ([`snapshot_cmd`]).
//!
//! Errors end the command with one line on stderr (`tensormem: error: ...`, causes joined with
//! `: `) and exit status 1; usage errors are clap's (exit status 2).
#![deny(unsafe_code)]

mod embedded;
mod matrix_cmd;
mod plot;
mod replay_cmd;
mod replay_report;
mod shm_cmd;
mod snapshot_cmd;

use std::io::IsTerminal;
use std::process::ExitCode;

/// `n` and the noun in the right number: `1 object`, `2 objects`.
pub(crate) fn count(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Writes `rows` under `titles`, columns padded; those in `left` aligned left, the rest right.
pub(crate) fn table(
    out: &mut impl std::io::Write,
    titles: &[&str],
    rows: &[Vec<String>],
    left: &[usize],
) -> std::io::Result<()> {
    let widths: Vec<usize> = (0..titles.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].chars().count())
                .chain([titles[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| -> String {
        let mut text = String::new();
        for (c, cell) in cells.into_iter().enumerate() {
            if c > 0 {
                text.push_str("  ");
            }
            let pad = " ".repeat(widths[c] - cell.chars().count());
            if left.contains(&c) {
                text.push_str(cell);
                text.push_str(&pad);
            } else {
                text.push_str(&pad);
                text.push_str(cell);
            }
        }
        text.trim_end().to_owned()
    };
    writeln!(out, "{}", line(titles.to_vec()))?;
    for row in rows {
        writeln!(out, "{}", line(row.iter().map(String::as_str).collect()))?;
    }
    Ok(())
}

/// Output cut short by the reader (`tensormem replay | head`) is not an error.
pub(crate) fn quiet_broken_pipe(result: std::io::Result<()>) -> anyhow::Result<()> {
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

use clap::{Parser, Subcommand};

/// tensormem: PyTorch's tensor-memory machinery in Rust.
#[derive(Debug, Parser)]
#[command(name = "tensormem", version, about, propagate_version = true)]
struct Cli {
    /// More diagnostics on stderr (-v: info, -vv: debug, -vvv: trace); TENSORMEM_LOG (a
    /// tracing filter such as `tensormem_shm=debug`) overrides it.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Shared memory housekeeping: list and clean up objects in /dev/shm.
    #[command(subcommand)]
    Shm(shm_cmd::ShmCommand),
    /// Replay a PyTorch allocator trace on a simulated device: the recorded configuration (checked
    /// against PyTorch's own figures) and what-if configurations.
    Replay(replay_cmd::ReplayArgs),
    /// Look at memory snapshots (PyTorch's _dump_snapshot files or tensormem's).
    #[command(subcommand)]
    Snapshot(snapshot_cmd::SnapshotCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    let result = match cli.command {
        Command::Shm(command) => shm_cmd::run(command),
        Command::Replay(args) => replay_cmd::run(args),
        Command::Snapshot(command) => snapshot_cmd::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tensormem: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Diagnostics go to stderr, so that stdout stays machine-readable (`--json`); coloured only on a
/// terminal, and not when `NO_COLOR` is set to a non-empty value (<https://no-color.org>).
fn init_tracing(verbose: u8) {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("TENSORMEM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .with_env_filter(filter)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn counts_agree_with_their_noun() {
        assert_eq!(super::count(1u64, "object", "objects"), "1 object");
        assert_eq!(super::count(0u64, "object", "objects"), "0 objects");
        assert_eq!(super::count(2u32, "process", "processes"), "2 processes");
    }
}
