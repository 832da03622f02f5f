//! Sharing between real processes: this test binary re-executes itself as the other process,
//! selecting the child's role with an environment variable (hence its own `main`, no libtest).
//!
//! Run with `cargo test -p tensormem-shm --test processes [-- FILTER]`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{ChildStdin, ChildStdout, Stdio};

use common::UnlinkOnDrop;
use tensormem_shm::transfer::{recv_region, send_region, SendOptions};
use tensormem_shm::{
    CreateMode, Error, MapOptions, NameGenerator, RefcountedRegion, SharedRegion, ShmName,
};
use tensormem_test_support::child::{self, Peer};
use tensormem_test_support::harness::{self, RoleResult, Test};

const ROLE: &str = "TENSORMEM_SHM_TEST_ROLE";
const SOCKET: &str = "TENSORMEM_SHM_TEST_SOCKET";
const NAME: &str = "TENSORMEM_SHM_TEST_NAME";
const INDEX: &str = "TENSORMEM_SHM_TEST_INDEX";

const TESTS: &[Test] = &[
    (
        "producer_passes_region_to_consumer",
        producer_passes_region_to_consumer,
    ),
    (
        "refcount_across_three_processes_last_closer_unlinks",
        refcount_across_three_processes_last_closer_unlinks,
    ),
    (
        "truncation_after_sharing_is_refused_at_attach",
        truncation_after_sharing_is_refused_at_attach,
    ),
    (
        "named_region_opened_by_another_process",
        named_region_opened_by_another_process,
    ),
    #[cfg(feature = "manager")]
    (
        "a_single_threaded_client_forks_a_clean_daemon",
        a_single_threaded_client_forks_a_clean_daemon,
    ),
];

fn main() {
    harness::main(ROLE, run_role, TESTS, None);
}

// ---------------------------------------------------------------------------------------------
// Parent side

/// A child process of this binary in `role`; killed if the test panics before it exits.
struct ChildProc {
    child: Peer,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl ChildProc {
    fn spawn(role: &str, env: &[(&str, &str)]) -> Self {
        let mut command = child::this_binary();
        command.env(ROLE, role).stdin(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let (mut child, stdout) = child::spawn(&mut command);
        let stdin = child.stdin.take();
        Self {
            child,
            stdin,
            stdout,
        }
    }

    fn say(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn hear(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "child exited without answering");
        line.trim_end().to_owned()
    }

    fn wait_success(mut self) {
        self.stdin.take();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "child failed: {status}");
    }
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

fn listener() -> (tempfile::TempDir, UnixListener, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region.sock");
    let listener = UnixListener::bind(&path).unwrap();
    (dir, listener, path.to_str().unwrap().to_owned())
}

fn producer_passes_region_to_consumer() {
    let (_dir, listener, path) = listener();
    let child = ChildProc::spawn("consumer", &[(SOCKET, &path)]);
    let (mut socket, _) = listener.accept().unwrap();

    let len = (3 << 20) + 123;
    let data: Vec<u8> = (0..len).map(pattern).collect();
    let region = SharedRegion::copy_from_bytes(&data).unwrap();
    let options = SendOptions {
        user: b"pattern",
        read_only: false,
    };
    send_region(&socket, &region, options).unwrap();

    let mut ack = [0u8; 1];
    socket.read_exact(&mut ack).unwrap();
    assert_eq!(ack, [b'k']);
    // The consumer's writes are visible here: same physical memory.
    assert_eq!(&region.to_vec().unwrap()[..17], b"consumer was here");
    assert_eq!(region.to_vec().unwrap()[len - 1], 0x5a);
    assert_eq!(region.to_vec().unwrap()[17], pattern(17));
    child.wait_success();
}

fn refcount_across_three_processes_last_closer_unlinks() {
    let name = NameGenerator::with_prefix("tmtest").unwrap().next_name();
    let path = name.path();
    let _cleanup = UnlinkOnDrop(name.clone());
    let mut creator = RefcountedRegion::create(&name, 4096).unwrap();
    creator.write_at(0, &[0xee]).unwrap();
    assert_eq!(creator.refcount(), 1);

    let mut holders: Vec<ChildProc> = (1..=2)
        .map(|i| {
            let index = i.to_string();
            let mut child =
                ChildProc::spawn("refcount_holder", &[(NAME, name.as_str()), (INDEX, &index)]);
            assert_eq!(child.hear(), format!("opened {}", i + 1));
            child
        })
        .collect();
    assert_eq!(creator.refcount(), 3);
    assert_eq!(&creator.to_vec().unwrap()[..3], &[0xee, 1, 2]);

    // The creator leaves first: the name must survive while the children hold it.
    assert!(!creator.close().unwrap());
    assert!(
        path.exists(),
        "{} vanished while still referenced",
        path.display()
    );

    holders[0].say("close");
    assert_eq!(holders[0].hear(), "closed unlinked=false");
    assert!(path.exists());

    holders[1].say("close");
    assert_eq!(holders[1].hear(), "closed unlinked=true");
    assert!(
        !path.exists(),
        "last closer did not unlink {}",
        path.display()
    );
    for holder in holders {
        holder.wait_success();
    }
}

fn truncation_after_sharing_is_refused_at_attach() {
    let (_dir, listener, path) = listener();
    let mut child = ChildProc::spawn("late_consumer", &[(SOCKET, &path)]);
    let (socket, _) = listener.accept().unwrap();

    // A named (so unsealed) object, as PyTorch's fd strategy makes them.
    let name = NameGenerator::with_prefix("tmtest").unwrap().next_name();
    let _cleanup = UnlinkOnDrop(name.clone());
    let mut region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(1 << 20)
        .keep_fd(true)
        .unlink_after_map(true)
        .map_shm(&name)
        .unwrap();
    assert!(!name.path().exists());
    send_region(&socket, &region, SendOptions::default()).unwrap();
    // The producer shrinks the object after sending it, before the consumer attaches.
    rustix::fs::ftruncate(region.take_fd().unwrap(), 4096).unwrap();
    child.say("go");
    assert_eq!(child.hear(), "too_small actual=4096 needed=1048576");
    child.wait_success();
}

fn named_region_opened_by_another_process() {
    let name = NameGenerator::default().next_name();
    let _cleanup = UnlinkOnDrop(name.clone());
    let mut region = MapOptions::new()
        .create(CreateMode::CreateExclusive)
        .len(8192)
        .map_shm(&name)
        .unwrap();
    region.write_at(8191, &[7]).unwrap();
    let mut child = ChildProc::spawn("named_reader", &[(NAME, name.as_str())]);
    assert_eq!(child.hear(), "len=8192 last=7");
    assert_eq!(
        region.to_vec().unwrap()[0],
        9,
        "the child's write is visible"
    );
    child.wait_success();
    region.unlink().unwrap();
    assert!(!name.path().exists());
}

// ---------------------------------------------------------------------------------------------
// Child side

fn run_role(role: &str) -> RoleResult {
    match role {
        "consumer" => consumer(),
        "refcount_holder" => refcount_holder(),
        "late_consumer" => late_consumer(),
        "named_reader" => named_reader(),
        other => Err(format!("unknown role {other}").into()),
    }
}

fn env(key: &str) -> Result<String, Box<dyn std::error::Error>> {
    std::env::var(key).map_err(|_| format!("{key} not set").into())
}

fn stdin_line() -> String {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    line.trim_end().to_owned()
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

fn consumer() -> RoleResult {
    let mut socket = UnixStream::connect(Path::new(&env(SOCKET)?))?;
    let mut received = recv_region(&socket, &MapOptions::new())?;
    if received.user_data() != b"pattern" {
        return Err("wrong user data".into());
    }
    let bytes = received.region.to_vec()?;
    if let Some(i) = (0..bytes.len()).find(|&i| bytes[i] != pattern(i)) {
        return Err(format!("byte {i} is {} not {}", bytes[i], pattern(i)).into());
    }
    let last = bytes.len() - 1;
    received.region.write_at(0, b"consumer was here")?;
    received.region.write_at(last, &[0x5a])?;
    socket.write_all(b"k")?;
    Ok(())
}

fn refcount_holder() -> RoleResult {
    let name = ShmName::new(env(NAME)?)?;
    let index: usize = env(INDEX)?.parse()?;
    let mut region = RefcountedRegion::open(&name)?;
    region.write_at(index, &[index as u8])?;
    say(&format!("opened {}", region.refcount()));
    if stdin_line() != "close" {
        return Err("expected close".into());
    }
    let unlinked = region.close()?;
    say(&format!("closed unlinked={unlinked}"));
    Ok(())
}

fn late_consumer() -> RoleResult {
    let socket = UnixStream::connect(Path::new(&env(SOCKET)?))?;
    if stdin_line() != "go" {
        return Err("expected go".into());
    }
    match recv_region(&socket, &MapOptions::new()) {
        Err(Error::TooSmall { actual, needed, .. }) => {
            say(&format!("too_small actual={actual} needed={needed}"));
            Ok(())
        }
        Err(other) => Err(format!("expected TooSmall, got {other}").into()),
        Ok(_) => Err("a truncated region was attached".into()),
    }
}

fn named_reader() -> RoleResult {
    let name = ShmName::new(env(NAME)?)?;
    let mut region = MapOptions::new().map_shm(&name)?;
    let last = region.to_vec().unwrap()[region.len() - 1];
    region.write_at(0, &[9])?;
    say(&format!("len={} last={last}", region.len()));
    Ok(())
}

#[cfg(feature = "manager")]
/// This harness runs tests on its one thread, so the manager's fork path (for programs whose
/// image cannot run the daemon) can be exercised here: a daemon forked without `exec` that holds
/// none of the client's descriptors or shared mappings and serves like any other.
fn a_single_threaded_client_forks_a_clean_daemon() {
    use std::sync::Arc;
    use tensormem_shm::manager::{ManagedRegion, Manager, ManagerConfig, StartMethod};

    let dir = tempfile::Builder::new()
        .prefix("tmfork")
        .tempdir_in("/tmp")
        .unwrap();
    // Something of the client's the daemon must not keep: a shared mapping and an open file.
    let client_region = SharedRegion::create_anonymous(1 << 20).unwrap();
    let marker = dir.path().join("client-file");
    let _client_file = std::fs::File::create(&marker).unwrap();
    // Unflushed client output must not reach the daemon's report pipe.
    print!("unflushed client output ");

    let config = ManagerConfig::new(dir.path())
        .with_start(StartMethod::Fork)
        .with_quiet_period(std::time::Duration::from_millis(300))
        .with_log_file(dir.path().join("daemon.log"));
    let manager = Arc::new(Manager::connect(&config).unwrap());
    let daemon = manager.daemon_pid();
    assert_ne!(daemon, std::process::id());
    let comm = std::fs::read_to_string(format!("/proc/{daemon}/comm")).unwrap();
    assert_eq!(comm.trim_end(), "tm-shm-manager");
    let maps = std::fs::read_to_string(format!("/proc/{daemon}/maps")).unwrap();
    assert!(
        !maps.lines().any(|l| l.contains("memfd:tensormem")),
        "the daemon kept the client's shared memory mapped:\n{maps}"
    );
    let fds: Vec<std::path::PathBuf> = std::fs::read_dir(format!("/proc/{daemon}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect();
    assert!(
        !fds.contains(&marker),
        "the daemon kept the client's file open: {fds:?}"
    );

    let names = NameGenerator::with_prefix("tmfork").unwrap();
    let region = ManagedRegion::create_with(&manager, &names, 4096).unwrap();
    let name = region.name().clone();
    assert!(name.path().exists());
    assert!(region.close().unwrap(), "the daemon unlinked the last hold");
    assert!(!name.path().exists());
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert!(log.contains("shm manager started"), "{log}");
    drop(manager);
    // It exits after its quiet period, removing its socket.
    let socket = dir.path().join("manager.sock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while socket.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        !socket.exists(),
        "the forked daemon did not exit after its quiet period"
    );
    drop(client_region);
}
