//! `docs/configuration.md` is the configuration reference, so it must not drift from the
//! code or from `deploy/runplane.example.toml`: every field `Config` accepts has exactly
//! one row, every row is such a field, and each row's default is the example's value.
//! The example itself is held equal to `Config::default()` by the crate's unit tests.
//!
//! The fields are read from `Config`'s own deserializer (an unknown key is refused with
//! the list of the keys expected there), so a field added to the code without a row
//! fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::error::Kind;
use figment::providers::{Format, Toml};
use figment::value::{Dict, Value};
use runplane_config::Config;

/// A key no section has, whose refusal lists the keys a section does have.
const PROBE: &str = "runplane_reference_probe";

/// The table rows' header; other tables of the page are not the reference.
const HEADER: &str = "| key | default | meaning |";

/// Fields the example file leaves out, each with the default its row must show and the
/// reason it is checked here against `Config::default()` instead.
const ABSENT_FROM_EXAMPLE: &[(&str, &str)] = &[
    // Unset means `node.endpoint`'s address; the example does not write it.
    ("node.listen", "`\"\"`"),
    // An `Option`: unset has no TOML value to write.
    ("credential_health.profiles[].network", "unset"),
    ("credential_health.profiles[].limits.cpus", "unset"),
    ("credential_health.profiles[].limits.memory_mib", "unset"),
    ("credential_health.profiles[].limits.pids", "unset"),
    ("credential_health.profiles[].limits.disk_mib", "unset"),
    ("credential_health.profiles[].image", "unset"),
    (
        "credential_health.profiles[].max_pause_seconds",
        "unset (24 h)",
    ),
    (
        "credential_health.profiles[].deadline_counts_paused_time",
        "unset (true)",
    ),
    (
        "credential_health.profiles[].ended_run_retention_seconds",
        "unset",
    ),
    // The retry table is unset in the example: its fields' defaults are the policy's.
    ("credential_health.profiles[].retry.max_attempts", "`3`"),
    (
        "credential_health.profiles[].retry.backoff_seconds",
        "`1.0`",
    ),
    (
        "credential_health.profiles[].retry.max_backoff_seconds",
        "`30.0`",
    ),
    ("credential_health.profiles[].retry.exit_codes", "`[]`"),
    (
        "credential_health.profiles[].retry.on_out_of_memory",
        "`false`",
    ),
    (
        "credential_health.profiles[].retry.on_image_unavailable",
        "`false`",
    ),
    // Webhooks are off by default: an entry in the example would turn one on.
    ("run_store.webhooks[].url", "required"),
    ("run_store.webhooks[].secret", "required"),
    ("run_store.webhooks[].events", "`[]`"),
    ("run_store.webhooks[].orgs", "`[]`"),
    ("run_store.webhooks[].allow_private_targets", "`false`"),
    ("run_store.webhooks[].ca_file", "`\"\"`"),
];

fn repo_file(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

fn read(relative: &str) -> String {
    let path = repo_file(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// TOML headers that open the table at `path` (`a.b[].c`: `b` is an array of tables),
/// as a table or, with `as_array`, as an element of an array of tables.
fn headers(path: &str, as_array: bool) -> String {
    if path.is_empty() {
        return String::new();
    }
    let mut toml = String::new();
    let parts: Vec<&str> = path.split("[]").collect();
    for i in 1..parts.len() {
        toml.push_str(&format!("[[{}]]\n", parts[..i].concat()));
    }
    let table = parts.concat();
    if as_array {
        toml.push_str(&format!("[[{table}]]\n"));
    } else {
        toml.push_str(&format!("[{table}]\n"));
    }
    toml
}

/// The keys `Config` accepts in the table at `path`, or `None` when no struct is there.
fn fields_at(path: &str, as_array: bool) -> Option<&'static [&'static str]> {
    let toml = format!("{}{PROBE} = 1\n", headers(path, as_array));
    let error = Figment::from(Toml::string(&toml))
        .extract::<Config>()
        .err()?;
    error.into_iter().find_map(|e| match e.kind {
        Kind::UnknownField(field, expected) if field == PROBE => Some(expected),
        _ => None,
    })
}

/// Whether serde lists `name` as another spelling of a field: runplane's own names are
/// snake_case, its aliases (`credentialId`) are not.
fn is_alias(name: &str) -> bool {
    name.chars().any(|c| c.is_ascii_uppercase())
}

/// Every field of `Config` as a dotted key (`server.listen`, and for arrays of tables
/// `credential_health.profiles[].name`), and apart the aliases serde also accepts.
struct ConfigKeys {
    fields: BTreeSet<String>,
    aliases: BTreeSet<String>,
}

fn config_keys() -> ConfigKeys {
    fn walk(path: &str, names: &[&str], keys: &mut ConfigKeys) {
        for name in names {
            let key = if path.is_empty() {
                (*name).to_owned()
            } else {
                format!("{path}.{name}")
            };
            if is_alias(name) {
                keys.aliases.insert(key);
            } else if let Some(nested) = fields_at(&key, false) {
                walk(&key, nested, keys);
            } else if let Some(nested) = fields_at(&key, true) {
                walk(&format!("{key}[]"), nested, keys);
            } else {
                keys.fields.insert(key);
            }
        }
    }
    let top = fields_at("", false).expect("Config refuses unknown top-level keys");
    let mut keys = ConfigKeys {
        fields: BTreeSet::new(),
        aliases: BTreeSet::new(),
    };
    walk("", top, &mut keys);
    keys
}

/// The example's value of each key it sets, in the same dotted form (the first element
/// of an array of tables stands for all).
fn example_values(config_keys: &BTreeSet<String>) -> BTreeMap<String, Value> {
    fn flatten(
        key: &str,
        value: &Value,
        config_keys: &BTreeSet<String>,
        out: &mut BTreeMap<String, Value>,
    ) {
        let nested = |name: &str| {
            if key.is_empty() {
                name.to_owned()
            } else {
                format!("{key}.{name}")
            }
        };
        match value {
            _ if config_keys.contains(key) => {
                out.entry(key.to_owned()).or_insert_with(|| value.clone());
            }
            Value::Dict(_, dict) => {
                for (name, value) in dict {
                    flatten(&nested(name), value, config_keys, out);
                }
            }
            Value::Array(_, items) => {
                for item in items {
                    flatten(&format!("{key}[]"), item, config_keys, out);
                }
            }
            _ => {
                out.insert(key.to_owned(), value.clone());
            }
        }
    }
    let example = Figment::from(Toml::file_exact(repo_file("deploy/runplane.example.toml")))
        .extract::<Dict>()
        .expect("the example is TOML");
    let mut out = BTreeMap::new();
    flatten("", &Value::from(example), config_keys, &mut out);
    out
}

/// The cells of one table row; `\|` is a pipe inside a cell.
fn cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cells.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => cells.push(String::new()),
            c => cells.last_mut().unwrap().push(c),
        }
    }
    cells.into_iter().map(|c| c.trim().to_owned()).collect()
}

/// The reference's rows: key to default cell, from every table under [`HEADER`].
fn documented_defaults(markdown: &str) -> BTreeMap<String, String> {
    let mut rows = BTreeMap::new();
    let mut in_reference = false;
    for line in markdown.lines() {
        if line.trim() == HEADER {
            in_reference = true;
            continue;
        }
        if !line.trim_start().starts_with('|') {
            in_reference = false;
            continue;
        }
        if !in_reference || line.trim_start().starts_with("|---") {
            continue;
        }
        let cells = cells(line);
        assert_eq!(
            cells.len(),
            3,
            "a reference row has key, default and meaning: {line}"
        );
        let key = code_span(&cells[0])
            .unwrap_or_else(|| panic!("a reference row's key is one code span: {line}"));
        let previous = rows.insert(key.to_owned(), cells[1].clone());
        assert!(previous.is_none(), "`{key}` has two rows");
    }
    rows
}

fn code_span(cell: &str) -> Option<&str> {
    cell.strip_prefix('`')?
        .strip_suffix('`')
        .filter(|inner| !inner.contains('`'))
}

/// A default cell's TOML value.
fn parse_default(key: &str, cell: &str) -> Value {
    let literal = code_span(cell).unwrap_or_else(|| {
        panic!("the default of `{key}` should be one code span holding a TOML value: {cell}")
    });
    let mut dict = Figment::from(Toml::string(&format!("value = {literal}")))
        .extract::<Dict>()
        .unwrap_or_else(|e| panic!("the default of `{key}` is not a TOML value: {literal}: {e}"));
    dict.remove("value").expect("parsed")
}

#[test]
fn every_field_of_config_has_one_row_and_every_row_is_a_field() {
    let ConfigKeys { fields, aliases } = config_keys();
    let reference = read("docs/configuration.md");
    let rows = documented_defaults(&reference);
    let documented: BTreeSet<String> = rows.keys().cloned().collect();
    let missing: Vec<_> = fields.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&fields).collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md has no row for {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "docs/configuration.md documents {unknown:?}, which Config does not accept"
    );
    for alias in aliases {
        let name = alias.rsplit('.').next().expect("a key has a name");
        assert!(
            reference.contains(&format!("`{name}`")),
            "docs/configuration.md does not say that `{alias}` is accepted as an alias"
        );
    }
}

#[test]
fn every_documented_default_is_the_example_files_value() {
    let fields = config_keys().fields;
    let example = example_values(&fields);
    let rows = documented_defaults(&read("docs/configuration.md"));

    let unknown: Vec<_> = example.keys().filter(|k| !fields.contains(*k)).collect();
    assert!(
        unknown.is_empty(),
        "the example sets {unknown:?}, which Config does not accept"
    );

    for (key, value) in &example {
        let Some(cell) = rows.get(key) else {
            panic!("docs/configuration.md has no row for `{key}`, which the example sets");
        };
        assert_eq!(
            &parse_default(key, cell),
            value,
            "docs/configuration.md gives `{key}` the default {cell}; the example has {value:?}"
        );
    }

    let absent: BTreeSet<&str> = fields
        .iter()
        .map(String::as_str)
        .filter(|k| !example.contains_key(*k))
        .collect();
    let expected: BTreeSet<&str> = ABSENT_FROM_EXAMPLE.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        absent, expected,
        "deploy/runplane.example.toml should set every field at its default, except \
         ABSENT_FROM_EXAMPLE"
    );
    for (key, cell) in ABSENT_FROM_EXAMPLE {
        assert_eq!(
            rows.get(*key).map(String::as_str),
            Some(*cell),
            "the default docs/configuration.md gives `{key}`"
        );
    }
}

/// The defaults [`ABSENT_FROM_EXAMPLE`] documents are `Config::default()`'s.
#[test]
fn the_defaults_the_example_leaves_out_are_the_codes() {
    let defaults = Config::default();
    assert_eq!(defaults.node.listen, "");
    assert!(
        defaults
            .credential_health
            .profiles
            .iter()
            .all(|p| p.network.is_none())
    );
}
