//! What the egress layer refuses when the broker is configured.

use ipnet::IpNet;

/// Why an allowlist or an exempted network is refused when the broker is configured.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{what} is empty: list at least one host")]
    Empty { what: String },
    #[error("{what}: {pattern:?}: {why}")]
    BadPattern {
        what: String,
        pattern: String,
        why: String,
    },
    #[error("{what}: port 0 is not a port")]
    PortZero { what: String },
    #[error("{net} reaches into {never}, which the egress proxy never connects to")]
    ReachesNever { net: IpNet, never: IpNet },
}
