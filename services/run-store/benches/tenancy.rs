//! Placeholder while the tenancy bench is written.

fn main() {}
