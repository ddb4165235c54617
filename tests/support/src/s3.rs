//! The test S3 server: `tests/s3-server.py`, moto on a loopback port with
//! request signatures checked, a user and its key, a bucket, and faults on
//! request. One launcher for the backup crate's tests and the black-box
//! tests.

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running test S3 server, stopped when dropped.
pub struct S3Server {
    child: Child,
    /// Its URL on loopback.
    pub endpoint: String,
    /// The bucket it made.
    pub bucket: String,
    /// The user's access key id.
    pub access_key_id: String,
    /// The user's secret key.
    pub secret_access_key: String,
}

impl S3Server {
    /// Starts one with the test venv's python (`BLOCKPLANE_TEST_PYTHON`,
    /// which `tests/run-all.sh` sets) and waits for the line that says
    /// where it listens.
    pub fn start() -> S3Server {
        let python = std::env::var("BLOCKPLANE_TEST_PYTHON").expect(
            "BLOCKPLANE_TEST_PYTHON: the test venv's python, with moto[server] (tests/requirements.txt; tests/run-all.sh sets it)",
        );
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../s3-server.py");
        let mut child = Command::new(&python)
            .arg(&script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{python} {}: {e}", script.display()));
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("piped")),
            &mut line,
        )
        .expect("tests/s3-server.py says where it listens");
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("tests/s3-server.py said {line:?}: {e}"));
        let field = |k: &str| {
            v[k].as_str()
                .unwrap_or_else(|| panic!("tests/s3-server.py gave no {k}: {line}"))
                .to_string()
        };
        S3Server {
            endpoint: field("endpoint"),
            bucket: field("bucket"),
            access_key_id: field("access_key_id"),
            secret_access_key: field("secret_access_key"),
            child,
        }
    }

    /// Asks for a fault (`slowdown?count=N`, `hang`, `clear`), or with
    /// `stats` for its counts; its answer.
    pub fn fault(&self, what: &str) -> serde_json::Value {
        let url = format!("{}/__fault/{what}", self.endpoint);
        let method = if what == "stats" { "GET" } else { "POST" };
        let r = Command::new("curl")
            .args(["-sf", "-X", method, &url])
            .output()
            .expect("curl runs");
        assert!(r.status.success(), "{url}: {r:?}");
        serde_json::from_slice(&r.stdout).unwrap_or_else(|e| panic!("{url}: {e}: {r:?}"))
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
