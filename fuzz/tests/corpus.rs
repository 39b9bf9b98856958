//! Replays every committed input (seed corpora in `corpus/<target>/`, crashes found in
//! `regressions/<target>/`) through the harnesses: a crash the fuzzer found stays fixed, and
//! the seeds keep decoding without a panic. Runs without AFL (`cargo test` in `fuzz/`).

use std::path::Path;

fn replay(target: &str, harness: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            let data = std::fs::read(&path).expect("a readable input");
            eprintln!("{target}: {}", path.display());
            harness(&data);
            n += 1;
        }
    }
    assert!(n > 0, "no inputs for {target}");
}

#[test]
fn wire_decode() {
    replay("wire_decode", kernel_broker_fuzz::wire_decode);
}

#[test]
fn zmtp_reader() {
    replay("zmtp_reader", kernel_broker_fuzz::zmtp_reader);
}

#[test]
fn jupyter_framing() {
    replay("jupyter_framing", kernel_broker_fuzz::jupyter_framing);
}

#[test]
fn stream_frame() {
    replay("stream_frame", kernel_broker_fuzz::stream_frame);
}
