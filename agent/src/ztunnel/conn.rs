//! One ztunnel connection: a `SOCK_SEQPACKET` socket, one protobuf message per packet, on
//! which every request the agent sends waits for ztunnel's ack (Istio's
//! `ztunnelserver_linux.go`).

use std::{
    collections::HashSet,
    io::{IoSlice, IoSliceMut},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    sync::Mutex,
    time::Duration,
};

use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        socket::{
            ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg, setsockopt, sockopt,
        },
        time::TimeVal,
    },
};
use prost::Message;

use super::{
    ZdsError,
    proto::{WorkloadRequest, WorkloadResponse, ZdsHello, workload_request, workload_response},
};

/// How long a send or a reply may take (Istio's `readWriteDeadline`).
const DEADLINE: Duration = Duration::from_secs(5);
/// The largest message read (Istio's read buffer).
const MAX_MESSAGE: usize = 1024;

pub(super) struct Connection {
    socket: OwnedFd,
    /// The pods this ztunnel acked an add (or a keep) of and no delete since: the agent's own
    /// record of the exchange (ZDS has no query).
    served: Mutex<HashSet<String>>,
}

impl Connection {
    pub(super) fn new(socket: OwnedFd) -> Result<Self, ZdsError> {
        let deadline = TimeVal::new(i64::try_from(DEADLINE.as_secs()).unwrap_or(i64::MAX), 0);
        setsockopt(&socket, sockopt::ReceiveTimeout, &deadline).map_err(ZdsError::io)?;
        setsockopt(&socket, sockopt::SendTimeout, &deadline).map_err(ZdsError::io)?;
        Ok(Self {
            socket,
            served: Mutex::default(),
        })
    }

    /// ztunnel's first message.
    pub(super) fn read_hello(&self) -> Result<ZdsHello, ZdsError> {
        self.read()
    }

    /// Sends `request` (with `netns` as `SCM_RIGHTS` when given) and waits for its ack; an ack
    /// carrying an error is [`ZdsError::Refused`].
    pub(super) fn request(
        &self,
        request: &WorkloadRequest,
        netns: Option<BorrowedFd<'_>>,
    ) -> Result<(), ZdsError> {
        let bytes = request.encode_to_vec();
        let fds = netns.map(|fd| [fd.as_raw_fd()]);
        let rights: Vec<ControlMessage<'_>> = fds
            .iter()
            .map(|fds| ControlMessage::ScmRights(fds))
            .collect();
        sendmsg::<()>(
            self.socket.as_raw_fd(),
            &[IoSlice::new(&bytes)],
            &rights,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(ZdsError::io)?;
        let response: WorkloadResponse = self.read()?;
        match response.payload {
            Some(workload_response::Payload::Ack(ack)) if ack.error.is_empty() => {
                self.note_acked(request);
                Ok(())
            }
            Some(workload_response::Payload::Ack(ack)) => Err(ZdsError::Refused(ack.error)),
            None => Err(ZdsError::Protocol("a response without an ack".to_owned())),
        }
    }

    /// Whether this ztunnel acked `uid` (an add or a keep, and no delete since).
    pub(super) fn serves(&self, uid: &str) -> bool {
        self.served_uids().contains(uid)
    }

    fn note_acked(&self, request: &WorkloadRequest) {
        use workload_request::Payload;
        let mut served = self.served_uids();
        match &request.payload {
            Some(Payload::Add(add)) => {
                served.insert(add.uid.clone());
            }
            Some(Payload::Keep(keep)) => {
                served.insert(keep.uid.clone());
            }
            Some(Payload::Del(del)) => {
                served.remove(&del.uid);
            }
            Some(Payload::SnapshotSent(_)) | None => {}
        }
    }

    fn served_uids(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.served
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether ztunnel has closed its end (nothing it sends unasked is read here).
    pub(super) fn closed(&self) -> bool {
        // A closed peer leaves the socket shut down both ways: POLLHUP, reported unasked.
        let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::empty())];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => false,
            Ok(_) => fds[0]
                .revents()
                .is_none_or(|events| events.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)),
            Err(_) => true,
        }
    }

    fn read<T: Message + Default>(&self) -> Result<T, ZdsError> {
        let mut buf = [0u8; MAX_MESSAGE];
        let mut iov = [IoSliceMut::new(&mut buf)];
        let mut control = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let message = recvmsg::<()>(
            self.socket.as_raw_fd(),
            &mut iov,
            Some(&mut control),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(ZdsError::io)?;
        // ztunnel never sends descriptors; close any it did rather than leak them.
        for cmsg in message.cmsgs().map_err(ZdsError::io)? {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                for fd in fds {
                    // SAFETY: recvmsg just created the descriptor; nothing else owns it.
                    drop(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if message
            .flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC)
        {
            return Err(ZdsError::Protocol(format!(
                "a message longer than {MAX_MESSAGE} bytes"
            )));
        }
        let len = message.bytes;
        if len == 0 {
            return Err(ZdsError::Closed);
        }
        T::decode(&buf[..len]).map_err(|err| ZdsError::Protocol(err.to_string()))
    }
}
