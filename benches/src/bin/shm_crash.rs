//! `shm_crash`: the crash harness of tensormem-shm's sharing modes.
//!
//! For every sharing mode it runs N trials (default 1000) of a producer/consumer pair, two real
//! processes, and SIGKILLs one of them (chosen at random) at a random moment of their exchange.
//! After both are gone it lets the manager daemon do its part (managed mode), counts the
//! objects left in `/dev/shm` and the refcounted objects whose count is stuck above zero, then
//! runs `shm gc` (`tensormem_shm::housekeeping::collect_garbage`, the code behind
//! `tensormem shm gc`) and counts again. In the pool mode a surviving producer also reports the
//! leases it still counts for its dead consumer.
//!
//! ```text
//! cargo run --release -p tensormem-benches --bin shm_crash -- [--trials N] [--seed S]
//!     [--max-delay-us US] [--mode MODE]...
//! ```
//!
//! Exit status 0 when every mode ends with nothing left after the manager and gc, and the modes
//! that do not leak by design (anonymous memfd, unlinked shm, managed, pool) leave nothing even
//! before gc; 1 otherwise. The table it prints is what `docs/reliability.md` records.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tensormem_shm::housekeeping;
use tensormem_shm::manager::ManagedRegion;
use tensormem_shm::transfer::{recv_region, send_region, SendOptions};
use tensormem_shm::{
    AnonymousKind, CreateMode, MapOptions, NameGenerator, PoolConfig, PoolReceiver, PoolSender,
    ReceiverOptions, RefcountedRegion, SharedRegion, ShmName, ShmPool,
};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Data bytes of every region.
const LEN: u64 = 64 * 1024;

/// Batches the pool mode's producer sends (the first makes a region and sends its descriptor,
/// the others reuse it and travel as an id).
const POOL_BATCHES: u8 = 64;

/// The line a surviving pool producer prints: the leases it still counts for its consumer.
const STUCK_LEASES: &str = "stuck-leases";

/// The line a surviving pool producer prints: the leases it got back because its consumer died
/// holding them.
const RECLAIMED: &str = "reclaimed";

/// A sharing mode and whether it leaks by design when a process is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Sealed memfd passed over the socket (`SharedRegion::create_anonymous`).
    AnonymousMemfd,
    /// Unlinked shm object passed over the socket (`AnonymousKind::UnlinkedShm`).
    UnlinkedShm,
    /// A named object (`MapOptions::map_shm`); the producer unlinks after the consumer's ack.
    Named,
    /// `RefcountedRegion`: the last closer unlinks.
    Refcounted,
    /// `ManagedRegion`: the manager daemon unlinks when the last holder closes or dies.
    Managed,
    /// `ShmPool` batches lent through a `PoolSender` to a `PoolReceiver` (memfd regions).
    Pool,
}

const MODES: [Mode; 6] = [
    Mode::AnonymousMemfd,
    Mode::UnlinkedShm,
    Mode::Named,
    Mode::Refcounted,
    Mode::Managed,
    Mode::Pool,
];

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::AnonymousMemfd => "anonymous-memfd",
            Mode::UnlinkedShm => "unlinked-shm",
            Mode::Named => "named",
            Mode::Refcounted => "refcounted",
            Mode::Managed => "managed",
            Mode::Pool => "pool",
        }
    }

    fn parse(name: &str) -> Option<Mode> {
        MODES.into_iter().find(|m| m.name() == name)
    }

    /// Whether a killed process leaves the object behind until `shm gc` (named objects and
    /// refcounted regions without the manager, as in PyTorch).
    fn leaks_by_design(self) -> bool {
        matches!(self, Mode::Named | Mode::Refcounted)
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some("--role") {
        child(&args[1..])
    } else {
        harness(&args)
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("shm_crash: {e}");
            ExitCode::from(2)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The two sides of a trial.

/// `--role producer|consumer MODE SOCKET PREFIX`
fn child(args: &[String]) -> BoxResult<ExitCode> {
    let [role, mode, socket, prefix] = args else {
        return Err("usage: --role producer|consumer MODE SOCKET PREFIX".into());
    };
    let mode = Mode::parse(mode).ok_or("unknown mode")?;
    let names = NameGenerator::with_prefix(prefix.as_str())?;
    match role.as_str() {
        "producer" => producer(mode, Path::new(socket), &names)?,
        "consumer" => consumer(mode, Path::new(socket))?,
        _ => return Err("unknown role".into()),
    }
    Ok(ExitCode::SUCCESS)
}

fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

fn producer(mode: Mode, socket: &Path, names: &NameGenerator) -> BoxResult<()> {
    let listener = UnixListener::bind(socket)?;
    println!("ready");
    std::io::stdout().flush()?;
    let (mut stream, _) = listener.accept()?;
    let mut ack = [0u8; 1];
    match mode {
        Mode::AnonymousMemfd | Mode::UnlinkedShm => {
            let kind = if mode == Mode::AnonymousMemfd {
                AnonymousKind::Memfd
            } else {
                AnonymousKind::UnlinkedShm
            };
            let mut region = SharedRegion::create_anonymous_as(LEN, kind)?;
            region.write_at(0, &[pattern(0); 4096])?;
            send_region(&stream, &region, SendOptions::default())?;
            stream.read_exact(&mut ack)?;
        }
        Mode::Named => {
            let name = names.next_name();
            let mut region = MapOptions::new()
                .create(CreateMode::CreateExclusive)
                .len(LEN)
                .map_shm(&name)?;
            // The producer owns the name: it unlinks it whether the exchange worked or not
            // (only a kill leaves it behind).
            let exchange = (|| -> BoxResult<()> {
                region.write_at(0, &[pattern(0); 4096])?;
                send_name(&mut stream, &name)?;
                stream.read_exact(&mut ack)?;
                Ok(())
            })();
            region.unlink()?;
            exchange?;
        }
        Mode::Refcounted => {
            let name = names.next_name();
            let mut region = RefcountedRegion::create(&name, LEN)?;
            region.write_at(0, &[pattern(0); 4096])?;
            send_name(&mut stream, &name)?;
            stream.read_exact(&mut ack)?;
            region.close()?;
        }
        Mode::Managed => {
            let manager = tensormem_shm::manager::Manager::global()?;
            let mut region = ManagedRegion::create_with(&manager, names, LEN)?;
            region.write_at(0, &[pattern(0); 4096])?;
            send_name(&mut stream, region.name())?;
            stream.read_exact(&mut ack)?;
            region.close()?;
        }
        Mode::Pool => pool_producer(stream)?,
    }
    Ok(())
}

/// Lends `POOL_BATCHES` batches, waiting for each to come back; then prints how many leases it
/// still counts (all must come back when the consumer dies: the pool reclaims them when the
/// connection closes).
fn pool_producer(stream: UnixStream) -> BoxResult<()> {
    let pool = ShmPool::new(PoolConfig::default());
    let mut sender = PoolSender::new(&pool, stream)?;
    let exchange = (|| -> BoxResult<()> {
        for step in 0..POOL_BATCHES {
            let mut batch = pool.alloc(LEN)?;
            batch.fill(pattern(step.into()))?;
            sender.send(&batch, &[step])?;
            drop(batch);
            sender.wait_release(None)?;
        }
        Ok(())
    })();
    // A failed exchange: the consumer is gone, or going. Give the sender the time to see the
    // hang-up (it reads the socket within the channel's liveness interval).
    let deadline = Instant::now() + Duration::from_secs(2);
    while exchange.is_err() && sender.outstanding() > 0 && Instant::now() < deadline {
        let _ = sender.wait_release_timeout(Duration::from_millis(10));
    }
    let stuck = if pool.stats().in_use_bytes.current > 0 {
        sender.outstanding().max(1)
    } else {
        0
    };
    println!("{STUCK_LEASES} {stuck}");
    println!("{RECLAIMED} {}", sender.stats().reclaimed);
    std::io::stdout().flush()?;
    exchange
}

fn consumer(mode: Mode, socket: &Path) -> BoxResult<()> {
    let mut stream = UnixStream::connect(socket)?;
    let mut first = [0u8; 64];
    match mode {
        // The socket belongs to the pool connection: the end of the batches is the ack.
        Mode::Pool => return pool_consumer(stream),
        Mode::AnonymousMemfd | Mode::UnlinkedShm => {
            let received = recv_region(&stream, &MapOptions::new())?;
            received.region.read_at(0, &mut first)?;
        }
        Mode::Named => {
            let name = recv_name(&mut stream)?;
            let region = MapOptions::new().read_only().map_shm(&name)?;
            region.read_at(0, &mut first)?;
        }
        Mode::Refcounted => {
            let name = recv_name(&mut stream)?;
            let region = RefcountedRegion::open(&name)?;
            region.read_at(0, &mut first)?;
            region.close()?;
        }
        Mode::Managed => {
            let name = recv_name(&mut stream)?;
            let region = ManagedRegion::open(&name)?;
            region.read_at(0, &mut first)?;
            region.close()?;
        }
    }
    if first.iter().any(|&b| b != pattern(0)) {
        return Err("the consumer read other bytes than the producer wrote".into());
    }
    stream.write_all(&[1])?;
    Ok(())
}

/// Receives batches until the producer is done (or gone), checking each one's bytes.
fn pool_consumer(stream: UnixStream) -> BoxResult<()> {
    let mut receiver = PoolReceiver::new(stream, ReceiverOptions::default())?;
    loop {
        let lease = match receiver.recv() {
            Ok(lease) => lease,
            Err(tensormem_shm::Error::Disconnected) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let step = *lease
            .user_data()
            .first()
            .ok_or("a batch without its step")?;
        let mut first = [0u8; 64];
        lease.read_at(0, &mut first)?;
        if first.iter().any(|&b| b != pattern(step.into())) {
            return Err("the consumer read other bytes than the producer wrote".into());
        }
        drop(lease); // tells the producer
    }
}

fn send_name(stream: &mut UnixStream, name: &ShmName) -> BoxResult<()> {
    let bytes = name.as_str().as_bytes();
    stream.write_all(&[u8::try_from(bytes.len())?])?;
    stream.write_all(bytes)?;
    Ok(())
}

fn recv_name(stream: &mut UnixStream) -> BoxResult<ShmName> {
    let mut len = [0u8; 1];
    stream.read_exact(&mut len)?;
    let mut name = vec![0u8; usize::from(len[0])];
    stream.read_exact(&mut name)?;
    Ok(ShmName::from_bytes(&name)?)
}

// ---------------------------------------------------------------------------------------------
// The harness.

#[derive(Debug)]
struct Options {
    trials: u64,
    seed: u64,
    max_delay: Duration,
    modes: Vec<Mode>,
}

fn parse_options(args: &[String]) -> BoxResult<Options> {
    let mut options = Options {
        trials: 1000,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
        max_delay: Duration::from_millis(4),
        modes: Vec::new(),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--trials" => options.trials = value()?.parse()?,
            "--seed" => options.seed = value()?.parse()?,
            "--max-delay-us" => options.max_delay = Duration::from_micros(value()?.parse()?),
            "--mode" => {
                let name = value()?;
                options
                    .modes
                    .push(Mode::parse(name).ok_or_else(|| format!("unknown mode {name}"))?);
            }
            "-h" | "--help" => {
                return Err(
                    "usage: shm_crash [--trials N] [--seed S] [--max-delay-us US] \
                     [--mode anonymous-memfd|unlinked-shm|named|refcounted|managed|pool]..."
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if options.modes.is_empty() {
        options.modes = MODES.to_vec();
    }
    Ok(options)
}

/// What the trials of one mode left.
#[derive(Debug, Default)]
struct Tally {
    trials: u64,
    producer_killed: u64,
    /// Objects in /dev/shm after the manager, before gc.
    left_before_gc: u64,
    /// Refcounted objects whose count stayed above zero with both processes dead, before gc;
    /// in the pool mode, leases a surviving producer still counted for its dead consumer.
    stuck_before_gc: u64,
    /// Objects left after gc.
    left_after_gc: u64,
    /// Stuck refcounts after gc.
    stuck_after_gc: u64,
    /// Survivors that had to be killed because they did not finish in time.
    hangs: u64,
    /// Pool mode: consumer kills that found a batch lent (the producer reclaimed its lease).
    killed_holding: u64,
}

fn harness(args: &[String]) -> BoxResult<ExitCode> {
    let options = parse_options(args)?;
    let exe = std::env::current_exe()?;
    let work = tempdir()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed);
    eprintln!(
        "shm_crash: {} trials per mode, seed {}, kills within {:?}",
        options.trials, options.seed, options.max_delay
    );
    let mut failed = false;
    let mut rows = Vec::new();
    for mode in &options.modes {
        let prefix = format!("tmcrash-{}-{}", std::process::id(), mode.name());
        let mut tally = Tally::default();
        for trial in 0..options.trials {
            run_trial(
                *mode, &exe, &work, &prefix, trial, &mut rng, &options, &mut tally,
            )?;
        }
        let ok = tally.left_after_gc == 0
            && tally.stuck_after_gc == 0
            && tally.hangs == 0
            && (mode.leaks_by_design() || tally.left_before_gc + tally.stuck_before_gc == 0);
        failed |= !ok;
        rows.push((*mode, tally, ok));
    }
    println!(
        "| mode | trials | producer killed | consumer killed | left before gc | stuck refcounts before gc | left after manager + gc | stuck after gc | hangs | verdict |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (mode, t, ok) in &rows {
        let verdict = match (*ok, mode.leaks_by_design() && t.left_before_gc > 0) {
            (true, true) => "leaks by design until gc; 0 after gc",
            (true, false) => "0",
            (false, _) => "FAILED",
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {verdict} |",
            mode.name(),
            t.trials,
            t.producer_killed,
            t.trials - t.producer_killed,
            t.left_before_gc,
            t.stuck_before_gc,
            t.left_after_gc,
            t.stuck_after_gc,
            t.hangs
        );
    }
    for (_, t, _) in rows.iter().filter(|(mode, _, _)| *mode == Mode::Pool) {
        println!(
            "\npool: {} of {} consumer kills came while a batch was lent; the producer reclaimed \
             the lease each time",
            t.killed_holding,
            t.trials - t.producer_killed
        );
    }
    let _ = std::fs::remove_dir_all(&work);
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[allow(clippy::too_many_arguments)]
fn run_trial(
    mode: Mode,
    exe: &Path,
    work: &Path,
    prefix: &str,
    trial: u64,
    rng: &mut rand::rngs::StdRng,
    options: &Options,
    tally: &mut Tally,
) -> BoxResult<()> {
    let socket = work.join(format!("t{trial}.sock"));
    let _ = std::fs::remove_file(&socket);
    let spawn = |role: &str| -> std::io::Result<Child> {
        Command::new(exe)
            .args(["--role", role, mode.name()])
            .arg(&socket)
            .arg(prefix)
            .env("TENSORMEM_SHM_MANAGER_DIR", work.join("manager"))
            .env("TENSORMEM_SHM_MANAGER_QUIET_MS", "3000")
            .env_remove("TENSORMEM_SHM_MANAGER")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
    };
    let mut producer = spawn("producer")?;
    // Kept open until the producer is gone: it may print more than `ready`.
    let mut producer_out = BufReader::new(producer.stdout.take().ok_or("no stdout")?);
    let mut ready = String::new();
    producer_out.read_line(&mut ready)?;
    let mut consumer = spawn("consumer")?;
    let kill_producer = rng.gen_bool(0.5);
    let delay = Duration::from_nanos(rng.gen_range(0..=options.max_delay.as_nanos() as u64));
    std::thread::sleep(delay);
    let (victim, survivor) = if kill_producer {
        (&mut producer, &mut consumer)
    } else {
        (&mut consumer, &mut producer)
    };
    let _ = victim.kill();
    victim.wait()?;
    if !kill_producer {
        // A consumer killed before it connected leaves the producer in accept(): a connection
        // that closes at once lets it go on (and fail to send, as with a consumer that died).
        drop(UnixStream::connect(&socket));
    }
    if !wait_timeout(survivor, Duration::from_secs(10))? {
        tally.hangs += 1;
        let _ = survivor.kill();
        survivor.wait()?;
    }
    tally.trials += 1;
    tally.producer_killed += u64::from(kill_producer);
    // (Only a pool producer says more; in the managed mode, the daemon a producer started may
    // hold its stdout open.)
    let mut said = String::new();
    if mode == Mode::Pool {
        producer_out.read_to_string(&mut said)?;
    }
    let count_of = |key: &str| -> u64 {
        said.lines()
            .filter_map(|line| line.strip_prefix(key))
            .filter_map(|count| count.trim().parse::<u64>().ok())
            .sum()
    };
    let stuck_leases = count_of(STUCK_LEASES);
    tally.killed_holding += u64::from(count_of(RECLAIMED) > 0);

    // The manager unlinks a dead holder's names once it sees the connection close.
    let settle = if mode == Mode::Managed {
        Duration::from_secs(3)
    } else {
        Duration::ZERO
    };
    let deadline = Instant::now() + settle;
    let mut left = leftovers(prefix)?;
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
        left = leftovers(prefix)?;
    }
    tally.left_before_gc += left.len() as u64;
    tally.stuck_before_gc += stuck_refcounts(mode, &left) + stuck_leases;

    // Every process of a trial is this harness's child, in its PID namespace: gc may collect
    // even where that is not the initial one (a container).
    let options = housekeeping::GcOptions {
        dry_run: false,
        this_namespace_only: true,
    };
    let report = housekeeping::collect_garbage_with(&[prefix], options)?;
    if !report.failed.is_empty() {
        eprintln!("shm_crash: gc could not remove {:?}", report.failed);
    }
    let left = leftovers(prefix)?;
    tally.left_after_gc += left.len() as u64;
    tally.stuck_after_gc += stuck_refcounts(mode, &left);
    for path in &left {
        let _ = std::fs::remove_file(path);
    }
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// Waits for `child` up to `limit`; whether it exited.
fn wait_timeout(child: &mut Child, limit: Duration) -> std::io::Result<bool> {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait()?.is_some() {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Objects in /dev/shm whose names start with `prefix_`.
fn leftovers(prefix: &str) -> std::io::Result<Vec<PathBuf>> {
    let start = format!("{prefix}_");
    Ok(std::fs::read_dir("/dev/shm")?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&start))
        .map(|e| e.path())
        .collect())
}

/// Refcounted objects among `left` whose header still counts a holder (both processes dead).
fn stuck_refcounts(mode: Mode, left: &[PathBuf]) -> u64 {
    if mode != Mode::Refcounted {
        return 0;
    }
    left.iter()
        .filter(|path| {
            let mut header = [0u8; 4];
            std::fs::File::open(path)
                .and_then(|mut f| f.read_exact(&mut header))
                .is_ok_and(|()| i32::from_ne_bytes(header) > 0)
        })
        .count() as u64
}

/// A private directory for sockets and the manager's runtime directory (short: socket paths
/// hold at most 107 bytes).
fn tempdir() -> std::io::Result<PathBuf> {
    let dir = PathBuf::from(format!("/tmp/tmcrash-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
