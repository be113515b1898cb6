//! The plugin ⇄ agent protocol: one request per connection on a UNIX socket.
//!
//! A message is a frame: a 4-byte big-endian length, then that many bytes of JSON. Every
//! message carries the protocol version `v`; a peer refuses a version it does not know with a
//! clear error instead of guessing. Requests are bounded by [`MAX_REQUEST_BYTES`], responses by
//! [`MAX_RESPONSE_BYTES`]; both sides put timeouts on every read and write.
//!
//! ```text
//! → {"v":1,"op":"add","pod":{"namespace":"default","name":"web","uid":"…","container_id":"…","netns":"/var/run/netns/cni-…","ifname":"eth0"}}
//! ← {"v":1,"status":"ok","outcome":"captured","message":"backend iptables, mode REDIRECT"}
//! ← {"v":1,"status":"error","kind":"invalid_pod","msg":"pod default/web: annotation …","details":""}
//! ```
//!
//! This module is shared: the plugin uses [`call`], the agent decodes with [`decode_request`]
//! and answers with [`encode`].
mod client;
mod frame;
mod message;

pub use client::{CallError, call};
pub use frame::{ProtocolError, check_len, decode_request, decode_response, encode, read_frame};
pub use message::{ErrorKind, LogLine, Op, Outcome, PodAttachment, Reply, Request, Response};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// The largest request body an agent accepts.
pub const MAX_REQUEST_BYTES: u32 = 64 * 1024;
/// The largest response body a client accepts (status reports list every captured pod).
pub const MAX_RESPONSE_BYTES: u32 = 8 * 1024 * 1024;
