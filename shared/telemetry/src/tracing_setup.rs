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
/// `TETHER_LOG_FORMAT=json` switches to JSON lines. Must be called inside a tokio runtime when
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
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed()
    };
    let mut provider = None;
    let otel_layer = match std::env::var(OTLP_ENDPOINT_ENV) {
        Ok(endpoint) if !endpoint.is_empty() => match build_provider(service) {
            Ok(p) => {
                let tracer = p.tracer(service.to_owned());
                provider = Some(p);
                Some(tracing_opentelemetry::layer().with_tracer(tracer))
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
