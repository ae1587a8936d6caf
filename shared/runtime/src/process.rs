//! What every service's `main` does the same way: build the actix system on a multi-thread
//! tokio runtime, and publish bound addresses in a ready file for scripts and tests.

use std::path::Path;

/// An actix `System` on a tokio runtime with `workers` worker threads (`None`: one per CPU).
/// Actors must be started inside its `block_on`: starting one under a plain `#[tokio::main]`
/// panics (no `LocalSet`).
///
/// `Some(1)` builds a **current-thread** runtime: the thread that runs the actors also polls
/// every spawned task and the I/O driver. A multi-thread runtime with one worker has two
/// threads that poll (the worker, and `block_on`'s thread for the actors), a shared run queue
/// with atomics and a parked-worker handshake on every wake-up from the other thread; the
/// current-thread scheduler runs a woken task from its local queue. The data-plane processes
/// default to one worker on 2 CPUs ([`data_plane_workers`]), where every tunnelled message
/// crosses two of their tasks (stream pump and HTTP/2 connection) per hop.
pub fn actix_system(workers: Option<usize>) -> actix::SystemRunner {
    actix::System::with_tokio_rt(move || {
        let mut b = match workers {
            Some(1) => tokio::runtime::Builder::new_current_thread(),
            Some(n) => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(n);
                b
            }
            None => tokio::runtime::Builder::new_multi_thread(),
        };
        b.enable_all().build().expect("tokio runtime")
    })
}

/// The broker's and the agent's actix `System`: as [`actix_system`] with `workers`, and with
/// idle polling of at most `idle_poll` ([`tether_idlepoll`]): on a current-thread runtime
/// (`workers == 1`, the default on machines with up to three CPUs) after light traffic, and on a
/// multi-thread one by the last worker to go idle ([`tether_idlepoll::build_multi_thread`]).
/// Call it from `main` before any other thread starts: the runtime's epoll descriptor is found
/// as the one its creation added.
pub fn actix_system_data_plane(
    workers: usize,
    idle_poll: std::time::Duration,
) -> actix::SystemRunner {
    if idle_poll.is_zero() {
        return actix_system(Some(workers));
    }
    actix::System::with_tokio_rt(move || {
        if workers == 1 {
            let mut b = tokio::runtime::Builder::new_current_thread();
            b.enable_all();
            tether_idlepoll::build_current_thread(&mut b, idle_poll).expect("tokio runtime")
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.enable_all();
            tether_idlepoll::build_multi_thread(&mut b, idle_poll, workers).expect("tokio runtime")
        }
    })
}

/// Default tokio worker threads of the data-plane processes (broker, agent): half the CPUs, at
/// least one.
///
/// Every tunnelled byte crosses two tasks of this process (the stream's pump and the HTTP/2
/// connection task), and the kernel's TCP work of its sockets needs CPU too. With one worker
/// per CPU, socket events also unpark idle sibling workers that mostly find nothing to do
/// (a futex wake and two context switches): on 2 CPUs one worker instead of two took about
/// 25 % less broker+agent CPU per GB of one-stream upload and half the context switches per
/// request/response round trip (docs/benchmarks.md, tuning log).
pub fn data_plane_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// Writes `json` to `path` atomically ([`write_atomic`], mode 0644), so a reader never sees
/// half a file.
pub fn write_ready_file(path: &Path, json: &serde_json::Value) -> std::io::Result<()> {
    write_atomic(path, json.to_string().as_bytes(), 0o644)
}

/// The flags every data-plane and hub service takes besides its config; flattened into its
/// clap `Args` (`#[command(flatten)]`).
#[derive(Debug, Clone, clap::Args)]
pub struct ProcessArgs {
    /// Write the bound addresses here as JSON once listening (for scripts and tests).
    #[arg(long)]
    pub ready_file: Option<std::path::PathBuf>,
    /// Tokio worker threads (default: half the CPUs for the broker and the agent, one per CPU
    /// for the others).
    #[arg(long, env = "TETHER_WORKER_THREADS", value_parser = parse_worker_threads)]
    pub worker_threads: Option<usize>,
    #[command(flatten)]
    pub idle_poll: IdlePollArgs,
}

/// `--worker-threads`: a whole number of at least one (tokio would panic on zero).
pub fn parse_worker_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--idle-poll-us` (`TETHER_IDLE_POLL_US`): the broker's and agent's ([`ProcessArgs`]) and
/// `tetherctl proxy connect|kubectl`'s forward's; flattened into a clap `Args`.
#[derive(Debug, Clone, clap::Args)]
pub struct IdlePollArgs {
    /// The longest a runtime thread polls for more work after light traffic before it sleeps,
    /// in microseconds (0: never; at most 1000). Adaptive below this bound; with several
    /// worker threads, only the last one awake polls. See docs/configuration.md, "Idle polling".
    #[arg(
        long,
        env = "TETHER_IDLE_POLL_US",
        default_value_t = DEFAULT_IDLE_POLL_US,
        value_parser = clap::value_parser!(u64).range(0..=1000)
    )]
    pub idle_poll_us: u64,
}

impl IdlePollArgs {
    /// The bound as a duration (zero: no polling).
    pub fn max(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.idle_poll_us)
    }
}

/// Default of `--idle-poll-us` ([`tether_idlepoll::DEFAULT_MAX`]).
pub const DEFAULT_IDLE_POLL_US: u64 = tether_idlepoll::DEFAULT_MAX.as_micros() as u64;

impl ProcessArgs {
    /// `--worker-threads`, or the data-plane default ([`data_plane_workers`]).
    pub fn data_plane_workers(&self) -> usize {
        self.worker_threads.unwrap_or_else(data_plane_workers)
    }

    /// The data-plane actix `System` these flags ask for ([`actix_system_data_plane`]).
    pub fn data_plane_system(&self) -> actix::SystemRunner {
        actix_system_data_plane(self.data_plane_workers(), self.idle_poll.max())
    }
}

/// The command line of a service that runs from one YAML config file (the broker and the
/// agent): `--config` (or an environment variable the service names) and [`ProcessArgs`].
#[derive(Debug, Clone, clap::Parser)]
#[command(version)]
pub struct ConfigFileArgs {
    /// Path of the YAML config file.
    #[arg(long, short)]
    pub config: std::path::PathBuf,
    #[command(flatten)]
    pub process: ProcessArgs,
}

impl ConfigFileArgs {
    /// Parses this process's arguments as service `name` (`about` is the help's first line);
    /// `--config` may also come from the environment variable `config_env`. Exits with clap's
    /// message on bad arguments, `--help` and `--version`.
    pub fn parse_for(name: &'static str, about: &'static str, config_env: &'static str) -> Self {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let matches = Self::command()
            .name(name)
            .about(about)
            .mut_arg("config", |a| a.env(config_env))
            .get_matches();
        Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

/// Why a service could not bind a listener or announce it.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot bind {field} {addr}: {source}")]
    Bind {
        field: &'static str,
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("write ready file {}: {source}", path.display())]
    ReadyFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Binds config field `field`'s address `addr`; the error names both.
pub async fn bind(
    addr: std::net::SocketAddr,
    field: &'static str,
) -> Result<tokio::net::TcpListener, StartError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind {
            field,
            addr,
            source,
        })
}

/// For a service whose only listener is its admin server: binds `admin_listen` and writes
/// `{"admin": "<bound address>"}` to `ready_file`, if given.
pub async fn bind_admin(
    addr: std::net::SocketAddr,
    ready_file: Option<&Path>,
) -> Result<tokio::net::TcpListener, StartError> {
    let admin = bind(addr, "admin_listen").await?;
    if let Some(path) = ready_file {
        let ready = |source| StartError::ReadyFile {
            path: path.to_owned(),
            source,
        };
        let bound = admin.local_addr().map_err(ready)?;
        write_ready_file(path, &serde_json::json!({ "admin": bound.to_string() }))
            .map_err(ready)?;
    }
    Ok(admin)
}

/// Writes `contents` to `path` atomically with permission `mode`: a temp file beside it
/// (`.<name>.tmp`), fsync, rename. Creates the parent directory. A reader never sees half a
/// file, and a key is never readable with a wider mode, even briefly.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
    }
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        // A leftover temp file keeps its old mode: set it explicitly.
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        f.write_all(contents)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// glibc tunable the data-plane processes (broker, agent) should run with: `memcpy` uses its
/// vector loop below 1 MiB instead of `rep movsb` from 2 KiB up. On AMD EPYC with glibc 2.36
/// (Debian bookworm) `rep movsb` is slow for the mutually misaligned copies userspace TLS makes
/// (a record's plaintext starts 5 bytes into its buffer): with this setting the broker and agent
/// used 22–25 % less CPU per GB on one stream (docs/benchmarks.md, tuning log). Harmless
/// elsewhere (a normal memcpy strategy). A tunable can only be set before the process starts, so
/// launchers set it: the container image (`compose/Dockerfile`), the registration-agent for the
/// tunnel-agent it supervises, the benchmark.
pub const GLIBC_TUNABLES_DATA_PLANE: &str = "glibc.cpu.x86_rep_movsb_threshold=1048576";

/// The `GLIBC_TUNABLES` value a launcher should give a data-plane child: the current one with
/// [`GLIBC_TUNABLES_DATA_PLANE`] appended, or `None` when the current environment already sets
/// the threshold (an operator's choice wins).
pub fn glibc_tunables_for_child(current: Option<&str>) -> Option<String> {
    match current.map(str::trim).filter(|c| !c.is_empty()) {
        Some(c) if c.contains("x86_rep_movsb_threshold") => None,
        Some(c) => Some(format!("{c}:{GLIBC_TUNABLES_DATA_PLANE}")),
        None => Some(GLIBC_TUNABLES_DATA_PLANE.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser, Debug)]
    struct Flags {
        #[command(flatten)]
        process: ProcessArgs,
    }

    #[test]
    fn worker_threads_refuses_zero_naming_the_flag() {
        use clap::Parser as _;
        let err = Flags::try_parse_from(["x", "--worker-threads", "0"]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("--worker-threads") && msg.contains("must be at least 1"),
            "{msg}"
        );
        let ok = Flags::try_parse_from(["x", "--worker-threads", "3"]).unwrap();
        assert_eq!(ok.process.data_plane_workers(), 3);
    }

    #[test]
    fn tunables_are_added_and_an_operator_setting_wins() {
        assert_eq!(
            glibc_tunables_for_child(None).as_deref(),
            Some(GLIBC_TUNABLES_DATA_PLANE)
        );
        assert_eq!(
            glibc_tunables_for_child(Some("glibc.malloc.arena_max=2")).unwrap(),
            format!("glibc.malloc.arena_max=2:{GLIBC_TUNABLES_DATA_PLANE}")
        );
        assert_eq!(
            glibc_tunables_for_child(Some("glibc.cpu.x86_rep_movsb_threshold=4096")),
            None
        );
    }
}
