//! `/healthz` (the process answers), `/readyz` (the agent serves CNI requests: backend open,
//! socket serving, pod source synced, plugin chained when this agent installs it) and
//! `/metrics` (Prometheus text), on the address given by `--http-listen`. The DaemonSet's
//! probes and scrape annotations name these paths (checked by `agent/tests/deploy.rs`).
use std::{net::SocketAddr, sync::Arc};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use tokio::net::TcpListener;

use crate::hub::Hub;

/// Liveness: answers while the runtime does.
pub const HEALTHZ: &str = "/healthz";
/// Readiness: 200 once the agent captures, 503 with the reason until then.
pub const READYZ: &str = "/readyz";
/// Prometheus text exposition.
pub const METRICS: &str = "/metrics";

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(hub): State<Arc<Hub>>) -> impl IntoResponse {
    match hub.readiness().not_ready_reason() {
        None => (StatusCode::OK, "ready\n".to_owned()),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        ),
    }
}

async fn metrics(State(hub): State<Arc<Hub>>) -> impl IntoResponse {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        hub.metrics_text().await,
    )
}

/// Binds the endpoint (so that the caller can report the address) and returns it with the
/// future that serves it until `shutdown` completes.
///
/// # Errors
/// When the address cannot be bound.
pub async fn bind(
    addr: SocketAddr,
    hub: Arc<Hub>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, impl Future<Output = std::io::Result<()>>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route(HEALTHZ, get(healthz))
        .route(READYZ, get(readyz))
        .route(METRICS, get(metrics))
        .with_state(hub);
    Ok((local, async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    }))
}
