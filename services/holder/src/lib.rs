//! The holder of a warm container and the wire between it and the wrapper that asks it
//! to start an agent.
//!
//! A warm container's pid 1 is `runplane-holder <socket>`, a static binary bound in from
//! the host, so nothing of the image is needed. It listens on `<socket>` (in a directory
//! bound from the sandbox's state directory) for one launch: the wrapper on the host
//! connects, hands over its stdin, stdout and stderr (the runner's pipes) as file
//! descriptors with the agent's working directory, command and environment, and the
//! holder starts the agent with them, inside the container and so under everything the
//! engine confines it with. The holder then answers its pid, forwards the signals the
//! wrapper writes (one byte each, the signal's number), reaps every process of the
//! container (it is pid 1), and when the agent ends kills what it left (as the end of a
//! pid namespace's init would) and answers its exit status. The engine's stop signals
//! reach pid 1 only: the holder passes them to the agent, and ends with it (at once, when
//! there is no agent). No engine
//! call is on that path: a warm start costs what starting a process costs.
//!
//! The wire:
//! - wrapper → holder: a 4-byte little-endian length, sent with three descriptors
//!   (`SCM_RIGHTS`: stdin, stdout, stderr), then that many bytes: NUL-terminated fields,
//!   the working directory, the number of arguments, the arguments, then the environment
//!   (`KEY=value`) to the end ([`Request`]). Then signals, one byte each.
//! - holder → wrapper: lines, `pid <n>`, then `exit <status>` (the exit code, or 128 + N
//!   for signal N), or `error <why>` when the agent could not be started.

/// What the wrapper asks the holder to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub cwd: String,
    pub argv: Vec<String>,
    pub env: Vec<String>,
}

/// The most a request may weigh: a command line as big as Linux allows, and its
/// environment.
pub const MAX_REQUEST_BYTES: u32 = 8 << 20;

impl Request {
    /// The request's bytes, after its length.
    pub fn encode(&self) -> Vec<u8> {
        let mut fields: Vec<&str> = vec![&self.cwd];
        let count = self.argv.len().to_string();
        fields.push(&count);
        fields.extend(self.argv.iter().map(String::as_str));
        fields.extend(self.env.iter().map(String::as_str));
        let mut bytes = Vec::new();
        for field in fields {
            bytes.extend_from_slice(field.as_bytes());
            bytes.push(0);
        }
        bytes
    }

    /// The request [`Request::encode`] wrote; None for anything else (a field with a
    /// NUL, too few fields, no command).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut fields = text.strip_suffix('\0')?.split('\0');
        let cwd = fields.next()?.to_owned();
        let count: usize = fields.next()?.parse().ok()?;
        let argv: Vec<String> = fields.by_ref().take(count).map(str::to_owned).collect();
        if argv.len() != count || count == 0 {
            return None;
        }
        let env = fields.map(str::to_owned).collect();
        Some(Self { cwd, argv, env })
    }
}

/// One line of the holder's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Pid(u32),
    Exit(i32),
    Error(String),
}

impl Answer {
    pub fn line(&self) -> String {
        match self {
            Answer::Pid(pid) => format!("pid {pid}\n"),
            Answer::Exit(status) => format!("exit {status}\n"),
            Answer::Error(why) => format!("error {}\n", why.replace('\n', " ")),
        }
    }

    pub fn parse(line: &str) -> Option<Self> {
        let (kind, rest) = line.trim_end_matches('\n').split_once(' ')?;
        match kind {
            "pid" => rest.parse().ok().map(Answer::Pid),
            "exit" => rest.parse().ok().map(Answer::Exit),
            "error" => Some(Answer::Error(rest.to_owned())),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_round_trip_and_nothing_else_decodes() {
        let request = Request {
            cwd: "/workspace".into(),
            argv: vec!["sh".into(), "-c".into(), "echo 'a b'; exit 3".into()],
            env: vec!["HOME=/workspace".into(), "EMPTY=".into()],
        };
        assert_eq!(Request::decode(&request.encode()), Some(request));
        for bad in [
            &b""[..],
            b"/w\0",
            b"/w\x002\0only\0",
            b"/w\x000\0",
            b"/w\0x\0a\0",
        ] {
            assert_eq!(Request::decode(bad), None, "{bad:?}");
        }
        for answer in [
            Answer::Pid(42),
            Answer::Exit(137),
            Answer::Error("no such file\nor directory".into()),
        ] {
            let parsed = Answer::parse(&answer.line());
            match answer {
                Answer::Error(_) => assert_eq!(
                    parsed,
                    Some(Answer::Error("no such file or directory".into()))
                ),
                other => assert_eq!(parsed, Some(other)),
            }
        }
        assert_eq!(Answer::parse("exit x"), None);
    }
}
