//! The nbformat document: cells, ids, metadata and markers as markdown.

use std::collections::HashSet;

use chrono::DateTime;
use uuid::Uuid;

use super::super::nbformat::cell_id;
use super::*;
use crate::recording::RecordingInfo;

/// A recording's info, as the notebook's header reads it.
fn info(cells: u64, events: u64) -> RecordingInfo {
    RecordingInfo {
        id: Uuid::nil(),
        user: "alice".into(),
        kernel: "python3".into(),
        created_at: DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
        ended_at: None,
        end_reason: None,
        cells,
        events,
        last_event_at: None,
    }
}

#[test]
fn notebook_has_cells_markers_and_metadata() {
    let info = info(3, 20);
    let nb = notebook(&info, &recording());
    assert_eq!(nb["nbformat"], 4);
    assert_eq!(nb["nbformat_minor"], 5);
    assert_eq!(nb["metadata"]["kernelspec"]["name"], "python3");
    let cells = nb["cells"].as_array().unwrap();
    let types: Vec<&str> = cells
        .iter()
        .map(|c| c["cell_type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["code", "code", "markdown", "code"]);
    assert_eq!(cells[0]["id"], "a");
    assert!(cells[2]["source"].as_str().unwrap().contains("restarted"));
    let ids: HashSet<&str> = cells.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 4);
    assert_eq!(cells[0]["metadata"]["kernel_broker"]["status"], "ok");
}

#[test]
fn ids_are_valid_and_unique() {
    let mut used = HashSet::new();
    let cases = ["abc-1_2", "a b/c", "", "abc-1_2", &"x".repeat(100)];
    for seed in cases {
        let id = cell_id(seed, &mut used);
        assert!(!id.is_empty() && id.len() <= 64, "{id}");
        assert!(
            id.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "{id}"
        );
    }
    assert_eq!(used.len(), cases.len());
}

#[test]
fn markers_in_the_notebook() {
    let info = info(0, 10);
    let nb = notebook(&info, &markers().0);
    let got: Vec<String> = nb["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            format!(
                "{} {} {}",
                c["cell_type"].as_str().unwrap(),
                c["metadata"]["kernel_broker"]["event"].as_str().unwrap(),
                c["source"].as_str().unwrap()
            )
        })
        .collect();
    let t = |s: i64| format!("2023-11-14T22:13:{}.000000Z", 20 + s);
    assert_eq!(
        got,
        [
            format!("markdown kernel_restarted *[kernel-broker, {}] The kernel was restarted: by request*", t(3)),
            format!("markdown kernel_died *[kernel-broker, {}] The kernel died: out of memory*", t(4)),
            format!("markdown recording_gap *[kernel-broker, {}] Part of the recording is missing: the writer fell behind*", t(5)),
            format!("markdown recording_truncated *[kernel-broker, {}] Output of a cell was cut in the recording: over its cap*", t(6)),
            format!("markdown session_expired *[kernel-broker, {}] The session expired*", t(7)),
            format!("markdown session_closed *[kernel-broker, {}] The session was closed by rest*", t(8)),
            format!("markdown broker_stopped *[kernel-broker, {}] The broker stopped: killed*", t(9)),
        ]
    );
}

#[test]
fn a_fork_names_its_origin_and_its_origin_its_forks() {
    let parent = Uuid::from_u128(7);
    let (a, b) = (Uuid::from_u128(8), Uuid::from_u128(9));
    let fork = Rec::default()
        .event(LifecycleEvent::SessionCreated {
            kernel: "python3".into(),
            idle_timeout_seconds: Some(60),
            provenance: Default::default(),
            forked_from: Some(crate::session::lifecycle::ForkedFrom {
                session: parent,
                execution_count: 4,
                checkpoint: Some(Uuid::from_u128(3)),
            }),
            own_workspace: false,
        })
        .request("a", "x + 1")
        .reply("a", "ok", 5);
    let nb = notebook(&info(1, 3), &fork.0);
    let meta = &nb["metadata"]["kernel_broker"];
    assert_eq!(
        meta["forked_from"],
        json!({"session": parent, "execution_count": 4, "checkpoint": Uuid::from_u128(3)})
    );
    assert!(meta.get("forks").is_none(), "{meta}");

    let origin = Rec::default()
        .event(LifecycleEvent::SessionCreated {
            kernel: "python3".into(),
            idle_timeout_seconds: Some(60),
            provenance: Default::default(),
            forked_from: None,
            own_workspace: false,
        })
        .request("a", "x = 1")
        .reply("a", "ok", 4)
        .event(LifecycleEvent::SessionForked {
            sessions: vec![a, b],
            execution_count: 4,
        })
        .request("b", "x = 2")
        .reply("b", "ok", 5);
    let nb = notebook(&info(2, 5), &origin.0);
    let meta = &nb["metadata"]["kernel_broker"];
    assert!(meta.get("forked_from").is_none(), "{meta}");
    assert_eq!(
        meta["forks"],
        json!([{"session": a, "execution_count": 4}, {"session": b, "execution_count": 4}])
    );
    // Where it forked, between the cells it ran before and after.
    let cells = nb["cells"].as_array().unwrap();
    let kinds: Vec<&str> = cells
        .iter()
        .map(|c| c["cell_type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["code", "markdown", "code"]);
    let said = cells[1]["source"].as_str().unwrap();
    assert!(
        said.contains("forked after execution 4") && said.contains(&a.to_string()),
        "{said}"
    );
    assert_eq!(
        cells[1]["metadata"]["kernel_broker"]["event"],
        "session_forked"
    );
}

#[test]
fn a_rewind_is_a_marker_between_the_cells_before_and_after() {
    let cp = Uuid::from_u128(11);
    let rec = Rec::default()
        .request("a", "x = 1")
        .reply("a", "ok", 1)
        .event(LifecycleEvent::CheckpointTaken {
            checkpoint: cp,
            execution_count: 1,
        })
        .request("b", "del x")
        .reply("b", "ok", 2)
        .event(LifecycleEvent::SessionRewound {
            checkpoint: cp,
            execution_count: 1,
        })
        .request("c", "x")
        .reply("c", "ok", 2);
    let nb = notebook(&info(3, 8), &rec.0);
    let cells = nb["cells"].as_array().unwrap();
    let kinds: Vec<&str> = cells
        .iter()
        .map(|c| c["cell_type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["code", "code", "markdown", "code"]);
    let said = cells[2]["source"].as_str().unwrap();
    assert!(
        said.contains("rewound to checkpoint") && said.contains(&cp.to_string()),
        "{said}"
    );
    assert_eq!(
        cells[2]["metadata"]["kernel_broker"]["event"],
        "session_rewound"
    );
}
