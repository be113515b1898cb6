//! Netlink TC, for kernels without TCX (before Linux 6.6, e.g. Debian 12's 6.1): a pod's stub
//! is a `cls_bpf` direct-action filter on the ingress of a `clsact` qdisc, at meshcap's own
//! priority and handle ([`PRIORITY`], [`HANDLE`]), so that meshcap finds, checks and deletes
//! exactly its filter and never another tool's. Such a filter outlives the agent by itself
//! (it holds its program); it dies with the interface.
//!
//! Spoken directly over rtnetlink (the crate the iptables backend already uses for its
//! policy route) rather than through `tc`: no fork per interface, the kernel's own errors,
//! and the program id read back from the filter dump instead of parsed from `tc`'s text.
//! Must run on a thread inside the pod's netns (the netlink socket belongs to the netns it is
//! opened in).
use std::os::fd::{AsFd, AsRawFd as _};

use futures::StreamExt as _;
use rtnetlink::{
    Handle,
    packet_core::{
        NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage,
        NetlinkPayload,
    },
    packet_route::{
        RouteNetlinkMessage,
        tc::{TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcHeader, TcMessage, TcOption},
    },
};

/// meshcap's filter priority: just after the first one the kernel gives a filter added
/// without one (0xc000, and lower for later ones), so that, like a TCX link appended last,
/// meshcap's stub runs after what other tools attached before it.
pub const PRIORITY: u16 = 0xc001;
/// meshcap's filter handle at [`PRIORITY`].
pub const HANDLE: u32 = 1;

const EEXIST: i32 = 17;
const ENOENT: i32 = 2;
const EINVAL: i32 = 22;
/// `ETH_P_ALL`: the filter sees every protocol.
const ETH_P_ALL: u16 = 0x0003;

/// `ffff:0`, the clsact qdisc's own handle.
const CLSACT_HANDLE: TcHandle = TcHandle {
    major: 0xffff,
    minor: 0,
};
/// `ffff:fff2`: clsact's ingress hook, the filters' parent.
const INGRESS: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_INGRESS,
};
/// `ffff:fff3`: clsact's egress hook.
const EGRESS: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_EGRESS,
};

/// A netlink TC request that failed.
#[derive(Debug, thiserror::Error)]
pub enum TcError {
    /// The kernel refused.
    #[error("{what}: {source}")]
    Kernel {
        /// The request, as `tc` would spell it.
        what: String,
        /// The kernel's answer.
        #[source]
        source: rtnetlink::Error,
    },
    /// No netlink socket or runtime.
    #[error("{what}: {source}")]
    Socket {
        /// What was being set up.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

fn fail(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> TcError {
    let what = what.into();
    move |source| TcError::Kernel { what, source }
}

fn errno(err: &rtnetlink::Error) -> Option<i32> {
    match err {
        rtnetlink::Error::NetlinkError(msg) => msg.code.map(|c| -c.get()),
        _ => None,
    }
}

/// Where [`attach`] put meshcap's filter, recorded in the pins (as a pin name) and handed
/// back to [`find`] and [`detach`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Filter {
    /// The filter's priority (`tc ... pref`).
    pub priority: u16,
    /// Its handle at that priority.
    pub handle: u32,
    /// Whether meshcap added the clsact qdisc (it was not there): only then may it remove it,
    /// and only when no filter is left on it.
    pub created_qdisc: bool,
}

impl Filter {
    /// The record's pin name: `filter@<priority>@<handle>@<own-qdisc|shared-qdisc>`.
    #[must_use]
    pub fn pin_name(&self) -> String {
        let qdisc = if self.created_qdisc {
            "own-qdisc"
        } else {
            "shared-qdisc"
        };
        format!("filter@{}@{}@{qdisc}", self.priority, self.handle)
    }

    /// The inverse of [`Self::pin_name`].
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        let mut parts = name.strip_prefix("filter@")?.split('@');
        let filter = Self {
            priority: parts.next()?.parse().ok()?,
            handle: parts.next()?.parse().ok()?,
            created_qdisc: match parts.next()? {
                "own-qdisc" => true,
                "shared-qdisc" => false,
                _ => return None,
            },
        };
        parts.next().is_none().then_some(filter)
    }

    fn info(&self) -> u32 {
        (u32::from(self.priority) << 16) | u32::from(ETH_P_ALL.to_be())
    }
}

/// One netlink socket, on a private single-threaded runtime, for every TC request of one
/// visit to a pod's netns (opened on first use, in the netns of the thread that first uses
/// it; this is a blocking call on a netns thread, never on the agent's runtime). A pod's
/// interfaces share it instead of paying a runtime and a socket per request.
#[derive(Default)]
pub struct Session {
    open: Option<(tokio::runtime::Runtime, Handle, tokio::task::JoinHandle<()>)>,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some((_, _, connection)) = &self.open {
            connection.abort();
        }
    }
}

impl Session {
    /// Runs `f` with the session's netlink handle.
    fn run<T>(&mut self, f: impl AsyncFnOnce(Handle) -> Result<T, TcError>) -> Result<T, TcError> {
        let (runtime, handle, _) = match &mut self.open {
            Some(open) => open,
            None => self.open.insert(open()?),
        };
        runtime.block_on(f(handle.clone()))
    }

    /// Attaches `prog` (a direct-action classifier) on the ingress of interface `ifindex`:
    /// adds the clsact qdisc when there is none, then creates meshcap's filter, or replaces
    /// its program (atomically) when a previous run left one without a record.
    ///
    /// # Errors
    /// When the kernel refuses, e.g. because another qdisc than clsact holds the ingress
    /// handle.
    pub fn attach(
        &mut self,
        ifindex: u32,
        ifname: &str,
        prog: impl AsFd,
        name: &str,
    ) -> Result<Filter, TcError> {
        attach(self, ifindex, ifname, prog, name)
    }

    /// The program id of the `bpf` filter at `filter`'s place on the ingress of `ifindex`,
    /// if there is one.
    ///
    /// # Errors
    /// When the filters cannot be listed.
    pub fn find(
        &mut self,
        ifindex: u32,
        ifname: &str,
        filter: Filter,
    ) -> Result<Option<u32>, TcError> {
        find(self, ifindex, ifname, filter)
    }

    /// Deletes meshcap's filter from the ingress of `ifindex` when it runs `prog_id` (a
    /// filter at that place with another program is not meshcap's record: left alone), then
    /// the clsact qdisc when meshcap added it and no filter is left on it. Absent ones are
    /// fine.
    ///
    /// # Errors
    /// When the kernel refuses.
    pub fn detach(
        &mut self,
        ifindex: u32,
        ifname: &str,
        prog_id: u32,
        filter: Filter,
    ) -> Result<(), TcError> {
        detach(self, ifindex, ifname, prog_id, filter)
    }
}

fn attach(
    tc: &mut Session,
    ifindex: u32,
    ifname: &str,
    prog: impl AsFd,
    name: &str,
) -> Result<Filter, TcError> {
    let prog_fd = u32::try_from(prog.as_fd().as_raw_fd()).unwrap_or_default();
    tc.run(async |mut handle| {
        let qdisc = TcMessage::from_parts(
            header(ifindex, CLSACT_HANDLE, TcHandle::CLSACT, 0),
            vec![TcAttribute::Kind("clsact".into())],
        );
        let created_qdisc = match request(
            &mut handle,
            RouteNetlinkMessage::NewQueueDiscipline(qdisc),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .await
        {
            Ok(_) => true,
            Err(e) if errno(&e) == Some(EEXIST) => false,
            Err(e) => return Err(fail(format!("tc qdisc add dev {ifname} clsact"))(e)),
        };
        let filter = Filter {
            priority: PRIORITY,
            handle: HANDLE,
            created_qdisc,
        };
        let message = TcMessage::from_parts(
            header(ifindex, HANDLE.into(), INGRESS, filter.info()),
            vec![
                TcAttribute::Kind("bpf".into()),
                TcAttribute::Options(vec![
                    TcOption::Bpf(TcFilterBpfOption::ProgFd(prog_fd)),
                    TcOption::Bpf(TcFilterBpfOption::ProgName(name.to_owned())),
                    TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
                ]),
            ],
        );
        request(
            &mut handle,
            RouteNetlinkMessage::NewTrafficFilter(message),
            NLM_F_CREATE,
        )
        .await
        .map_err(fail(format!(
            "tc filter replace dev {ifname} ingress pref {PRIORITY} handle {HANDLE:#x} bpf da"
        )))?;
        Ok(filter)
    })
}

fn find(
    tc: &mut Session,
    ifindex: u32,
    ifname: &str,
    filter: Filter,
) -> Result<Option<u32>, TcError> {
    tc.run(async |mut handle| {
        let filters = filters(&mut handle, ifindex, INGRESS)
            .await
            .map_err(fail(format!("tc filter show dev {ifname} ingress")))?;
        Ok(filters.iter().find_map(|found| {
            let ours = found.header.handle == TcHandle::from(filter.handle)
                && found.header.info >> 16 == u32::from(filter.priority)
                && found.attributes.contains(&TcAttribute::Kind("bpf".into()));
            if !ours {
                return None;
            }
            found
                .attributes
                .iter()
                .find_map(|attribute| match attribute {
                    TcAttribute::Options(options) => options.iter().find_map(|o| match o {
                        TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => Some(*id),
                        _ => None,
                    }),
                    _ => None,
                })
        }))
    })
}

fn detach(
    tc: &mut Session,
    ifindex: u32,
    ifname: &str,
    prog_id: u32,
    filter: Filter,
) -> Result<(), TcError> {
    if find(tc, ifindex, ifname, filter)? == Some(prog_id) {
        tc.run(async |mut handle| {
            let message = TcMessage::from_parts(
                header(ifindex, filter.handle.into(), INGRESS, filter.info()),
                vec![TcAttribute::Kind("bpf".into())],
            );
            match request(
                &mut handle,
                RouteNetlinkMessage::DelTrafficFilter(message),
                0,
            )
            .await
            {
                Err(e) if errno(&e) != Some(ENOENT) => Err(fail(format!(
                    "tc filter del dev {ifname} ingress pref {} handle {:#x} bpf",
                    filter.priority, filter.handle
                ))(e)),
                _ => Ok(()),
            }
        })?;
    }
    if !filter.created_qdisc {
        return Ok(());
    }
    tc.run(async |mut handle| {
        // Another tool's filters (either direction) mean the qdisc is shared by now.
        for parent in [INGRESS, EGRESS] {
            let left = filters(&mut handle, ifindex, parent)
                .await
                .map_err(fail(format!("tc filter show dev {ifname}")))?;
            if !left.is_empty() {
                return Ok(());
            }
        }
        let qdisc = TcMessage::from_parts(
            header(ifindex, CLSACT_HANDLE, TcHandle::CLSACT, 0),
            vec![TcAttribute::Kind("clsact".into())],
        );
        match request(
            &mut handle,
            RouteNetlinkMessage::DelQueueDiscipline(qdisc),
            0,
        )
        .await
        {
            Err(e) if !matches!(errno(&e), Some(ENOENT | EINVAL)) => {
                Err(fail(format!("tc qdisc del dev {ifname} clsact"))(e))
            }
            _ => Ok(()),
        }
    })
}

fn header(ifindex: u32, handle: TcHandle, parent: TcHandle, info: u32) -> TcHeader {
    TcHeader {
        index: i32::try_from(ifindex).unwrap_or_default(),
        handle,
        parent,
        info,
        ..TcHeader::default()
    }
}

/// Every filter on `parent` of `ifindex` (none when there is no clsact qdisc). The kernel
/// also lists each priority's classifier itself (handle 0), which never matches a filter.
async fn filters(
    handle: &mut Handle,
    ifindex: u32,
    parent: TcHandle,
) -> Result<Vec<TcMessage>, rtnetlink::Error> {
    let query = TcMessage::from_parts(header(ifindex, TcHandle::UNSPEC, parent, 0), vec![]);
    match request(
        handle,
        RouteNetlinkMessage::GetTrafficFilter(query),
        NLM_F_DUMP,
    )
    .await
    {
        Ok(messages) => Ok(messages
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewTrafficFilter(f) if f.header.handle != TcHandle::UNSPEC => {
                    Some(f)
                }
                _ => None,
            })
            .collect()),
        Err(e) if errno(&e) == Some(EINVAL) => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Sends one request and collects the answers, failing on the kernel's error. Requests other
/// than dumps ask for the kernel's acknowledgement, so that a refusal is never missed.
async fn request(
    handle: &mut Handle,
    message: RouteNetlinkMessage,
    flags: u16,
) -> Result<Vec<RouteNetlinkMessage>, rtnetlink::Error> {
    let mut request = NetlinkMessage::from(message);
    // (NLM_F_DUMP is two bits, one of which is NLM_F_EXCL's.)
    let ack = if flags & NLM_F_DUMP == NLM_F_DUMP {
        0
    } else {
        NLM_F_ACK
    };
    request.header.flags = NLM_F_REQUEST | ack | flags;
    let mut responses = handle.request(request)?;
    let mut out = Vec::new();
    while let Some(response) = responses.next().await {
        match response.payload {
            // An error message without a code is the ACK.
            NetlinkPayload::Error(e) if e.code.is_some() => {
                return Err(rtnetlink::Error::NetlinkError(e));
            }
            NetlinkPayload::InnerMessage(m) => out.push(m),
            _ => {}
        }
    }
    Ok(out)
}

/// A private single-threaded runtime and a netlink connection driven on it.
fn open() -> Result<(tokio::runtime::Runtime, Handle, tokio::task::JoinHandle<()>), TcError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|source| TcError::Socket {
            what: "starting a netlink runtime",
            source,
        })?;
    let (connection, handle, _) = {
        // The socket registers with the runtime it is created in.
        let _entered = runtime.enter();
        rtnetlink::new_connection().map_err(|source| TcError::Socket {
            what: "opening a netlink socket",
            source,
        })?
    };
    let connection = runtime.spawn(connection);
    Ok((runtime, handle, connection))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        for created_qdisc in [true, false] {
            let filter = Filter {
                priority: PRIORITY,
                handle: HANDLE,
                created_qdisc,
            };
            assert_eq!(Filter::parse(&filter.pin_name()), Some(filter));
        }
        assert_eq!(
            Filter::parse("filter@49153@1@own-qdisc"),
            Some(Filter {
                priority: 0xc001,
                handle: 1,
                created_qdisc: true
            })
        );
        for bad in [
            "filter@49153@1",
            "filter@49153@1@mine",
            "filter@x@1@own-qdisc",
            "filter@49153@1@own-qdisc@more",
            "pod@default@web@c1",
        ] {
            assert_eq!(Filter::parse(bad), None, "{bad}");
        }
    }

    /// Priority in the upper half, `ETH_P_ALL` in network order in the lower half, as `tc`
    /// sends `protocol all pref N`.
    #[test]
    fn info_is_priority_and_protocol() {
        let filter = Filter {
            priority: 0xc001,
            handle: 1,
            created_qdisc: false,
        };
        assert_eq!(filter.info() >> 16, 0xc001);
        assert_eq!(u16::from_be((filter.info() & 0xffff) as u16), 0x0003);
    }
}
