//! `meshcap-agent explain NAMESPACE/POD`: asks the running agent, over its socket, why a pod is
//! (not) captured and what is installed for it (docs/install.md, Troubleshooting).
use std::{path::Path, time::Duration};

use anyhow::Context as _;
use meshcap_agent::verify::Explanation;
use meshcap_cni::protocol::{self, Op, Request};

/// Prints the agent's answer for `pod` (`namespace/name`), as text or JSON.
pub fn explain(socket: &Path, pod: &str, json: bool) -> anyhow::Result<()> {
    let (namespace, name) = pod
        .split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
        .with_context(|| format!("{pod:?} is not NAMESPACE/POD"))?;
    let request = Request::new(Op::Explain {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    });
    let response = protocol::call(socket, &request, Duration::from_secs(30))
        .with_context(|| format!("asking the agent at {}", socket.display()))?;
    crate::commands::print_report(
        response.reply,
        json,
        "the agent sent no explanation (an agent older than explain?)",
        Explanation::to_text,
    )
}
