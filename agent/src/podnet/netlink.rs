//! One synchronous rtnetlink socket for one visit to a pod's network namespace: requests are
//! sent and their answers read on the calling thread, which is inside the namespace for the
//! visit ([`super::run_in`]). No async runtime is built per request or per visit
//! (the socket belongs to the netns it was opened in, so it cannot be shared across pods).
use std::io;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkBuffer, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// Bytes read per `recv`: a netlink datagram never exceeds what the kernel fits in one
/// (`NLMSG_GOODSIZE`, a page or 8 KiB), and a dump sends one datagram per batch.
const RECV_BUFFER: usize = 64 * 1024;

/// The kernel's errno for a refused request, or `None` for any other failure.
#[must_use]
pub fn errno(err: &io::Error) -> Option<i32> {
    err.raw_os_error()
}

/// An open rtnetlink socket (see the module documentation).
pub struct Netlink {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace.
    ///
    /// # Errors
    /// When the kernel refuses the socket.
    pub fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// Sends `message` with `flags` (`NLM_F_CREATE`, `NLM_F_EXCL`, `NLM_F_DUMP`, ...) and
    /// collects the answers: for a dump every message until its end, for any other request
    /// the kernel's acknowledgement, which is always asked for so that no refusal is missed.
    ///
    /// # Errors
    /// The kernel's refusal as an [`io::Error`] carrying its errno ([`errno`]), or a socket
    /// failure.
    pub fn request(
        &mut self,
        message: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        self.sequence = self.sequence.wrapping_add(1);
        let mut request = NetlinkMessage::from(message);
        request.header.flags = NLM_F_REQUEST | flags | if dump { 0 } else { NLM_F_ACK };
        request.header.sequence_number = self.sequence;
        request.finalize();
        let mut bytes = vec![0; request.buffer_len()];
        request.serialize(&mut bytes);
        self.socket.send(&bytes, 0)?;
        let mut answers = Vec::new();
        loop {
            self.buffer.clear();
            let len = self.socket.recv(&mut self.buffer, 0)?;
            if len > self.buffer.len() {
                return Err(io::Error::other(format!(
                    "netlink answer of {len} bytes exceeds the {RECV_BUFFER}-byte buffer"
                )));
            }
            let mut offset = 0;
            while offset < self.buffer.len() {
                let datagram = &self.buffer[offset..];
                let length = NetlinkBuffer::new_checked(datagram)
                    .map_err(|e| io::Error::other(format!("malformed netlink answer: {e}")))?
                    .length() as usize;
                let answer =
                    NetlinkMessage::<RouteNetlinkMessage>::deserialize(&datagram[..length])
                        .map_err(|e| io::Error::other(format!("malformed netlink answer: {e}")))?;
                offset += length.max(1).next_multiple_of(4);
                if answer.header.sequence_number != self.sequence {
                    // A late answer to an earlier request of this session: not ours.
                    continue;
                }
                match answer.payload {
                    NetlinkPayload::Error(error) => {
                        return match error.code {
                            // The acknowledgement: an error message without an error.
                            None => Ok(answers),
                            Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(answers),
                    NetlinkPayload::InnerMessage(inner) => answers.push(inner),
                    _ => {}
                }
            }
        }
    }
}
