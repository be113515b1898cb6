//! A stand-in for ztunnel in end-to-end tests: it speaks ZDS to the agent's socket as ztunnel
//! does (istio/ztunnel `src/inpod/`), and serves each pod it is handed inside the pod's own
//! network namespace, with ztunnel's in-pod listeners (a `meshcap-standin` named `ztunnel`,
//! every socket marked 0x539 as ztunnel marks its own, and bound with `SO_REUSEPORT` as
//! ztunnel's are, so that two ztunnels serve a pod during an update): TCP 15001 (outbound),
//! 15006 (inbound plaintext) and 15008 (HBONE) on every address, DNS on 127.0.0.1:15053 and
//! [::1]:15053 (UDP and TCP). Outbound connections to an address given with `--mesh IP` (a
//! workload of the mesh, as ztunnel's configuration names them) go over HBONE: from the pod,
//! marked, to IP:15008, whose listener (the far pod's, served by this stand-in too) carries
//! them to the app from the client's address; mTLS and HTTP/2 are left out
//! (`meshcap-standin`'s `+hbone`).
//!
//! `meshcap-ztunnel --socket PATH [--refuse UID]... [--mesh IP]... [--acks-only]` says hello
//! (version 1), then prints one line per message and acks it: `add UID NETNS-INODE
//! NAMESPACE/NAME` once the pod's listeners are up, `keep UID`, `del UID` once they are gone,
//! `snapshot_sent` (after dropping the pods the snapshot did not name, as ztunnel does), and
//! `refused UID` for a pod it was told to refuse (or one handed without a network namespace).
//! As ztunnel does, it outlives the agent: when the agent closes the socket (a restart) it
//! connects again, keeps serving its pods, and drops those the new snapshot does not name. Its
//! listeners die with it. With `--acks-only` it opens no listener (the benchmark runs its own
//! proxy in the pod) and only acks.
use std::{
    collections::{HashMap, HashSet},
    io::{BufRead as _, BufReader, IoSliceMut, Write as _},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::process::CommandExt as _,
    },
    process::{Child, Command, Stdio},
};

use anyhow::{Context as _, bail};
use meshcap_agent::ztunnel::proto::{
    Ack, Version, WorkloadRequest, WorkloadResponse, ZdsHello, workload_request::Payload,
    workload_response,
};
use nix::sys::socket::{
    AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr, connect, recvmsg,
    send, socket,
};
use prost::Message as _;

/// ztunnel's in-pod listeners, as it opens them (`src/proxy`, `src/dns`): dual-stack on `[::]`,
/// so IPv4 connections arrive on IPv6 sockets as IPv4-mapped ones; DNS on localhost, both
/// families (istio/ztunnel 62d8265 `src/config.rs`: `Address::Localhost` with IPv6 on localhost).
/// The outbound and plaintext inbound ones hold each connection open (`+hold`), as ztunnel does
/// a proxied one, so that a test can keep a captured connection across what happens to the pod.
const LISTENERS: [&str; 7] = [
    "tcp:[::]:15001+hold+dualstack",
    "tcp:[::]:15006+hold+dualstack",
    "tcp:[::]:15008+hbone+dualstack",
    "udp:127.0.0.1:15053",
    "tcp:127.0.0.1:15053",
    "udp:[::1]:15053",
    "tcp:[::1]:15053",
];

/// A pod being served: its listeners' process, killed on drop.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        // Our own child, by its pid.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() -> anyhow::Result<()> {
    let mut socket_path = None;
    let mut refuse = HashSet::new();
    let mut listen = true;
    let mut mesh = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--socket" => socket_path = Some(args.next().context("--socket needs a path")?),
            "--refuse" => {
                refuse.insert(args.next().context("--refuse needs a uid")?);
            }
            "--mesh" => mesh.push(args.next().context("--mesh needs an address")?),
            "--acks-only" => listen = false,
            other => bail!("unknown argument {other}"),
        }
    }
    let path = socket_path.context("--socket is required")?;
    let mut served: HashMap<String, Served> = HashMap::new();
    loop {
        let fd = connect_when_listening(&path)?;
        let serving = Serving {
            refuse: &refuse,
            listen,
            mesh: &mesh,
        };
        serve_connection(&fd, &serving, &mut served)?;
    }
}

/// Connects to the agent's socket, waiting for it to be there (an agent restarting).
fn connect_when_listening(path: &str) -> anyhow::Result<OwnedFd> {
    loop {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        match connect(fd.as_raw_fd(), &UnixAddr::new(path)?) {
            Ok(()) => return Ok(fd),
            Err(nix::errno::Errno::ENOENT | nix::errno::Errno::ECONNREFUSED) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(err) => return Err(err).with_context(|| format!("connecting to {path}")),
        }
    }
}

/// How pods are served: the uids refused, whether listeners are opened, the mesh's addresses.
struct Serving<'a> {
    refuse: &'a HashSet<String>,
    listen: bool,
    mesh: &'a [String],
}

/// One connection: hello, then every request acked, until the agent closes it or goes (a
/// killed agent resets the connection: ztunnel reconnects then too).
fn serve_connection(
    fd: &OwnedFd,
    serving: &Serving<'_>,
    served: &mut HashMap<String, Served>,
) -> anyhow::Result<()> {
    let hello = ZdsHello {
        version: Version::V1.into(),
    };
    if gone(send(
        fd.as_raw_fd(),
        &hello.encode_to_vec(),
        MsgFlags::empty(),
    ))? {
        return Ok(());
    }
    let mut in_snapshot: Option<HashSet<String>> = Some(HashSet::new());
    loop {
        let Some((request, netns)) = receive(fd.as_raw_fd())? else {
            return Ok(());
        };
        let mut error = String::new();
        match request.payload.context("a request without a payload")? {
            Payload::Add(add) => {
                let workload = add.workload_info.unwrap_or_default();
                let pod = format!("{}/{}", workload.namespace, workload.name);
                match (netns, serving.refuse.contains(&add.uid)) {
                    (Some(netns), false) => {
                        let inode = netns_inode(&netns)?;
                        if serving.listen && !served.contains_key(&add.uid) {
                            served.insert(add.uid.clone(), serve(&netns, serving.mesh)?);
                        }
                        say(&format!("add {} {inode} {pod}", add.uid));
                    }
                    _ => {
                        error = format!("refusing {}", add.uid);
                        say(&format!("refused {}", add.uid));
                    }
                }
                if let Some(seen) = in_snapshot.as_mut() {
                    seen.insert(add.uid);
                }
            }
            Payload::Keep(keep) => {
                say(&format!("keep {}", keep.uid));
                if let Some(seen) = in_snapshot.as_mut() {
                    seen.insert(keep.uid);
                }
            }
            Payload::Del(del) => {
                served.remove(&del.uid);
                say(&format!("del {}", del.uid));
            }
            Payload::SnapshotSent(_) => {
                let seen = in_snapshot.take().unwrap_or_default();
                served.retain(|uid, _| seen.contains(uid));
                say("snapshot_sent");
            }
        }
        let ack = WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack { error })),
        };
        if gone(send(
            fd.as_raw_fd(),
            &ack.encode_to_vec(),
            MsgFlags::empty(),
        ))? {
            return Ok(());
        }
    }
}

/// Whether a send found the agent gone (its end closed or reset).
fn gone(sent: nix::Result<usize>) -> anyhow::Result<bool> {
    match sent {
        Ok(_) => Ok(false),
        Err(nix::errno::Errno::EPIPE | nix::errno::Errno::ECONNRESET) => Ok(true),
        Err(err) => Err(err.into()),
    }
}

/// The next request and the descriptor that came with it; `None` once the agent closed or
/// reset the connection.
fn receive(fd: RawFd) -> anyhow::Result<Option<(WorkloadRequest, Option<OwnedFd>)>> {
    let mut buf = [0u8; 1024];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let mut control = nix::cmsg_space!([RawFd; 1]);
    let message = match recvmsg::<()>(fd, &mut iov, Some(&mut control), MsgFlags::MSG_CMSG_CLOEXEC)
    {
        Err(nix::errno::Errno::ECONNRESET) => return Ok(None),
        received => received?,
    };
    let mut netns = None;
    for cmsg in message.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for raw in fds {
                // SAFETY: recvmsg just created the descriptor; nothing else owns it.
                netns = Some(unsafe { OwnedFd::from_raw_fd(raw) });
            }
        }
    }
    let len = message.bytes;
    if len == 0 {
        return Ok(None);
    }
    Ok(Some((WorkloadRequest::decode(&buf[..len])?, netns)))
}

/// The inode of a network namespace descriptor (ztunnel checks it is one, too).
fn netns_inode(netns: &OwnedFd) -> anyhow::Result<u64> {
    /// `ioctl(NS_GET_NSTYPE)`: which kind of namespace a descriptor is.
    const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
    // SAFETY: an argument-less ioctl on our own descriptor.
    let kind = unsafe { libc::ioctl(netns.as_raw_fd(), NS_GET_NSTYPE) };
    anyhow::ensure!(
        kind == libc::CLONE_NEWNET,
        "handed a descriptor that is not a network namespace"
    );
    Ok(nix::sys::stat::fstat(netns)?.st_ino)
}

/// Starts ztunnel's listeners inside `netns` and waits until they are up; outbound connections
/// to `mesh` go over HBONE.
fn serve(netns: &OwnedFd, mesh: &[String]) -> anyhow::Result<Served> {
    let standin = std::env::current_exe()?.with_file_name("meshcap-standin");
    let mut command = Command::new(&standin);
    command
        .args(["--name", "ztunnel", "--mark", "0x539", "--reuseport"])
        .args(LISTENERS.iter().flat_map(|l| ["--listen", l]))
        .args(mesh.iter().flat_map(|ip| ["--hbone", ip.as_str()]))
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let raw = netns.as_raw_fd();
    // SAFETY: only async-signal-safe syscalls on a descriptor opened before the fork.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                || libc::setns(raw, libc::CLONE_NEWNET) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {}", standin.display()))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    let served = Served(child);
    anyhow::ensure!(line.trim() == "ready", "the listeners said {line:?}");
    Ok(served)
}

fn say(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}
