//! The hooks on a real runtime: a 64 B exchange over real TCP on 127.0.0.1 with an echo thread.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const EXCHANGES: usize = 400;

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

/// Runs `EXCHANGES` round trips on a runtime built with idle polling of at most `max`, noting
/// `noted` bytes of tunnel work before each one; returns the counters' growth.
fn exchange(max: Duration, noted: usize) -> (u64, u64, f64) {
    let addr = echo_server();
    let rt = build_current_thread(
        tokio::runtime::Builder::new_current_thread().enable_all(),
        max,
    )
    .expect("runtime");
    let (p0, h0, s0) = totals();
    rt.block_on(async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = [7u8; 64];
        for _ in 0..EXCHANGES {
            note_io(noted);
            s.write_all(&buf).await.expect("write");
            s.read_exact(&mut buf).await.expect("read");
        }
    });
    let (p1, h1, s1) = totals();
    (p1 - p0, h1 - h0, s1 - s0)
}

#[test]
fn answers_to_light_messages_are_caught_by_the_poll() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (polls, hits, secs) = exchange(MAX_MAX, 120);
    // The window opens after a few short idle periods; from then on the thread polls whenever
    // it waits for an answer (not at every exchange: on a fast machine several round trips can
    // complete within one busy period), and the echo thread answers within the window unless
    // the machine preempts it for a whole millisecond.
    assert!(polls >= (EXCHANGES / 20) as u64, "{polls} polls");
    assert!(hits >= polls / 2, "{hits} hits of {polls} polls");
    assert!(secs > 0.0);
}

#[test]
fn bulk_work_is_never_followed_by_a_poll() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (polls, hits, _) = exchange(MAX_MAX, policy::LIGHT_BYTES as usize + 1);
    assert_eq!((polls, hits), (0, 0));
}

#[test]
fn a_zero_maximum_installs_nothing() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (polls, hits, _) = exchange(Duration::ZERO, 0);
    assert_eq!((polls, hits), (0, 0));
}
