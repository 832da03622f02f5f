//! loom models of the ring and its doorbell protocol (`ring` module docs): every interleaving of
//! a producer and a consumer (and of a side closing its end) within loom's bounds. Run with
//! `RUSTFLAGS="--cfg loom"` (see `docs/reliability.md`).
//!
//! What must hold:
//! - messages arrive complete and in order through a ring smaller than the stream, with both
//!   sides sleeping whenever they have nothing to do: no wake-up is lost (a lost one leaves a
//!   thread asleep forever, which loom reports as a deadlock; the models' futex has no timeout);
//! - a side that closes its end wakes a peer asleep on either doorbell, and the peer then sees
//!   the closed flag (no lost wake-up there either).

use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

use super::ring::{
    wait_for, wake_unconditionally, Consumer, Producer, Ring, RingControl, Stop, WaitPlan,
    SLOT_WORDS,
};

/// One ring on the heap with `slots` slots, and a closed flag per side.
struct Model {
    control: RingControl,
    words: Vec<AtomicU64>,
    slots: u32,
    producer_closed: AtomicU32,
    consumer_closed: AtomicU32,
}

impl Model {
    fn new(slots: u32) -> Arc<Self> {
        Arc::new(Self {
            control: RingControl::new(),
            words: (0..slots as usize * SLOT_WORDS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            slots,
            producer_closed: AtomicU32::new(0),
            consumer_closed: AtomicU32::new(0),
        })
    }

    fn ring(&self) -> Ring<'_> {
        Ring {
            control: &self.control,
            words: &self.words,
            slots: self.slots,
        }
    }
}

const PLAN: WaitPlan = WaitPlan {
    spin: std::time::Duration::ZERO,
    check_every: None,
    deadline: None,
};

/// The endpoint's blocking send: wait for a free slot, then push. `Err` if the consumer closed.
fn send(model: &Model, producer: &mut Producer, message: &[u8]) -> Result<(), ()> {
    let ring = model.ring();
    wait_for(
        &ring.control.tx_sleep.0,
        PLAN,
        || Ok(producer.free(ring)?.checked_sub(1).map(|_| ())),
        || (model.consumer_closed.load(Ordering::Acquire) != 0).then_some(()),
        || None,
    )
    .map_err(|_| ())?;
    assert!(producer.push(ring, message, 0).expect("no corruption"));
    Ok(())
}

/// The endpoint's blocking receive. `Err` once the producer closed and nothing is left.
fn recv(model: &Model, consumer: &mut Consumer) -> Result<Vec<u8>, ()> {
    let ring = model.ring();
    let peeked = wait_for(
        &ring.control.rx_sleep.0,
        PLAN,
        || consumer.peek(ring),
        || (model.producer_closed.load(Ordering::Acquire) != 0).then_some(()),
        || None,
    );
    let peeked = match peeked {
        Ok(peeked) => peeked,
        Err(Stop::Peer(())) => return Err(()),
        Err(other) => panic!("unexpected end of a wait: {other:?}"),
    };
    let mut out = vec![0u8; peeked.len];
    consumer.take(ring, peeked, &mut out);
    Ok(out)
}

/// What a side's drop does (`Shared::drop`).
fn close(model: &Model, flag: &AtomicU32) {
    flag.store(1, Ordering::SeqCst);
    wake_unconditionally(&model.control.rx_sleep.0);
    wake_unconditionally(&model.control.tx_sleep.0);
}

fn builder() -> loom::model::Builder {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder
}

#[test]
fn messages_pass_a_full_ring_in_order_with_both_sides_sleeping() {
    builder().check(|| {
        let model = Model::new(1);
        let producer_side = Arc::clone(&model);
        let producer = thread::spawn(move || {
            let mut producer = Producer::default();
            for i in 0..3u8 {
                send(&producer_side, &mut producer, &[i, i + 10]).unwrap();
            }
        });
        let mut consumer = Consumer::default();
        for i in 0..3u8 {
            assert_eq!(recv(&model, &mut consumer).unwrap(), vec![i, i + 10]);
        }
        producer.join().unwrap();
    });
}

#[test]
fn a_closing_producer_wakes_a_sleeping_consumer_after_its_last_message() {
    builder().check(|| {
        let model = Model::new(2);
        let producer_side = Arc::clone(&model);
        let producer = thread::spawn(move || {
            let mut producer = Producer::default();
            send(&producer_side, &mut producer, &[7]).unwrap();
            close(&producer_side, &producer_side.producer_closed);
        });
        let mut consumer = Consumer::default();
        assert_eq!(recv(&model, &mut consumer).unwrap(), vec![7]);
        assert!(recv(&model, &mut consumer).is_err(), "the producer closed");
        producer.join().unwrap();
    });
}

#[test]
fn a_closing_consumer_wakes_a_producer_asleep_on_a_full_ring() {
    builder().check(|| {
        let model = Model::new(1);
        let consumer_side = Arc::clone(&model);
        let consumer = thread::spawn(move || {
            close(&consumer_side, &consumer_side.consumer_closed);
        });
        let mut producer = Producer::default();
        // The first message fits; the second finds the ring full and sleeps until the close.
        send(&model, &mut producer, &[1]).unwrap();
        assert!(send(&model, &mut producer, &[2]).is_err());
        consumer.join().unwrap();
    });
}
