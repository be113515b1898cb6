//! The agent's IP set client on the real kernel, in a throwaway network namespace: what
//! ambient mode's probe set needs of it (create kept when there, an entry's comment replaced
//! by a second add, both families, deletes that find nothing, refusals reported and changing nothing).
use meshcap_agent::ipset::{Entry, Family, IpSets};
use meshcap_tests::{Netns, require_root};

fn entry(ip: &str, comment: &str) -> Entry {
    Entry {
        ip: ip.parse().expect("address"),
        comment: comment.into(),
    }
}

#[test]
fn sets_are_created_filled_listed_and_emptied() {
    require_root();
    let netns = Netns::new("mc-ipset").expect("netns");
    netns
        .run_in(|| {
            let mut sets = IpSets::open()?;
            sets.create("t-v4", Family::V4)?;
            sets.create("t-v4", Family::V4)?;
            sets.create("t-v6", Family::V6)?;
            assert_eq!(sets.list("t-v4")?, []);

            sets.add("t-v4", &entry("10.1.2.3", "uid-a"))?;
            sets.add("t-v4", &entry("10.1.2.3", "uid-b"))?;
            assert_eq!(
                sets.list("t-v4")?,
                [entry("10.1.2.3", "uid-b")],
                "a second add of an address replaces its comment"
            );
            sets.add("t-v6", &entry("fd00::7", "uid-c"))?;
            assert_eq!(sets.list("t-v6")?, [entry("fd00::7", "uid-c")]);

            let refused = sets
                .add("t-v4", &entry("fd00::8", "uid-d"))
                .expect_err("an IPv6 address in an IPv4 set");
            assert!(refused.to_string().contains("ipset error"), "{refused}");
            assert_eq!(sets.list("t-v4")?, [entry("10.1.2.3", "uid-b")]);

            sets.delete("t-v4", "10.1.2.3".parse()?)?;
            sets.delete("t-v4", "10.1.2.3".parse()?)?;
            assert_eq!(sets.list("t-v4")?, []);

            sets.destroy("t-v4")?;
            sets.destroy("t-v4")?;
            let gone = sets.list("t-v4").expect_err("a destroyed set");
            assert_eq!(gone.raw_os_error(), Some(libc::ENOENT), "{gone}");
            Ok(())
        })
        .expect("ip sets in a throwaway netns");
}
