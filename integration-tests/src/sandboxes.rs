//! What tests of node agents and sandboxes share: waiting for a condition, and the
//! processes of a sandbox, which runs in a session of its own and so outlives the test
//! unless the test reaps it.

use std::time::Duration;

/// Polls `check` every 100 ms until it answers, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The state letter of `pid` (`R`, `S`, `T` for stopped, …), None once it has exited
/// (a zombie has, in all but name).
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
    (state != 'Z' && state != 'X').then_some(state)
}

/// Live processes of the session `sid` leads: a sandbox's shell, its runner and the
/// agent the runner started in a process group of its own.
pub fn session_members(sid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("/proc is readable")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
                    Some(fields.first()? != &"Z" && fields.get(3)?.parse::<u32>().ok()? == sid)
                })
                .unwrap_or(false)
        })
        .collect()
}

/// Kills every process of the sandbox session it names when dropped, so a failing test
/// leaves no (SIGSTOPped) processes behind.
pub struct ReapSession(pub u32);

impl Drop for ReapSession {
    fn drop(&mut self) {
        for member in session_members(self.0) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &member.to_string()])
                .status();
        }
    }
}
