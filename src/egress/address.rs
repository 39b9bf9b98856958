//! Which addresses the egress proxy may connect to: public unicast only. Every address a
//! name resolves to is checked here before any connection, so an allowed name that
//! resolves to the host itself, a private network or a cloud metadata service (DNS
//! rebinding) is refused.
//!
//! Written as a table of networks (`ipnet` does the prefix arithmetic) rather than with
//! `std`'s `is_*` methods: several of the ranges needed (shared address space, benchmarking,
//! reserved, IPv6 documentation) are still unstable there, and one table reads as the
//! policy it is.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::error::PolicyError;

/// Why an address is not public.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocked(&'static str);

impl std::fmt::Display for Blocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// IPv4 networks that are not public unicast, with what they are.
const V4: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "this network"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private"),
    (
        Ipv4Addr::new(100, 64, 0, 0),
        10,
        "shared address space (CGNAT)",
    ),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    (
        Ipv4Addr::new(169, 254, 0, 0),
        16,
        "link-local (cloud metadata)",
    ),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private"),
    (Ipv4Addr::new(192, 0, 0, 0), 24, "IETF protocol assignments"),
    (Ipv4Addr::new(192, 0, 2, 0), 24, "documentation"),
    (Ipv4Addr::new(192, 88, 99, 0), 24, "6to4 relay anycast"),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private"),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking"),
    (Ipv4Addr::new(198, 51, 100, 0), 24, "documentation"),
    (Ipv4Addr::new(203, 0, 113, 0), 24, "documentation"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved or broadcast"),
];

/// IPv6 networks that are not public unicast. Those that embed an IPv4 address
/// (mapped, NAT64, 6to4) are checked by that address instead (`embedded_v4`).
const V6: &[(Ipv6Addr, u8, &str)] = &[
    (Ipv6Addr::UNSPECIFIED, 128, "unspecified"),
    (Ipv6Addr::LOCALHOST, 128, "loopback"),
    // IPv4-compatible (deprecated) and other uses of the first /96.
    (Ipv6Addr::UNSPECIFIED, 96, "IPv4-compatible"),
    (
        Ipv6Addr::new(0x100, 0, 0, 0, 0, 0, 0, 0),
        64,
        "discard-only",
    ),
    (
        Ipv6Addr::new(0x2001, 0, 0, 0, 0, 0, 0, 0),
        23,
        "IETF protocol assignments",
    ),
    (
        Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0),
        32,
        "documentation",
    ),
    (
        Ipv6Addr::new(0x3fff, 0, 0, 0, 0, 0, 0, 0),
        20,
        "documentation",
    ),
    (
        Ipv6Addr::new(0x5f00, 0, 0, 0, 0, 0, 0, 0),
        16,
        "segment routing",
    ),
    (
        Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0),
        7,
        "unique local (private)",
    ),
    (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10, "link-local"),
    (Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0), 10, "site-local"),
    (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8, "multicast"),
];

/// Networks no exemption may reach into: the host itself, cloud metadata, "any" and
/// multicast. An operator may exempt a private or documentation network where the host's
/// own egress gateway lives; never these.
const NEVER: &[&str] = &[
    "0.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "224.0.0.0/4",
    "255.255.255.255/32",
    "::/128",
    "::1/128",
    "::ffff:0:0/96",
    "fe80::/10",
    "ff00::/8",
];

/// Checks a network an operator exempts from the filter (`--egress-allow-networks`).
pub fn check_exemption(net: &IpNet) -> Result<(), PolicyError> {
    for never in NEVER {
        let Ok(never) = never.parse::<IpNet>() else {
            continue;
        };
        if never.contains(net) || net.contains(&never) || net.contains(&never.network()) {
            return Err(PolicyError::ReachesNever { net: *net, never });
        }
    }
    Ok(())
}

/// `Ok` for a public unicast address, or one inside an operator's exemption.
pub fn check_exempt(ip: IpAddr, exempt: &[IpNet]) -> Result<(), Blocked> {
    match check(ip) {
        Err(_) if exempt.iter().any(|n| n.contains(&ip)) => Ok(()),
        r => r,
    }
}

/// `Ok` for a public unicast address the proxy may connect to.
pub fn check(ip: IpAddr) -> Result<(), Blocked> {
    match ip {
        IpAddr::V4(v4) => check_v4(v4),
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(v4) => check_v4(v4),
            None => lookup(
                IpNet::V6(host6(v6)),
                V6.iter().map(|(a, p, w)| (IpNet::V6(net6(*a, *p)), *w)),
            ),
        },
    }
}

fn check_v4(v4: Ipv4Addr) -> Result<(), Blocked> {
    lookup(
        IpNet::V4(host4(v4)),
        V4.iter().map(|(a, p, w)| (IpNet::V4(net4(*a, *p)), *w)),
    )
}

fn lookup(ip: IpNet, table: impl Iterator<Item = (IpNet, &'static str)>) -> Result<(), Blocked> {
    for (net, what) in table {
        if net.contains(&ip) {
            return Err(Blocked(what));
        }
    }
    Ok(())
}

/// The IPv4 address inside an IPv6 one that carries it: IPv4-mapped `::ffff:a.b.c.d`,
/// NAT64 `64:ff9b::a.b.c.d` and 6to4 `2002:AABB:CCDD::`.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = v6.segments();
    let [a, b, c, d] = v6.octets()[12..16] else {
        return None;
    };
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(Ipv4Addr::new(a, b, c, d));
    }
    if s[0] == 0x2002 {
        let [h1, h2] = s[1].to_be_bytes();
        let [l1, l2] = s[2].to_be_bytes();
        return Some(Ipv4Addr::new(h1, h2, l1, l2));
    }
    None
}

// The prefix lengths in the tables are at most 32 and 128, so these constructors cannot
// fail; a bad table entry would be caught by the tests, and falls back to the host route.
fn net4(a: Ipv4Addr, p: u8) -> Ipv4Net {
    Ipv4Net::new(a, p).unwrap_or_else(|_| host4(a))
}
fn net6(a: Ipv6Addr, p: u8) -> Ipv6Net {
    Ipv6Net::new(a, p).unwrap_or_else(|_| host6(a))
}
fn host4(a: Ipv4Addr) -> Ipv4Net {
    Ipv4Net::from(a)
}
fn host6(a: Ipv6Addr) -> Ipv6Net {
    Ipv6Net::from(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_unicast_passes() {
        let cases: &[(&str, Option<&str>)] = &[
            ("151.101.0.223", None),
            ("8.8.8.8", None),
            ("2a04:4e42::223", None),
            ("127.0.0.1", Some("loopback")),
            ("127.255.255.254", Some("loopback")),
            ("0.0.0.0", Some("this network")),
            ("10.1.2.3", Some("private")),
            ("172.16.0.1", Some("private")),
            ("172.31.255.255", Some("private")),
            ("172.32.0.1", None),
            ("192.168.1.1", Some("private")),
            ("100.64.0.1", Some("shared address space (CGNAT)")),
            ("100.128.0.1", None),
            ("169.254.169.254", Some("link-local (cloud metadata)")),
            ("192.0.2.7", Some("documentation")),
            ("198.51.100.7", Some("documentation")),
            ("203.0.113.7", Some("documentation")),
            ("198.18.0.1", Some("benchmarking")),
            ("198.19.255.1", Some("benchmarking")),
            ("224.0.0.1", Some("multicast")),
            ("255.255.255.255", Some("reserved or broadcast")),
            ("::", Some("unspecified")),
            ("::1", Some("loopback")),
            ("::ffff:127.0.0.1", Some("loopback")),
            (
                "::ffff:169.254.169.254",
                Some("link-local (cloud metadata)"),
            ),
            ("::ffff:8.8.8.8", None),
            ("::127.0.0.1", Some("IPv4-compatible")),
            ("64:ff9b::10.0.0.1", Some("private")),
            ("64:ff9b::8.8.8.8", None),
            ("2002:7f00:1::", Some("loopback")),
            ("2002:c0a8:101::1", Some("private")),
            ("fe80::1", Some("link-local")),
            ("fd00::1", Some("unique local (private)")),
            ("fc00::1", Some("unique local (private)")),
            ("fec0::1", Some("site-local")),
            ("ff02::1", Some("multicast")),
            ("2001:db8::1", Some("documentation")),
            ("100::1", Some("discard-only")),
        ];
        for (ip, want) in cases {
            let got = check(ip.parse().unwrap()).err().map(|b| b.0);
            assert_eq!(got, *want, "{ip}");
        }
    }

    #[test]
    fn exemptions_open_a_gateway_network_never_the_host() {
        let gateway: IpNet = "203.0.113.80/32".parse().unwrap();
        assert!(check_exemption(&gateway).is_ok());
        assert!(check_exemption(&"10.0.0.0/8".parse().unwrap()).is_ok());
        for bad in [
            "127.0.0.1/32",
            "0.0.0.0/0",
            "169.254.169.254/32",
            "::1/128",
            "::/0",
            "fe80::/64",
        ] {
            assert!(check_exemption(&bad.parse().unwrap()).is_err(), "{bad}");
        }
        let ip = "203.0.113.80".parse().unwrap();
        assert!(check_exempt(ip, &[gateway]).is_ok());
        assert!(check_exempt("203.0.113.81".parse().unwrap(), &[gateway]).is_err());
        assert!(check_exempt("127.0.0.1".parse().unwrap(), &[gateway]).is_err());
    }

    #[test]
    fn every_table_entry_is_a_valid_network() {
        for n in NEVER {
            assert!(n.parse::<IpNet>().is_ok(), "{n}");
        }
        for (a, p, _) in V4 {
            assert!(Ipv4Net::new(*a, *p).is_ok(), "{a}/{p}");
        }
        for (a, p, _) in V6 {
            assert!(Ipv6Net::new(*a, *p).is_ok(), "{a}/{p}");
        }
    }
}
