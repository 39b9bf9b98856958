//! [`NoKernels`]: a sandbox where nothing can run, for tests of the layers above the
//! session layer alone (the api's router tests): every launch fails, the workspace is the
//! temporary directory.

use std::path::PathBuf;

use async_trait::async_trait;

use crate::sandbox::{LaunchRefusal, LaunchSpec, Launched, Sandbox, SandboxError, SandboxUser};

/// A sandbox where nothing can run.
pub struct NoKernels;

#[async_trait]
impl Sandbox for NoKernels {
    fn name(&self) -> &'static str {
        "local"
    }
    async fn check(&self) -> Result<(), SandboxError> {
        Ok(())
    }
    async fn launch(&self, spec: LaunchSpec) -> Result<Launched, SandboxError> {
        Err(SandboxError::Launch {
            user: spec.user.name,
            reason: LaunchRefusal::CannotRun {
                backend: "test",
                what: "anything",
            },
        })
    }
    fn workspace(&self, _user: &SandboxUser) -> Result<PathBuf, SandboxError> {
        Ok(std::env::temp_dir())
    }
    async fn shutdown(&self) {}
}
