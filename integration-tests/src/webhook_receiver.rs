//! A real HTTP/1.1 server that receives webhooks: it records each POST's headers and body
//! and answers 200, so tests see exactly what an endpoint would.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// One request as received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    /// Header names lowercased.
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Received {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_default()
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).expect("a webhook body is JSON")
    }
}

/// A listening receiver; it stops when dropped.
pub struct Receiver {
    pub address: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    /// Listens on `address` (port 0: any free port).
    pub async fn start(address: &str) -> Self {
        let listener = TcpListener::bind(address).await.expect("bind the receiver");
        let address = listener.local_addr().expect("bound");
        let received = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let received = received.clone();
            async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let received = received.clone();
                    tokio::spawn(async move {
                        let _ = serve(stream, received).await;
                    });
                }
            }
        });
        Self {
            address,
            received,
            task,
        }
    }

    /// `http://ADDR/hook`.
    pub fn url(&self) -> String {
        format!("http://{}/hook", self.address)
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Waits (up to `within`) until `done` holds of what was received; returns it.
    pub async fn wait_for(
        &self,
        within: Duration,
        done: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let got = self.received();
            if done(&got) {
                return got;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the receiver did not get what was expected within {within:?}; it got {got:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Reads requests off one connection (keep-alive or not) and answers each 200.
async fn serve(
    stream: tokio::net::TcpStream,
    received: Arc<Mutex<Vec<Received>>>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).await? == 0 {
            return Ok(());
        }
        let mut parts = request_line.split_whitespace();
        let method = parts.next().unwrap_or_default().to_owned();
        let path = parts.next().unwrap_or_default().to_owned();
        let mut headers = BTreeMap::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).await?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
            }
        }
        let length: usize = headers
            .get("content-length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; length];
        reader.read_exact(&mut body).await?;
        received.lock().unwrap().push(Received {
            method,
            path,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
        write
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await?;
    }
}

/// Checks a delivery's signature with Python's `hmac` module: an implementation of the
/// Standard Webhooks scheme that shares no code with runplane's. `secret` is the
/// `whsec_` secret as configured.
pub fn verify_with_python(secret: &str, received: &Received) -> bool {
    let script = r#"
import base64, hashlib, hmac, json, sys
given = json.load(sys.stdin)
key = base64.b64decode(given["secret"].removeprefix("whsec_"))
content = f'{given["id"]}.{given["timestamp"]}.{given["body"]}'.encode()
expected = base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()
signatures = [s.split(",", 1)[1] for s in given["signature"].split() if s.startswith("v1,")]
sys.exit(0 if any(hmac.compare_digest(expected, s) for s in signatures) else 1)
"#;
    let input = serde_json::json!({
        "secret": secret,
        "id": received.header("webhook-id"),
        "timestamp": received.header("webhook-timestamp"),
        "signature": received.header("webhook-signature"),
        "body": received.body,
    });
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs (scripts/test needs it too)");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("piped");
        stdin
            .write_all(input.to_string().as_bytes())
            .expect("write");
    }
    child.wait().expect("python3 ends").success()
}
