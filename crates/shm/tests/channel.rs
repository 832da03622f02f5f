//! The shared-memory channel within one process (two threads, or one thread and a hostile
//! "peer" that writes the shared memory itself). Across processes: `tests/channel_processes.rs`.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tensormem_shm::channel::{Channel, ChannelOptions, MAX_MESSAGE};
use tensormem_shm::Error;

fn options(slots: u32) -> ChannelOptions {
    ChannelOptions {
        slots,
        ..ChannelOptions::default()
    }
}

/// Message `i`: its length and bytes are a function of `i`.
fn message(i: u32) -> Vec<u8> {
    let len = (i as usize * 37) % (MAX_MESSAGE + 1);
    (0..len).map(|k| (i as usize + k * 7) as u8).collect()
}

#[test]
fn messages_arrive_in_order_through_a_small_ring_between_threads() {
    let (a, b) = Channel::pair(options(4)).unwrap();
    let (mut tx, _a_rx) = a.split();
    let (_b_tx, mut rx) = b.split();
    const N: u32 = 5_000;
    let sender = std::thread::spawn(move || {
        for i in 0..N {
            tx.send(&message(i)).unwrap();
        }
        tx
    });
    let mut buf = [0u8; MAX_MESSAGE];
    for i in 0..N {
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], &message(i)[..], "message {i}");
    }
    drop(sender.join().unwrap());
}

#[test]
fn a_full_ring_refuses_try_send_until_a_message_is_taken() {
    let (mut a, mut b) = Channel::pair(options(4)).unwrap();
    for i in 0..4u8 {
        assert!(a.try_send(&[i]).unwrap());
    }
    assert!(!a.try_send(&[9]).unwrap(), "four slots are taken");
    let mut buf = [0u8; 8];
    assert_eq!(b.try_recv(&mut buf).unwrap(), Some(1));
    assert_eq!(buf[0], 0);
    assert!(a.try_send(&[4]).unwrap());
    for expected in 1..=4u8 {
        assert_eq!(b.recv(&mut buf).unwrap(), 1);
        assert_eq!(buf[0], expected);
    }
    assert_eq!(b.try_recv(&mut buf).unwrap(), None);
    assert_eq!(
        b.recv_timeout(&mut buf, Duration::from_millis(5)).unwrap(),
        None
    );
}

#[test]
fn lengths_are_checked_and_a_short_buffer_keeps_the_message() {
    let (mut a, mut b) = Channel::pair(options(8)).unwrap();
    assert!(matches!(
        a.send(&[0u8; MAX_MESSAGE + 1]),
        Err(Error::MessageTooLarge { len, max }) if len == MAX_MESSAGE + 1 && max == MAX_MESSAGE
    ));
    a.send(&[5u8; 100]).unwrap();
    a.send(&[]).unwrap();
    let mut small = [0u8; 10];
    assert!(matches!(
        b.recv(&mut small),
        Err(Error::BufferTooSmall {
            needed: 100,
            len: 10
        })
    ));
    let mut buf = [0u8; MAX_MESSAGE];
    assert_eq!(b.recv(&mut buf).unwrap(), 100);
    assert_eq!(&buf[..100], &[5u8; 100]);
    assert_eq!(b.recv(&mut small).unwrap(), 0, "an empty message");
}

#[test]
fn a_dropped_peer_leaves_its_messages_then_peer_gone() {
    let (mut a, mut b) = Channel::pair(options(8)).unwrap();
    a.send(b"last words").unwrap();
    drop(a);
    let mut buf = [0u8; 64];
    assert_eq!(b.recv(&mut buf).unwrap(), 10);
    assert!(matches!(b.recv(&mut buf), Err(Error::PeerGone)));
    assert!(matches!(b.try_recv(&mut buf), Err(Error::PeerGone)));
    assert!(matches!(b.send(b"anyone?"), Err(Error::PeerGone)));
    assert!(!b.is_peer_alive());
}

#[test]
fn dropping_the_peer_wakes_a_receiver_asleep_with_no_liveness_polling() {
    let slow = ChannelOptions {
        slots: 1,
        liveness_interval: Duration::from_secs(3600),
        ..ChannelOptions::default()
    };
    let (a, mut b) = Channel::pair(slow).unwrap();
    let sleeper = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        let first = b.recv(&mut buf);
        let second = b.recv(&mut buf);
        (first, second)
    });
    let mut a = a;
    a.send(&[1]).unwrap();
    // The receiver may or may not be asleep already; either way the drop must end its wait.
    std::thread::sleep(Duration::from_millis(20));
    drop(a);
    let (first, second) = sleeper.join().unwrap();
    assert_eq!(first.unwrap(), 1);
    assert!(matches!(second, Err(Error::PeerGone)));
}

#[test]
fn dropping_the_peer_wakes_a_sender_asleep_on_a_full_ring() {
    let slow = ChannelOptions {
        slots: 1,
        liveness_interval: Duration::from_secs(3600),
        ..ChannelOptions::default()
    };
    let (mut a, b) = Channel::pair(slow).unwrap();
    a.send(&[1]).unwrap();
    let sender = std::thread::spawn(move || a.send(&[2]));
    std::thread::sleep(Duration::from_millis(20));
    drop(b);
    assert!(matches!(sender.join().unwrap(), Err(Error::PeerGone)));
}

#[test]
fn fds_travel_with_their_messages_in_order() {
    let (mut a, mut b) = Channel::pair(options(4)).unwrap();
    let mut files = Vec::new();
    for i in 0..3u8 {
        let fd = rustix::fs::memfd_create("channel-test", MemfdFlags::CLOEXEC).unwrap();
        rustix::io::write(&fd, &[i; 3]).unwrap();
        files.push(fd);
    }
    a.send(b"plain").unwrap();
    for (i, fd) in files.iter().enumerate() {
        a.send_with_fd(&[i as u8], fd.as_fd()).unwrap();
    }
    let mut buf = [0u8; 16];
    let plain = b.recv_with_fd(&mut buf).unwrap();
    assert_eq!((plain.len, plain.fd.is_none()), (5, true));
    for i in 0..3u8 {
        let got = b.recv_with_fd(&mut buf).unwrap();
        assert_eq!((got.len, buf[0]), (1, i));
        let fd = got.fd.expect("an fd came with the message");
        let mut content = [0u8; 3];
        rustix::io::pread(&fd, &mut content, 0).unwrap();
        assert_eq!(content, [i; 3], "the fd of message {i}");
    }
}

#[test]
fn bad_slot_counts_are_refused() {
    for slots in [0, 3, 1 << 17] {
        assert!(matches!(
            Channel::pair(options(slots)),
            Err(Error::InvalidSize { .. })
        ));
    }
}

// ---- A hostile creator: it makes the memory itself and scribbles on it. ----

const CONTROL: [usize; 2] = [256, 512];
const SLOTS_START: usize = 1024;
const SLOT_BYTES: usize = 512;

struct Hostile {
    socket: UnixStream,
    _memfd: OwnedFd,
    base: *mut u8,
    len: usize,
}

impl Hostile {
    /// Sets a channel up as `Channel::create` would, from outside the crate.
    fn create(slots: u32, seal: bool, len: Option<usize>) -> (Self, UnixStream) {
        let (mine, theirs) = UnixStream::pair().unwrap();
        let len = len.unwrap_or(SLOTS_START + 2 * slots as usize * SLOT_BYTES);
        let memfd =
            rustix::fs::memfd_create("hostile", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .unwrap();
        rustix::fs::ftruncate(&memfd, len as u64).unwrap();
        if seal {
            rustix::fs::fcntl_add_seals(&memfd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        }
        // SAFETY: a fresh shared mapping of the memfd's `len` bytes, unmapped in Drop.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &memfd,
                0,
            )
        }
        .unwrap()
        .cast::<u8>();
        let hostile = Self {
            socket: mine,
            _memfd: memfd,
            base,
            len,
        };
        let mut header = [0u8; 16];
        header[0..4].copy_from_slice(b"TMCH");
        header[4..8].copy_from_slice(&1u32.to_le_bytes());
        header[8..12].copy_from_slice(&slots.to_le_bytes());
        for (i, chunk) in header.chunks(4).enumerate() {
            hostile.word(i * 4).store(
                u32::from_le_bytes(chunk.try_into().unwrap()),
                Ordering::SeqCst,
            );
        }
        hostile.send_frame(&header, true);
        (hostile, theirs)
    }

    fn send_frame(&self, frame: &[u8; 16], with_fd: bool) {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [self._memfd.as_fd()];
        if with_fd {
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        }
        rustix::net::sendmsg(
            &self.socket,
            &[IoSlice::new(frame)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .unwrap();
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        assert!(offset + 4 <= self.len);
        // SAFETY: inside the mapping, 4-aligned (offsets used are), lives as long as `self`.
        unsafe { &*self.base.add(offset).cast::<AtomicU32>() }
    }

    fn slot_word(&self, ring: usize, slots: u32, slot: usize) -> &AtomicU64 {
        let offset = SLOTS_START + (ring * slots as usize + slot) * SLOT_BYTES;
        // SAFETY: inside the mapping, 8-aligned, lives as long as `self`.
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        // SAFETY: exactly the range mapped in `create`.
        unsafe { rustix::mm::munmap(self.base.cast(), self.len).unwrap() };
    }
}

#[test]
fn a_head_index_far_ahead_is_a_corrupt_channel() {
    let (hostile, socket) = Hostile::create(8, true, None);
    let mut end = Channel::accept(socket, ChannelOptions::default()).unwrap();
    hostile.word(CONTROL[0]).store(1000, Ordering::SeqCst); // ring 0's head
    let mut buf = [0u8; MAX_MESSAGE];
    assert!(matches!(
        end.recv(&mut buf),
        Err(Error::ChannelCorrupt { .. })
    ));
    assert!(matches!(
        end.try_recv(&mut buf),
        Err(Error::ChannelCorrupt { .. })
    ));
    // A head "behind" the tail reads as ahead by nearly 2^32: corrupt too.
    hostile.word(CONTROL[0]).store(u32::MAX, Ordering::SeqCst);
    assert!(matches!(
        end.try_recv(&mut buf),
        Err(Error::ChannelCorrupt { .. })
    ));
}

#[test]
fn a_slot_claiming_too_many_bytes_is_a_corrupt_channel() {
    let (hostile, socket) = Hostile::create(8, true, None);
    let mut end = Channel::accept(socket, ChannelOptions::default()).unwrap();
    hostile
        .slot_word(0, 8, 0)
        .store(u64::from(u32::MAX), Ordering::SeqCst);
    hostile.word(CONTROL[0]).store(1, Ordering::SeqCst);
    let mut buf = [0u8; MAX_MESSAGE];
    assert!(matches!(
        end.recv(&mut buf),
        Err(Error::ChannelCorrupt { .. })
    ));
    // Unknown flag bits too.
    hostile
        .slot_word(0, 8, 0)
        .store(4 | (1 << 40), Ordering::SeqCst);
    assert!(matches!(
        end.recv(&mut buf),
        Err(Error::ChannelCorrupt { .. })
    ));
}

#[test]
fn a_tail_index_beyond_what_was_sent_is_a_corrupt_channel() {
    let (hostile, socket) = Hostile::create(2, true, None);
    let mut end = Channel::accept(socket, ChannelOptions::default()).unwrap();
    end.send(b"1").unwrap();
    end.send(b"2").unwrap();
    // Ring 1 (the acceptor sends): its tail claims 7 messages taken of 2.
    hostile.word(CONTROL[1] + 64).store(7, Ordering::SeqCst);
    assert!(matches!(end.send(b"3"), Err(Error::ChannelCorrupt { .. })));
}

#[test]
fn an_fd_frame_for_another_message_is_a_protocol_error() {
    let (hostile, socket) = Hostile::create(8, true, None);
    let mut end = Channel::accept(socket, ChannelOptions::default()).unwrap();
    hostile
        .slot_word(0, 8, 0)
        .store(3 | (1 << 32), Ordering::SeqCst);
    hostile.word(CONTROL[0]).store(1, Ordering::SeqCst);
    // An fd frame for another message.
    let mut frame = [0u8; 16];
    frame[0..4].copy_from_slice(b"TMFD");
    frame[8..16].copy_from_slice(&5u64.to_le_bytes());
    hostile.send_frame(&frame, true);
    let mut buf = [0u8; MAX_MESSAGE];
    assert!(matches!(
        end.recv_with_fd(&mut buf),
        Err(Error::Protocol { .. })
    ));
}

#[test]
fn unsealed_short_or_malformed_memory_is_refused_at_accept() {
    let (_unsealed, socket) = Hostile::create(8, false, None);
    assert!(matches!(
        Channel::accept(socket, ChannelOptions::default()),
        Err(Error::Protocol { .. })
    ));
    let (_short, socket) = Hostile::create(8, true, Some(4096));
    assert!(matches!(
        Channel::accept(socket, ChannelOptions::default()),
        Err(Error::TooSmall { .. })
    ));
    let (hostile, socket) = Hostile::create(8, true, None);
    let mut bad = [0u8; 16];
    bad[0..4].copy_from_slice(b"XXXX");
    drop(Channel::accept(socket.try_clone().unwrap(), ChannelOptions::default()).unwrap());
    hostile.send_frame(&bad, true);
    assert!(matches!(
        Channel::accept(socket, ChannelOptions::default()),
        Err(Error::Protocol { .. })
    ));
    let (hostile, socket) = Hostile::create(8, true, None);
    drop(hostile);
    drop(Channel::accept(socket.try_clone().unwrap(), ChannelOptions::default()).unwrap());
    assert!(matches!(
        Channel::accept(socket, ChannelOptions::default()),
        Err(Error::PeerGone)
    ));
}
