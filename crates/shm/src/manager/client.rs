//! The client's side: one connection to the daemon, started on demand.

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use rustix::net::sockopt;

use super::config::{check_socket_path, prepare_dir, ManagerConfig, StartMethod};
use super::error::{ManagerError, ManagerResult};
use super::launch;
use super::protocol::{Reply, Request, PROTOCOL_VERSION};

/// Clients start a daemon at most this often while one fails to answer.
const RESPAWN_INTERVAL: Duration = Duration::from_millis(100);
/// Backoff between connection attempts grows from 1 ms up to this.
const MAX_BACKOFF: Duration = Duration::from_millis(50);

/// A connection to the shared-memory manager daemon.
///
/// The daemon counts each `Manager` as one client: the names registered through it are
/// unlinked once it is dropped or its process dies (`kill -9` included) and no other client
/// holds them. [`ManagedRegion`](super::ManagedRegion) uses a process-wide one
/// ([`Manager::global`]); embedders that need their own runtime directory connect explicitly.
///
/// Requests are serialised on the one connection; the handle is `Send + Sync`.
#[derive(Debug)]
pub struct Manager {
    stream: Mutex<UnixStream>,
    socket: std::path::PathBuf,
    daemon_pid: u32,
    owner_pid: u32,
    /// Set once a request found the connection broken (the daemon died); `global` then
    /// replaces this manager.
    broken: AtomicBool,
}

/// A snapshot of the daemon's bookkeeping ([`Manager::status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManagerStatus {
    /// Connections open now, the asking one included.
    pub clients: u32,
    /// Names held by at least one client.
    pub names: u32,
}

/// The process-wide manager, reconnected after `fork` (a child gets its own connection).
static GLOBAL: Mutex<Option<Arc<Manager>>> = Mutex::new(None);

impl Manager {
    /// Connects to the daemon of `config`'s directory, starting one if none answers.
    ///
    /// Racing callers in many processes end up on one daemon: each may start one, all but one
    /// of those step back, and every caller retries with a bounded backoff until the
    /// connect timeout.
    ///
    /// # Errors
    ///
    /// [`ManagerError::BinaryNotFound`] when a daemon is needed and none can be found,
    /// [`ManagerError::StartFailed`] when it cannot start, [`ManagerError::Unavailable`] when
    /// nothing answers in time, [`ManagerError::ForeignPeer`] or
    /// [`ManagerError::VersionMismatch`] when the socket is served by something else.
    pub fn connect(config: &ManagerConfig) -> ManagerResult<Manager> {
        let socket = config.socket_path();
        check_socket_path(&socket)?;
        prepare_dir(config.dir())?;
        let start = Instant::now();
        let deadline = start + config.connect_timeout();
        let mut backoff = Duration::from_millis(1);
        let mut last_spawn: Option<Instant> = None;
        loop {
            let last = match handshake(&socket, config.connect_timeout()) {
                Ok(manager) => return Ok(manager),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry(e)) => e,
            };
            if last_spawn.is_none_or(|t| t.elapsed() >= RESPAWN_INTERVAL) {
                start_daemon(config)?;
                last_spawn = Some(Instant::now());
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ManagerError::Unavailable {
                    socket,
                    waited: now - start,
                    last,
                });
            }
            thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// The process-wide connection, configured from the environment
    /// ([`ManagerConfig::from_env`]) on first use. A forked child gets a new connection of
    /// its own on its first call, and so does every process after its connection broke (the
    /// daemon was killed; names registered before are then no longer protected).
    ///
    /// # Errors
    ///
    /// As [`Manager::connect`], and [`ManagerError::Usage`] for a bad environment.
    pub fn global() -> ManagerResult<Arc<Manager>> {
        let mut global = GLOBAL.lock().unwrap_or_else(PoisonError::into_inner);
        let pid = current_pid();
        let usable = |m: &&Arc<Manager>| m.owner_pid == pid && !m.broken.load(Ordering::Relaxed);
        if let Some(manager) = global.as_ref().filter(usable) {
            return Ok(Arc::clone(manager));
        }
        // After fork the parent's connection is shared with the parent, and a broken one is
        // useless; drop our reference (the fd closes once the regions using it are gone).
        global.take();
        let manager = Arc::new(Manager::connect(&ManagerConfig::from_env()?)?);
        *global = Some(Arc::clone(&manager));
        Ok(manager)
    }

    /// The daemon's process id, as it reported in its welcome.
    pub fn daemon_pid(&self) -> u32 {
        self.daemon_pid
    }

    /// The socket this manager is connected to.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Registers a name this client is about to create: from now on the daemon unlinks it
    /// when this client dies, unless another live client holds it. Register before creating
    /// the object so that a crash in between leaks nothing.
    ///
    /// # Errors
    ///
    /// [`ManagerError::Refused`] for a malformed name, [`ManagerError::Disconnected`] when the
    /// daemon is gone.
    pub fn register_new(&self, name: &str) -> ManagerResult<()> {
        self.register(name, false)
    }

    /// Registers a name that must already exist (this client is about to open it).
    ///
    /// # Errors
    ///
    /// [`ManagerError::Refused`] when no such object exists (its last holder released it),
    /// [`ManagerError::Disconnected`] when the daemon is gone.
    pub fn register_existing(&self, name: &str) -> ManagerResult<()> {
        self.register(name, true)
    }

    fn register(&self, name: &str, must_exist: bool) -> ManagerResult<()> {
        let request = Request::Register {
            name: name.to_owned(),
            must_exist,
        };
        match self.round_trip(&request)? {
            Reply::Registered => Ok(()),
            other => Err(unexpected(name, other)),
        }
    }

    /// Drops one hold of `name` by this client. When it was the last hold of any client, the
    /// daemon unlinks the object and this returns `true`.
    ///
    /// # Errors
    ///
    /// [`ManagerError::Disconnected`] when the daemon is gone.
    pub fn release(&self, name: &str) -> ManagerResult<bool> {
        let request = Request::Release {
            name: name.to_owned(),
        };
        match self.round_trip(&request)? {
            Reply::Released { unlinked } => Ok(unlinked),
            other => Err(unexpected(name, other)),
        }
    }

    /// Tells the daemon that `name` was unlinked by this client: it drops the name for every
    /// holder and will not unlink it.
    ///
    /// # Errors
    ///
    /// [`ManagerError::Disconnected`] when the daemon is gone.
    pub fn forget(&self, name: &str) -> ManagerResult<()> {
        let request = Request::Forget {
            name: name.to_owned(),
        };
        match self.round_trip(&request)? {
            Reply::Forgotten => Ok(()),
            other => Err(unexpected(name, other)),
        }
    }

    /// What the daemon tracks right now.
    ///
    /// # Errors
    ///
    /// [`ManagerError::Disconnected`] when the daemon is gone.
    pub fn status(&self) -> ManagerResult<ManagerStatus> {
        match self.round_trip(&Request::Status)? {
            Reply::Status { clients, names } => Ok(ManagerStatus { clients, names }),
            other => Err(unexpected("status", other)),
        }
    }

    fn round_trip(&self, request: &Request) -> ManagerResult<Reply> {
        let stream = self.stream.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: &UnixStream = &stream;
        let broken = |e: io::Error| {
            self.broken.store(true, Ordering::Relaxed);
            ManagerError::Disconnected(e)
        };
        request
            .write_to(&mut out)
            .and_then(|()| out.flush())
            .map_err(broken)?;
        let mut input: &UnixStream = &stream;
        Reply::read_from(&mut input).map_err(|e| {
            if e.kind() == io::ErrorKind::InvalidData {
                ManagerError::Protocol(e.to_string())
            } else {
                broken(e)
            }
        })
    }
}

fn unexpected(name: &str, reply: Reply) -> ManagerError {
    match reply {
        Reply::Refused { message } => ManagerError::Refused {
            name: name.to_owned(),
            message,
        },
        other => ManagerError::Protocol(format!("unexpected reply {other:?}")),
    }
}

fn current_pid() -> u32 {
    rustix::process::getpid()
        .as_raw_nonzero()
        .get()
        .unsigned_abs()
}

/// Outcome of one connection attempt that did not work out.
enum Attempt {
    /// Nobody answers (yet): start a daemon or wait.
    Retry(io::Error),
    /// Something answers that we must not use.
    Fatal(ManagerError),
}

/// Connects, checks the daemon's uid, and exchanges hello/welcome.
fn handshake(socket: &Path, timeout: Duration) -> Result<Manager, Attempt> {
    let stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => Attempt::Retry(e),
        _ => Attempt::Fatal(ManagerError::io(
            format!("cannot connect to {}", socket.display()),
            e,
        )),
    })?;
    let own_uid = rustix::process::getuid();
    let cred = sockopt::socket_peercred(&stream).map_err(|e| {
        Attempt::Fatal(ManagerError::io(
            format!("cannot read SO_PEERCRED of {}", socket.display()),
            e,
        ))
    })?;
    if cred.uid != own_uid {
        return Err(Attempt::Fatal(ManagerError::ForeignPeer {
            socket: socket.to_owned(),
            peer_uid: cred.uid.as_raw(),
            own_uid: own_uid.as_raw(),
        }));
    }
    // A daemon that accepted but wedged must not hang us forever.
    let io_fatal = |e: io::Error| {
        Attempt::Fatal(ManagerError::io(
            format!("cannot configure the socket to {}", socket.display()),
            e,
        ))
    };
    stream.set_read_timeout(Some(timeout)).map_err(io_fatal)?;
    let owner_pid = current_pid();
    let hello = Request::Hello {
        version: PROTOCOL_VERSION,
        pid: owner_pid,
    };
    let mut out: &UnixStream = &stream;
    let welcome = hello
        .write_to(&mut out)
        .and_then(|()| Reply::read_from(&mut &stream));
    let daemon_pid = match welcome {
        Ok(Reply::Welcome { version, pid }) if version == PROTOCOL_VERSION => pid,
        Ok(Reply::Welcome { version, .. }) => {
            return Err(Attempt::Fatal(ManagerError::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: version,
            }))
        }
        Ok(other) => {
            return Err(Attempt::Fatal(ManagerError::Protocol(format!(
                "expected welcome, got {other:?}"
            ))))
        }
        // A daemon that is exiting resets connections still in its backlog.
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe
            ) =>
        {
            return Err(Attempt::Retry(e))
        }
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            return Err(Attempt::Fatal(ManagerError::Protocol(e.to_string())))
        }
        Err(e) => {
            return Err(Attempt::Fatal(ManagerError::io(
                format!("no welcome from {}", socket.display()),
                e,
            )))
        }
    };
    Ok(Manager {
        stream: Mutex::new(stream),
        socket: socket.to_owned(),
        daemon_pid,
        owner_pid,
        broken: AtomicBool::new(false),
    })
}

/// Runs a launcher (see [`super::launch`]: the configured binary, this program's own image, or a
/// binary found next to it or in `PATH`), which returns once a daemon listens (this one or a
/// racing one).
fn start_daemon(config: &ManagerConfig) -> ManagerResult<()> {
    let forked = |required: bool| -> ManagerResult<Option<(String, String)>> {
        Ok(launch::fork_daemon(config, required)?.map(|line| (line, String::new())))
    };
    let (first, stderr, binary) = if config.start_method() == StartMethod::Fork {
        let (line, err) = forked(true)?.unwrap_or_default();
        (line, err, launch::describe_self())
    } else if let Some(binary) = config.configured_binary() {
        run_launcher(binary_launcher(config, binary)?, binary)?
    } else if let Some(command) = launch::self_launcher(config) {
        run_launcher(command, &launch::describe_self())?
    } else if let Some((line, err)) = forked(false)? {
        (line, err, launch::describe_self())
    } else {
        let binary = config.locate_binary()?;
        run_launcher(binary_launcher(config, &binary)?, &binary)?
    };
    if first.starts_with("ready") || first == "running" {
        return Ok(());
    }
    let mut message = stderr.trim().to_owned();
    if message.is_empty() {
        message = match first.strip_prefix("error ") {
            Some(error) => error.to_owned(),
            None if first.is_empty() => "the daemon exited before it listened".to_owned(),
            None => first,
        };
    }
    Err(ManagerError::StartFailed { binary, message })
}

/// Runs a launcher and returns the first line of its stdout (or a description of its failure),
/// its stderr, and the image it ran.
fn run_launcher(
    mut command: Command,
    image: &Path,
) -> ManagerResult<(String, String, std::path::PathBuf)> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    tracing::debug!(image = %image.display(), "starting shm manager");
    let output = command.output().map_err(|source| ManagerError::Spawn {
        binary: image.to_owned(),
        source,
    })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut first = stdout.lines().next().unwrap_or("").to_owned();
    if !output.status.success() && !first.starts_with("error ") {
        first = format!("{} (exit status {})", stdout.trim(), output.status);
    }
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    Ok((first, stderr, image.to_owned()))
}

/// `BINARY --daemonize --dir D --quiet-ms MS [--log F]`.
fn binary_launcher(config: &ManagerConfig, binary: &Path) -> ManagerResult<Command> {
    let binary = config.check_binary(binary)?;
    let mut command = Command::new(binary);
    command.arg("--daemonize").args(config.daemon_args());
    if let Some(log) = config.log_file() {
        command.arg("--log").arg(log);
    }
    Ok(command)
}
