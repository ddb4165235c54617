//! One connection of a worker's control socket, from either side: the
//! handshake, then one request and its answer.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::messages::{Answer, ErrorCode, PROTOCOL, Peer, Request};

/// Why talking to a worker failed.
#[derive(Debug, thiserror::Error)]
pub enum TalkError {
    /// Connecting, writing or reading failed.
    #[error("worker control socket {path}: {source}")]
    Io {
        /// The socket.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The answer was not JSON of an [`Answer`].
    #[error("worker answered something unreadable: {0}")]
    Garbled(String),
    /// The worker's protocol has no such request: it was not sent.
    #[error(
        "the worker speaks protocol {protocol} (build {build}), which has no request '{op}' (protocol {since} and later)"
    )]
    NotUnderstood {
        /// The request's op.
        op: &'static str,
        /// The first protocol that has it.
        since: u32,
        /// The worker's protocol.
        protocol: u32,
        /// The worker's build.
        build: String,
    },
}

/// The `--spec` argument of process `pid`, if it is a blockplane worker (read
/// as plain JSON: a worker of another version may have other fields).
pub fn worker_spec(pid: u32) -> Option<serde_json::Value> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = cmdline.split(|b| *b == 0);
    args.find(|a| *a == b"worker")?;
    args.find(|a| *a == b"--spec")?;
    serde_json::from_slice(args.next()?).ok()
}

/// One connection to a worker's control socket.
struct Conn {
    reader: BufReader<UnixStream>,
    path: String,
}

impl Conn {
    fn open(socket: &Path, timeout: Duration) -> Result<Self, TalkError> {
        let path = socket.display().to_string();
        let io = |source| TalkError::Io {
            path: path.clone(),
            source,
        };
        let s = UnixStream::connect(socket).map_err(io)?;
        s.set_read_timeout(Some(timeout)).map_err(io)?;
        s.set_write_timeout(Some(timeout)).map_err(io)?;
        Ok(Self {
            reader: BufReader::new(s),
            path,
        })
    }

    /// Sends `req`, reads one answer.
    fn ask(&mut self, req: &Request) -> Result<Answer, TalkError> {
        let io = |source| TalkError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_string(req).expect("requests serialize");
        line.push('\n');
        self.reader
            .get_mut()
            .write_all(line.as_bytes())
            .map_err(io)?;
        let mut answer = String::new();
        self.reader.read_line(&mut answer).map_err(io)?;
        serde_json::from_str(&answer).map_err(|e| TalkError::Garbled(format!("{e}: {answer:?}")))
    }
}

/// Refuses a request the worker's protocol does not have.
fn understood(req: &Request, peer: &Peer) -> Result<(), TalkError> {
    if req.since() > peer.protocol {
        return Err(TalkError::NotUnderstood {
            op: req.op(),
            since: req.since(),
            protocol: peer.protocol,
            build: peer.build.clone().unwrap_or_else(|| "unknown".into()),
        });
    }
    Ok(())
}

/// The handshake, then one request and its answer; what the worker said of
/// itself with it. A worker from before the handshake is asked again on a
/// fresh connection, with the request alone, if its protocol has it.
pub fn converse(
    socket: &Path,
    req: &Request,
    timeout: Duration,
) -> Result<(Peer, Answer), TalkError> {
    let mut conn = Conn::open(socket, timeout)?;
    match conn.ask(&Request::Hello(Peer::this_build()))? {
        Answer::Hello(peer) => {
            understood(req, &peer)?;
            let answer = conn.ask(&req.for_peer(peer.protocol))?;
            Ok((peer, answer))
        }
        // Protocol 1 reads the hello as a request it does not know.
        Answer::Error {
            code: ErrorCode::BadRequest,
            ..
        } => {
            let peer = Peer::before_handshake();
            understood(req, &peer)?;
            let answer = Conn::open(socket, timeout)?.ask(&req.for_peer(peer.protocol))?;
            Ok((peer, answer))
        }
        other => Err(TalkError::Garbled(format!(
            "the answer to the handshake was {other:?}"
        ))),
    }
}

/// [`converse`], without what the worker said of itself.
pub fn talk(socket: &Path, req: &Request, timeout: Duration) -> Result<Answer, TalkError> {
    converse(socket, req, timeout).map(|(_, answer)| answer)
}

/// Reads one request line as this build's [`Request`], or the refusal to
/// answer: a request of a newer protocol (an unknown op or field) is
/// refused, never read in part.
pub fn read_request(line: &str) -> Result<Request, Answer> {
    serde_json::from_str(line).map_err(|e| Answer::Error {
        code: ErrorCode::BadRequest,
        message: format!(
            "unreadable request (this worker speaks protocol {PROTOCOL}, build {}): {e}",
            blockplane_system::build::current()
        ),
    })
}

/// Serves one connection of a control socket: the handshake if the client
/// starts with one, then one request, answered by `handle` (a refusal of an
/// unreadable line never reaches it).
pub fn serve_connection(
    conn: &UnixStream,
    handle: impl FnOnce(Request) -> Answer,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn);
    let mut writer = conn;
    let mut answer = |a: &Answer| {
        let mut out = serde_json::to_string(a).expect("answers serialize");
        out.push('\n');
        writer.write_all(out.as_bytes())
    };
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut req = read_request(&line);
    if let Ok(Request::Hello(_)) = req {
        answer(&Answer::Hello(Peer::this_build()))?;
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        req = read_request(&line);
    }
    match req {
        Ok(Request::Hello(_)) => answer(&Answer::Error {
            code: ErrorCode::BadRequest,
            message: "a second hello on one connection".into(),
        }),
        Ok(req) => answer(&handle(req)),
        Err(refused) => answer(&refused),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_are_one_json_line_each() {
        let r = Request::SetDispatch {
            dispatch: crate::DataPath::Direct,
            reason: "asked".into(),
            why: None,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"op":"set_dispatch","dispatch":"direct","reason":"asked"}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        let a = Answer::Error {
            code: ErrorCode::Refused,
            message: "direct-map rule 2".into(),
        };
        let s = serde_json::to_string(&a).unwrap();
        assert!(!s.contains('\n'));
        assert_eq!(serde_json::from_str::<Answer>(&s).unwrap(), a);
        // The codes are the words workers of earlier versions answer with.
        assert_eq!(
            s,
            r#"{"error":{"code":"refused","message":"direct-map rule 2"}}"#
        );
        for (code, word) in [
            (ErrorCode::IoError, "io_error"),
            (ErrorCode::BadRequest, "bad_request"),
        ] {
            assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{word}\""));
        }
        assert_eq!(
            serde_json::from_str::<ErrorCode>(r#""from_the_future""#).unwrap(),
            ErrorCode::Unknown
        );
        // A service from before the pace asks without it.
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"allocate"}"#).unwrap(),
            Request::Allocate { pace_ms: 0 }
        );
    }

    /// A switch carries its reason as a type to a worker of protocol 4,
    /// and as words alone to an older one, which refuses fields it does not
    /// know; a status without the type reads its words.
    #[test]
    fn a_reason_crosses_typed_to_protocol_4_and_as_words_before() {
        use blockplane_system::dispatch::{On, Reason};
        let reason = Reason::Asked {
            policy: blockplane_api::model::DispatchPolicy::Nowait,
            on: On::Ublk { threads: 2 },
        };
        let r = Request::set_dispatch(crate::DataPath::Nowait, &reason);
        assert_eq!(r.for_peer(4), r);
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"op":"set_dispatch","dispatch":"nowait","reason":"asked: nowait","why":{"why":"asked","policy":"nowait","on":{"ublk":{"threads":2}}}}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        assert_eq!(
            serde_json::to_string(&r.for_peer(3)).unwrap(),
            r#"{"op":"set_dispatch","dispatch":"nowait","reason":"asked: nowait"}"#
        );
        let Answer::Status(old) = serde_json::from_str::<Answer>(V1_STATUS).unwrap() else {
            panic!("a status")
        };
        assert_eq!(
            old.reason(),
            Reason::Words {
                words: "asked".into()
            }
        );
    }

    /// A worker of protocol 1 (before the handshake), as it answered: an
    /// unknown op is an unreadable request, a known one is answered.
    const V1_STATUS: &str = r#"{"status":{"pid":7,"dev_id":3,"device":"/dev/ublkb3","dispatch":"nowait","dispatch_reason":"asked","pinned":null,"size_bytes":4096,"read_only":false,"buffer_bytes":0,"queues":1,"zero_copy":false,"features":0,"dev_flags":0,"degraded":null,"resize_pending":false,"allocate":null}}"#;

    fn v1_worker(dir: &Path, connections: usize) -> std::thread::JoinHandle<Vec<String>> {
        let listener = std::os::unix::net::UnixListener::bind(dir.join("ctl.sock")).unwrap();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            for conn in listener.incoming().take(connections) {
                let conn = conn.unwrap();
                let mut line = String::new();
                BufReader::new(&conn).read_line(&mut line).unwrap();
                let op = serde_json::from_str::<serde_json::Value>(&line).unwrap()["op"]
                    .as_str()
                    .unwrap()
                    .to_string();
                let answer = match op.as_str() {
                    "status" => V1_STATUS.to_string(),
                    other => format!(
                        r#"{{"error":{{"code":"bad_request","message":"unreadable request: unknown variant `{other}`"}}}}"#
                    ),
                };
                seen.push(op);
                (&conn).write_all(format!("{answer}\n").as_bytes()).unwrap();
            }
            seen
        })
    }

    /// The service drives a worker from before the handshake: it is asked
    /// again without the hello, only what protocol 1 has, and its answers
    /// (without a build) read as this version's.
    #[test]
    fn a_worker_of_the_previous_protocol_is_still_driven() {
        let dir = tempfile::tempdir().unwrap();
        let worker = v1_worker(dir.path(), 3);
        let socket = dir.path().join("ctl.sock");
        let (peer, answer) =
            converse(&socket, &Request::Status {}, Duration::from_secs(5)).unwrap();
        assert_eq!(peer, Peer::before_handshake());
        let Answer::Status(status) = answer else {
            panic!("{answer:?}")
        };
        assert_eq!((status.dev_id, status.build), (3, None));
        // A request protocol 1 lacks is not sent at all.
        let e = converse(
            &socket,
            &Request::Handover { pace_ms: 0 },
            Duration::from_secs(5),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("speaks protocol 1 (build unknown), which has no request 'handover'"),
            "{e}"
        );
        assert_eq!(worker.join().unwrap(), ["hello", "status", "hello"]);
    }

    /// A worker of protocol 2 (a build from before copy-before-write, still
    /// serving after an upgrade without a handover) is never asked to copy
    /// a moment: the refusal names the request and the worker's protocol.
    #[test]
    fn a_protocol_2_worker_is_never_sent_a_copy_of_one_moment() {
        let old = Peer {
            protocol: 2,
            build: Some("0.1.0 (older)".into()),
        };
        let copy = Request::CopyMoment {
            dest: "/d".into(),
            dev: 1,
            ino: 2,
            pace_ms: 0,
            gate: None,
        };
        for req in [copy, Request::CancelCopy {}] {
            let e = understood(&req, &old).unwrap_err().to_string();
            assert!(
                e.contains(&format!("which has no request '{}'", req.op())),
                "{e}"
            );
        }
        assert!(understood(&Request::Handover { pace_ms: 0 }, &old).is_ok());
    }

    /// Lines written to a worker's side of a connection, and what it answered.
    fn serve(lines: &[&str]) -> (Vec<Answer>, Vec<Request>) {
        let (client, server) = UnixStream::pair().unwrap();
        let mut input = lines.join("\n");
        input.push('\n');
        (&client).write_all(input.as_bytes()).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let mut handled = Vec::new();
        serve_connection(&server, |req| {
            handled.push(req);
            Answer::Status(Box::new(
                serde_json::from_str::<Answer>(V1_STATUS)
                    .map(|a| match a {
                        Answer::Status(s) => *s,
                        _ => unreachable!(),
                    })
                    .unwrap(),
            ))
        })
        .unwrap();
        drop(server);
        let answers = BufReader::new(&client)
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
            .collect();
        (answers, handled)
    }

    #[test]
    fn a_connection_starts_with_the_handshake_or_is_served_as_protocol_1() {
        // Protocol 1: the request alone.
        let (answers, handled) = serve(&[r#"{"op":"set_qos","qos":{"iops":10}}"#]);
        assert_eq!(answers.len(), 1);
        assert!(matches!(answers[0], Answer::Status(_)));
        assert!(matches!(&handled[..], [Request::SetQos { qos: Some(q) }] if q.iops == Some(10)));
        // Protocol 2: the hello is answered with this build, then the request.
        let hello = serde_json::to_string(&Request::Hello(Peer::this_build())).unwrap();
        let (answers, handled) = serve(&[&hello, r#"{"op":"status"}"#]);
        assert_eq!(answers[0], Answer::Hello(Peer::this_build()));
        assert!(matches!(answers[1], Answer::Status(_)));
        assert_eq!(handled, [Request::Status {}]);
        // A later protocol's hello says more of itself: still a hello.
        let later = r#"{"op":"hello","protocol":3,"build":"0.2.0+x","features":["y"]}"#;
        let (answers, _) = serve(&[later, r#"{"op":"status"}"#]);
        assert_eq!(answers[0], Answer::Hello(Peer::this_build()));
    }

    /// A request of a newer version (an op, or a field, this build does not
    /// know) is refused with the reason; the handler never sees it.
    #[test]
    fn an_unknown_newer_request_is_refused_not_misread() {
        for (line, says) in [
            (
                r#"{"op":"set_read_only","read_only":true,"scope":"discards"}"#,
                "unknown field `scope`",
            ),
            (
                r#"{"op":"teleport","to":"elsewhere"}"#,
                "unknown variant `teleport`",
            ),
            (
                r#"{"op":"allocate","pace_ms":5,"zeroes":"fast"}"#,
                "unknown field `zeroes`",
            ),
            (
                r#"{"op":"status","verbose":true}"#,
                "unknown field `verbose`",
            ),
        ] {
            let (answers, handled) = serve(&[line]);
            assert!(
                handled.is_empty(),
                "{line} reached the handler: {handled:?}"
            );
            let [Answer::Error { code, message }] = &answers[..] else {
                panic!("{line}: {answers:?}")
            };
            assert_eq!(*code, ErrorCode::BadRequest, "{line}");
            assert!(message.contains(says), "{line}: {message}");
            assert!(
                message.contains(&format!("protocol {PROTOCOL}")),
                "{line}: {message}"
            );
        }
    }
}
