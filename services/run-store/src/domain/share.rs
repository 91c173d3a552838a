//! Which queued runs start now: the slots of each credential shared across the orgs with
//! runs waiting on it by weighted fair share, each org held to its quota of active runs.
//!
//! The share is stride scheduling, as a CPU scheduler shares a core: every org has a
//! *pass* on every credential, and each start there moves the org's pass on by
//! `STRIDE / weight`. The next free slot goes to the waiting org with the lowest pass, so
//! over time each org's starts follow its weight. An org that comes back after waiting
//! nothing takes the credential's virtual time (the pass of its latest start) as its
//! pass, never an older one, so time spent idle is not credit to spend later: it gets
//! the next slot, not the next hundred. Ties go to the org holding fewer of the
//! credential's slots, then to the one whose oldest run has waited longest.
//!
//! What an org may not start (its quota reached) and what a credential cannot take (full,
//! cooling off, quarantined, not in the fleet) is passed over and never blocks the rest:
//! the plan looks at every org and every credential with runs waiting, not at the oldest
//! runs of the whole queue.
//!
//! Within an org its own runs start by priority, then age; that is the store's order
//! when it takes an org's next runs (`store::slots`), not this plan's.

use std::collections::{BTreeMap, HashMap};

use runplane_config::TenancyConfig;

/// One start moves an org of weight 1 this far; weight `w`, `STRIDE / w`.
pub const STRIDE: i64 = 1_000_000;

/// The runs of one org waiting on one credential.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    pub credential_id: String,
    pub org_id: String,
    pub queued: u32,
    /// When the oldest of them was created.
    pub oldest_us: i64,
}

/// What a credential may take now, as the fleet says.
#[derive(Debug, Clone, Default)]
pub struct SlotLimit {
    pub capacity: u32,
    /// Why it takes nothing now; empty when it may.
    pub unavailable: String,
    /// Orgs whose runs it takes none of now, and why (a shared credential out for one
    /// org on that org's own evidence).
    pub unavailable_orgs: HashMap<String, String>,
}

/// What the plan starts from.
#[derive(Debug, Default)]
pub struct Queue<'a> {
    pub waiting: Vec<Waiting>,
    /// Runs STARTING or RUNNING per credential and org.
    pub active: HashMap<(String, String), u32>,
    /// Each org's pass per credential, as stored.
    pub passes: HashMap<(String, String), i64>,
    /// Each credential's virtual time, as stored.
    pub virtual_times: HashMap<String, i64>,
    /// The fleet's credentials; `None`: no capacity applies (no credential health).
    pub capacity: Option<&'a HashMap<String, SlotLimit>>,
}

/// What to start and what to say to the runs that wait.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// How many of each org's runs start on each credential, in the order granted.
    pub grants: Vec<Grant>,
    /// Passes and virtual times that moved (the empty org is the virtual time).
    pub passes: BTreeMap<(String, String), i64>,
    /// Why the runs still waiting on a credential wait, for the orgs not at quota.
    pub credential_reasons: BTreeMap<String, String>,
    /// Why every run of an org at its quota waits.
    pub org_reasons: BTreeMap<String, String>,
    /// Why an org's runs wait on a credential that takes other orgs' runs.
    pub pair_reasons: BTreeMap<(String, String), String>,
}

/// `runs` of `org_id`'s runs start on `credential_id`.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub credential_id: String,
    pub org_id: String,
    pub runs: u32,
}

/// Where an org stands for a credential's next slot, lowest first: its pass, the slots
/// it holds there, when its oldest waiting run was created, its name.
type Rank<'a> = (i64, i64, i64, &'a str);

/// Decides at most `max_runs` starts from `queue` under `tenancy`.
pub fn plan(queue: &Queue<'_>, tenancy: &TenancyConfig, max_runs: u32) -> Plan {
    let mut active_on: HashMap<&str, i64> = HashMap::new();
    let mut active_of: HashMap<&str, i64> = HashMap::new();
    for ((credential, org), n) in &queue.active {
        *active_on.entry(credential).or_default() += i64::from(*n);
        *active_of.entry(org).or_default() += i64::from(*n);
    }
    let credentials: Vec<&str> = {
        let mut all: Vec<&str> = queue
            .waiting
            .iter()
            .map(|w| w.credential_id.as_str())
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    };
    // Slots each credential has free; none for one the fleet does not offer now.
    let mut free: HashMap<&str, i64> = credentials
        .iter()
        .map(|&c| {
            let slots = match queue.capacity {
                None => i64::MAX,
                Some(capacity) => match capacity.get(c) {
                    Some(l) if l.unavailable.is_empty() => {
                        i64::from(l.capacity) - active_on.get(c).copied().unwrap_or(0)
                    }
                    _ => 0,
                },
            };
            (c, slots)
        })
        .collect();
    // Starts each org may still make under its quota.
    let mut room: HashMap<&str, i64> = HashMap::new();
    for w in &queue.waiting {
        room.entry(w.org_id.as_str()).or_insert_with(|| {
            tenancy
                .max_active_runs(&w.org_id)
                .map_or(i64::MAX, |quota| {
                    i64::from(quota) - active_of.get(w.org_id.as_str()).copied().unwrap_or(0)
                })
        });
    }
    let mut left: Vec<u32> = queue.waiting.iter().map(|w| w.queued).collect();
    let mut held: Vec<i64> = queue
        .waiting
        .iter()
        .map(|w| {
            let key = (w.credential_id.clone(), w.org_id.clone());
            i64::from(queue.active.get(&key).copied().unwrap_or(0))
        })
        .collect();
    let mut passes = queue.passes.clone();
    let mut virtual_times = queue.virtual_times.clone();
    let mut out = Plan::default();
    let pass_of = |passes: &HashMap<(String, String), i64>,
                   virtual_times: &HashMap<String, i64>,
                   w: &Waiting| {
        let now = virtual_times.get(&w.credential_id).copied().unwrap_or(0);
        passes
            .get(&(w.credential_id.clone(), w.org_id.clone()))
            .copied()
            .unwrap_or(0)
            .max(now)
    };
    let mut started = 0;
    while started < max_runs {
        // Each credential's pick: the lowest pass among the orgs that may start there;
        // across credentials, the pick whose oldest run has waited longest.
        let mut best: Option<(usize, Rank<'_>)> = None;
        let mut best_of: HashMap<&str, (usize, Rank<'_>)> = HashMap::new();
        for (i, w) in queue.waiting.iter().enumerate() {
            if left[i] == 0
                || free[w.credential_id.as_str()] <= 0
                || room[w.org_id.as_str()] <= 0
                || out_for_org(queue, w).is_some()
            {
                continue;
            }
            let key = (
                pass_of(&passes, &virtual_times, w),
                held[i],
                w.oldest_us,
                w.org_id.as_str(),
            );
            let slot = best_of.entry(w.credential_id.as_str()).or_insert((i, key));
            if key < slot.1 {
                *slot = (i, key);
            }
        }
        for (i, key) in best_of.into_values() {
            let age = (
                queue.waiting[i].oldest_us,
                queue.waiting[i].credential_id.as_str(),
            );
            let better = match best {
                None => true,
                Some((j, _)) => {
                    age < (
                        queue.waiting[j].oldest_us,
                        queue.waiting[j].credential_id.as_str(),
                    )
                }
            };
            if better {
                best = Some((i, key));
            }
        }
        let Some((i, (pass, ..))) = best else { break };
        let w = &queue.waiting[i];
        let stride = STRIDE / i64::from(tenancy.weight(&w.org_id).max(1));
        virtual_times.insert(w.credential_id.clone(), pass);
        passes.insert((w.credential_id.clone(), w.org_id.clone()), pass + stride);
        out.passes
            .insert((w.credential_id.clone(), String::new()), pass);
        out.passes
            .insert((w.credential_id.clone(), w.org_id.clone()), pass + stride);
        *free.get_mut(w.credential_id.as_str()).expect("counted") -= 1;
        *room.get_mut(w.org_id.as_str()).expect("counted") -= 1;
        left[i] -= 1;
        held[i] += 1;
        match out
            .grants
            .iter_mut()
            .find(|g| g.credential_id == w.credential_id && g.org_id == w.org_id)
        {
            Some(g) => g.runs += 1,
            None => out.grants.push(Grant {
                credential_id: w.credential_id.clone(),
                org_id: w.org_id.clone(),
                runs: 1,
            }),
        }
        started += 1;
    }
    // Why the rest waits: the org's quota first (it holds whatever the credential
    // does), then the credential. A run passed over only because this call started its
    // most keeps what it said.
    for (i, w) in queue.waiting.iter().enumerate() {
        if left[i] == 0 {
            continue;
        }
        if room[w.org_id.as_str()] <= 0 {
            let quota = tenancy.max_active_runs(&w.org_id).unwrap_or_default();
            out.org_reasons.insert(
                w.org_id.clone(),
                format!("org {} is at its quota of {quota} active runs", w.org_id),
            );
        } else if let Some(why) = out_for_org(queue, w)
            && free[w.credential_id.as_str()] > 0
        {
            out.pair_reasons.insert(
                (w.credential_id.clone(), w.org_id.clone()),
                format!("credential {} is {why}", w.credential_id),
            );
        } else if let Some(capacity) = queue.capacity
            && free[w.credential_id.as_str()] <= 0
        {
            let credential = w.credential_id.as_str();
            let limit = capacity.get(credential);
            let reason = match limit {
                None => format!("credential {credential} is not in the fleet"),
                Some(l) if !l.unavailable.is_empty() => {
                    format!("credential {credential} is {}", l.unavailable)
                }
                Some(l) => format!(
                    "credential {credential} is full: {} of {} slots busy",
                    i64::from(l.capacity) - free[credential],
                    l.capacity
                ),
            };
            out.credential_reasons
                .insert(w.credential_id.clone(), reason);
        }
    }
    out
}

/// Why `w`'s credential takes none of its org's runs now, though it may take others'.
fn out_for_org<'a>(queue: &'a Queue<'_>, w: &Waiting) -> Option<&'a str> {
    let limit = queue.capacity?.get(&w.credential_id)?;
    limit.unavailable_orgs.get(&w.org_id).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(credential: &str, org: &str, queued: u32, oldest_us: i64) -> Waiting {
        Waiting {
            credential_id: credential.into(),
            org_id: org.into(),
            queued,
            oldest_us,
        }
    }

    fn limits(entries: &[(&str, u32, &str)]) -> HashMap<String, SlotLimit> {
        entries
            .iter()
            .map(|(c, capacity, unavailable)| {
                (
                    c.to_string(),
                    SlotLimit {
                        capacity: *capacity,
                        unavailable: unavailable.to_string(),
                        ..Default::default()
                    },
                )
            })
            .collect()
    }

    fn runs_of(plan: &Plan, org: &str) -> u32 {
        plan.grants
            .iter()
            .filter(|g| g.org_id == org)
            .map(|g| g.runs)
            .sum()
    }

    /// Plans `rounds` rounds of one start each on a credential of one slot, every org
    /// always waiting, carrying the passes over: how many starts each org got.
    fn starts_over(rounds: u32, tenancy: &TenancyConfig, orgs: &[&str]) -> HashMap<String, u32> {
        let capacity = limits(&[("c", 1, "")]);
        let mut passes = HashMap::new();
        let mut virtual_times = HashMap::new();
        let mut starts = HashMap::new();
        for _ in 0..rounds {
            let queue = Queue {
                waiting: orgs
                    .iter()
                    .enumerate()
                    .map(|(i, o)| waiting("c", o, 100, i as i64))
                    .collect(),
                active: HashMap::new(),
                passes: passes.clone(),
                virtual_times: virtual_times.clone(),
                capacity: Some(&capacity),
            };
            let plan = plan(&queue, tenancy, 10);
            for ((c, o), pass) in plan.passes {
                if o.is_empty() {
                    virtual_times.insert(c, pass);
                } else {
                    passes.insert((c, o), pass);
                }
            }
            for g in plan.grants {
                *starts.entry(g.org_id).or_default() += g.runs;
            }
        }
        starts
    }

    #[test]
    fn an_org_with_one_run_takes_the_next_slot_before_a_long_queue() {
        let capacity = limits(&[("c", 2, "")]);
        // acme holds both slots and has started many runs; beta arrives with one.
        let queue = Queue {
            waiting: vec![waiting("c", "acme", 24, 1), waiting("c", "beta", 1, 50)],
            active: HashMap::from([(("c".into(), "acme".into()), 1)]),
            passes: HashMap::from([(("c".into(), "acme".into()), 5 * STRIDE)]),
            virtual_times: HashMap::from([("c".into(), 4 * STRIDE)]),
            capacity: Some(&capacity),
        };
        let plan = plan(&queue, &TenancyConfig::default(), 10);
        assert_eq!(
            plan.grants,
            [Grant {
                credential_id: "c".into(),
                org_id: "beta".into(),
                runs: 1
            }]
        );
        // Coming back after an idle spell is no credit: beta starts at the virtual time.
        assert_eq!(plan.passes[&("c".into(), "beta".into())], 5 * STRIDE);
    }

    #[test]
    fn starts_follow_the_weights_while_every_org_waits() {
        let mut tenancy = TenancyConfig::default();
        tenancy.orgs.insert(
            "big".into(),
            runplane_config::OrgTenancy {
                weight: Some(3),
                ..Default::default()
            },
        );
        let starts = starts_over(500, &tenancy, &["big", "small", "tiny"]);
        assert_eq!(starts["big"], 300, "{starts:?}");
        assert_eq!(starts["small"], 100, "{starts:?}");
        assert_eq!(starts["tiny"], 100, "{starts:?}");
    }

    #[test]
    fn equal_weights_take_turns() {
        let starts = starts_over(99, &TenancyConfig::default(), &["a", "b", "c"]);
        assert_eq!(starts.values().copied().collect::<Vec<_>>(), [33, 33, 33]);
    }

    #[test]
    fn a_run_that_cannot_start_never_blocks_one_that_can() {
        let capacity = limits(&[
            ("sick", 4, "quarantined for 1800 s (exhausted)"),
            ("full", 1, ""),
            ("well", 4, ""),
        ]);
        let mut tenancy = TenancyConfig::default();
        tenancy.orgs.insert(
            "capped".into(),
            runplane_config::OrgTenancy {
                max_active_runs: Some(1),
                ..Default::default()
            },
        );
        let queue = Queue {
            waiting: vec![
                waiting("sick", "acme", 400, 1),
                waiting("full", "acme", 400, 2),
                waiting("well", "capped", 400, 3),
                waiting("unknown", "acme", 5, 4),
                waiting("well", "beta", 1, 1000),
            ],
            active: HashMap::from([
                (("full".into(), "acme".into()), 1),
                (("other".into(), "capped".into()), 1),
            ]),
            capacity: Some(&capacity),
            ..Default::default()
        };
        let plan = plan(&queue, &tenancy, 100);
        assert_eq!(runs_of(&plan, "beta"), 1);
        assert_eq!(runs_of(&plan, "acme"), 0);
        assert_eq!(runs_of(&plan, "capped"), 0);
        assert_eq!(
            plan.credential_reasons,
            BTreeMap::from([
                (
                    "full".to_string(),
                    "credential full is full: 1 of 1 slots busy".to_string()
                ),
                (
                    "sick".to_string(),
                    "credential sick is quarantined for 1800 s (exhausted)".to_string()
                ),
                (
                    "unknown".to_string(),
                    "credential unknown is not in the fleet".to_string()
                ),
            ])
        );
        assert_eq!(
            plan.org_reasons["capped"],
            "org capped is at its quota of 1 active runs"
        );
    }

    #[test]
    fn a_call_starts_at_most_its_bound_and_without_capacity_every_org_takes_turns() {
        let queue = Queue {
            waiting: vec![waiting("c", "a", 50, 1), waiting("c", "b", 50, 2)],
            ..Default::default()
        };
        let plan = plan(&queue, &TenancyConfig::default(), 10);
        assert_eq!((runs_of(&plan, "a"), runs_of(&plan, "b")), (5, 5));
        assert!(plan.credential_reasons.is_empty());
    }
}
