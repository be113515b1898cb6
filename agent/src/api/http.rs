//! `/healthz` (the process answers), `/readyz` (the agent serves CNI requests: backend open,
//! socket serving, pod source synced, plugin chained when this agent installs it) and
//! `/metrics` (Prometheus text), where Istio's node agent serves them: health and readiness on
//! port 8000 (`constants.ReadinessPort`, `cni/pkg/nodeagent/healthServer.go`), metrics on port
//! 15014 (`--monitoring-port`, `cni/pkg/cmd/root.go`), each address its own setting
//! ([`Endpoints`]); or all three on one address (`--http-listen`, a private agent's default).
//! The DaemonSet's probes and scrape annotations name these paths and ports (checked by
//! `agent/tests/deploy.rs`).
use std::{net::SocketAddr, sync::Arc};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use tokio::net::TcpListener;

use crate::{hub::Hub, paths::Endpoints};

/// Liveness: answers while the runtime does.
pub const HEALTHZ: &str = "/healthz";
/// Readiness: 200 once the agent captures, 503 with the reason until then.
pub const READYZ: &str = "/readyz";
/// Prometheus text exposition.
pub const METRICS: &str = "/metrics";

/// What one listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serves {
    /// `/healthz` and `/readyz`.
    Health,
    /// `/metrics`.
    Metrics,
    /// All three.
    All,
}

impl Serves {
    /// What it is for and the setting that moves it, for an operator reading an error.
    const fn purpose(self) -> &'static str {
        match self {
            Self::Health => {
                "health and readiness (/healthz, /readyz; chart value meshcap.healthPort, flag \
                 --health-listen)"
            }
            Self::Metrics => {
                "metrics (/metrics; chart value meshcap.metricsPort, flag --metrics-listen)"
            }
            Self::All => "health, readiness and metrics (flag --http-listen)",
        }
    }
}

/// The listeners `endpoints` asks for: health and metrics apart, or one for both when they
/// share an address.
#[must_use]
pub fn listeners(endpoints: &Endpoints) -> Vec<(SocketAddr, Serves)> {
    match *endpoints {
        Endpoints::Combined(addr) => vec![(addr, Serves::All)],
        Endpoints::Split { health, metrics } if health == metrics && health.port() != 0 => {
            vec![(health, Serves::All)]
        }
        Endpoints::Split { health, metrics } => {
            vec![(health, Serves::Health), (metrics, Serves::Metrics)]
        }
    }
}

/// A listener that could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Another process listens on the port: with the node's network (`hostNetwork`), anything
    /// on the node can.
    #[error(
        "port {} on {} for {} is already in use on this node (the agent shares the node's \
         network): stop what listens there or give meshcap another port",
        .addr.port(), .addr.ip(), .serves.purpose()
    )]
    InUse {
        /// The address.
        addr: SocketAddr,
        /// What it was for.
        serves: Serves,
    },
    /// Any other failure.
    #[error("binding {addr} for {}: {source}", .serves.purpose())]
    Other {
        /// The address.
        addr: SocketAddr,
        /// What it was for.
        serves: Serves,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A bound listener, not serving yet.
pub struct Bound {
    listener: TcpListener,
    serves: Serves,
}

impl Bound {
    /// Binds `addr` for `serves`.
    ///
    /// # Errors
    /// When the address is in use or cannot be bound.
    pub async fn bind(addr: SocketAddr, serves: Serves) -> Result<Self, BindError> {
        let listener = TcpListener::bind(addr).await.map_err(|source| {
            if source.kind() == std::io::ErrorKind::AddrInUse {
                BindError::InUse { addr, serves }
            } else {
                BindError::Other {
                    addr,
                    serves,
                    source,
                }
            }
        })?;
        Ok(Self { listener, serves })
    }

    /// The address bound (the port the kernel chose for port 0).
    ///
    /// # Errors
    /// When the socket cannot say.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// What it serves.
    #[must_use]
    pub const fn serves(&self) -> Serves {
        self.serves
    }

    /// Serves until `shutdown` completes.
    pub fn serve(
        self,
        hub: Arc<Hub>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = std::io::Result<()>> {
        let mut app = Router::new();
        if self.serves != Serves::Metrics {
            app = app.route(HEALTHZ, get(healthz)).route(READYZ, get(readyz));
        }
        if self.serves != Serves::Health {
            app = app.route(METRICS, get(metrics));
        }
        let served =
            axum::serve(self.listener, app.with_state(hub)).with_graceful_shutdown(shutdown);
        std::future::IntoFuture::into_future(served)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_port_names_the_port_and_what_it_is_for() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let addr = taken.local_addr().expect("its address");
        let err = Bound::bind(addr, Serves::Health)
            .await
            .err()
            .expect("the port is taken");
        let message = err.to_string();
        assert!(
            message.starts_with(&format!(
                "port {} on 127.0.0.1 for health and readiness (/healthz, /readyz; chart value \
                 meshcap.healthPort",
                addr.port()
            )),
            "{message}"
        );
        assert!(message.contains("already in use on this node"), "{message}");
    }

    #[test]
    fn health_and_metrics_apart_or_together() {
        let at = |s: &str| s.parse::<SocketAddr>().expect("an address");
        assert_eq!(
            listeners(&Endpoints::default()),
            [
                (at("0.0.0.0:8000"), Serves::Health),
                (at("0.0.0.0:15014"), Serves::Metrics)
            ]
        );
        let same = Endpoints::Split {
            health: at("127.0.0.1:9000"),
            metrics: at("127.0.0.1:9000"),
        };
        assert_eq!(listeners(&same), [(at("127.0.0.1:9000"), Serves::All)]);
        assert_eq!(
            listeners(&Endpoints::Combined(at("127.0.0.1:0"))),
            [(at("127.0.0.1:0"), Serves::All)]
        );
    }
}
