//! The host's tools a contained sandbox is set up with (`mount`, `mkfs.ext4`, `ip`, `nft`,
//! `slirp4netns`), found in the system's directories and run with their error kept.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// `program` in the system's directories, first: a user's `PATH` may lack `sbin`.
pub fn find(program: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(program))
        .find(|path| path.exists())
}

/// [`find`], or the bare name for `PATH` to resolve.
pub fn path_of(program: &str) -> PathBuf {
    find(program).unwrap_or_else(|| PathBuf::from(program))
}

/// Runs `program` with `args` (and `input` on its stdin); its stderr is the error when
/// it fails.
pub async fn run(
    program: &str,
    args: &[impl AsRef<OsStr>],
    input: Option<&str>,
) -> Result<(), String> {
    let mut child = tokio::process::Command::new(path_of(program))
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running {program}: {e}"))?;
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        use tokio::io::AsyncWriteExt;
        let _ = stdin.write_all(input.as_bytes()).await;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| format!("running {program}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let shown: Vec<String> = args
        .iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect();
    Err(format!(
        "{program} {} failed ({}): {}",
        shown.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}
