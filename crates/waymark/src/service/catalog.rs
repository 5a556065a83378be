//! The configured tools as a front end publishes them (the answer to `ListTools`).

use waymark_gateway::tools;

use crate::protocol::{ArgInfo, ToolCatalog, ToolSpec};

/// What a front end needs to publish the configured tools.
pub fn tool_catalog(cfg: &waymark_gateway::config::Config) -> ToolCatalog {
    use waymark_gateway::config::ArgType;
    let tools = cfg
        .tools
        .values()
        .map(|t| ToolSpec {
            name: t.name.clone(),
            description: t.description.clone(),
            contract: t.contract,
            hosts: tools::allowed_hosts(t, cfg),
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
    ToolCatalog {
        tools,
        raw_hosts: cfg.policy.raw_commands.clone(),
    }
}
