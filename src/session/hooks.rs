//! What one execution asks of the kernel's own hooks (`kernels/kernel_broker_e2b.py`, which
//! the boot script loads into the kernels it starts), and how the kernel answers: carried
//! in the `execute_request`'s metadata and the `execute_reply`'s content, so the actor
//! forwards them without knowing what they mean.

use std::collections::BTreeMap;

use bytes::Bytes;

/// What one execution asks of the kernel's own hooks (`kernels/kernel_broker_e2b.py`,
/// which the boot script loads into the kernels it starts): sent as the `execute_request`'s
/// `metadata.kernel_broker`. A kernel without the hooks ignores it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct KernelHooks {
    /// E2B's result formats for this execution: `e2b/chart` for matplotlib figures,
    /// `e2b/data` for DataFrames, PIL images displayed by `show()` and `save(path)`.
    pub e2b: bool,
    /// Variables set for this execution only; the previous values (or their absence) are
    /// back when it ends, however it ends. The kernel acknowledges them in its
    /// `execute_reply` ([`KernelHooks::env_acknowledged`]).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

impl KernelHooks {
    /// Whether an `execute_reply`'s content says the kernel applied (and has restored) the
    /// execution's [`KernelHooks::env`]: `"kernel_broker_env": "restored"`.
    pub fn env_acknowledged(reply_content: &[u8]) -> bool {
        #[derive(serde::Deserialize)]
        struct Reply {
            kernel_broker_env: Option<String>,
        }
        serde_json::from_slice::<Reply>(reply_content)
            .is_ok_and(|r| r.kernel_broker_env.as_deref() == Some("restored"))
    }

    /// The `execute_request` metadata that carries them.
    pub fn metadata(&self) -> Bytes {
        // A struct of a bool and string map: serialising it cannot fail.
        Bytes::from(
            serde_json::to_vec(&serde_json::json!({ "kernel_broker": self })).unwrap_or_default(),
        )
    }
}
