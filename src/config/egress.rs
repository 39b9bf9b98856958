//! The network policy settings: `--egress none|allow`, `--egress-allow`, `--egress-ports`,
//! the egress limits, and each user's `egress_allow` / `egress_ports` / limits in the users
//! file, resolved into one [`UserEgress`] per user who has a policy. Every pattern is
//! checked here, at start, with an error that names the setting and the pattern.

use super::args::{EgressMode, ServeArgs};
use super::ConfigError;
use crate::egress::{EgressLimits, IpNet, Policy, UserEgress};

/// What applies to users whose entry says nothing of egress.
pub(super) struct Defaults {
    /// The default allowlist (`--egress allow`), already checked.
    policy: Option<Policy>,
    ports: Option<Vec<u16>>,
    limits: EgressLimits,
    exempt: Vec<IpNet>,
    /// See [`crate::egress::EgressConfig::ca_bundle`].
    pub ca_bundle: Option<String>,
    /// `--egress-ca-file`: the host file the sandboxes show at `CA_FILE_INSIDE`.
    pub ca_file: Option<std::path::PathBuf>,
}

/// The CA bundle kernels with egress trust by default: the system's (Debian's path, in
/// the local sandbox the host's `/etc/ssl/certs`, in Docker the image's).
const DEFAULT_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A user's egress keys in the users file.
#[derive(Default)]
pub(super) struct UserEgressEntry<'a> {
    pub allow: Option<&'a [String]>,
    pub ports: Option<&'a [u16]>,
    pub max_bytes: Option<u64>,
    pub max_connections: Option<usize>,
}

impl Defaults {
    pub fn resolve(args: &ServeArgs, file: &ServeArgs) -> Result<Self, ConfigError> {
        let mode = args.egress.or(file.egress);
        let allow = args.egress_allow.clone().or(file.egress_allow.clone());
        let ports = args.egress_ports.clone().or(file.egress_ports.clone());
        let base = EgressLimits::default();
        let limits = EgressLimits {
            max_bytes: args
                .egress_max_bytes
                .or(file.egress_max_bytes)
                .unwrap_or(base.max_bytes),
            max_connections: args
                .egress_max_connections
                .or(file.egress_max_connections)
                .unwrap_or(base.max_connections),
        };
        let allow = allow.filter(|l| !l.is_empty());
        let exempt = args
            .egress_allow_networks
            .clone()
            .or(file.egress_allow_networks.clone())
            .unwrap_or_default()
            .iter()
            .map(|n| {
                n.trim().parse::<IpNet>().map_err(|_| {
                    ConfigError::Invalid(format!(
                        "--egress-allow-networks: {n:?} is not a network (e.g. 203.0.113.80/32)"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ca_file = args.egress_ca_file.clone().or(file.egress_ca_file.clone());
        if let Some(f) = &ca_file {
            if !f.is_absolute() || !f.is_file() {
                return Err(ConfigError::Invalid(format!(
                    "--egress-ca-file: {} is not an absolute path of a file",
                    f.display()
                )));
            }
        }
        let ca_bundle = match args
            .egress_ca_bundle
            .clone()
            .or(file.egress_ca_bundle.clone())
        {
            _ if ca_file.is_some() => Some(crate::egress::CA_FILE_INSIDE.to_string()),
            Some(v) if v == "none" => None,
            Some(v) if v.starts_with('/') => Some(v),
            Some(v) => {
                return Err(ConfigError::Invalid(format!(
                    "--egress-ca-bundle: {v:?} is not an absolute path (inside the sandbox) or none"
                )))
            }
            None => Some(DEFAULT_CA_BUNDLE.to_string()),
        };
        let policy = match (mode, allow) {
            (Some(EgressMode::None), Some(_)) => {
                return Err(ConfigError::Invalid(
                    "--egress none with --egress-allow: choose one (--egress allow to use the list)"
                        .into(),
                ))
            }
            (Some(EgressMode::Allow), None) => {
                return Err(ConfigError::Invalid(
                    "--egress allow needs --egress-allow HOST[,HOST...] (e.g. pypi.org,files.pythonhosted.org)"
                        .into(),
                ))
            }
            // A list given alone means it is allowed.
            (Some(EgressMode::Allow) | None, Some(list)) => Some(
                Policy::parse(&list, ports.as_deref(), "--egress-allow")
                    .and_then(|p| p.with_exempt(&exempt))
                    ?,
            ),
            (Some(EgressMode::None) | None, None) => None,
        };
        if let Some(bad) = exempt
            .iter()
            .find_map(|n| crate::egress::check_exemption(n).err())
        {
            return Err(ConfigError::EgressNetwork {
                what: "--egress-allow-networks",
                source: bad,
            });
        }
        Ok(Self {
            policy,
            ports,
            limits,
            exempt,
            ca_bundle,
            ca_file,
        })
    }

    /// The policy of user `name`: its own `egress_allow` when the entry has one (empty:
    /// none), else the default; its limits: its own, else the defaults.
    pub fn for_user(
        &self,
        name: &str,
        entry: &UserEgressEntry<'_>,
    ) -> Result<Option<UserEgress>, ConfigError> {
        let ports = entry.ports.or(self.ports.as_deref());
        let policy = match entry.allow {
            Some([]) => None,
            Some(list) => Some(
                Policy::parse(list, ports, &format!("egress_allow of user {name}"))
                    .and_then(|p| p.with_exempt(&self.exempt))?,
            ),
            None => match (&self.policy, entry.ports) {
                (Some(_), Some(own)) => {
                    let list = self.default_patterns();
                    Some(
                        Policy::parse(&list, Some(own), &format!("egress_ports of user {name}"))
                            .and_then(|p| p.with_exempt(&self.exempt))?,
                    )
                }
                (p, _) => p.clone(),
            },
        };
        if policy.is_none() && entry.ports.is_some() {
            return Err(ConfigError::Invalid(format!(
                "egress_ports of user {name} without any allowed host (egress_allow or --egress allow)"
            )));
        }
        Ok(policy.map(|policy| UserEgress {
            policy,
            limits: EgressLimits {
                max_bytes: entry.max_bytes.unwrap_or(self.limits.max_bytes),
                max_connections: entry.max_connections.unwrap_or(self.limits.max_connections),
            },
        }))
    }

    fn default_patterns(&self) -> Vec<String> {
        self.policy
            .as_ref()
            .map(|p| p.patterns().to_vec())
            .unwrap_or_default()
    }
}
