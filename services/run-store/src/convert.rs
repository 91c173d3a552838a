//! Stored rows to protobuf messages, and the verdict between its domain and wire forms.

use prost::Message;
use runplane_proto::runstore::v1 as runstore_pb;

use crate::domain::state::RunState;
use crate::domain::validate::json_to_struct;
use crate::domain::verdict::Verdict;
use crate::error::RunStoreError;
use crate::store::entities::{event, run, run_attempt, steering_message};
use runplane_clock::to_timestamp as timestamp;

pub fn run(model: &run::Model) -> runstore_pb::Run {
    let terminal = model.state.is_terminal();
    let backend_error: Option<runstore_pb::BackendError> = model
        .backend_error
        .as_deref()
        .and_then(|json| serde_json::from_str::<serde_json::Value>(json).ok())
        .map(|v| runstore_pb::BackendError {
            kind: runstore_pb::BackendErrorKind::from_str_name(
                v["kind"].as_str().unwrap_or_default(),
            )
            .unwrap_or(runstore_pb::BackendErrorKind::Unspecified) as i32,
            reason: v["reason"].as_str().unwrap_or_default().to_owned(),
            credential_id: v["credential_id"].as_str().unwrap_or_default().to_owned(),
            incident_id: v["incident_id"].as_str().unwrap_or_default().to_owned(),
            turn_id: v["turn_id"].as_str().unwrap_or_default().to_owned(),
            recorded_at: v["recorded_at_us"].as_i64().map(timestamp),
        });
    let verdict = terminal
        .then(|| model.verdict())
        .flatten()
        .map(|v| runstore_pb::Verdict::from(&v));
    let failure_reason = match (&backend_error, &verdict) {
        (Some(b), _) => b.reason.clone(),
        (None, Some(v)) if v.outcome() != runstore_pb::VerdictOutcome::Succeeded => {
            v.reason.clone()
        }
        _ => String::new(),
    };
    runstore_pb::Run {
        id: model.id.clone(),
        org_id: model.org_id.clone(),
        lead_id: model.lead_id.clone(),
        state: runstore_pb::RunState::from(model.state) as i32,
        verdict,
        failure_reason,
        credential_id: model.credential_id.clone(),
        profile: model.profile.clone(),
        command: model.command.clone(),
        args: serde_json::from_str(&model.args).unwrap_or_default(),
        labels: serde_json::from_str(&model.labels).unwrap_or_default(),
        sandbox_generation: model.sandbox_generation as u64,
        last_sequence: model.last_sequence as u64,
        backend_error,
        created_at: Some(timestamp(model.created_at_us)),
        started_at: model.started_at_us.map(timestamp),
        ended_at: model.ended_at_us.map(timestamp),
        updated_at: Some(timestamp(model.updated_at_us)),
        traceparent: model.traceparent.clone(),
        deadline: model.deadline_at_us.map(timestamp),
        sandbox_id: model.sandbox_id.clone(),
        waiting_reason: if model.state == RunState::Queued {
            model.waiting_reason.clone()
        } else {
            String::new()
        },
        priority: model.priority,
        waiting_for_input_since: (model.state == RunState::Running && model.waiting_since_us > 0)
            .then(|| timestamp(model.waiting_since_us)),
        paused_since: (!model.state.is_terminal() && model.paused_at_us > 0)
            .then(|| timestamp(model.paused_at_us)),
        attempt: crate::store::attempts::current_attempt(model),
        retry_at: (!model.state.is_terminal() && model.retry_at_us > 0)
            .then(|| timestamp(model.retry_at_us)),
        attempts: Vec::new(),
    }
}

/// One attempt's record.
pub fn attempt(model: &run_attempt::Model) -> runstore_pb::Attempt {
    runstore_pb::Attempt {
        number: u32::try_from(model.number).unwrap_or(u32::MAX),
        sandbox_id: model.sandbox_id.clone(),
        node_id: model.node_id.clone(),
        started_at: Some(timestamp(model.started_at_us)),
        ended_at: (model.ended_at_us > 0).then(|| timestamp(model.ended_at_us)),
        end_reason: model.end_reason.clone(),
        end_message: model.end_message.clone(),
        superseded_verdict: model.superseded_verdict.clone(),
    }
}

/// A run as `view` says: the basic view without its spec and its verdict's message.
pub fn run_in(model: &run::Model, view: runstore_pb::RunView) -> runstore_pb::Run {
    let mut run = run(model);
    if view == runstore_pb::RunView::Basic {
        run.command.clear();
        run.args.clear();
        run.labels.clear();
        if let Some(verdict) = run.verdict.as_mut() {
            verdict.message.clear();
        }
    }
    run
}

pub fn event(model: &event::Model) -> runstore_pb::Event {
    runstore_pb::Event {
        run_id: model.run_id.clone(),
        sequence: model.sequence as u64,
        kind: model.kind,
        text: model.text.clone(),
        data: json_to_struct(&model.data),
        check: model.is_check,
        name: model.name.clone(),
        observed_at: model.observed_at_us.map(timestamp),
        recorded_at: Some(timestamp(model.recorded_at_us)),
        digest: model.digest.clone(),
    }
}

pub fn message(model: &steering_message::Model) -> runstore_pb::SteeringMessage {
    use runstore_pb::steering_message::Payload;
    let bytes = model.payload.as_slice();
    let payload = match runstore_pb::SteeringKind::try_from(model.kind) {
        Ok(runstore_pb::SteeringKind::Steer) => runstore_pb::SteerPayload::decode(bytes)
            .ok()
            .map(Payload::Steer),
        Ok(runstore_pb::SteeringKind::Interrupt) => runstore_pb::InterruptPayload::decode(bytes)
            .ok()
            .map(Payload::Interrupt),
        Ok(runstore_pb::SteeringKind::ResumeStream) => {
            runstore_pb::ResumeStreamPayload::decode(bytes)
                .ok()
                .map(Payload::ResumeStream)
        }
        Ok(runstore_pb::SteeringKind::Abort) => runstore_pb::AbortPayload::decode(bytes)
            .ok()
            .map(Payload::Abort),
        _ => None,
    };
    runstore_pb::SteeringMessage {
        id: model.id.clone(),
        run_id: model.run_id.clone(),
        kind: model.kind,
        sequence: model.sequence as u64,
        enqueued_at: Some(timestamp(model.enqueued_at_us)),
        payload,
    }
}

/// The recorded verdict as sent in answers and sealed in receipts.
impl From<&Verdict> for runstore_pb::Verdict {
    fn from(verdict: &Verdict) -> Self {
        Self {
            outcome: runstore_pb::VerdictOutcome::from(verdict.outcome) as i32,
            reason: verdict.reason.clone(),
            exit_code: verdict.exit_code,
            signal: verdict.signal,
            message: verdict.message.clone(),
        }
    }
}

/// A runner's verdict; an unspecified (or unknown) outcome is refused naming the field.
impl TryFrom<&runstore_pb::Verdict> for Verdict {
    type Error = RunStoreError;

    fn try_from(verdict: &runstore_pb::Verdict) -> Result<Self, Self::Error> {
        let outcome = verdict.outcome().try_into().map_err(|_| {
            RunStoreError::invalid("verdict.outcome", "must be succeeded, failed or cancelled")
        })?;
        Ok(Self {
            outcome,
            reason: verdict.reason.clone(),
            exit_code: verdict.exit_code,
            signal: verdict.signal,
            message: verdict.message.clone(),
        })
    }
}
