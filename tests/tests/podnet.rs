//! A visit to a pod's network namespace (`podnet::run_in`) takes the calling thread in and
//! brings it back where it was: after the work returns, after it panics, and from a visit
//! inside a visit. The agent's blocking threads visit one pod after another; one left behind
//! would do the next pod's work, or the agent's own, in the wrong namespace. (Namespaces are
//! told apart by inode, which every kernel reports; netns cookies need 5.14.)
use std::{fs, os::unix::fs::MetadataExt as _, path::Path};

use meshcap_agent::podnet::{self, PodNetError};
use meshcap_tests::{Netns, require_root};

/// The inode of a network namespace file.
fn inode(path: &Path) -> u64 {
    fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .ino()
}

/// The calling thread's network namespace.
fn here() -> u64 {
    inode(Path::new("/proc/thread-self/ns/net"))
}

#[test]
fn a_visit_returns_the_thread_where_it_was() {
    require_root();
    let home = here();
    let (a, b) = (
        Netns::new("mc-visit-a").expect("netns"),
        Netns::new("mc-visit-b").expect("netns"),
    );
    let (in_a, in_b) = (inode(&a.path()), inode(&b.path()));
    assert!(home != in_a && in_a != in_b);

    assert_eq!(podnet::run_in(&a.path(), |_| here()).expect("visit"), in_a);
    assert_eq!(here(), home);

    let panicked = podnet::run_in(&a.path(), |_| -> () { panic!("the work inside failed") });
    assert!(
        matches!(&panicked, Err(PodNetError::Panicked(path)) if *path == a.path()),
        "{panicked:?}"
    );
    assert_eq!(here(), home);

    let nested = podnet::run_in(&a.path(), |_| {
        let inner = podnet::run_in(&b.path(), |_| here()).expect("inner visit");
        (inner, here())
    })
    .expect("outer visit");
    assert_eq!(
        nested,
        (in_b, in_a),
        "the inner visit returns to the outer one's netns"
    );
    assert_eq!(here(), home);

    let missing = a.path().with_file_name("mc-visit-never-made");
    let refused = podnet::run_in(&missing, |_| here());
    assert!(
        matches!(&refused, Err(PodNetError::Open { path, .. }) if *path == missing),
        "{refused:?}"
    );
    assert_eq!(here(), home);
}
