//! The ztunnel discovery service (ZDS): how the agent hands ambient pods to ztunnel, exactly as
//! Istio's node agent does (`cni/pkg/nodeagent/ztunnelserver*.go`).
//!
//! ztunnel connects to the agent's `SOCK_SEQPACKET` socket and says hello; the agent sends
//! every enrolled pod it knows ([`Enrolled`]: an `AddWorkload` with the pod's network namespace
//! as `SCM_RIGHTS`, or a `KeepWorkload` when it has no namespace for it), then
//! `SnapshotSent`, after which ztunnel drops the pods it was not sent. From then on a new pod
//! goes to the newest connection ([`ZtunnelServer::add`], ztunnel opens its listeners inside
//! the namespace before it acks) and a removed pod to every connection
//! ([`ZtunnelServer::delete`]), so that both ztunnels of a rolling update agree. Every
//! message waits for its ack.

mod conn;
mod diag;
mod listener;
pub mod proto;
mod server;

pub use server::{Enrolled, ZtunnelServer};

/// Where ztunnel looks for the agent (Istio's `ZTUNNEL_UDS_ADDRESS` default).
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// What went wrong talking to ztunnel.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    /// No ztunnel is connected.
    #[error("no ztunnel is connected")]
    NotConnected,
    /// Another agent listens on the ZDS socket's path (istio-cni's, the node being handed back
    /// to it): ztunnel will be its.
    #[error(
        "another agent (istio-cni's) serves ztunnel's socket on this node now: the pod waits \
         for it"
    )]
    Yielded,
    /// ztunnel acked with an error.
    #[error("ztunnel refused: {0}")]
    Refused(String),
    /// ztunnel closed the connection.
    #[error("ztunnel closed the connection")]
    Closed,
    /// ztunnel sent something that is not ZDS.
    #[error("ztunnel sent something that is not ZDS: {0}")]
    Protocol(String),
    /// The socket failed (a timeout waiting for an ack among them).
    #[error("ztunnel's socket: {0}")]
    Io(#[source] std::io::Error),
}

impl ZdsError {
    fn io(errno: nix::errno::Errno) -> Self {
        Self::Io(std::io::Error::from(errno))
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::proto::{
        Ack, DelWorkload, KeepWorkload, SnapshotSent, Version, WorkloadRequest, WorkloadResponse,
        ZdsHello, workload_request::Payload, workload_response,
    };

    /// The bytes on the wire, worked out by hand from `zds.proto`'s field numbers: what
    /// ztunnel (built from the same file) reads and writes.
    #[test]
    fn messages_are_zds_on_the_wire() {
        let request = |payload| WorkloadRequest {
            payload: Some(payload),
        };
        let del = request(Payload::Del(DelWorkload { uid: "u".into() }));
        // field 2 (del), length 3: field 2 (uid), length 1, "u".
        assert_eq!(del.encode_to_vec(), [0x12, 3, 0x12, 1, b'u']);
        let keep = request(Payload::Keep(KeepWorkload { uid: "u".into() }));
        // field 5 (keep): field 1 (uid).
        assert_eq!(keep.encode_to_vec(), [0x2a, 3, 0x0a, 1, b'u']);
        let sent = request(Payload::SnapshotSent(SnapshotSent {}));
        assert_eq!(sent.encode_to_vec(), [0x1a, 0]);
        let hello = ZdsHello {
            version: Version::V1.into(),
        };
        assert_eq!(hello.encode_to_vec(), [0x08, 1]);
        let refused = WorkloadResponse::decode(&[0x0a, 3, 0x0a, 1, b'x'][..]).unwrap();
        assert_eq!(
            refused.payload,
            Some(workload_response::Payload::Ack(Ack { error: "x".into() }))
        );
    }
}
