//! The kernel specs this sandbox offers (their `kernel.json`s, read from the broker's
//! kernels directory), as the launches read them.

use super::Inner;

impl Inner {
    /// The spec of kernel `name` (its `kernel.json`), if this sandbox offers it.
    pub(super) fn kernel_spec(&self, name: &str) -> Option<&crate::kernel::spec::KernelSpec> {
        self.cfg.kernel_specs.as_ref()?.get(name)
    }

    /// The variables of kernel `name`'s spec (its `kernel.json`'s `env`) as `KEY=value`,
    /// sorted; none if this sandbox does not offer it.
    pub(super) fn spec_env(&self, name: &str) -> Vec<String> {
        let mut env: Vec<String> = self
            .kernel_spec(name)
            .map(|k| k.env.iter().map(|(k, v)| format!("{k}={v}")).collect())
            .unwrap_or_default();
        env.sort();
        env
    }

    /// The spec of a kernel other than `python3` that this sandbox offers.
    pub(super) fn other_kernel(&self, name: &str) -> Option<&crate::kernel::spec::KernelSpec> {
        (name != "python3")
            .then(|| self.kernel_spec(name))
            .flatten()
    }
}
