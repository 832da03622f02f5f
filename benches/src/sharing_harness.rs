//! What the sharing benchmarks (`shm_bench`, `shm_pool_bench`, `storage_pool_bench`,
//! `storage_round_trip`, the criterion bench `shm_round_trip`) have in common: their command-line
//! options, the consumer process (the benchmark's own executable run again, connected over a
//! Unix socket), the tag a pooled round trip's message carries, and their medians and rows.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Duration;

use tensormem_shm::transfer::RecvOptions;

/// The sizes of the round-trip rows, in bytes: 4 KiB, 1 MiB, 64 MiB.
pub const ROUND_TRIP_SIZES: [usize; 3] = [4 << 10, 1 << 20, 64 << 20];
/// The sizes of the `share_memory_` rows, in bytes: 64 MiB, 1 GiB.
pub const COPY_SIZES: [usize; 2] = [64 << 20, 1 << 30];
/// Untimed round trips before the timed ones of each row.
pub const WARM_UP: usize = 50;

/// What a benchmark's steps return: any error ends the run with its message.
pub type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The exit code of a benchmark's run; an error is printed first as `BENCH: ERROR`.
pub fn exit_code(bench: &str, result: BenchResult<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{bench}: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Which options a benchmark takes beyond `--rounds N`, `--spin-us N` and `--no-copy`.
#[derive(Debug, Clone, Copy)]
pub struct OptionSet {
    /// The usage line errors repeat.
    pub usage: &'static str,
    /// `--copies N`, if taken: its default and its least value.
    pub copies: Option<Copies>,
    /// Whether `--same-cpu` is taken.
    pub same_cpu: bool,
}

/// The `--copies N` option: how many timed copies per size.
#[derive(Debug, Clone, Copy)]
pub struct Copies {
    /// Without the option.
    pub default: usize,
    /// A smaller value given is raised to this.
    pub min: usize,
}

/// A sharing benchmark's options, as parsed by [`Options::parse`].
#[derive(Debug, Clone)]
pub struct Options {
    /// `--rounds N`: timed round trips per row (default 1000, at least 1), after the warm-up.
    pub rounds: usize,
    /// `--spin-us N`: how long the spinning rows poll before blocking (default 200 µs).
    pub spin: Duration,
    /// `--copies N`: timed copies per size (0 where the benchmark takes no `--copies`).
    pub copies: usize,
    /// Whether to run the copy section (`--no-copy` turns it off).
    pub copy: bool,
    /// `--same-cpu`: measure again with both processes on one CPU.
    pub same_cpu: bool,
}

impl Options {
    /// Parses `args` (without the program name), taking what `set` says.
    ///
    /// # Errors
    /// An option that is not taken, one without its value, or a value that is not a whole number,
    /// with the usage line.
    pub fn parse(args: &[String], set: &OptionSet) -> BenchResult<Self> {
        let usage = set.usage;
        let mut parsed = Options {
            rounds: 1000,
            spin: Duration::from_micros(200),
            copies: set.copies.map_or(0, |copies| copies.default),
            copy: true,
            same_cpu: false,
        };
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            let mut value = || -> BenchResult<u64> {
                let value = iter
                    .next()
                    .ok_or_else(|| format!("{arg} needs a value; usage: {usage}"))?;
                value.parse().map_err(|_| {
                    format!("{arg} needs a whole number, not {value:?}; usage: {usage}").into()
                })
            };
            match (arg.as_str(), set.copies) {
                ("--rounds", _) => parsed.rounds = value()?.max(1) as usize,
                ("--spin-us", _) => parsed.spin = Duration::from_micros(value()?),
                ("--copies", Some(copies)) => {
                    parsed.copies = (value()? as usize).max(copies.min);
                }
                ("--no-copy", _) => parsed.copy = false,
                ("--same-cpu", _) if set.same_cpu => parsed.same_cpu = true,
                _ => return Err(format!("unknown argument {arg}; usage: {usage}").into()),
            }
        }
        Ok(parsed)
    }

    /// How many timed copies of `len` bytes: [`Options::copies`], fewer (half, at least 3) from
    /// 1 GiB on.
    pub fn copy_runs(&self, len: usize) -> usize {
        if len >= 1 << 30 {
            self.copies.div_ceil(2).max(3)
        } else {
            self.copies
        }
    }
}

/// A consumer process: this executable run again, connected to this one over a Unix socket
/// bound in a directory of its own (removed by [`Consumer::finish`]).
#[derive(Debug)]
pub struct Consumer {
    child: Child,
    socket: UnixStream,
    dir: PathBuf,
}

impl Consumer {
    /// Runs this executable again (stdin closed), `tell` adding to its command line or
    /// environment the path of the socket to connect to; returns once it has connected. `name`
    /// names the socket's directory (with this process's id).
    ///
    /// # Errors
    /// The directory, the socket or the process could not be made.
    pub fn spawn(name: &str, tell: impl FnOnce(&mut Command, &Path)) -> BenchResult<Self> {
        let dir = std::env::temp_dir().join(format!("tensormem-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("s.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        let mut command = Command::new(std::env::current_exe()?);
        command.stdin(Stdio::null());
        tell(&mut command, &path);
        let child = command.spawn()?;
        let (socket, _) = listener.accept()?;
        Ok(Self { child, socket, dir })
    }

    /// The consumer in `role`: this executable run as `EXE ROLE SOCKET EXTRA...`.
    ///
    /// # Errors
    /// As [`Consumer::spawn`].
    pub fn spawn_role(bench: &str, role: &str, extra: &[String]) -> BenchResult<Self> {
        let name = format!("{bench}-{}", role.trim_start_matches('-'));
        Self::spawn(&name, |command, path| {
            command.arg(role).arg(path).args(extra);
        })
    }

    /// This end of the connection.
    pub fn socket(&self) -> &UnixStream {
        &self.socket
    }

    /// Hangs up, waits for the consumer to exit and removes the socket's directory.
    ///
    /// # Errors
    /// The consumer could not be waited for, or it failed.
    pub fn finish(mut self) -> BenchResult<()> {
        drop(self.socket);
        let status = self.child.wait()?;
        let _ = std::fs::remove_dir_all(&self.dir);
        if !status.success() {
            return Err(format!("consumer failed: {status}").into());
        }
        Ok(())
    }
}

/// The user data of a pooled round trip's message (5 bytes): how long the consumer spins for
/// the next message (µs, a little-endian `u32`), then the value the buffer's first and last
/// byte hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundTripTag {
    /// How long the consumer polls for the next message before blocking, in µs.
    pub spin_us: u32,
    /// The value of the first and last byte.
    pub value: u8,
}

impl RoundTripTag {
    /// The tag telling the consumer to wait for the next message as `recv` does.
    pub fn new(recv: RecvOptions, value: u8) -> Self {
        Self {
            spin_us: u32::try_from(recv.spin.as_micros()).unwrap_or(u32::MAX),
            value,
        }
    }

    /// The user data that carries the tag.
    pub fn to_bytes(self) -> [u8; 5] {
        let mut user = [0u8; 5];
        user[..4].copy_from_slice(&self.spin_us.to_le_bytes());
        user[4] = self.value;
        user
    }

    /// The tag at the start of `user`.
    ///
    /// # Errors
    /// `user` is shorter than a tag.
    pub fn from_bytes(user: &[u8]) -> BenchResult<Self> {
        let Some(&[a, b, c, d, value]) = user.get(..5) else {
            return Err(format!("user data of {} bytes carries no tag", user.len()).into());
        };
        Ok(Self {
            spin_us: u32::from_le_bytes([a, b, c, d]),
            value,
        })
    }

    /// Checks the first and last byte read against the tag's value.
    ///
    /// # Errors
    /// Either differs.
    pub fn check(self, first: u8, last: u8) -> BenchResult<()> {
        if first != self.value || last != self.value {
            return Err(format!("read {first}/{last}, expected {}", self.value).into());
        }
        Ok(())
    }

    /// How the consumer waits for the next message.
    pub fn next_recv(self) -> RecvOptions {
        RecvOptions::spinning(Duration::from_micros(self.spin_us.into()))
    }
}

/// The median of `times` in µs (sorts them).
///
/// # Panics
/// `times` is empty.
pub fn median_us(times: &mut [Duration]) -> f64 {
    times.sort_unstable();
    times[times.len() / 2].as_secs_f64() * 1e6
}

/// Prints the row `LABEL,cpu,LEN,US  (GB/s)` of a copy of `len` bytes, `US` the median of
/// `times`; returns it.
pub fn print_copy(label: &str, len: usize, times: &mut [Duration]) -> f64 {
    let us = median_us(times);
    println!(
        "{label},cpu,{len},{us:.1}  ({:.2} GB/s)",
        len as f64 / (us * 1e-6) / 1e9
    );
    us
}
