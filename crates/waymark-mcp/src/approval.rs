//! Approval through MCP elicitation: when a call's execution waits on an approval (the
//! daemon's `awaiting_approval` event) and the client declared the elicitation capability,
//! the server asks the client's user (`elicitation/create`) to approve exactly that action.
//!
//! Accept with `approve: true` → `Approve`; accept with `false`, or decline → `Deny`; cancel,
//! no answer or an error → nothing: the execution stays pending and the operator CLI
//! (`waymark approve` / `deny`) still decides. Each execution is asked about at most once per
//! MCP session ([`Asked`]), so a retry of a pending call does not ask again.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use rmcp::model::{
    BooleanSchema, ElicitRequestParams, ElicitationAction, ElicitationSchema, StringSchema,
};
use rmcp::service::{ElicitationMode, Peer};
use rmcp::RoleServer;
use serde_json::Value;
use waymark_core::ExecutionId;
use waymark_protocol::{ApprovalQuestion, Frame, Request};

use crate::Backend;

/// Executions this MCP session already asked its user about.
#[derive(Clone, Default)]
pub struct Asked(Arc<Mutex<HashSet<ExecutionId>>>);

impl Asked {
    /// True the first time for an id (the caller then asks), false afterwards.
    pub fn first(&self, id: ExecutionId) -> bool {
        self.0.lock().expect("asked").insert(id)
    }
}

/// Whether the client can answer a form elicitation.
pub fn supported(peer: &Peer<RoleServer>) -> bool {
    peer.supported_elicitation_modes()
        .contains(&ElicitationMode::Form)
}

/// What the user is shown: tool, host, the canonical action (secret-free) and the id.
pub fn message(q: &ApprovalQuestion) -> String {
    format!(
        "Approve this action?\n\ntool: {}\nhost: {}\naction: {}\nexecution: {}\nrequested by: {}\n\n\
         Set approve to true to run it once, or to false (with a reason) to deny it. \
         Cancelling leaves it pending for an operator (`waymark approve {}`).",
        q.tool, q.host, q.action, q.id, q.actor.0, q.id,
    )
}

/// What the user answers: `approve` (required) and an optional `reason`.
pub fn schema() -> ElicitationSchema {
    ElicitationSchema::builder()
        .required_bool_with("approve", |b: BooleanSchema| {
            b.title("Approve")
                .description("true: run this action once; false: deny it.")
        })
        .optional_string_with("reason", |s: StringSchema| {
            s.title("Reason")
                .description("Why it is denied (recorded in the audit log).")
        })
        .build_unchecked()
}

/// The user's decision, as a control request; `None`: leave it pending.
pub fn decision(
    id: ExecutionId,
    action: &ElicitationAction,
    content: Option<&Value>,
) -> Option<Request> {
    match action {
        ElicitationAction::Accept => {
            let approve = content.and_then(|c| c["approve"].as_bool())?;
            if approve {
                Some(Request::Approve { id })
            } else {
                let reason = content
                    .and_then(|c| c["reason"].as_str())
                    .filter(|r| !r.trim().is_empty())
                    .unwrap_or("denied by the MCP client's user");
                Some(Request::Deny {
                    id,
                    reason: reason.into(),
                })
            }
        }
        ElicitationAction::Decline => Some(Request::Deny {
            id,
            reason: "declined by the MCP client's user".into(),
        }),
        _ => None,
    }
}

/// Asks the user about one execution and relays the decision to the daemon.
pub async fn ask(peer: Peer<RoleServer>, backend: Arc<dyn Backend>, question: ApprovalQuestion) {
    let id = question.id;
    let params = ElicitRequestParams::FormElicitationParams {
        meta: None,
        message: message(&question),
        requested_schema: schema(),
    };
    let answer = match peer.create_elicitation(params).await {
        Ok(a) => a,
        Err(e) => {
            tracing::info!(%id, error = %e, "no answer to the approval elicitation; left pending");
            return;
        }
    };
    let Some(req) = decision(id, &answer.action, answer.content.as_ref()) else {
        tracing::info!(%id, "approval elicitation cancelled; left pending");
        return;
    };
    match backend.request(req, &|_| {}).await {
        Ok(Frame::Done { .. }) => tracing::info!(%id, "decided through elicitation"),
        other => {
            tracing::info!(%id, answer = ?other.ok(), "the elicited decision was not applied")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use waymark_core::{Actor, ReplayContract};

    fn id(n: u8) -> ExecutionId {
        format!("act_01J9Z3K8Q4M7W2X5Y6Z8A9B0C{n}").parse().unwrap()
    }

    #[test]
    fn decisions_map_to_requests() {
        let yes = json!({"approve": true});
        let no = json!({"approve": false, "reason": "not now"});
        assert!(matches!(
            decision(id(1), &ElicitationAction::Accept, Some(&yes)),
            Some(Request::Approve { .. })
        ));
        match decision(id(1), &ElicitationAction::Accept, Some(&no)) {
            Some(Request::Deny { reason, .. }) => assert_eq!(reason, "not now"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decision(id(1), &ElicitationAction::Decline, None),
            Some(Request::Deny { .. })
        ));
        assert!(decision(id(1), &ElicitationAction::Cancel, None).is_none());
        assert!(decision(id(1), &ElicitationAction::Accept, None).is_none());
    }

    #[test]
    fn each_execution_is_asked_once() {
        let a = Asked::default();
        assert!(a.first(id(1)));
        assert!(!a.first(id(1)));
        assert!(a.first(id(2)));
    }

    #[test]
    fn the_message_names_the_action_and_the_schema_asks_for_approve() {
        let m = message(&ApprovalQuestion {
            id: id(1),
            tool: "guarded".into(),
            host: "h1".into(),
            actor: Actor("uid:1:x".into()),
            contract: ReplayContract::Irreversible,
            action: "sh -c x".into(),
        });
        assert!(
            m.contains("guarded")
                && m.contains("h1")
                && m.contains("sh -c x")
                && m.contains(&id(1).to_string())
        );
        let s = serde_json::to_value(schema()).unwrap();
        assert_eq!(s["required"], json!(["approve"]));
        assert_eq!(s["properties"]["approve"]["type"], "boolean");
    }
}
