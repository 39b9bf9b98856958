//! The capabilities the broker must hold to hand CRIU its own (`--inh-caps`, `--ambient-caps`
//! of the dump's and restore's setpriv): checked once with the tools, so that a broker in a
//! container started without them says so, rather than "CRIU could not dump it".

/// Each capability a copy needs, its number and why.
const NEEDED: [(u32, &str, &str); 3] = [
    (
        40,
        "CHECKPOINT_RESTORE",
        "CRIU's dump and restore as the kernel's uid",
    ),
    (
        19,
        "SYS_PTRACE",
        "the held child's pid namespace read, and the dump of a kernel that is not dumpable",
    ),
    (
        2,
        "DAC_READ_SEARCH",
        "the dump of a kernel that is not dumpable: one sharing its user's workspace",
    ),
];

/// Why a copy cannot be made with the permitted capabilities `permitted` (the bits of
/// `CapPrm` in `/proc/self/status`); `None` if it can.
pub(super) fn missing(permitted: u64) -> Option<String> {
    let missing: Vec<String> = NEEDED
        .iter()
        .filter(|(bit, _, _)| permitted & (1u64 << bit) == 0)
        .map(|(_, name, why)| format!("CAP_{name} ({why})"))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "copying a kernel with CRIU needs capabilities the broker does not hold: {}. In a \
             container, add them (`--cap-add CHECKPOINT_RESTORE --cap-add SYS_PTRACE --cap-add \
             DAC_READ_SEARCH`; CHECKPOINT_RESTORE needs Docker 23 or later, or a runtime that \
             knows it)",
            missing.join(", ")
        )
    })
}

/// The broker's permitted capabilities, from `/proc/self/status`; all of them if it cannot
/// be read (the copy then fails on its own, saying why).
pub(super) fn permitted() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapPrm:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_without_the_capabilities_says_which() {
        assert_eq!(missing(u64::MAX), None);
        // The shipped compose file's set, as Docker 20.10 gives it (CapPrm 00000000002011eb).
        let why = missing(0x2011eb).unwrap();
        for name in [
            "CAP_CHECKPOINT_RESTORE",
            "CAP_SYS_PTRACE",
            "CAP_DAC_READ_SEARCH",
        ] {
            assert!(why.contains(name), "{why}");
        }
        let with_all = 0x2011eb | 1 << 40 | 1 << 19 | 1 << 2;
        assert_eq!(missing(with_all), None);
        assert!(missing(with_all & !(1 << 40))
            .unwrap()
            .contains("CHECKPOINT_RESTORE"));
    }
}
