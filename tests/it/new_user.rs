//! What a new user meets (issue 19), on both backends: uploads the kernel owns (and can
//! overwrite and delete), `DELETE` and move in the files API with hostile symlinks in the
//! way, the kernel's caches kept out of the listed workspace, no host path in what the kernel
//! shows, and the README's walkthrough followed by `examples/agent_session.py`.

use crate::common;

on_both_backends!(
    uploads_belong_to_the_kernel,
    delete_and_move_follow_no_symlink,
    caches_stay_out_of_the_workspace_listing,
    no_host_path_in_tracebacks_or_sys_path,
    the_readme_walkthrough_then_the_example,
);

use common::*;
use serde_json::{json, Value};

async fn put(api: &Api, broker: &Broker, id: &str, path: &str, body: &'static str) -> u16 {
    api.http
        .put(broker.url(&format!("/v1/sessions/{id}/files/{path}")))
        .bearer_auth(&api.token)
        .body(body)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn patch(api: &Api, id: &str, path: &str, to: &str) -> (u16, Value) {
    api.call(
        reqwest::Method::PATCH,
        &format!("/v1/sessions/{id}/files/{path}"),
        Some(json!({ "path": to })),
    )
    .await
}

fn text(exec: &Value) -> String {
    let main = exec["results"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["is_main_result"] == true))
        .unwrap_or_else(|| panic!("no main result in {exec}"));
    main["data"]["text/plain"].as_str().unwrap().to_string()
}

async fn listed(api: &Api, id: &str) -> Vec<String> {
    let (status, list) = api.get(&format!("/v1/sessions/{id}/files")).await;
    assert_eq!(status, 200, "{list}");
    list.as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_string())
        .collect()
}

async fn uploads_belong_to_the_kernel(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    assert_eq!(
        put(&api, &broker, &id, "in/deep/sales.csv", "a\n1\n").await,
        201
    );
    assert_eq!(put(&api, &broker, &id, "top.csv", "a\n1\n").await, 201);
    // Files and the directories the upload made are the kernel's: same uid, writable.
    let x = api
        .execute(
            &id,
            "import os\n\
             owners = {p: os.stat(p).st_uid == os.getuid() for p in ['in', 'in/deep', 'in/deep/sales.csv', 'top.csv']}\n\
             open('top.csv', 'w').write('overwritten')\n\
             open('in/deep/sales.csv', 'a').write('2\\n')\n\
             open('in/deep/new.txt', 'w').write('new')\n\
             os.rename('in/deep/new.txt', 'in/moved.txt')\n\
             os.remove('in/deep/sales.csv'); os.rmdir('in/deep')\n\
             all(owners.values()), sorted(os.listdir('in'))",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    assert_eq!(text(&x), "(True, ['moved.txt'])");
    // Moved and deleted through the API, the kernel's files too.
    assert_eq!(
        patch(&api, &id, "in/moved.txt", "out/final.txt").await.0,
        200
    );
    let x = api
        .execute(
            &id,
            "import os\nos.stat('out').st_uid == os.getuid(), open('out/final.txt').read()",
        )
        .await;
    assert_eq!(text(&x), "(True, 'new')");
    assert_eq!(
        api.delete(&format!("/v1/sessions/{id}/files/out/final.txt"))
            .await
            .0,
        204
    );
    assert_eq!(
        api.delete(&format!("/v1/sessions/{id}/files/out")).await.0,
        204
    );
    assert_eq!(listed(&api, &id).await, ["top.csv"]);
    broker.stop().await;
}

async fn delete_and_move_follow_no_symlink(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    assert_eq!(put(&api, &broker, &id, "keep.txt", "k").await, 201);
    assert_eq!(put(&api, &broker, &id, "d/inner.txt", "i").await, 201);
    // The kernel plants links: to a directory outside, to a file outside, to its own dir.
    let x = api
        .execute(
            &id,
            "import os\nos.makedirs('/tmp/outside', exist_ok=True)\n\
             open('/tmp/outside/secret', 'w').write('s')\n\
             os.symlink('/tmp/outside', 'dirlink'); os.symlink('/etc', 'etc')\n\
             os.symlink('/tmp/outside/secret', 'filelink')",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    let files = |p: &str| format!("/v1/sessions/{id}/files/{p}");
    for path in ["dirlink/secret", "etc/hostname", "etc/passwd"] {
        let (status, body) = api.delete(&files(path)).await;
        assert_eq!(status, 400, "{path}: {body}");
    }
    for (from, to) in [
        ("dirlink/secret", "stolen"),
        ("keep.txt", "dirlink/planted"),
        ("keep.txt", "etc/planted"),
        ("keep.txt", "dirlink/sub/planted"),
    ] {
        let (status, body) = patch(&api, &id, from, to).await;
        assert_eq!(status, 400, "{from} -> {to}: {body}");
    }
    // Bad paths and conflicts. A name longer than the filesystem takes is the client's
    // mistake (400), on every verb.
    let long = "n".repeat(256);
    assert_eq!(put(&api, &broker, &id, &long, "x").await, 400);
    assert_eq!(api.get(&files(&long)).await.0, 400);
    assert_eq!(api.delete(&files(&long)).await.0, 400);
    assert_eq!(patch(&api, &id, "keep.txt", &long).await.0, 400);
    assert_eq!(patch(&api, &id, "keep.txt", "../x").await.0, 400);
    assert_eq!(patch(&api, &id, "keep.txt", "d/inner.txt").await.0, 409);
    assert_eq!(api.delete(&files("d")).await.0, 409);
    assert_eq!(api.delete(&files("missing")).await.0, 404);
    assert_eq!(patch(&api, &id, "missing", "x").await.0, 404);
    // A link is deleted and moved as the link it is; its target is untouched.
    assert_eq!(patch(&api, &id, "filelink", "moved-link").await.0, 200);
    assert_eq!(api.delete(&files("moved-link")).await.0, 204);
    assert_eq!(api.delete(&files("dirlink")).await.0, 204);
    let x = api
        .execute(
            &id,
            "import os\nopen('/tmp/outside/secret').read(), sorted(os.listdir('/tmp/outside')), \
             os.path.exists('/etc/hostname') or os.path.exists('/etc/passwd'), open('keep.txt').read()",
        )
        .await;
    assert_eq!(text(&x), "('s', ['secret'], True, 'k')");
    broker.stop().await;
}

async fn caches_stay_out_of_the_workspace_listing(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api
        .execute(
            &id,
            "import os, matplotlib.pyplot as plt, IPython\n\
             plt.plot([1, 2]); plt.savefig('chart.png')\n\
             IPython.paths.get_ipython_dir(), os.path.expanduser('~')",
        )
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    assert_eq!(text(&x), "('/home/kernel/.ipython', '/home/kernel')");
    assert_eq!(listed(&api, &id).await, ["chart.png"]);
    broker.stop().await;
}

async fn no_host_path_in_tracebacks_or_sys_path(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    // A library function's error (pandas, then the standard library's json) and the paths
    // the interpreter reports.
    let errors = [
        api.execute(&id, "import pandas as pd\npd.read_csv('missing.csv')")
            .await,
        api.execute(&id, "import json\njson.loads('{')").await,
    ];
    let paths = api
        .execute(
            &id,
            "import sys, os, pandas, json\n\
             [*sys.path, sys.executable, sys.prefix, sys.base_prefix, os.path.realpath(sys.executable), \
              pandas.__file__, json.__file__, os.environ.get('PATH')]",
        )
        .await;
    let host_paths = [
        repo().to_string_lossy().into_owned(),
        broker.data_dir.to_string_lossy().into_owned(),
        "/root".to_string(),
        "/work".to_string(),
        ".pyenv".to_string(),
    ];
    for exec in errors.iter().chain([&paths]) {
        let shown = exec.to_string();
        for host in &host_paths {
            assert!(!shown.contains(host.as_str()), "{host} shows in {shown}");
        }
    }
    for e in &errors {
        assert_eq!(e["status"], "error", "{e}");
    }
    // The library's frames name the kernel's venv where kernels see it.
    let tb = errors[0]["error"]["traceback"].to_string();
    assert!(tb.contains("/opt/kernel-venv/lib/python3"), "{tb}");
    assert!(
        text(&paths).contains("/opt/kernel-venv/lib/python3"),
        "{paths}"
    );
    broker.stop().await;
}

/// The README's curl walkthrough, as requests (load, mistake, fix, chart, upload
/// `sales.csv`), then `examples/agent_session.py` against the same broker and user: the
/// example writes `sales.csv` from its kernel over the uploaded one.
async fn the_readme_walkthrough_then_the_example(sb: &'static str) {
    let broker = Broker::start(sb, |_| {}).await;
    let api = broker.api(ALICE);
    let id = api.create().await;
    let x = api
        .execute(&id, "import pandas as pd\ndf = pd.DataFrame({\"units\": [3, 5, 2], \"unit_price\": [9.5, 12.0, 7.25]})")
        .await;
    assert_eq!(x["status"], "ok", "{x}");
    let x = api.execute(&id, "df[\"price\"]").await;
    assert_eq!(x["error"]["ename"], "KeyError", "{x}");
    let x = api
        .execute_with(
            &id,
            json!({"code": "df[\"revenue\"] = df.units * df.unit_price\ndf.revenue.sum()", "timeout_seconds": 30}),
        )
        .await;
    assert!(text(&x).contains("103.0"), "{x}");
    let x = api
        .execute(
            &id,
            "import matplotlib.pyplot as plt\ndf.revenue.plot.bar()\nplt.show()",
        )
        .await;
    assert!(x["results"][0]["data"]["image/png"].is_string(), "{x}");
    assert_eq!(
        put(
            &api,
            &broker,
            &id,
            "sales.csv",
            "units,unit_price\n3,9.5\n5,12.0\n"
        )
        .await,
        201
    );
    assert_eq!(patch(&api, &id, "sales.csv", "data/sales.csv").await.0, 200);
    assert_eq!(listed(&api, &id).await, ["data/sales.csv"]);
    let file = format!("/v1/sessions/{id}/files/data/sales.csv");
    assert_eq!(api.delete(&file).await.0, 204);
    // The example then writes its own sales.csv from its kernel: over an uploaded one here
    // (what the reader had, who skipped the move and delete).
    assert_eq!(
        put(&api, &broker, &id, "sales.csv", "units\n1\n").await,
        201
    );
    let (status, body) = api.delete(&format!("/v1/sessions/{id}")).await;
    assert!((200..300).contains(&status), "{body}");

    let python = repo().join("protocol-tests/.venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: scripts/setup --test makes it",
        python.display()
    );
    let out_dir = tempfile::tempdir().unwrap();
    let chart = out_dir.path().join("chart.png");
    let run = tokio::process::Command::new(&python)
        .arg(repo().join("examples/agent_session.py"))
        .args(["--url", &broker.url("")])
        .arg("--out")
        .arg(&chart)
        .env("KERNEL_BROKER_TOKEN", ALICE)
        .kill_on_drop(true)
        .output();
    let out = within(180, "examples/agent_session.py", run).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the example failed:\n{stdout}\n{stderr}"
    );
    assert!(!stdout.contains("PermissionError"), "{stdout}");
    assert!(std::fs::metadata(&chart).unwrap().len() > 1000);
    broker.stop().await;
}
