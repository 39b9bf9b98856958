//! How much slower than this machine the tests' host is. Bounds that only keep a test from
//! hanging (a kernel's start, an answer, an exit) are stretched by `KB_TEST_TIME_SCALE`
//! (default 1): `scripts/vm` sets it when the guest runs under emulation, where a kernel
//! starts twenty to thirty times slower. What a test asserts is unchanged.

use std::time::Duration;

pub fn time_scale() -> f64 {
    std::env::var("KB_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 1.0)
        .unwrap_or(1.0)
}

/// `d` on this host.
pub fn scaled(d: Duration) -> Duration {
    d.mul_f64(time_scale())
}
