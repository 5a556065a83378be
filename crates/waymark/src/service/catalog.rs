//! The configured tools as a front end publishes them (the answer to `ListTools`).

use waymark_gateway::config::ActorDef;
use waymark_gateway::tools;

use crate::protocol::{ArgInfo, ToolCatalog, ToolSpec};

/// What a front end needs to publish the tools `rights` may call (every tool for `None`), each
/// with the hosts those rights let it target; a tool left with no host is not published.
pub fn tool_catalog(
    cfg: &waymark_gateway::config::Config,
    rights: Option<&ActorDef>,
) -> ToolCatalog {
    use waymark_gateway::config::ArgType;
    let host_ok = |h: &String| rights.is_none_or(|r| r.may_target(h).is_ok());
    let tools = cfg
        .tools
        .values()
        .filter(|t| rights.is_none_or(|r| r.may_call(&t.name).is_ok()))
        .filter_map(|t| {
            let hosts = tools::allowed_hosts(t, cfg);
            let targets_none = hosts.is_empty();
            let kept: Vec<String> = hosts
                .into_iter()
                .filter(|h| t.http.is_some() || host_ok(h))
                .collect();
            // Published while it has a host this caller may target (or targets none).
            (targets_none || !kept.is_empty()).then_some((t, kept))
        })
        .map(|(t, hosts)| ToolSpec {
            name: t.name.clone(),
            description: t.description.clone(),
            contract: t.contract,
            hosts,
            host_arg: t.host_arg || t.hosts.len() > 1,
            args: t
                .args
                .iter()
                .map(|a| ArgInfo {
                    name: a.name.clone(),
                    ty: match a.ty {
                        ArgType::String => "string",
                        ArgType::Integer => "integer",
                        ArgType::Boolean => "boolean",
                        ArgType::Enum => "enum",
                    }
                    .into(),
                    description: a.description.clone(),
                    values: a.values.clone(),
                    pattern: a.pattern.as_ref().map(|p| p.as_str().to_string()),
                    secret: a.secret,
                    required: a.required,
                })
                .collect(),
        })
        .collect();
    let raw_hosts = if rights.is_none_or(|r| r.may_call(tools::RAW_TOOL).is_ok()) {
        cfg.policy
            .raw_commands
            .iter()
            .filter(|h| host_ok(h))
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    ToolCatalog { tools, raw_hosts }
}
