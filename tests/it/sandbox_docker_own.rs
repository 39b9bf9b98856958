//! A sandbox with a workspace of its own on Docker (every E2B sandbox): a container of its
//! own per own-workspace key, shared by the kernels of that key, with its own workspace at
//! `/home/user` and `/workspace`, its own `/tmp`, the kernel uid named `user`; removed with
//! its workspace and runtime directory when the last session in it ends, following none of
//! the symlinks its kernel planted.

use crate::common::sandbox as common;

use std::time::Duration;

use common::{bounded, spec, start_spec, user, wait_exit, DockerHarness as Harness};
use kernel_broker::sandbox::docker::LABEL_SANDBOX;
use kernel_broker::sandbox::{ExitReason, Sandbox, UserLimits};
use uuid::Uuid;

/// The containers (any state) labelled as the own container of `key`.
fn sandbox_containers(key: Uuid) -> Vec<String> {
    let out = common::docker_cli()
        .args(["ps", "-aq", "--filter"])
        .arg(format!("label={LABEL_SANDBOX}={key}"))
        .output()
        .expect("docker ps");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_own_workspace_gets_a_container_of_its_own_removed_without_following_symlinks() {
    let Some(h) = Harness::new() else { return };
    bounded(async {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("precious"), b"keep me").unwrap();
        let alice = user("alice", 0, UserLimits::default());
        let (key, other_key) = (Uuid::new_v4(), Uuid::new_v4());
        let own_spec = |k: Uuid| {
            let mut s = spec(&alice);
            s.own_workspace = Some(k);
            s
        };
        let first = {
            let mut s = own_spec(key);
            s.session_id = key;
            s
        };
        let (mut a, _) = start_spec(&h.sandbox, first).await;
        // A second kernel of the same key (an E2B context) goes into the same container.
        let (mut ctx, _) = start_spec(&h.sandbox, own_spec(key)).await;
        let (mut other, _) = start_spec(&h.sandbox, own_spec(other_key)).await;
        let (mine, theirs) = (sandbox_containers(key), sandbox_containers(other_key));
        assert_eq!((mine.len(), theirs.len()), (1, 1), "{mine:?} {theirs:?}");
        assert_ne!(mine, theirs);
        // Not the user's container.
        assert!(!h.containers().contains(&h.sandbox.container_name("alice")));

        let who = "import os, getpass; print(getpass.getuser(), os.getcwd(), os.environ['HOME'])";
        assert_eq!(a.run(who).await.out(), "user /home/user /home/user");
        a.run("open('/home/user/f', 'w').write('1'); open('/tmp/t', 'w').write('2')")
            .await;
        let both = "import os; print(os.path.exists('/workspace/f'), os.path.exists('/tmp/t'))";
        assert_eq!(ctx.run(both).await.out(), "True True");
        assert_eq!(other.run(both).await.out(), "False False");

        let home = h.sandbox.own_workspace(&alice, key).unwrap().unwrap();
        assert_eq!(std::fs::read(home.join("f")).unwrap(), b"1");
        let root = home.parent().unwrap().to_path_buf();
        // The kernel plants symlinks to a host directory and a host file.
        let o = outside.path().display();
        let plant = format!(
            "import os\n\
             os.symlink('{o}', '/home/user/link')\n\
             os.symlink('{o}/precious', '/home/user/file')\n\
             os.makedirs('/home/user/d/e')\n\
             os.symlink('{o}', '/home/user/d/e/up')\n\
             os.symlink('{o}', '/run/kernel/planted')\n\
             print('ok')"
        );
        let planted = a.run(&plant).await;
        assert!(
            planted.error.is_some() || planted.out() == "ok",
            "{planted:?}"
        );

        // The sessions end, then the last one's removal takes container and directories.
        a.process().terminate().await;
        ctx.process().terminate().await;
        assert_eq!(
            wait_exit(ctx.process(), Duration::from_secs(10)).await,
            ExitReason::Terminated
        );
        h.sandbox.remove_own_workspace(&alice, key).await;
        assert!(sandbox_containers(key).is_empty(), "the container is left");
        assert!(!root.exists(), "{} is left", root.display());
        assert!(h.sandbox.own_workspace(&alice, key).is_err());
        assert_eq!(
            std::fs::read(outside.path().join("precious")).unwrap(),
            b"keep me"
        );
        // The other sandbox lives on.
        assert_eq!(other.run("print(3)").await.out(), "3");
        assert_eq!(sandbox_containers(other_key).len(), 1);
        h.sandbox.shutdown().await;
        assert!(sandbox_containers(other_key).is_empty());
    })
    .await;
}
