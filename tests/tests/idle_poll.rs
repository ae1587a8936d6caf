//! Idle polling in the real broker and agent processes (`--idle-poll-us`, `tether_idlepoll`):
//! after request/response traffic through the tunnel both report polls that caught the next
//! message; during a bulk upload they spend little time polling; with `--idle-poll-us 0` they
//! never poll.

use std::time::Duration;

use tether_e2e::{Hub, IdlePolls, OPS_TOKEN, admin_get, connect};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const POLLS: &str = "tether_runtime_idle_polls_total";
const HITS: &str = "tether_runtime_idle_poll_hits_total";
const SECONDS: &str = "tether_runtime_idle_poll_seconds_total";
const CONTENDED: &str = "tether_runtime_idle_poll_contended_total";

/// A hub with one broker and one agent on one worker thread each (current-thread runtimes,
/// the default on up to three CPUs, whatever the machine's CPU count), `idle_poll_us` as given.
async fn pair(idle_poll_us: u64) -> anyhow::Result<(Hub, tether_e2e::Broker, tether_e2e::Agent)> {
    pair_on(1, idle_poll_us).await
}

/// As [`pair`], with `workers` worker threads each (more than one: multi-thread runtimes, the
/// default on four CPUs or more).
async fn pair_on(
    workers: usize,
    idle_poll_us: u64,
) -> anyhow::Result<(Hub, tether_e2e::Broker, tether_e2e::Agent)> {
    let mut hub = Hub::new()?;
    hub.env
        .push(("TETHER_WORKER_THREADS".into(), workers.to_string()));
    hub.env
        .push(("TETHER_IDLE_POLL_US".into(), idle_poll_us.to_string()));
    tether_e2e::with_c1(hub).await
}

/// `rounds` 64 B request/response round trips through one CONNECT stream.
async fn ping_pong(broker: &tether_e2e::Broker, rounds: u64) -> anyhow::Result<()> {
    let mut s = match connect(broker.client_addr, "c1:443", Some(OPS_TOKEN)).await? {
        Ok(s) => s,
        Err((code, body)) => anyhow::bail!("CONNECT answered {code}: {body}"),
    };
    exchange(&mut s, rounds).await
}

/// `rounds` 64 B request/response round trips on an open echo stream, each answer within 10 s.
async fn exchange(s: &mut tokio::net::TcpStream, rounds: u64) -> anyhow::Result<()> {
    let mut buf = [5u8; 64];
    for _ in 0..rounds {
        s.write_all(&buf).await?;
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf)).await??;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_response_traffic_is_caught_by_idle_polls_in_broker_and_agent() -> anyhow::Result<()>
{
    let _beside = ALONE.read().await;
    let (_hub, broker, agent) = pair(1000).await?;
    polls_catch_messages(&broker, &agent).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_workers_the_last_awake_polls() -> anyhow::Result<()> {
    let _beside = ALONE.read().await;
    let (_hub, broker, agent) = pair_on(2, 1000).await?;
    polls_catch_messages(&broker, &agent).await
}

/// Round trips through the tunnel until both processes have caught 100 messages in an idle
/// poll. The window opens after a few short idle periods; from then on most waits for the next
/// message end in a poll that catches it, unless the machine (busy with other tests) keeps the
/// other processes off the CPU for a whole millisecond. So: batches of 500 round trips, within
/// a deadline.
async fn polls_catch_messages(
    broker: &tether_e2e::Broker,
    agent: &tether_e2e::Agent,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        ping_pong(broker, 500).await?;
        let b = IdlePolls::read(broker.admin_addr).await?;
        let a = IdlePolls::read(agent.admin_addr).await?;
        eprintln!("broker {b:?}, agent {a:?}");
        if b.hits >= 100.0 && a.hits >= 100.0 {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "after 30 s of round trips: broker {b:?}, agent {a:?}"
        );
    }
    Ok(())
}

/// A CPU-bound neighbour on the broker's CPU: a poll yields the CPU to it and gets it back only
/// at the end of the neighbour's time slice (milliseconds), while the answer it waits for has
/// long arrived, since a runnable thread is not woken by its events. The broker sees that the
/// yield was stolen and stops polling for a while (sleeping in its driver, it is woken by the
/// answer and preempts the neighbour), so it polls a few times, not once or twice per round
/// trip as without a neighbour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_bound_neighbour_pauses_polling() -> anyhow::Result<()> {
    const ROUNDS: u64 = 2000;
    let (polls, contended) = round_trips_beside(Neighbour::Spinning, ROUNDS).await?;
    assert!(
        contended >= 1.0,
        "no poll was seen as contended ({polls} polls)"
    );
    assert!(
        polls < ROUNDS as f64 / 4.0,
        "{polls} polls in {ROUNDS} round trips beside a CPU-bound neighbour"
    );
    Ok(())
}

/// A neighbour on the broker's CPU that runs in short bursts (400 µs of work every 5 ms, as a
/// process handling messages of its own): a poll that yields into a burst loses the CPU past
/// the bound and counts as contended, but the polls between bursts keep their CPU, so polling
/// goes on: about two polls per round trip, one per direction. (Pausing on each such poll, as
/// the first version did, left 549–737 polls in 2,000 round trips here, against 3,550–4,009.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_neighbours_short_bursts_do_not_pause_polling() -> anyhow::Result<()> {
    const ROUNDS: u64 = 2000;
    let bursts = Neighbour::Bursts {
        burst: Duration::from_micros(400),
        gap: Duration::from_millis(5),
    };
    let (polls, contended) = round_trips_beside(bursts, ROUNDS).await?;
    assert!(
        contended >= 1.0,
        "no poll met a burst ({polls} polls): the neighbour did not share the CPU"
    );
    assert!(
        polls > ROUNDS as f64 / 2.0,
        "{polls} polls in {ROUNDS} round trips beside a bursting neighbour ({contended} contended)"
    );
    Ok(())
}

/// What runs beside the broker on its CPU in the neighbour tests.
#[derive(Debug, Clone, Copy)]
enum Neighbour {
    /// Spins without a pause: a CPU-bound process.
    Spinning,
    /// Spins for `burst`, sleeps for `gap`, and again.
    Bursts { burst: Duration, gap: Duration },
}

/// A neighbour test runs alone in this binary (`cargo test` runs its tests on parallel
/// threads): each pins its neighbour to the first CPU allowed, where a spinning one would be a
/// CPU-bound neighbour of every other test's broker, and another test's bulk upload one of its
/// broker (the bursts test then counted 1,160 polls in one run; alone, 3,719–4,006).
/// The neighbour tests take it to write, the others to read. Under nextest, where every test is
/// a process, the neighbour tests take both test slots instead (`.config/nextest.toml`).
static ALONE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// `rounds` round trips through a broker pinned to one CPU beside `neighbour`: the broker's
/// polls and contended polls over them.
async fn round_trips_beside(neighbour: Neighbour, rounds: u64) -> anyhow::Result<(f64, f64)> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    let _alone = ALONE.write().await;
    let (_hub, broker, _agent) = pair(tether_runtime::DEFAULT_IDLE_POLL_US).await?;
    ping_pong(&broker, 200).await?;
    let cpu = *tether_e2e::benchkit::allowed_cpus()?
        .first()
        .ok_or_else(|| anyhow::anyhow!("no CPU allowed"))?;
    tether_e2e::benchkit::pin_process(broker.child.pid(), cpu)?;
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let pinned = std::sync::Arc::new(AtomicBool::new(false));
    let thread = {
        let (stop, pinned) = (stop.clone(), pinned.clone());
        std::thread::spawn(move || -> anyhow::Result<()> {
            tether_e2e::benchkit::pin_current_thread(cpu)?;
            pinned.store(true, Ordering::Release);
            // Bounded: the test ends it, or it ends itself.
            let started = Instant::now();
            let spin = |d: Duration| {
                let from = Instant::now();
                while !stop.load(Ordering::Relaxed) && from.elapsed() < d {
                    std::hint::spin_loop();
                }
            };
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(120) {
                match neighbour {
                    Neighbour::Spinning => spin(Duration::from_secs(120)),
                    Neighbour::Bursts { burst, gap } => {
                        spin(burst);
                        // The neighbour's idle time between bursts, not a wait for a result.
                        std::thread::sleep(gap);
                    }
                }
            }
            Ok(())
        })
    };
    tether_test_support::wait_until_async(
        Duration::from_secs(10),
        "the neighbour running on the broker's CPU",
        || async { pinned.load(Ordering::Acquire).then_some(()) },
    )
    .await?;
    let before = IdlePolls::read(broker.admin_addr).await?;
    let result = ping_pong(&broker, rounds).await;
    stop.store(true, Ordering::Relaxed);
    thread.join().expect("neighbour thread")?;
    result?;
    let gained = IdlePolls::read(broker.admin_addr).await?.since(before);
    let (polls, contended) = (gained.polls, gained.contended);
    eprintln!("{rounds} round trips beside {neighbour:?}: {polls} polls, {contended} contended");
    Ok((polls, contended))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_upload_costs_little_polling() -> anyhow::Result<()> {
    let _beside = ALONE.read().await;
    bulk_upload_polls_little(1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_upload_costs_little_polling_with_two_workers() -> anyhow::Result<()> {
    let _beside = ALONE.read().await;
    // The same bound with two workers per process. That the gate judges the whole runtime's
    // traffic (so the less busy worker does not poll while the other moves bulk data) is
    // checked exactly in tether_idlepoll's unit tests; this checks the real processes.
    bulk_upload_polls_little(2).await
}

/// 64 MiB up and back through broker and agent on `workers` worker threads each, with the
/// default window: each process's time spent polling stays a small part of the transfer's.
async fn bulk_upload_polls_little(workers: usize) -> anyhow::Result<()> {
    let (_hub, broker, agent) = pair_on(workers, tether_runtime::DEFAULT_IDLE_POLL_US).await?;
    let before = [
        IdlePolls::read(broker.admin_addr).await?,
        IdlePolls::read(agent.admin_addr).await?,
    ];
    // 64 MiB through an echo target (and back): the busy periods of both processes move
    // hundreds of KiB...
    let mut s = match connect(broker.client_addr, "c1:443", Some(OPS_TOKEN)).await? {
        Ok(s) => s,
        Err((code, body)) => anyhow::bail!("CONNECT answered {code}: {body}"),
    };
    let (mut r, mut w) = s.split();
    let chunk = vec![9u8; 256 * 1024];
    let total = 64 * 1024 * 1024;
    let write = async {
        for _ in 0..total / chunk.len() {
            w.write_all(&chunk).await?;
        }
        anyhow::Ok(())
    };
    let read = async {
        let mut got = 0;
        let mut buf = vec![0u8; 256 * 1024];
        while got < total {
            let n = r.read(&mut buf).await?;
            anyhow::ensure!(n > 0, "echo ended after {got} bytes");
            got += n;
        }
        anyhow::Ok(())
    };
    let started = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(60), async {
        tokio::try_join!(write, read)
    })
    .await??;
    let took = started.elapsed();
    let after = [
        IdlePolls::read(broker.admin_addr).await?,
        IdlePolls::read(agent.admin_addr).await?,
    ];
    for (who, (b, a)) in ["broker", "agent"]
        .iter()
        .zip(before.into_iter().zip(after))
    {
        let d = a.since(b);
        eprintln!(
            "{who}: {} polls, {} hits, {:.6} s polled during the upload",
            d.polls, d.hits, d.seconds
        );
        // Polls that caught the next burst cost a few µs each and replace a sleep and a
        // wake-up; a poll that missed costs a whole window. Bulk traffic gets few of either
        // (the gate keeps the window shut while recent traffic is heavy, and what slips through
        // mostly comes back at once): 1-4 % of the transfer's time here. The bound leaves room
        // for a machine busy with other tests, where a poll that yields the CPU may get it back
        // only after another process's time slice (the counter is wall time).
        let secs = d.seconds;
        assert!(
            secs <= 0.20 * took.as_secs_f64(),
            "{who}: {secs:.4} s polled during a {took:?} upload"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_poll_zero_never_polls() -> anyhow::Result<()> {
    let _beside = ALONE.read().await;
    let (_hub, broker, agent) = pair(0).await?;
    ping_pong(&broker, 500).await?;
    for admin in [broker.admin_addr, agent.admin_addr] {
        // Registered (so a zero is a reading, not an absent metric) and zero.
        let (_, body) = admin_get(admin, "/metrics").await?;
        for name in [POLLS, HITS, SECONDS, CONTENDED] {
            assert!(
                body.contains(&format!("{name} 0")),
                "{name} missing or not 0"
            );
        }
        assert_eq!(IdlePolls::read(admin).await?, IdlePolls::ZERO);
    }
    Ok(())
}

/// A running `tetherctl proxy connect` to c1's API server (the echo target) over the broker's
/// plain port, with one forward thread and `--idle-poll-us idle_poll_us`: the child (killed on
/// drop) and its local address.
async fn proxy_connect(
    broker: &tether_e2e::Broker,
    idle_poll_us: u64,
) -> anyhow::Result<(tokio::process::Child, std::net::SocketAddr)> {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new(tether_test_support::bin("tetherctl")?)
        .args(["proxy", "connect", "c1", "--local-port", "0"])
        .args(["--worker-threads", "1", "--idle-poll-us"])
        .arg(idle_poll_us.to_string())
        .arg("--broker")
        .arg(format!("http://{}", broker.client_addr))
        .env("TETHER_TOKEN", OPS_TOKEN)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(20),
        tokio::io::BufReader::new(stdout).read_line(&mut line),
    )
    .await??;
    let local = line
        .strip_prefix("Forwarding from ")
        .and_then(|l| l.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("tetherctl proxy connect said {line:?}"))?;
    Ok((child, local))
}

/// How often the forward's thread has gone to sleep (`voluntary_ctxt_switches`; a yield while
/// polling is not one).
fn forward_sleeps(pid: u32) -> anyhow::Result<u64> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let dir = task?.path();
        if !std::fs::read_to_string(dir.join("comm"))?.starts_with("tetherctl-forw") {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status"))?;
        return status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no voluntary_ctxt_switches in {status}"));
    }
    anyhow::bail!("tetherctl {pid} has no tetherctl-forward thread")
}

/// `tetherctl proxy connect` with one forward thread polls as the broker and agent do: without
/// polling its thread sleeps about twice per forwarded round trip (waiting for the request,
/// then for the answer); with it, most waits end in a poll that catches the next message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_connect_polls_between_requests_unless_told_not_to() -> anyhow::Result<()> {
    let _beside = ALONE.read().await;
    const ROUNDS: u64 = 500;
    let (_hub, broker, _agent) = pair(tether_runtime::DEFAULT_IDLE_POLL_US).await?;
    for idle_poll_us in [0, 1000] {
        let (child, local) = proxy_connect(&broker, idle_poll_us).await?;
        let pid = child.id().expect("running");
        let mut s = tokio::net::TcpStream::connect(local).await?;
        s.set_nodelay(true)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let before = forward_sleeps(pid)?;
            exchange(&mut s, ROUNDS).await?;
            let per_round = (forward_sleeps(pid)? - before) as f64 / ROUNDS as f64;
            eprintln!("--idle-poll-us {idle_poll_us}: {per_round:.2} sleeps per round trip");
            if idle_poll_us == 0 {
                // Two waits per round trip, each a sleep; a busy machine may let a message
                // arrive before the thread went to sleep now and then.
                assert!(
                    per_round >= 1.0,
                    "without polling the forward slept {per_round:.2} times per round trip"
                );
                break;
            }
            // The window opens after a few short idle periods; on a machine busy with other
            // tests a poll may yield the CPU for longer than the window. So: batches until one
            // in which most waits were caught, within the deadline.
            if per_round < 1.0 {
                break;
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "after 30 s of round trips the forward still slept {per_round:.2} times per round trip"
            );
        }
    }
    Ok(())
}
