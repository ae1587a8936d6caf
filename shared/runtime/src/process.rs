//! What every service's `main` does the same way: build the actix system on a multi-thread
//! tokio runtime, and publish bound addresses in a ready file for scripts and tests.

use std::path::Path;

/// An actix `System` whose arbiters run on a multi-thread tokio runtime (`workers` threads, or
/// one per CPU). Actors must be started inside its `block_on`: starting one under a plain
/// `#[tokio::main]` panics (no `LocalSet`).
pub fn actix_system(workers: Option<usize>) -> actix::SystemRunner {
    actix::System::with_tokio_rt(move || {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        if let Some(n) = workers {
            b.worker_threads(n);
        }
        b.enable_all().build().expect("tokio runtime")
    })
}

/// Writes `json` to `path` atomically (temp file + rename), so a reader never sees half a file.
pub fn write_ready_file(path: &Path, json: &serde_json::Value) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, json.to_string())?;
    std::fs::rename(&tmp, path)
}
