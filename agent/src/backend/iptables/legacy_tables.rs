//! A pod's legacy tables as the kernel hands them to `iptables-legacy-save`, read in process:
//! `IPT_SO_GET_INFO` and `IPT_SO_GET_ENTRIES` on a raw socket of the visited netns (the
//! `IP6T_` twins for IPv6), as libiptc does. The verifier hashes them to tell whether a
//! legacy pod's tables changed since its rules were last found whole; a `-save` fork per pod
//! did that before, and was most of a legacy pass's CPU.
//!
//! The entries are the kernel's blob (`struct ipt_entry` after `struct ipt_entry`, each with its
//! matches and target), the same bytes for the same rules, but for what changes without a rule
//! changing: each entry's packet and byte counters (and `comefrom`, the kernel's own mark), which
//! are zeroed.
use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

/// `IPT_SO_GET_INFO`, `IPT_SO_GET_ENTRIES` (and `IP6T_`: the same numbers, at `SOL_IPV6`).
const SO_GET_INFO: libc::c_int = 64;
const SO_GET_ENTRIES: libc::c_int = 65;
/// `XT_TABLE_MAXNAMELEN`.
const NAME_LEN: usize = 32;
/// `struct ipt_getinfo` (and `ip6t_getinfo`): the table's entries' total size at 80.
const GETINFO_LEN: usize = 84;
const GETINFO_SIZE_AT: usize = 80;
/// `struct ipt_get_entries`: name, size, then the entries, 8-aligned.
const ENTRIES_AT: usize = 40;

/// Where an entry's fields sit, per family (`struct ipt_entry`, `struct ip6t_entry`).
struct Layout {
    next_offset: usize,
    comefrom: usize,
    /// `struct xt_counters`: two u64, packets then bytes.
    counters: usize,
}

const IPV4: Layout = Layout {
    next_offset: 90,
    comefrom: 92,
    counters: 96,
};
const IPV6: Layout = Layout {
    next_offset: 142,
    comefrom: 144,
    counters: 152,
};

/// The tables `names` of the family in the visited netns: each name with its entries, counters
/// zeroed, or `None` for a table the netns does not have. A table is read only when the kernel
/// lists it (`ip_tables_names`): asking for another would create it empty.
///
/// # Errors
/// When a listed table cannot be read.
pub(super) fn read(ipv6: bool, names: &[String]) -> io::Result<Vec<(String, Option<Vec<u8>>)>> {
    let listed = std::fs::read_to_string(if ipv6 {
        "/proc/thread-self/net/ip6_tables_names"
    } else {
        "/proc/thread-self/net/ip_tables_names"
    })
    .unwrap_or_default();
    let mut socket: Option<OwnedFd> = None;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        if !listed.lines().any(|l| l.trim() == name) {
            out.push((name.clone(), None));
            continue;
        }
        let fd = match &socket {
            Some(fd) => fd.as_raw_fd(),
            None => socket.insert(raw_socket(ipv6)?).as_raw_fd(),
        };
        out.push((name.clone(), Some(entries(fd, ipv6, name)?)));
    }
    Ok(out)
}

fn raw_socket(ipv6: bool) -> io::Result<OwnedFd> {
    let domain = if ipv6 { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: socket(2) with constant arguments; the descriptor is owned at once.
    let fd = unsafe {
        libc::socket(
            domain,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One table's entries with their counters zeroed. The kernel refuses the read (`EAGAIN`) when
/// the table changed between the two calls; it is then asked again, as libiptc does.
fn entries(fd: libc::c_int, ipv6: bool, name: &str) -> io::Result<Vec<u8>> {
    let level = if ipv6 { libc::SOL_IPV6 } else { libc::SOL_IP };
    let mut attempts = 0;
    loop {
        let mut info = [0u8; GETINFO_LEN];
        put_name(&mut info, name)?;
        getsockopt(fd, level, SO_GET_INFO, &mut info)?;
        let size = u32::from_ne_bytes(read4(&info, GETINFO_SIZE_AT)) as usize;
        let mut buffer = vec![0u8; ENTRIES_AT + size];
        put_name(&mut buffer, name)?;
        buffer[NAME_LEN..NAME_LEN + 4].copy_from_slice(&read4(&info, GETINFO_SIZE_AT));
        match getsockopt(fd, level, SO_GET_ENTRIES, &mut buffer) {
            Err(err) if err.raw_os_error() == Some(libc::EAGAIN) && attempts < 5 => attempts += 1,
            Err(err) => return Err(err),
            Ok(()) => {
                let mut table = buffer.split_off(ENTRIES_AT);
                zero_counters(&mut table, if ipv6 { &IPV6 } else { &IPV4 })?;
                return Ok(table);
            }
        }
    }
}

fn put_name(buffer: &mut [u8], name: &str) -> io::Result<()> {
    let bytes = name.as_bytes();
    if bytes.len() >= NAME_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("table name {name:?}"),
        ));
    }
    buffer[..bytes.len()].copy_from_slice(bytes);
    Ok(())
}

fn read4(buffer: &[u8], at: usize) -> [u8; 4] {
    let mut out = [0; 4];
    out.copy_from_slice(&buffer[at..at + 4]);
    out
}

fn getsockopt(
    fd: libc::c_int,
    level: libc::c_int,
    name: libc::c_int,
    buffer: &mut [u8],
) -> io::Result<()> {
    let mut len = libc::socklen_t::try_from(buffer.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a table too large"))?;
    // SAFETY: the kernel writes at most `len` bytes into `buffer`, which holds that many.
    let rc = unsafe { libc::getsockopt(fd, level, name, buffer.as_mut_ptr().cast(), &raw mut len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Zeroes every entry's counters and `comefrom`, walking the entries by their `next_offset`.
fn zero_counters(table: &mut [u8], layout: &Layout) -> io::Result<()> {
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "a malformed table entry");
    let mut at = 0;
    while at < table.len() {
        let entry = table.get_mut(at..).ok_or_else(malformed)?;
        if entry.len() < layout.counters + 2 * size_of::<u64>() {
            return Err(malformed());
        }
        let next = usize::from(u16::from_ne_bytes([
            entry[layout.next_offset],
            entry[layout.next_offset + 1],
        ]));
        if next < layout.counters + 2 * size_of::<u64>() {
            return Err(malformed());
        }
        entry[layout.comefrom..layout.comefrom + 4].fill(0);
        entry[layout.counters..layout.counters + 16].fill(0);
        at += next;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two entries of the IPv4 layout: counters and `comefrom` zeroed, the rest kept.
    #[test]
    fn counters_are_zeroed_entry_by_entry() {
        let mut table = vec![0xaau8; 2 * 112];
        for entry in table.chunks_mut(112) {
            entry[90..92].copy_from_slice(&112u16.to_ne_bytes());
        }
        zero_counters(&mut table, &IPV4).expect("walks");
        for entry in table.chunks(112) {
            assert!(entry[92..112].iter().all(|b| *b == 0));
            assert!(entry[..90].iter().all(|b| *b == 0xaa));
        }
        let mut short = vec![0u8; 112];
        assert!(zero_counters(&mut short, &IPV4).is_err(), "next_offset 0");
    }

    /// In a throwaway netns (a thread's own), each family: a table not there is not read and
    /// not created; a table's bytes stay the same while packets move its counters, and change
    /// with a rule.
    #[test]
    fn a_table_reads_the_same_until_a_rule_changes() {
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare (root)");
            let up = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .expect("ip");
            assert!(up.success());
            for (ipv6, program, address) in [
                (false, "iptables-legacy", "127.0.0.1"),
                (true, "ip6tables-legacy", "::1"),
            ] {
                table_reads_the_same_until_a_rule_changes(ipv6, program, address);
            }
        })
        .join()
        .expect("the thread");
    }

    fn table_reads_the_same_until_a_rule_changes(ipv6: bool, program: &str, address: &str) {
        let names = ["nat".to_owned(), "mangle".to_owned()];
        let restore = |port: u16| {
            use std::io::Write as _;
            let mut child = std::process::Command::new(format!("{program}-restore"))
                .arg("--noflush")
                .stdin(std::process::Stdio::piped())
                .spawn()
                .expect("restore");
            let rule =
                format!("-A OUTPUT -p tcp -d {address} --dport {port} -j REDIRECT --to-ports 7");
            let rules = format!("*nat\n{rule}\nCOMMIT\n");
            let mut stdin = child.stdin.take().expect("stdin");
            stdin.write_all(rules.as_bytes()).expect("rules");
            drop(stdin);
            assert!(child.wait().expect("wait").success());
        };
        restore(9);
        let before = read(ipv6, &names).expect("read");
        assert!(
            before[0].1.as_ref().is_some_and(|e| !e.is_empty()),
            "{before:?}"
        );
        assert_eq!(before[1], ("mangle".to_owned(), None));
        let names_file = if ipv6 {
            "ip6_tables_names"
        } else {
            "ip_tables_names"
        };
        let listed = std::fs::read_to_string(format!("/proc/thread-self/net/{names_file}"));
        assert!(!listed.expect("names").contains("mangle"), "mangle created");
        // A connection through OUTPUT's rule: its counters move.
        let _ = std::net::TcpStream::connect((address, 9));
        let counted = std::process::Command::new(format!("{program}-save"))
            .args(["-c", "-t", "nat"])
            .output()
            .expect("save");
        let counted = String::from_utf8_lossy(&counted.stdout).into_owned();
        assert!(
            counted
                .lines()
                .any(|l| l.contains("REDIRECT") && !l.starts_with("[0:0]")),
            "the rule counted no packet:\n{counted}"
        );
        assert_eq!(read(ipv6, &names).expect("read"), before);
        restore(10);
        assert_ne!(read(ipv6, &names).expect("read"), before);
    }
}
