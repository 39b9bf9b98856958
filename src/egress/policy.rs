//! A user's network policy: which hosts (names, `*.domain` wildcards, public IP literals)
//! and which ports a kernel may reach through the egress proxy. Pure: parsed once at start
//! (every pattern checked, with an error that names it), matched per request.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

use super::address::{self, Blocked};
use super::error::PolicyError;

/// The ports allowed when a policy names none: plain HTTP and HTTPS.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// One allowed host.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPattern {
    /// Exactly this name (lower case, no trailing dot).
    Name(String),
    /// Any name strictly below this domain: `*.example.org` allows `a.example.org` and
    /// `a.b.example.org`, not `example.org` itself (list it too to allow it).
    Below(String),
    /// This address, written as an IP literal in the allowlist (it must be public).
    Address(IpAddr),
}

/// Hosts and ports one user's kernels may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The patterns as configured (for the logs and for a user who overrides only ports).
    patterns: Vec<String>,
    hosts: Vec<HostPattern>,
    ports: BTreeSet<u16>,
    /// Non-public networks the operator lets the proxy connect to anyway (the host's own
    /// egress gateway); checked by `address::check_exemption` at start.
    exempt: Vec<IpNet>,
}

/// Why a request does not pass the policy (the proxy's 403 says it in these words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Host(String),
    Port {
        host: String,
        port: u16,
    },
    /// The target, or an address its name resolved to, is not a public address.
    Address {
        host: String,
        address: IpAddr,
        why: Blocked,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Host(host) => write!(f, "host not allowed by policy: {host}"),
            Refusal::Port { host, port } => {
                write!(f, "port not allowed by policy: {host}:{port}")
            }
            Refusal::Address { host, address, why } => write!(
                f,
                "address not allowed by policy: {host} is {address} ({why})"
            ),
        }
    }
}

impl Policy {
    /// A policy from the allowlist's patterns and ports (`None` or empty: 80 and 443).
    /// `what` names the setting in errors (`--egress-allow`, `egress_allow of user x`).
    pub fn parse(
        patterns: &[String],
        ports: Option<&[u16]>,
        what: &str,
    ) -> Result<Self, PolicyError> {
        if patterns.is_empty() {
            return Err(PolicyError::Empty { what: what.into() });
        }
        let hosts = patterns
            .iter()
            .map(|p| {
                parse_pattern(p).map_err(|why| PolicyError::BadPattern {
                    what: what.into(),
                    pattern: p.clone(),
                    why,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ports: BTreeSet<u16> = match ports {
            Some(list) if !list.is_empty() => list.iter().copied().collect(),
            _ => DEFAULT_PORTS.into_iter().collect(),
        };
        if ports.contains(&0) {
            return Err(PolicyError::PortZero { what: what.into() });
        }
        Ok(Self {
            patterns: patterns.to_vec(),
            hosts,
            ports,
            exempt: Vec::new(),
        })
    }

    /// Checks a request's target before anything is resolved or connected: `host` as the
    /// client wrote it (a name or an IP literal, brackets removed). Returns the host in its
    /// normal form (lower case, no trailing dot).
    pub fn check(&self, host: &str, port: u16) -> Result<Target, Refusal> {
        let target = Target::parse(host).ok_or_else(|| Refusal::Host(host.to_string()))?;
        let allowed = match &target {
            Target::Address(ip) => self.hosts.contains(&HostPattern::Address(*ip)),
            Target::Name(name) => self.hosts.iter().any(|h| match h {
                HostPattern::Name(n) => n == name,
                HostPattern::Below(domain) => name
                    .strip_suffix(domain.as_str())
                    // The domain is stored with its leading dot: `a.example.org` leaves `a`,
                    // `evilexample.org` does not end with `.example.org`.
                    .is_some_and(|rest| !rest.is_empty()),
                HostPattern::Address(_) => false,
            }),
        };
        if !allowed {
            return Err(Refusal::Host(target.to_string()));
        }
        if !self.ports.contains(&port) {
            return Err(Refusal::Port {
                host: target.to_string(),
                port,
            });
        }
        if let Target::Address(ip) = target {
            self.address_ok(ip).map_err(|why| Refusal::Address {
                host: target.to_string(),
                address: ip,
                why,
            })?;
        }
        Ok(target)
    }

    /// The policy with non-public networks the proxy may connect to anyway; each must
    /// pass `address::check_exemption`.
    pub fn with_exempt(mut self, nets: &[IpNet]) -> Result<Self, PolicyError> {
        for n in nets {
            address::check_exemption(n)?;
        }
        self.exempt = nets.to_vec();
        Ok(self)
    }

    /// Whether the proxy may connect to `ip` (public, or exempted).
    pub fn address_ok(&self, ip: IpAddr) -> Result<(), Blocked> {
        address::check_exempt(ip, &self.exempt)
    }

    /// The patterns as configured.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// The allowed ports, for the documentation of a refusal and the logs.
    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.ports.iter().copied()
    }
}

/// A request's target host in normal form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Name(String),
    Address(IpAddr),
}

impl Target {
    /// `None` for what is neither a host name nor an IP literal.
    fn parse(host: &str) -> Option<Self> {
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Some(Target::Address(ip));
        }
        let name = normal_name(host)?;
        Some(Target::Name(name))
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Name(n) => f.write_str(n),
            Target::Address(ip) => write!(f, "{ip}"),
        }
    }
}

/// A DNS host name in lower case without its trailing dot; `None` unless every label is
/// 1 to 63 letters, digits, `-` or `_` (no leading or trailing `-`) and the whole at most
/// 253 bytes.
fn normal_name(host: &str) -> Option<String> {
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    let labels_ok = name.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    });
    (labels_ok && !name.is_empty() && name.len() <= 253).then_some(name)
}

fn parse_pattern(pattern: &str) -> Result<HostPattern, String> {
    let p = pattern.trim();
    if p.is_empty() {
        return Err("an empty host".into());
    }
    if p.contains("://") {
        return Err("a host, not a URL: leave out the scheme".into());
    }
    if p.contains('/') {
        return Err("a host, not a URL: leave out the path".into());
    }
    if p == "*" || p == "*." {
        return Err("'*' would allow every host: list the hosts instead".into());
    }
    if let Some(domain) = p.strip_prefix("*.") {
        if domain.contains('*') {
            return Err("only one leading '*.' is allowed".into());
        }
        let domain = normal_name(domain).ok_or("not a valid domain after '*.'")?;
        if !domain.contains('.') {
            return Err(format!(
                "'*.{domain}' would allow a whole top-level domain: name a domain below it"
            ));
        }
        return Ok(HostPattern::Below(format!(".{domain}")));
    }
    if p.contains('*') {
        return Err("a wildcard is allowed only as a leading '*.'".into());
    }
    let bare = p
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(p);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        address::check(ip).map_err(|why| {
            format!("{ip} is not a public address ({why}); the proxy never connects there")
        })?;
        return Ok(HostPattern::Address(ip));
    }
    if p.contains(':') {
        return Err("a host without a port: allowed ports are set apart (egress_ports)".into());
    }
    normal_name(p)
        .map(HostPattern::Name)
        .ok_or_else(|| "not a valid host name (letters, digits, '-', '.')".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(patterns: &[&str], ports: Option<&[u16]>) -> Policy {
        let p: Vec<String> = patterns.iter().map(|s| s.to_string()).collect();
        Policy::parse(&p, ports, "test").unwrap()
    }

    #[test]
    fn patterns_match_names_wildcards_and_ports() {
        let p = policy(&["pypi.org", "*.pythonhosted.org", "93.184.215.14"], None);
        let cases: &[(&str, u16, Result<&str, &str>)] = &[
            ("pypi.org", 443, Ok("pypi.org")),
            ("PyPI.org.", 80, Ok("pypi.org")),
            ("files.pythonhosted.org", 443, Ok("files.pythonhosted.org")),
            ("a.b.pythonhosted.org", 443, Ok("a.b.pythonhosted.org")),
            ("93.184.215.14", 443, Ok("93.184.215.14")),
            (
                "pythonhosted.org",
                443,
                Err("host not allowed by policy: pythonhosted.org"),
            ),
            (
                "evilpythonhosted.org",
                443,
                Err("host not allowed by policy: evilpythonhosted.org"),
            ),
            (
                "pypi.org.evil.com",
                443,
                Err("host not allowed by policy: pypi.org.evil.com"),
            ),
            (
                "example.org",
                443,
                Err("host not allowed by policy: example.org"),
            ),
            (
                "pypi.org",
                22,
                Err("port not allowed by policy: pypi.org:22"),
            ),
            (
                "127.0.0.1",
                443,
                Err("host not allowed by policy: 127.0.0.1"),
            ),
            ("bad host", 443, Err("host not allowed by policy: bad host")),
            ("", 443, Err("host not allowed by policy: ")),
        ];
        for (host, port, want) in cases {
            let got = p
                .check(host, *port)
                .map(|t| t.to_string())
                .map_err(|e| e.to_string());
            assert_eq!(
                got,
                want.map(str::to_string).map_err(str::to_string),
                "{host}:{port}"
            );
        }
    }

    #[test]
    fn explicit_ports_replace_the_defaults() {
        let p = policy(&["pypi.org"], Some(&[8443]));
        assert!(p.check("pypi.org", 8443).is_ok());
        assert!(p.check("pypi.org", 443).is_err());
        assert_eq!(p.ports().collect::<Vec<_>>(), vec![8443]);
    }

    #[test]
    fn bad_patterns_are_refused_with_a_reason() {
        let cases: &[(&str, &str)] = &[
            ("*", "would allow every host"),
            ("", "empty host"),
            ("https://pypi.org", "leave out the scheme"),
            ("pypi.org/simple", "leave out the path"),
            ("*.org", "whole top-level domain"),
            ("a.*.org", "only as a leading"),
            ("*.*.org", "only one leading"),
            ("pypi..org", "not a valid host name"),
            ("pypi.org:443", "without a port"),
            ("10.0.0.1", "not a public address"),
            ("127.0.0.1", "not a public address"),
            ("[::1]", "not a public address"),
            ("169.254.169.254", "not a public address"),
            ("-bad.org", "not a valid host name"),
        ];
        for (pattern, want) in cases {
            let err = Policy::parse(&[pattern.to_string()], None, "egress_allow")
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{pattern:?}: {err}");
            assert!(err.starts_with("egress_allow: "), "{err}");
        }
        assert!(Policy::parse(&[], None, "x")
            .unwrap_err()
            .to_string()
            .contains("empty"));
        assert!(Policy::parse(&["a.org".into()], Some(&[0]), "x").is_err());
    }
}
