//! The index: pod ids go round and skip those in use; interface keys and cookies are per pod.
use super::*;

#[test]
fn ids_go_round_and_skip_those_in_use() {
    let mut index = Index::default();
    index.use_id(2);
    assert_eq!(index.allocate(), 3);
    index.lists_mut(4).ports.push(PortKey::new(
        4,
        meshcap_common::PortKind::ExcludeOutbound,
        1,
    ));
    assert_eq!(index.allocate(), 5);
    assert_eq!(index.release(4).ports.len(), 1);
    assert!(index.release(4).ports.is_empty(), "released once");
    // 4 is free again, but ids go round first.
    assert_eq!(index.allocate(), 6);
    index.cursor = u32::MAX - 1;
    assert_eq!(index.allocate(), u32::MAX);
    assert_eq!(index.allocate(), 1, "0 is never an id");
    assert_eq!(index.allocate(), 4, "2, 3, 5 and 6 are in use");
}

#[test]
fn ifaces_and_cookies_are_per_pod() {
    let mut index = Index::default();
    let key = |netns, ifindex| IfaceKey {
        netns,
        ifindex,
        pad: 0,
    };
    index.add_iface(7, key(7, 2), 1);
    index.add_iface(7, key(7, 3), 2);
    index.add_iface(8, key(8, 2), 1);
    assert_eq!(index.take_ifaces(7).len(), 2);
    assert!(index.take_ifaces(7).is_empty());
    assert_eq!(index.take_ifaces(8).len(), 1);
    index.set_cookie("pod@a@b@c".into(), 7);
    index.set_cookie("pod@a@b@d".into(), 9);
    assert_eq!(index.cookie("pod@a@b@c"), Some(7));
    assert_eq!(index.pods(), 2);
    index.forget_cookie(7);
    assert_eq!(index.cookie("pod@a@b@c"), None);
    assert_eq!(index.pods(), 1);
}
