//! The hooks on a real runtime: a 64 B exchange over real TCP on 127.0.0.1 with an echo thread.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// Round trips per batch; a run is a number of batches.
const BATCH: usize = 100;

/// An echo server on 127.0.0.1:0 in a thread of its own (answers each 64 B message at once).
fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = [0u8; 64];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    });
    addr
}

/// Round trips on a current-thread runtime built with idle polling of at most `max`, as
/// [`exchange_on`].
fn exchange(
    max: Duration,
    noted: usize,
    batches: usize,
    enough: impl Fn(u64, u64) -> bool + Send + 'static,
) -> (u64, u64, f64) {
    let rt = build_current_thread(
        tokio::runtime::Builder::new_current_thread().enable_all(),
        max,
    )
    .expect("runtime");
    exchange_on(rt, noted, batches, enough)
}

/// Round trips on `rt`, noting `noted` bytes of tunnel work before each one, in batches of
/// [`BATCH`]: `batches` of them, or fewer once `enough(polls, hits)` holds. Returns the
/// counters' growth.
fn exchange_on(
    rt: tokio::runtime::Runtime,
    noted: usize,
    batches: usize,
    enough: impl Fn(u64, u64) -> bool + Send + 'static,
) -> (u64, u64, f64) {
    let addr = echo_server();
    let (p0, h0, s0) = totals();
    // On a spawned task, so that on a multi-thread runtime a worker (not `block_on`'s thread)
    // runs the exchange and parks between answers.
    let task = rt.spawn(async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = [7u8; 64];
        for _ in 0..batches {
            for _ in 0..BATCH {
                note_io(noted);
                s.write_all(&buf).await.expect("write");
                s.read_exact(&mut buf).await.expect("read");
            }
            let (p, h, _) = totals();
            if enough(p - p0, h - h0) {
                break;
            }
        }
    });
    rt.block_on(task).expect("exchange task");
    let (p1, h1, s1) = totals();
    (p1 - p0, h1 - h0, s1 - s0)
}

#[test]
fn answers_to_light_messages_are_caught_by_the_poll() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The window opens after a few short idle periods; from then on the thread polls whenever
    // it waits for an answer (not at every exchange: on a fast machine several round trips can
    // complete within one busy period), and the echo thread answers within the window unless
    // the machine preempts it for a whole millisecond, which a busy machine running other
    // tests does often: so run until 50 polls caught their answer (at most 200 batches, a few
    // seconds even on a loaded machine).
    let (polls, hits, secs) = exchange(MAX_MAX, 120, 200, |_, hits| hits >= 50);
    assert!(hits >= 50, "{hits} hits of {polls} polls");
    assert!(status().starts_with("on: polls up to"), "{}", status());
    assert!(secs > 0.0);
}

#[test]
fn on_a_multi_thread_runtime_the_last_worker_awake_catches_answers() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Two workers: while one runs the exchange the other is parked, so the one that waits for
    // the echo is the last awake and polls (as above, until 50 polls caught their answer).
    let rt = build_multi_thread(
        tokio::runtime::Builder::new_multi_thread().enable_all(),
        MAX_MAX,
        2,
    )
    .expect("runtime");
    let (polls, hits, _) = exchange_on(rt, 120, 200, |_, hits| hits >= 50);
    assert!(hits >= 50, "{hits} hits of {polls} polls");
}

#[test]
fn a_worker_polls_only_while_every_other_worker_is_parked() {
    let gate = LastAwake::new(3);
    assert_eq!(
        gate.park(10),
        None,
        "first of three to park: two others awake"
    );
    assert_eq!(gate.park(20), None, "second: one other awake");
    assert_eq!(
        gate.park(30),
        Some(60),
        "third: the last awake, judged by what all three moved"
    );
    gate.unpark();
    assert_eq!(
        gate.park(5),
        Some(5),
        "the one that woke parks again while the other two sleep: only its new bytes"
    );
    for _ in 0..3 {
        gate.unpark();
    }
    // An unpark without its park (a worker that started parked) does not wrap the count.
    gate.unpark();
    assert_eq!(gate.park(0), None);
    // One worker is always the last awake.
    assert_eq!(LastAwake::new(1).park(7), Some(7));
}

#[test]
fn bulk_work_is_never_followed_by_a_poll() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (polls, hits, _) = exchange(MAX_MAX, policy::LIGHT_BYTES as usize + 1, 4, |_, _| false);
    assert_eq!((polls, hits), (0, 0));
}

#[test]
fn a_zero_maximum_installs_nothing() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (polls, hits, _) = exchange(Duration::ZERO, 0, 4, |_, _| false);
    assert_eq!((polls, hits), (0, 0));
}

#[tokio::test]
async fn a_counted_transport_reports_what_it_moves() {
    let (a, b) = tokio::io::duplex(64 * 1024);
    let (mut a, mut b) = (Counted::new(a), Counted::new(b));
    let before = WORK.with(|w| w.get());
    a.write_all(&[1u8; 1000]).await.expect("write");
    let mut got = [0u8; 1000];
    b.read_exact(&mut got).await.expect("read");
    // Both ends run on this thread: 1,000 bytes written and 1,000 read.
    assert_eq!(WORK.with(|w| w.get()) - before, 2000);
}
