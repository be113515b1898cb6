//! ZDS on the real kernel: the agent's ztunnel server hands real network namespaces to a
//! stand-in ztunnel (`meshcap-ztunnel`), which opens ztunnel's in-pod listeners inside each,
//! as Istio's node agent and ztunnel do: the snapshot on connect (adds with the namespace,
//! keeps without), live adds to the newest ztunnel, deletes to all, refusals reported, a
//! ztunnel restart served again from the snapshot.
use std::{
    fs::File,
    os::{fd::AsFd as _, unix::fs::MetadataExt as _},
    path::PathBuf,
    time::{Duration, Instant},
};

use meshcap_agent::ztunnel::{Enrolled, ZdsError, ZtunnelServer, proto::WorkloadInfo};
use meshcap_tests::{Netns, Placement, Proc, bin, dial, require_root, unique_name};

/// A pod for the server: a network namespace and its uid.
struct TestPod {
    uid: &'static str,
    netns: Netns,
}

impl TestPod {
    fn new(uid: &'static str) -> Self {
        Self {
            uid,
            netns: Netns::new("mc-zds-pod").expect("netns"),
        }
    }

    fn inode(&self) -> u64 {
        std::fs::metadata(self.netns.path()).expect("netns").ino()
    }

    fn workload(&self) -> WorkloadInfo {
        WorkloadInfo {
            name: format!("pod-{}", self.uid),
            namespace: "default".to_owned(),
            service_account: "app".to_owned(),
        }
    }

    fn enrolled(&self) -> Enrolled {
        Enrolled {
            uid: self.uid.to_owned(),
            workload: self.workload(),
            netns: Some(File::open(self.netns.path()).expect("netns").into()),
        }
    }

    fn add_line(&self) -> String {
        format!("add {} {} default/pod-{}", self.uid, self.inode(), self.uid)
    }

    /// Who answers TCP 15006 inside the pod (ztunnel's inbound listener, once served).
    fn inbound_listener(&self) -> Option<String> {
        let at = Placement {
            netns: &self.netns,
            cgroup: None,
            uid: 0,
            gid: 0,
        };
        dial(at, "tcp:127.0.0.1:15006", None)
            .expect("dial")
            .map(|report| format!("{}:{}", report.server, report.listener))
    }
}

fn socket_path() -> PathBuf {
    std::env::temp_dir().join(format!("{}.sock", unique_name("mc-zds")))
}

/// A stand-in ztunnel, in a namespace of its own as ztunnel's pod is.
fn ztunnel(home: &Netns, socket: &std::path::Path, refuse: &[&str]) -> Proc {
    let at = Placement {
        netns: home,
        cgroup: None,
        uid: 0,
        gid: 0,
    };
    let socket = socket.to_string_lossy().into_owned();
    let mut args = vec!["--socket", socket.as_str()];
    for uid in refuse {
        args.extend_from_slice(&["--refuse", uid]);
    }
    Proc::spawn(at, &bin::ztunnel(), &args).expect("meshcap-ztunnel")
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ztunnel_is_sent_the_snapshot_then_each_add_and_delete() {
    require_root();
    let (a, c, d) = (TestPod::new("a"), TestPod::new("c"), TestPod::new("d"));
    let home = Netns::new("mc-zds-zt").expect("netns");
    let socket = socket_path();
    let b = Enrolled {
        uid: "b".to_owned(),
        workload: WorkloadInfo::default(),
        netns: None,
    };
    let snapshot = snapshot_of(vec![a.enrolled(), b]);
    let server = ZtunnelServer::start(&socket, snapshot, || {}).expect("server");

    let no_one = server.add(
        "c",
        c.workload(),
        File::open(c.netns.path()).unwrap().as_fd(),
    );
    assert!(matches!(no_one, Err(ZdsError::NotConnected)), "{no_one:?}");
    assert_eq!(c.inbound_listener(), None);

    let mut zt = ztunnel(&home, &socket, &["d"]);
    assert_eq!(zt.wait_line().unwrap(), a.add_line());
    assert_eq!(zt.wait_line().unwrap(), "keep b");
    assert_eq!(zt.wait_line().unwrap(), "snapshot_sent");
    assert_eq!(a.inbound_listener().as_deref(), Some("ztunnel:15006"));
    assert_eq!(server.connected(), 1);

    let netns_c = File::open(c.netns.path()).unwrap();
    server
        .add("c", c.workload(), netns_c.as_fd())
        .expect("add c");
    assert_eq!(zt.wait_line().unwrap(), c.add_line());
    assert_eq!(c.inbound_listener().as_deref(), Some("ztunnel:15006"));

    let refused = server.add(
        "d",
        d.workload(),
        File::open(d.netns.path()).unwrap().as_fd(),
    );
    assert!(
        matches!(&refused, Err(ZdsError::Refused(why)) if why == "refusing d"),
        "{refused:?}"
    );
    assert_eq!(zt.wait_line().unwrap(), "refused d");
    assert_eq!(d.inbound_listener(), None);

    server.delete("c").expect("delete c");
    assert_eq!(zt.wait_line().unwrap(), "del c");
    assert_eq!(c.inbound_listener(), None);

    // ztunnel restarts: the agent notices, and the new one is sent the snapshot again.
    drop(zt);
    wait_until("the agent saw ztunnel go", || server.connected() == 0);
    assert_eq!(
        a.inbound_listener(),
        None,
        "the old ztunnel's listeners died with it"
    );
    let mut zt = ztunnel(&home, &socket, &[]);
    assert_eq!(zt.wait_line().unwrap(), a.add_line());
    assert_eq!(zt.wait_line().unwrap(), "keep b");
    assert_eq!(zt.wait_line().unwrap(), "snapshot_sent");
    assert_eq!(a.inbound_listener().as_deref(), Some("ztunnel:15006"));
}

#[test]
fn during_a_ztunnel_rolling_update_adds_go_to_the_newest_and_deletes_to_both() {
    require_root();
    let (a, e) = (TestPod::new("a"), TestPod::new("e"));
    let home = Netns::new("mc-zds-zt").expect("netns");
    let socket = socket_path();
    let snapshot = snapshot_of(vec![a.enrolled()]);
    let server = ZtunnelServer::start(&socket, snapshot, || {}).expect("server");
    let mut old = ztunnel(&home, &socket, &[]);
    for expected in [a.add_line(), "snapshot_sent".to_owned()] {
        assert_eq!(old.wait_line().unwrap(), expected);
    }
    let mut new = ztunnel(&home, &socket, &[]);
    for expected in [a.add_line(), "snapshot_sent".to_owned()] {
        assert_eq!(new.wait_line().unwrap(), expected);
    }
    assert_eq!(server.connected(), 2);

    let netns_e = File::open(e.netns.path()).unwrap();
    server
        .add("e", e.workload(), netns_e.as_fd())
        .expect("add e");
    assert_eq!(new.wait_line().unwrap(), e.add_line());
    server.delete("e").expect("delete e");
    assert_eq!(new.wait_line().unwrap(), "del e");
    // The old ztunnel's next line is the delete: it was never sent the add.
    assert_eq!(old.wait_line().unwrap(), "del e");
}

/// What the agent would send each connecting ztunnel: these pods, every time.
fn snapshot_of(pods: Vec<Enrolled>) -> impl Fn() -> Vec<Enrolled> + Send + Sync + 'static {
    move || {
        pods.iter()
            .map(|pod| Enrolled {
                uid: pod.uid.clone(),
                workload: pod.workload.clone(),
                netns: pod.netns.as_ref().map(|fd| fd.try_clone().expect("dup")),
            })
            .collect()
    }
}
