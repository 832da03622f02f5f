//! Small messages between two processes on a shared-memory channel, and a descriptor beside them.
//!
//! Run `cargo run -p tensormem-shm --example channel`. The parent starts this program again as the
//! child with one end of a Unix socket pair as its standard input. The parent creates the channel
//! (a sealed memfd sent over the socket), the child accepts it; then they play ping-pong on the
//! rings (no system call while the other side is awake), and the parent sends a region's
//! descriptor with a message ([`Channel::send_with_fd`]).
//!
//! Needs only `tensormem-shm = { path = ... }` (no features: the manager is not needed).

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::process::{Command, ExitCode, Stdio};

use tensormem_shm::channel::{Channel, ChannelOptions, MAX_MESSAGE};
use tensormem_shm::{MapOptions, SharedRegion};

const ROUNDS: u32 = 10_000;

/// An error ends the program with its message on one line of stderr and exit status 1, as the
/// `tensormem` command prints its errors (`main` returning the error would print its `Debug` form).
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("channel: error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("child") {
        return child();
    }
    let (ours, theirs) = UnixStream::pair()?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("child")
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
        .spawn()?;
    let mut channel = Channel::create(ours, ChannelOptions::default())?;

    let mut buf = [0u8; MAX_MESSAGE];
    for i in 0..ROUNDS {
        channel.send(&i.to_le_bytes())?;
        let n = channel.recv(&mut buf)?;
        assert_eq!(&buf[..n], &(i + 1).to_le_bytes());
    }

    // A descriptor travels on the socket, announced by a ring message.
    let region = SharedRegion::copy_from_bytes(b"a region the child maps")?;
    let fd = region
        .fd()
        .expect("anonymous regions keep their descriptor");
    channel.send_with_fd(b"region", fd)?;
    let n = channel.recv(&mut buf)?;
    assert_eq!(&buf[..n], b"mapped");

    drop(channel); // the child's next receive reports the end
    assert!(child.wait()?.success(), "the child failed");
    println!("parent: {ROUNDS} round trips, then a descriptor sent beside a message");
    Ok(())
}

fn child() -> Result<(), Box<dyn std::error::Error>> {
    let socket = std::io::stdin().as_fd().try_clone_to_owned()?;
    let mut channel = Channel::accept(socket, ChannelOptions::default())?;
    let mut buf = [0u8; MAX_MESSAGE];
    for _ in 0..ROUNDS {
        let n = channel.recv(&mut buf)?;
        let i = u32::from_le_bytes(buf[..n].try_into()?);
        channel.send(&(i + 1).to_le_bytes())?;
    }
    let received = channel.recv_with_fd(&mut buf)?;
    assert_eq!(&buf[..received.len], b"region");
    let fd = received.fd.ok_or("the message announced a descriptor")?;
    // The descriptor is checked (kind, owner, size) before it is mapped.
    let region = MapOptions::new().map_fd(&fd)?;
    assert_eq!(region.to_vec()?, b"a region the child maps");
    channel.send(b"mapped")?;
    match channel.recv(&mut buf) {
        Err(tensormem_shm::Error::PeerGone) => Ok(()),
        other => Err(format!("expected the parent to be gone, got {other:?}").into()),
    }
}
