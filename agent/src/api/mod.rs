//! The ways into the agent, side by side: `socket` ([`Server`]), the plugin's UNIX socket (root
//! only, one bounded request per connection, and the only place the plugin's protocol is turned
//! into the hub's domain values and back), and [`http`], the health, readiness and metrics
//! endpoint. Both hand their work to [`crate::hub`]; nothing below imports this module.
pub mod http;
mod plugin_log;
mod socket;

pub use socket::{ApiError, Server, ServerConfig};
