//! Tracing subscriber and OpenTelemetry exporter setup.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Environment variable that switches OTLP export on (OpenTelemetry standard).
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Flushes and stops the OpenTelemetry exporter when dropped.
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            // The batch exporter's shutdown blocks; never run it on an async worker.
            let join = std::thread::spawn(move || {
                let _ = p.shutdown();
            });
            let _ = join.join();
        }
    }
}

/// Installs the global subscriber for `service`. Log level from `RUST_LOG` (default `info`);
/// `TETHER_LOG_FORMAT=json` switches to JSON lines. Text lines are coloured only when stderr is
/// a terminal and `NO_COLOR` is unset ([`use_colour`]): a log file, a pipe or a container's log
/// gets plain text. Must be called inside a tokio runtime when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the exporter uses tonic).
pub fn init_tracing(service: &str) -> TelemetryGuard {
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("TETHER_LOG_FORMAT").is_ok_and(|v| v == "json");
    let fmt_layer = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        tracing_subscriber::fmt::layer()
            .with_ansi(use_colour(
                terminal,
                std::env::var_os("NO_COLOR").as_deref(),
            ))
            .with_writer(std::io::stderr)
            .boxed()
    };
    let mut provider = None;
    let otel_layer = match std::env::var(OTLP_ENDPOINT_ENV) {
        Ok(endpoint) if !endpoint.is_empty() => match build_provider(service) {
            Ok(p) => {
                let tracer = p.tracer(service.to_owned());
                provider = Some(p);
                // No `target` attribute for the tracing target: the stream spans have a field
                // of that name (the dialled address), and `code.module.name` names the module.
                Some(
                    tracing_opentelemetry::layer()
                        .with_tracer(tracer)
                        .with_target(false),
                )
            }
            Err(e) => {
                eprintln!("{service}: OTLP export to {endpoint} disabled: {e}");
                None
            }
        },
        _ => None,
    };
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt_layer)
        .with(otel_layer)
        .try_init();
    TelemetryGuard { provider }
}

/// Whether text log lines get ANSI colours: only on a terminal, and not when `NO_COLOR` is set
/// to a non-empty value (<https://no-color.org>). tracing-subscriber's own default colours every
/// line wherever it goes, which left escape codes in log files and container logs (and cost a
/// formatting pass per span field).
pub fn use_colour(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

fn build_provider(
    service: &str,
) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_timeout(std::time::Duration::from_secs(5))
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.to_owned())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

#[cfg(test)]
mod tests {
    use super::use_colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(use_colour(true, Some(OsStr::new(""))));
        assert!(!use_colour(true, Some(OsStr::new("1"))));
        assert!(!use_colour(false, None));
        assert!(!use_colour(false, Some(OsStr::new(""))));
    }
}
