//! Stream recovery's decisions, without I/O: the budget and backoff of takeovers, the
//! replay buffers' bounds, and the sweep's pace ([`policy`]).

pub mod policy;
