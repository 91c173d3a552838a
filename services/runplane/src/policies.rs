//! `runplane policies`: the generated replay-safety table, for operators and reviewers.

use std::io::Write;

use runplane_proto::METHOD_POLICIES;

pub fn print(out: &mut impl Write) -> std::io::Result<()> {
    let width = METHOD_POLICIES
        .iter()
        .map(|p| p.path.len())
        .max()
        .unwrap_or(6);
    writeln!(
        out,
        "{:<width$}  {:<10}  {:<20}  {:<8}  JUSTIFICATION",
        "METHOD", "REPLAY", "KEY FIELD", "BUDGET"
    )?;
    for p in METHOD_POLICIES {
        writeln!(
            out,
            "{:<width$}  {:<10}  {:<20}  {:<8}  {}",
            p.path,
            p.replay_safety.as_str(),
            p.key_field.unwrap_or("-"),
            p.outage_budget.as_str(),
            p.justification
        )?;
    }
    Ok(())
}
