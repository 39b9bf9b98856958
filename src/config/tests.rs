//! Settings resolution: precedence, users files, each layer's defaults.

use super::*;
use crate::recording::Synchronous;
use std::io::Write;

fn write(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn flags_beat_file_beat_defaults() {
    let cfg = write("idle_timeout = 30\noutput_limit = 5\nlisten = \"127.0.0.1:9999\"\n");
    let args = ServeArgs {
        config: Some(cfg.path().to_path_buf()),
        idle_timeout: Some(7),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("tok-123456".into())).unwrap();
    assert_eq!(s.session.idle_timeout, Duration::from_secs(7));
    assert_eq!(s.session.output_limit, 5);
    assert_eq!(s.listen.port(), 9999);
    assert_eq!(s.session.execution_timeout, Duration::from_secs(60));
    assert_eq!(s.users.len(), 1);
    assert_eq!(s.users[0].name, "default");
    assert_eq!(s.token_source, TokenSource::Environment);
}

#[test]
fn sandbox_settings_start_from_the_backends_defaults() {
    let cfg = write(
        "uid_base = 300000
container_idle = 9
",
    );
    let args = ServeArgs {
        config: Some(cfg.path().to_path_buf()),
        docker_image: Some("img:1".into()),
        kernels_dir: Some("/k".into()),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("tok-123456".into())).unwrap();
    assert_eq!(s.local.uid_base, 300_000);
    assert_eq!(s.local.python, PathBuf::from("/k/.venv/bin/python"));
    // Named after the data directory, so brokers side by side keep apart.
    let (cgroup, _) = crate::sandbox::local::instance_defaults(&s.data_dir);
    assert_eq!(s.local.cgroup_name, cgroup);
    assert!(s.local.cgroup_name.starts_with("kernel-broker-"));
    assert!(s.local.require_limits);
    assert_eq!(s.local.launch_timeout, Duration::from_secs(30));
    // A cold Docker launch makes the user's container first.
    assert_eq!(s.docker.launch_timeout, Duration::from_secs(60));
    assert_eq!(s.docker.image, "img:1");
    assert_eq!(s.docker.container_idle, Duration::from_secs(9));
    assert_eq!(s.docker.socket, "/var/run/docker.sock");
    // Both backends fork from a template with the data stack by default (the image has it).
    assert!(s.docker.fork_server && s.local.fork_server);
    assert_eq!(s.docker.preload, ["numpy", "pandas", "matplotlib"]);
    assert_eq!(s.docker.preload, s.local.preload);
}

#[test]
fn the_fork_server_switch_and_preload_reach_both_backends() {
    let args = ServeArgs {
        fork_server: Some(false),
        preload: Some("none".into()),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("tok-123456".into())).unwrap();
    assert!(!s.docker.fork_server && !s.local.fork_server);
    assert!(s.docker.preload.is_empty() && s.local.preload.is_empty());
    let bad = ServeArgs {
        preload: Some("numpy,os;rm".into()),
        ..Default::default()
    };
    assert!(Settings::resolve(bad, Some("tok-123456".into())).is_err());
}

#[test]
fn users_file_with_limits() {
    let users = write(
            "[[user]]\nname = \"alice\"\ntoken = \"alice-token\"\nmemory_bytes = 536870912\nworkspace_quota_bytes = 67108864\n\n[[user]]\nname = \"bob\"\ntoken = \"bob-token-1\"\n",
        );
    let args = ServeArgs {
        users_file: Some(users.path().to_path_buf()),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("ignored-token".into())).unwrap();
    assert_eq!(s.users.len(), 2);
    assert_eq!(s.users[0].limits.memory_bytes, 512 << 20);
    assert_eq!(s.users[1].limits.memory_bytes, 5 << 30);
    assert_eq!(s.users[0].limits.workspace_quota_bytes, 64 << 20);
    assert_eq!(s.users[1].limits.workspace_quota_bytes, 1 << 30);
    assert_eq!(s.users[1].index, 1);
    let small = ServeArgs {
        workspace_quota: Some(1 << 20),
        ..Default::default()
    };
    assert!(Settings::resolve(small, Some("some-token".into())).is_err());
}

#[test]
fn session_limits_default_to_agreeing_values_and_can_be_set() {
    let users = write(
        "[[user]]\nname = \"alice\"\ntoken = \"alice-token\"\nmemory_bytes = 134217728\n\n\
         [[user]]\nname = \"bob\"\ntoken = \"bob-token-1\"\nsession_memory_bytes = 536870912\nsession_pids = 40\n",
    );
    let args = ServeArgs {
        users_file: Some(users.path().to_path_buf()),
        ..Default::default()
    };
    let s = Settings::resolve(args, None).unwrap();
    // 20 sessions of the default size fill the default total, and their pids fit.
    let bob = &s.users[1].limits;
    assert_eq!(s.users[1].max_sessions, 20);
    assert_eq!(bob.memory_bytes, 20 * (256 << 20));
    assert_eq!(bob.pids, 20 * 64);
    assert_eq!(
        (bob.session_memory_bytes, bob.session_pids),
        (512 << 20, 40)
    );
    // A total below the default session size takes the session size down with it.
    let alice = &s.users[0].limits;
    assert_eq!(alice.session_memory_bytes, 128 << 20);
    assert_eq!(alice.session_pids, 64);
    // Bob's limits keep a fork bomb to the pids limit; alice's smaller memory does not (the
    // broker warns at start-up and lets it be).
    assert_eq!(bob.memory_for_pids(), None);
    assert_eq!(alice.memory_for_pids(), Some(256 << 20));

    let args = ServeArgs {
        session_memory_limit: Some(64 << 20),
        session_pids_limit: Some(32),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("some-token".into())).unwrap();
    assert_eq!(s.users[0].limits.session_memory_bytes, 64 << 20);
    assert_eq!(s.users[0].limits.session_pids, 32);
    for bad in [
        ServeArgs {
            session_memory_limit: Some(1 << 20),
            ..Default::default()
        },
        ServeArgs {
            memory_limit: Some(1 << 30),
            session_memory_limit: Some(2 << 30),
            ..Default::default()
        },
        ServeArgs {
            session_pids_limit: Some(0),
            ..Default::default()
        },
    ] {
        assert!(Settings::resolve(bad, Some("some-token".into())).is_err());
    }
}

#[test]
fn bad_users_are_refused() {
    for bad in [
            "[[user]]\nname = \"../x\"\ntoken = \"long-enough\"\n",
            "[[user]]\nname = \"a\"\ntoken = \"short\"\n",
            "[[user]]\nname = \"a\"\ntoken = \"same-token\"\n[[user]]\nname = \"b\"\ntoken = \"same-token\"\n",
            "[[user]]\nname = \"a\"\ntoken = \"long-enough\"\nshoe_size = 3\n",
            "",
        ] {
            let f = write(bad);
            let args = ServeArgs {
                users_file: Some(f.path().to_path_buf()),
                ..Default::default()
            };
            assert!(Settings::resolve(args, None).is_err(), "{bad}");
        }
}

#[test]
fn recording_settings() {
    let s = Settings::resolve(ServeArgs::default(), Some("tok-123456".into())).unwrap();
    let r = s.recording.expect("recording is on by default");
    assert_eq!(r.path, PathBuf::from(".data/recordings.sqlite3"));
    assert_eq!(r.retention, Some(Duration::from_secs(30 * 86_400)));
    assert_eq!(r.synchronous, Synchronous::Normal);
    assert_eq!(r.max_execution_bytes, 50 << 20);
    assert_eq!(r.max_session_bytes, 1 << 30);
    let cfg = write(
        "retention_days = 0\nrecord_synchronous = \"full\"\ndata_dir = \"/x\"\n\
             record_max_session_bytes = 1000\n",
    );
    let args = ServeArgs {
        config: Some(cfg.path().to_path_buf()),
        record: Some(false),
        ..Default::default()
    };
    let s = Settings::resolve(args.clone(), Some("tok-123456".into())).unwrap();
    assert!(s.recording.is_none());
    let args = ServeArgs {
        record: None,
        ..args
    };
    let s = Settings::resolve(args, Some("tok-123456".into())).unwrap();
    let r = s.recording.expect("on again");
    assert_eq!(r.retention, None);
    assert_eq!(r.path, PathBuf::from("/x/recordings.sqlite3"));
    assert_eq!(r.synchronous, Synchronous::Full);
    assert_eq!(r.max_session_bytes, 1000);
}

#[test]
fn recordings_in_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = |url: &str, record_db: Option<&str>, node: Option<&str>| ServeArgs {
        data_dir: Some(data.clone()),
        database_url: Some(url.into()),
        record_db: record_db.map(PathBuf::from),
        node_id: node.map(str::to_string),
        ..Default::default()
    };
    let resolve = |a| Settings::resolve(a, Some("tok-123456".into()));
    let url = "postgres://kb:pw@db:5432/kb";
    let r = resolve(args(url, None, None)).unwrap().recording.unwrap();
    assert_eq!(r.database_url.as_deref(), Some(url));
    // A node id made once and kept in the data directory.
    let made = std::fs::read_to_string(data.join("node-id")).unwrap();
    assert_eq!(r.node, made.trim());
    assert!(uuid::Uuid::parse_str(&r.node).is_ok());
    let again = resolve(args(url, None, None)).unwrap().recording.unwrap();
    assert_eq!(again.node, r.node);
    let named = resolve(args(url, None, Some("node-7"))).unwrap();
    assert_eq!(named.recording.unwrap().node, "node-7");
    for bad in [
        args("mysql://db/kb", None, None),
        args(url, Some("/x.sqlite3"), None),
    ] {
        let e = resolve(bad).unwrap_err().to_string();
        assert!(e.contains("--database-url"), "{e}");
    }
}

#[test]
fn no_token_generates_one() {
    let s = Settings::resolve(ServeArgs::default(), None).unwrap();
    assert_eq!(s.token_source, TokenSource::Generated);
    assert_eq!(s.users[0].token.len(), 48);
}

#[test]
fn client_limits_start_from_the_apis_defaults() {
    let cfg =
        write("client_header_timeout = 2.5\nmax_connections = 50\nwebsocket_ping_interval = 0\n");
    let args = ServeArgs {
        config: Some(cfg.path().to_path_buf()),
        max_connections_per_client: Some(5),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("tok-123456".into())).unwrap();
    let defaults = ClientLimits::default();
    assert_eq!(s.clients.header_timeout, Duration::from_millis(2500));
    assert_eq!(s.clients.max_connections, 50);
    assert_eq!(s.clients.max_connections_per_client, 5);
    assert_eq!(s.clients.websocket_ping_interval, Duration::ZERO);
    assert_eq!(s.clients.body_timeout, defaults.body_timeout);
    assert_eq!(
        s.clients.websocket_pong_timeout,
        defaults.websocket_pong_timeout
    );

    let bad = ServeArgs {
        websocket_pong_timeout: Some(0.0),
        ..Default::default()
    };
    assert!(Settings::resolve(bad, Some("tok-123456".into())).is_err());
    let negative = ServeArgs {
        client_body_timeout: Some(-1.0),
        ..Default::default()
    };
    assert!(Settings::resolve(negative, Some("tok-123456".into())).is_err());
}

#[test]
fn websockets_per_session_default_and_override() {
    let s = Settings::resolve(ServeArgs::default(), Some("tok-123456".into())).unwrap();
    assert_eq!(s.clients.max_websockets_per_session, 64);
    let args = ServeArgs {
        max_websockets_per_session: Some(3),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("tok-123456".into())).unwrap();
    assert_eq!(s.clients.max_websockets_per_session, 3);
}

#[test]
fn brokers_with_different_data_directories_get_their_own_cgroup_and_uids() {
    use crate::sandbox::local::instance_defaults;
    let (a_cgroup, a_uid) = instance_defaults(Path::new("/var/lib/broker-a"));
    let (b_cgroup, b_uid) = instance_defaults(Path::new("/var/lib/broker-b"));
    assert_ne!(a_cgroup, b_cgroup);
    assert_ne!(a_uid, b_uid);
    for uid in [a_uid, b_uid] {
        assert!((200_000..200_000 + 10_000 * 10_000).contains(&uid));
        assert_eq!(uid % 10_000, 0);
    }
    // The same directory, spelled relative or absolute, is the same instance.
    let here = std::env::current_dir().unwrap();
    assert_eq!(
        instance_defaults(Path::new("data")),
        instance_defaults(&here.join("data"))
    );
    // Given explicitly, the values are taken as they are.
    let args = ServeArgs {
        data_dir: Some("/var/lib/broker-a".into()),
        uid_base: Some(300_000),
        cgroup_name: Some("mine".into()),
        launch_timeout: Some(180),
        ..Default::default()
    };
    let s = Settings::resolve(args, Some("tok-123456".into())).unwrap();
    assert_eq!(
        (s.local.cgroup_name.as_str(), s.local.uid_base),
        ("mine", 300_000)
    );
    assert_eq!(s.local.launch_timeout, Duration::from_secs(180));
    assert_eq!(s.docker.launch_timeout, Duration::from_secs(180));
}

/// Network policies: the default (`--egress`), a user's own list replacing it, `[]` for
/// none, limits, and every bad setting refused at start with the setting named.
#[test]
fn egress_policies_resolve_per_user_and_bad_ones_are_refused() {
    let users = write(
        "[[user]]\nname = \"alice\"\ntoken = \"alice-token\"\negress_allow = [\"pypi.org\", \"*.pythonhosted.org\"]\negress_max_connections = 2\n\n\
         [[user]]\nname = \"bob\"\ntoken = \"bob-token-1\"\n\n\
         [[user]]\nname = \"carol\"\ntoken = \"carol-token\"\negress_allow = []\n",
    );
    let resolve = |tweak: &dyn Fn(&mut ServeArgs)| {
        let mut args = ServeArgs {
            users_file: Some(users.path().to_path_buf()),
            ..Default::default()
        };
        tweak(&mut args);
        Settings::resolve(args, None)
    };
    // Default none: only alice (her own list) has egress.
    let s = resolve(&|_| {}).unwrap();
    assert_eq!(s.egress.users.len(), 1);
    let alice = &s.egress.users["alice"];
    assert!(alice.policy.check("files.pythonhosted.org", 443).is_ok());
    assert!(alice.policy.check("example.org", 443).is_err());
    assert_eq!(alice.limits.max_connections, 2);
    assert_eq!(alice.limits.max_bytes, 1 << 30);
    assert_eq!(s.local.ca_file, None);
    assert_eq!(
        s.egress.ca_bundle.as_deref(),
        Some("/etc/ssl/certs/ca-certificates.crt")
    );
    // --egress allow: bob gets the default list, carol's [] keeps her without.
    let s = resolve(&|a| {
        a.egress = Some(EgressMode::Allow);
        a.egress_allow = Some(vec!["pypi.org".into()]);
        a.egress_ports = Some(vec![443]);
        a.egress_max_bytes = Some(1000);
    })
    .unwrap();
    let mut names: Vec<_> = s.egress.users.keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["alice", "bob"]);
    assert!(s.egress.users["bob"].policy.check("pypi.org", 80).is_err());
    assert!(s.egress.users["bob"].policy.check("pypi.org", 443).is_ok());
    assert_eq!(s.egress.users["bob"].limits.max_bytes, 1000);

    type Tweak<'a> = &'a dyn Fn(&mut ServeArgs);
    let bad: &[(&str, Tweak)] = &[
        ("needs --egress-allow", &|a| {
            a.egress = Some(EgressMode::Allow)
        }),
        ("choose one", &|a| {
            a.egress = Some(EgressMode::None);
            a.egress_allow = Some(vec!["pypi.org".into()]);
        }),
        ("--egress-allow: \"*\"", &|a| {
            a.egress_allow = Some(vec!["*".into()])
        }),
        ("leave out the scheme", &|a| {
            a.egress_allow = Some(vec!["https://pypi.org".into()])
        }),
        ("not a network", &|a| {
            a.egress_allow_networks = Some(vec!["pypi.org".into()])
        }),
        ("never connects to", &|a| {
            a.egress_allow_networks = Some(vec!["127.0.0.0/8".into()])
        }),
        ("not an absolute path", &|a| {
            a.egress_ca_bundle = Some("certs.pem".into())
        }),
        ("--egress-ca-file", &|a| {
            a.egress_ca_file = Some("/nonexistent/ca.pem".into())
        }),
    ];
    for (want, tweak) in bad {
        let err = resolve(tweak).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    let ports_alone =
        write("[[user]]\nname = \"dave\"\ntoken = \"dave-token\"\negress_ports = [443]\n");
    let err = Settings::resolve(
        ServeArgs {
            users_file: Some(ports_alone.path().to_path_buf()),
            ..Default::default()
        },
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("egress_ports of user dave"), "{err}");
    let bad_user =
        write("[[user]]\nname = \"erin\"\ntoken = \"erin-token\"\negress_allow = [\"10.0.0.1\"]\n");
    let err = Settings::resolve(
        ServeArgs {
            users_file: Some(bad_user.path().to_path_buf()),
            ..Default::default()
        },
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("egress_allow of user erin") && err.contains("not a public address"),
        "{err}"
    );
}

/// Secrets and the policy (issue 39): a user's secrets, the credential patterns (default set
/// on, operator patterns added, the defaults turned off), the policy file; bad ones are
/// refused at start with the setting named.
#[test]
fn secrets_patterns_and_the_policy_resolve_and_bad_ones_are_refused() {
    let users = write(
        "[[user]]\nname = \"alice\"\ntoken = \"alice-token\"\nsecrets = { API_KEY = \"alice-api-key\" }\n\n\
         [[user]]\nname = \"bob\"\ntoken = \"bob-token-1\"\n",
    );
    let policy = write("[[rule]]\nname = \"no-sockets\"\ndeny_imports = [\"socket\"]\n");
    let resolve = |tweak: &dyn Fn(&mut ServeArgs)| {
        let mut args = ServeArgs {
            users_file: Some(users.path().to_path_buf()),
            ..Default::default()
        };
        tweak(&mut args);
        Settings::resolve(args, None)
    };
    let s = resolve(&|_| {}).unwrap();
    assert_eq!(s.users[0].secrets["API_KEY"], "alice-api-key");
    assert!(s.users[1].secrets.is_empty());
    assert!(s.policy.is_empty());
    let creds = s.credentials();
    let masker = creds.masker(&Default::default(), &[]);
    assert_eq!(
        masker.mask_str("bob-token-1 AKIAIOSFODNN7EXAMPLE"),
        "[secret:broker-token] [secret:aws-access-key]"
    );
    let s = resolve(&|a| {
        a.default_secret_patterns = Some(false);
        a.secret_patterns = Some(vec!["corp=CORP-[0-9]{6}".into()]);
        a.policy = Some(policy.path().to_path_buf());
    })
    .unwrap();
    let masker = s.credentials().masker(&Default::default(), &[]);
    assert_eq!(
        masker.mask_str("AKIAIOSFODNN7EXAMPLE CORP-123456"),
        "AKIAIOSFODNN7EXAMPLE [secret:corp]"
    );
    assert_eq!(s.policy.rule_names(), ["no-sockets"]);
    let e = resolve(&|a| a.secret_patterns = Some(vec!["bad".into()])).unwrap_err();
    assert!(e.to_string().contains("secret pattern"), "{e}");
    let bad_policy = write("[[rule]]\nname = \"empty\"\n");
    let e = resolve(&|a| a.policy = Some(bad_policy.path().to_path_buf())).unwrap_err();
    assert!(e.to_string().contains("--policy"), "{e}");
    let bad_users = write("[[user]]\nname = \"carol\"\ntoken = \"carol-token\"\nsecrets = { LD_PRELOAD = \"/x.so\" }\n");
    let e = Settings::resolve(
        ServeArgs {
            users_file: Some(bad_users.path().to_path_buf()),
            ..Default::default()
        },
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("user carol") && e.to_string().contains("LD_PRELOAD"),
        "{e}"
    );
}

#[test]
fn a_carry_key_file_is_read_and_a_short_one_refused() {
    let dir = tempfile::tempdir().unwrap();
    let key = |text: &str| {
        let path = dir.path().join(format!("key-{}", text.len()));
        std::fs::write(&path, text).unwrap();
        path
    };
    let args = |file: PathBuf| ServeArgs {
        data_dir: Some(dir.path().join("data")),
        database_url: Some("postgres://kb:pw@db:5432/kb".into()),
        advertise_url: Some("http://node-1:8080".into()),
        carry_paused: Some(true),
        carry_key_file: Some(file),
        ..Default::default()
    };
    let resolve = |a| Settings::resolve(a, Some("tok-123456".into()));
    let long = "k".repeat(40);
    let cluster = resolve(args(key(&format!("{long}\n"))))
        .unwrap()
        .cluster
        .unwrap();
    assert_eq!(cluster.carry_key.as_ref().unwrap().0, long.as_bytes());
    assert!(!format!("{cluster:?}").contains(&long), "never printed");
    for bad in [key("short"), dir.path().join("missing")] {
        let e = resolve(args(bad)).unwrap_err().to_string();
        assert!(e.contains("--carry-key-file"), "{e}");
    }
}
