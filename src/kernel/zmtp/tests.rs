//! The ZMTP client against scripted peers: handshakes, frames, limits, hostile bytes.

use super::*;
use tokio::io::DuplexStream;

const T: Duration = Duration::from_secs(5);

/// A scripted peer: answers the greeting and READY, then runs `script` on the stream.
async fn peer(mut io: DuplexStream) -> DuplexStream {
    let mut g = [0u8; 64];
    io.read_exact(&mut g).await.unwrap();
    check_greeting(&g).unwrap();
    let mut ours = greeting();
    ours[32] = 1; // as-server
    io.write_all(&ours).await.unwrap();
    // Their READY.
    let mut h = [0u8; 2];
    io.read_exact(&mut h).await.unwrap();
    assert_eq!(h[0], FLAG_COMMAND);
    let mut body = vec![0u8; h[1] as usize];
    io.read_exact(&mut body).await.unwrap();
    assert_eq!(&body[..6], b"\x05READY");
    let ready = ready_body(SocketType::Dealer, None);
    io.write_all(&[FLAG_COMMAND, ready.len() as u8])
        .await
        .unwrap();
    io.write_all(&ready).await.unwrap();
    io
}

async fn pair(
    limits: Limits,
) -> (
    Reader<tokio::io::ReadHalf<DuplexStream>>,
    Writer<tokio::io::WriteHalf<DuplexStream>>,
    DuplexStream,
) {
    let (a, b) = tokio::io::duplex(1 << 20);
    let server = tokio::spawn(peer(b));
    let (r, w) = handshake(a, SocketType::Dealer, Some(b"me"), limits, T)
        .await
        .unwrap();
    (r, w, server.await.unwrap())
}

#[tokio::test]
async fn messages_round_trip_short_and_long_frames() {
    let (mut r, mut w, mut peer) = pair(Limits::default()).await;
    let frames = vec![
        Bytes::from_static(b"<IDS|MSG>"),
        Bytes::new(),
        Bytes::from(vec![7u8; 300]),
        Bytes::from(vec![9u8; 200_000]),
    ];
    w.send(&frames).await.unwrap();
    // Echo back what the peer received, byte for byte.
    let mut expect = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        let (h, n) = frame_header(f.len(), i + 1 < frames.len(), false);
        expect.extend_from_slice(&h[..n]);
        expect.extend_from_slice(f);
    }
    let mut got = vec![0u8; expect.len()];
    peer.read_exact(&mut got).await.unwrap();
    assert_eq!(got, expect);
    peer.write_all(&got).await.unwrap();
    match r.next().await.unwrap() {
        Incoming::Message(m, _) => assert_eq!(m, frames),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_huge_claimed_frame_is_refused_before_allocation() {
    let (mut r, _w, mut peer) = pair(Limits::default()).await;
    // A long frame claiming 2^62 bytes, and nothing after it.
    let mut h = vec![FLAG_LONG];
    h.extend_from_slice(&(1u64 << 62).to_be_bytes());
    peer.write_all(&h).await.unwrap();
    let e = r.next().await.unwrap_err();
    assert!(
        matches!(e, ZmtpError::Protocol(ref m) if m.contains("over the limit")),
        "{e}"
    );
}

#[tokio::test]
async fn the_message_total_and_frame_count_are_bounded() {
    let limits = Limits {
        max_message: 1000,
        max_frames: 4,
    };
    let (mut r, _w, mut peer) = pair(limits).await;
    // Three frames of 400 bytes: the third crosses 1000.
    for _ in 0..3 {
        let (h, n) = frame_header(400, true, false);
        peer.write_all(&h[..n]).await.unwrap();
        peer.write_all(&[0u8; 400]).await.unwrap();
    }
    assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

    let (mut r, _w, mut peer) = pair(limits).await;
    for _ in 0..5 {
        peer.write_all(&[FLAG_MORE, 0]).await.unwrap();
    }
    let e = r.next().await.unwrap_err();
    assert!(e.to_string().contains("frames"), "{e}");
}

#[tokio::test]
async fn claimed_but_unsent_bytes_cost_no_memory() {
    // 32 MiB claimed, 10 bytes sent, then the peer goes quiet: the reader waits with
    // a buffer of at most one chunk (checked through capacity growth indirectly: the
    // read does not complete and nothing panics or aborts).
    let (mut r, _w, mut peer) = pair(Limits::default()).await;
    let mut h = vec![FLAG_LONG];
    h.extend_from_slice(&(32u64 << 20).to_be_bytes());
    peer.write_all(&h).await.unwrap();
    peer.write_all(&[1u8; 10]).await.unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(100), r.next())
        .await
        .is_err());
    drop(peer);
}

#[tokio::test]
async fn reserved_flags_bad_commands_and_truncation_are_errors() {
    let (mut r, _w, mut peer) = pair(Limits::default()).await;
    peer.write_all(&[0x80, 1, 0]).await.unwrap();
    assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

    let (mut r, _w, mut peer) = pair(Limits::default()).await;
    let mut h = vec![FLAG_COMMAND | FLAG_LONG];
    h.extend_from_slice(&(1u64 << 40).to_be_bytes());
    peer.write_all(&h).await.unwrap();
    assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

    let (mut r, _w, mut peer) = pair(Limits::default()).await;
    peer.write_all(&[FLAG_MORE, 3, 1, 2, 3, 0, 10, 1])
        .await
        .unwrap();
    drop(peer);
    assert!(matches!(r.next().await, Err(ZmtpError::Protocol(_))));

    let (mut r, _w, peer) = pair(Limits::default()).await;
    drop(peer);
    assert!(matches!(r.next().await, Err(ZmtpError::Closed)));
}

#[tokio::test]
async fn pings_are_reported_and_other_commands_skipped() {
    let (mut r, mut w, mut peer) = pair(Limits::default()).await;
    let mut pong_cmd = vec![4u8];
    pong_cmd.extend_from_slice(b"PONG");
    peer.write_all(&[FLAG_COMMAND, pong_cmd.len() as u8])
        .await
        .unwrap();
    peer.write_all(&pong_cmd).await.unwrap();
    let mut ping = vec![4u8];
    ping.extend_from_slice(b"PING\x00\x10ctx");
    peer.write_all(&[FLAG_COMMAND, ping.len() as u8])
        .await
        .unwrap();
    peer.write_all(&ping).await.unwrap();
    match r.next().await.unwrap() {
        Incoming::Ping(ctx) => {
            assert_eq!(&ctx[..], b"ctx");
            pong(&mut w, &ctx).await.unwrap();
        }
        other => panic!("{other:?}"),
    }
    let mut got = [0u8; 10];
    peer.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"\x04\x08\x04PONGctx");
}

#[tokio::test]
async fn a_peer_that_is_not_zmtp_or_wants_security_is_refused() {
    let (a, mut b) = tokio::io::duplex(4096);
    tokio::spawn(async move {
        let mut g = [0u8; 64];
        let _ = b.read_exact(&mut g).await;
        let _ = b.write_all(&[b'H'; 64]).await;
    });
    assert!(handshake(a, SocketType::Sub, None, Limits::default(), T)
        .await
        .is_err());

    let (a, mut b) = tokio::io::duplex(4096);
    tokio::spawn(async move {
        let mut g = [0u8; 64];
        let _ = b.read_exact(&mut g).await;
        let mut theirs = greeting();
        theirs[12..17].copy_from_slice(b"CURVE");
        let _ = b.write_all(&theirs).await;
    });
    assert!(handshake(a, SocketType::Sub, None, Limits::default(), T)
        .await
        .is_err());

    // A peer that never answers: the handshake times out.
    let (a, _b) = tokio::io::duplex(4096);
    let Err(e) = handshake(
        a,
        SocketType::Req,
        None,
        Limits::default(),
        Duration::from_millis(50),
    )
    .await
    else {
        panic!("a silent peer completed the handshake");
    };
    assert!(e.to_string().contains("handshake"), "{e}");
}

#[tokio::test]
async fn connect_ipc_refuses_a_planted_symlink_and_non_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    let listener = tokio::net::UnixListener::bind(&real).unwrap();
    // The genuine socket connects.
    let accept = tokio::spawn(async move { listener.accept().await.map(|_| ()) });
    connect_ipc(&real).await.unwrap();
    accept.await.unwrap().unwrap();
    // A symlink to it does not (O_PATH | O_NOFOLLOW opens the link itself, which is
    // not a socket).
    let link = dir.path().join("k-1");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let e = connect_ipc(&link).await.unwrap_err();
    assert!(e.to_string().contains("not a socket"), "{e}");
    // Nor does a path through a symlinked directory.
    let linked_dir = dir.path().join("linked");
    std::os::unix::fs::symlink(dir.path(), &linked_dir).unwrap();
    assert!(connect_ipc(&linked_dir.join("real")).await.is_err());
    // Nor does a regular file.
    let file = dir.path().join("k-2");
    std::fs::write(&file, b"x").unwrap();
    assert!(connect_ipc(&file).await.is_err());
}

/// A cutter that lets every message with at least `min_whole` whole frames be cut, and
/// counts what it is fed.
#[derive(Clone, Default)]
struct Counting(Arc<std::sync::Mutex<CountingState>>);

#[derive(Default)]
struct CountingState {
    min_whole: usize,
    begun: usize,
    fed: Vec<(usize, usize)>,
}

impl Cutter for Counting {
    fn begin(&mut self, whole: &[Bytes]) -> bool {
        let mut s = self.0.lock().unwrap();
        s.begun += 1;
        s.fed.clear();
        whole.len() >= s.min_whole
    }
    fn feed(&mut self, index: usize, piece: &[u8]) {
        let mut s = self.0.lock().unwrap();
        match s.fed.last_mut() {
            Some((i, n)) if *i == index => *n += piece.len(),
            _ => s.fed.push((index, piece.len())),
        }
    }
    fn finish(&mut self) -> bool {
        true
    }
}

async fn send_frame(peer: &mut DuplexStream, body: &[u8], more: bool) {
    let (h, n) = frame_header(body.len(), more, false);
    peer.write_all(&h[..n]).await.unwrap();
    peer.write_all(body).await.unwrap();
}

#[tokio::test]
async fn an_oversized_message_is_cut_to_a_prefix_and_the_stream_stays_in_step() {
    let limits = Limits {
        max_message: 1000,
        max_frames: 8,
    };
    let (mut r, _w, mut peer) = pair(limits).await;
    let cutter = Counting::default();
    cutter.0.lock().unwrap().min_whole = 2;
    let budget = Arc::new(Semaphore::new(2000));
    r.set_budget(budget.clone());
    r.cut_oversized(
        Box::new(cutter.clone()),
        CutLimits {
            keep: 300,
            max_total: 1 << 20,
        },
    );
    // Two small frames, then 200,000 bytes over two frames: far over the limit.
    let big: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
    let writer = tokio::spawn(async move {
        send_frame(&mut peer, b"topic", true).await;
        send_frame(&mut peer, &[7u8; 600], true).await;
        send_frame(&mut peer, &big, true).await;
        send_frame(&mut peer, &[9u8; 50_000], false).await;
        // And a normal message after it.
        send_frame(&mut peer, b"next", false).await;
        peer
    });
    let Incoming::Cut(cut, permit) = r.next().await.unwrap() else {
        panic!("the message was not cut");
    };
    assert_eq!(cut.bytes, 5 + 600 + 150_000 + 50_000);
    assert!(cut.genuine);
    let sizes: Vec<usize> = cut.frames.iter().map(|f| f.len()).collect();
    // Whole frames, then 300 bytes kept of the rest, all from the first big frame.
    assert_eq!(sizes, vec![5, 600, 300, 0]);
    let expect: Vec<u8> = (0..300u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(&cut.frames[2][..], &expect[..]);
    // What is held counts only what was kept.
    assert_eq!(budget.available_permits(), 2000 - 905);
    drop(permit);
    {
        let s = cutter.0.lock().unwrap();
        assert_eq!(s.begun, 1);
        // The cutter saw every byte of the frames it did not get whole.
        assert_eq!(s.fed, vec![(2, 150_000), (3, 50_000)]);
    }
    match r.next().await.unwrap() {
        Incoming::Message(m, _) => assert_eq!(m, vec![Bytes::from_static(b"next")]),
        other => panic!("{other:?}"),
    }
    drop(writer.await.unwrap());
}

#[tokio::test]
async fn a_cutting_reader_still_refuses_absurd_claims_and_what_its_cutter_refuses() {
    let limits = Limits {
        max_message: 1000,
        max_frames: 8,
    };
    let cut = CutLimits {
        keep: 100,
        max_total: 10_000,
    };
    // A frame claiming 2^62 bytes: refused at its header, before the cutter is asked.
    let (mut r, _w, mut peer) = pair(limits).await;
    let cutter = Counting::default();
    r.cut_oversized(Box::new(cutter.clone()), cut);
    let mut h = vec![FLAG_MORE, 3, b'a', b'b', b'c', FLAG_LONG];
    h.extend_from_slice(&(1u64 << 62).to_be_bytes());
    peer.write_all(&h).await.unwrap();
    let e = r.next().await.unwrap_err();
    assert!(
        matches!(e, ZmtpError::Protocol(ref m) if m.contains("over the limit")),
        "{e}"
    );
    assert_eq!(cutter.0.lock().unwrap().begun, 0);

    // Past the ceiling over several frames, each below it.
    let (mut r, _w, mut peer) = pair(limits).await;
    r.cut_oversized(Box::new(Counting::default()), cut);
    let writer = tokio::spawn(async move {
        for _ in 0..4 {
            send_frame(&mut peer, &[0u8; 3000], true).await;
        }
        peer
    });
    let e = r.next().await.unwrap_err();
    assert!(e.to_string().contains("message that is cut"), "{e}");
    drop(writer);

    // The cutter says no (too few whole frames): as without cutting.
    let (mut r, _w, mut peer) = pair(limits).await;
    let cutter = Counting::default();
    cutter.0.lock().unwrap().min_whole = 2;
    r.cut_oversized(Box::new(cutter.clone()), cut);
    send_frame(&mut peer, &[0u8; 2000], false).await;
    let e = r.next().await.unwrap_err();
    assert!(e.to_string().contains("over the limit of 1000"), "{e}");
    assert_eq!(cutter.0.lock().unwrap().begun, 1);
}
