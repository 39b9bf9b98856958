//! Launching a kernel for a session: forked from its user's template when one works, else
//! started plainly (through the bootstrap script when its spec is bootable).

use super::process::SandboxCommand;
use super::{boot, template, LocalSandbox, BOOT_DIR_INSIDE, CONNECTION_FILE_INSIDE};
use crate::sandbox::fsutil::launch_err;
use crate::sandbox::launch_error::LaunchRefusal;
use crate::sandbox::{LaunchSpec, Launched, SandboxError};

impl LocalSandbox {
    pub(super) async fn launch_kernel(&self, spec: LaunchSpec) -> Result<Launched, SandboxError> {
        let cgroups = self.startup().await?;
        self.templates.launched(&spec.user.name);
        let kspec = self.specs.get(&spec.kernel_name).ok_or_else(|| {
            launch_err(
                &spec.user,
                LaunchRefusal::UnknownKernel {
                    name: spec.kernel_name.clone(),
                    dir: self.cfg.kernels_dir.clone(),
                    found: self.kernel_names().join(", "),
                },
            )
        })?;
        let uses_resource_dir = kspec.argv.iter().any(|a| a.contains("{resource_dir}"));
        let resource_dir = uses_resource_dir.then(|| kspec.resource_dir.clone());
        if boot::spec_wants_tcp(&kspec.raw) {
            // Behind the relay, which reads the `ipc` connection file and writes the TCP one
            // the kernel's own argv names (see `boot::relay_argv`).
            let tcp_file = boot::tcp_connection_file(CONNECTION_FILE_INSIDE);
            let own: Vec<String> = kspec
                .argv
                .iter()
                .map(|a| a.replace("{connection_file}", &tcp_file))
                .collect();
            let own = self.substitute_argv(&own, resource_dir.as_deref());
            let python = self.substitute_argv(&["python".to_string()], None);
            let script = format!("{BOOT_DIR_INSIDE}/{}", boot::RELAY_SCRIPT_NAME);
            let argv = boot::relay_argv(
                &python[0],
                &script,
                &kspec.raw,
                (CONNECTION_FILE_INSIDE, &tcp_file),
                &own,
            );
            tracing::debug!(kernel = %spec.kernel_name, ?argv, "launching kernel behind the relay");
            let command = SandboxCommand {
                argv,
                env: kspec.env.clone(),
                resource_dir,
            };
            return self.launch_argv(spec, command, cgroups).await;
        }
        let argv = self.substitute_argv(&kspec.argv, resource_dir.as_deref());
        let preload = boot::resolve_preload(
            self.cfg.user_preload.get(&spec.user.name),
            &kspec.raw,
            &self.cfg.preload,
        );
        // Forked from the user's template when one works (the spec's own arguments, with
        // the fork's connection file); otherwise started plainly, through the bootstrap
        // script when the spec is bootable (see below).
        if let (Some((python, _)), Some((_, raw_args)), false, Some(cg), false) = (
            boot::ipykernel_args(&argv),
            boot::ipykernel_args(&kspec.argv),
            preload.is_empty(),
            &cgroups,
            uses_resource_dir,
        ) {
            // A template's children share its mounts: a kernel with a workspace of its own
            // starts plainly.
            if spec.own_workspace.is_none() && self.forks_for(&spec.user, &kspec.raw) {
                let bootable = template::Bootable {
                    python,
                    args: raw_args,
                    preload: &preload,
                    spec_env: &kspec.env,
                };
                if let Some(t) = self.template(&spec, &bootable, cg).await {
                    match self.fork_kernel(&t, &spec, &bootable, cg).await {
                        Ok(launched) => return Ok(launched),
                        Err(e) => {
                            tracing::warn!(session = %spec.session_id, error = %e, "fork failed; starting the kernel plainly")
                        }
                    }
                }
            }
        }
        // A bootable spec starts plainly through the bootstrap script (read-only, the
        // broker's): a fork's kernel (inline backend, E2B's hooks) preloading nothing, which
        // would only move the imports to the start (E2B create 1.7 s, not 0.5 s; first chart
        // the same). Any other spec starts exactly as written.
        let script = format!("{BOOT_DIR_INSIDE}/{}", boot::BOOT_SCRIPT_NAME);
        let argv = boot::ipykernel_args(&argv)
            .map(|(python, args)| boot::kernel_argv(python, &script, &[], args))
            .unwrap_or(argv);
        tracing::debug!(kernel = %spec.kernel_name, interrupt_mode = ?kspec.interrupt_mode, ?argv, "launching kernel");
        let command = SandboxCommand {
            argv,
            env: kspec.env.clone(),
            resource_dir,
        };
        self.launch_argv(spec, command, cgroups).await
    }
}
