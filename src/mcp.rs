//! MCP servers as tool sources (the official Rust SDK, `rmcp`). Servers are declared in Claude
//! Code's `.mcp.json` format (`SUBAGENTS_MCP_CONFIG`, default `./.mcp.json`, and an agent's
//! `mcpServers:`); their tools appear to agents as `mcp__<server>__<tool>`.
//!
//! A server is started (stdio) or connected to (streamable HTTP) the first time a run needs it,
//! and reused by later runs of this worker process; it stops with the process. A stdio server
//! is one process per owner: it may keep state or touch files, and one owner's runs must not
//! reach another's through it. An HTTP server is shared (it is the remote's to separate
//! callers). A server that
//! died is started again on the next call, and the call is sent once more. A server that cannot
//! start, hangs or errs gives the model a tool error, never a failed run. As for any tool, a
//! call whose result was not committed before a crash is sent again on replay.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::ids::OwnerId;
use crate::model::{FunctionSpec, ToolSpec};

/// How to reach one server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerConfig {
    /// A process speaking MCP on stdin/stdout.
    Stdio {
        /// Program.
        command: String,
        /// Arguments.
        args: Vec<String>,
        /// Extra environment.
        env: BTreeMap<String, String>,
    },
    /// A streamable HTTP endpoint.
    Http {
        /// Endpoint URL.
        url: String,
        /// Extra request headers (e.g. `Authorization`).
        headers: BTreeMap<String, String>,
    },
}

/// Servers by name.
pub type Servers = BTreeMap<String, ServerConfig>;

/// Expands `${VAR}` and `${VAR:-default}` from the environment the process started with, as
/// Claude Code does (secrets included: they were taken out of the live environment, see
/// [`crate::secrets`]).
pub fn expand(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("`{s}`: `${{` without a closing `}}`"))?;
        let inner = &after[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        match (crate::secrets::var(name), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => {
                return Err(format!(
                    "`{s}` uses ${{{name}}}, which is not set (give a default with ${{{name}:-…}})"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Parses an `mcpServers` object (the value under `mcpServers` in `.mcp.json`).
pub fn parse_servers(v: &Value) -> Result<Servers, String> {
    let Value::Object(map) = v else {
        return Err("`mcpServers` must be an object of servers by name".into());
    };
    let mut out = Servers::new();
    for (name, s) in map {
        if name.is_empty()
            || name.contains("__")
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!(
                "MCP server name `{name}` must be letters, digits, `-` and `_`, without `__`"
            ));
        }
        let strings = |key: &str| -> Result<BTreeMap<String, String>, String> {
            match s.get(key) {
                None | Some(Value::Null) => Ok(BTreeMap::new()),
                Some(Value::Object(o)) => o
                    .iter()
                    .map(|(k, v)| {
                        v.as_str()
                            .ok_or_else(|| format!("{name}.{key}.{k} must be a string"))
                            .and_then(expand)
                            .map(|v| (k.clone(), v))
                    })
                    .collect(),
                Some(_) => Err(format!("{name}.{key} must be an object of strings")),
            }
        };
        let kind = s
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(if s.get("url").is_some() {
                "http"
            } else {
                "stdio"
            });
        let config = match kind {
            "stdio" => ServerConfig::Stdio {
                command: expand(s.get("command").and_then(Value::as_str).ok_or_else(|| {
                    format!("MCP server `{name}` needs `command` (or `url` for HTTP)")
                })?)?,
                args: match s.get("args") {
                    None | Some(Value::Null) => vec![],
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|x| {
                            x.as_str()
                                .ok_or_else(|| format!("{name}.args must be strings"))
                                .and_then(expand)
                        })
                        .collect::<Result<_, _>>()?,
                    Some(_) => return Err(format!("{name}.args must be a list of strings")),
                },
                env: strings("env")?,
            },
            "http" | "sse" | "streamable-http" => {
                let url =
                    expand(s.get("url").and_then(Value::as_str).ok_or_else(|| {
                        format!("MCP server `{name}` of type {kind} needs `url`")
                    })?)?;
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!(
                        "MCP server `{name}`: `{url}` is not an http(s) URL"
                    ));
                }
                ServerConfig::Http {
                    url,
                    headers: strings("headers")?,
                }
            }
            other => {
                return Err(format!(
                    "MCP server `{name}`: type `{other}` is not stdio, http or sse"
                ));
            }
        };
        out.insert(name.clone(), config);
    }
    Ok(out)
}

/// Loads `.mcp.json` (`{"mcpServers": {...}}`); a missing file declares no servers.
pub fn load(path: &std::path::Path) -> Result<Servers, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Servers::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not valid JSON: {e}", path.display()))?;
    v.get("mcpServers")
        .map(parse_servers)
        .transpose()
        .map(Option::unwrap_or_default)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Splits `mcp__server__tool` (or `mcp__server`) into its parts.
pub fn split(name: &str) -> Option<(&str, Option<&str>)> {
    let rest = name.strip_prefix("mcp__")?;
    Some(match rest.split_once("__") {
        Some((server, tool)) => (server, Some(tool)),
        None => (rest, None),
    })
}

/// How an MCP call failed (the model gets the text).
#[derive(Debug, Clone, thiserror::Error)]
pub enum McpError {
    /// No such server in the configuration.
    #[error("error[mcp_unknown_server]: there is no MCP server `{0}` configured")]
    Unknown(String),
    /// It could not be started or reached.
    #[error("error[mcp_unavailable]: the MCP server `{server}` is not available: {why}")]
    Unavailable {
        /// Server.
        server: String,
        /// Why.
        why: String,
    },
    /// The server no longer offers a tool the run's menu has (its tool list changed since the
    /// run pinned it).
    #[error(
        "the MCP server `{server}` no longer offers `{tool}` (its tool list changed after this run started); do without it"
    )]
    Gone {
        /// Server.
        server: String,
        /// Tool.
        tool: String,
    },
    /// The call failed at the protocol level.
    #[error("error[mcp_call_failed]: `{tool}` on the MCP server `{server}` failed: {why}")]
    Call {
        /// Server.
        server: String,
        /// Tool.
        tool: String,
        /// Why.
        why: String,
    },
}

struct Live {
    service: RunningService<RoleClient, ()>,
    tools: Vec<rmcp::model::Tool>,
}

/// The MCP servers this process talks to, started on first use.
pub struct Hub {
    servers: Servers,
    /// Servers an agent file declared: visible to that agent only.
    private: BTreeMap<String, String>,
    live: Mutex<HashMap<String, Arc<Live>>>,
    /// Servers that just failed to start, not tried again for a while (every run would wait).
    failed: Mutex<HashMap<String, (std::time::Instant, McpError)>>,
    start_timeout: Duration,
}

/// How long a server that failed to start is left alone.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(15);

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("servers", &self.servers.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Hub {
    /// A hub for `servers`; a server must answer its handshake and tool list within
    /// `start_timeout`.
    pub fn new(servers: Servers, start_timeout: Duration) -> Hub {
        Hub {
            servers,
            private: BTreeMap::new(),
            live: Mutex::new(HashMap::new()),
            failed: Mutex::new(HashMap::new()),
            start_timeout,
        }
    }

    /// Adds the servers an agent file declares, visible to that agent only; a name the
    /// operator's file already uses keeps the operator's server.
    pub fn add_private(&mut self, agent: &str, servers: Servers) {
        for (name, config) in servers {
            if self.servers.contains_key(&name) {
                tracing::warn!(agent, server = %name, "the agent declares an MCP server the operator's .mcp.json already has; using the operator's");
                continue;
            }
            self.private.insert(name.clone(), agent.to_owned());
            self.servers.insert(name, config);
        }
    }

    /// The servers `agent` may use: the operator's and its own.
    pub fn visible(&self, agent: &str) -> Vec<String> {
        self.servers
            .keys()
            .filter(|n| self.private.get(*n).is_none_or(|a| a == agent))
            .cloned()
            .collect()
    }

    /// The key of `name`'s connection for `owner`: a stdio server's process is the owner's own.
    fn instance(&self, name: &str, owner: &str) -> String {
        match self.servers.get(name) {
            Some(ServerConfig::Stdio { .. }) => format!("{name}\u{0}{owner}"),
            _ => name.to_owned(),
        }
    }

    async fn connect(&self, name: &str, owner: &str) -> Result<Arc<Live>, McpError> {
        let key = self.instance(name, owner);
        if let Some(l) = self.live.lock().await.get(&key)
            && !l.service.is_transport_closed()
        {
            return Ok(l.clone());
        }
        if let Some((at, e)) = self.failed.lock().await.get(&key)
            && at.elapsed() < RETRY_AFTER_FAILURE
        {
            return Err(e.clone());
        }
        let result = self.start(name, &key).await;
        match &result {
            Ok(_) => {
                self.failed.lock().await.remove(&key);
            }
            Err(e) => {
                tracing::warn!(server = name, owner, error = %e, "MCP server could not be started");
                self.failed
                    .lock()
                    .await
                    .insert(key, (std::time::Instant::now(), e.clone()));
            }
        }
        result
    }

    async fn start(&self, name: &str, key: &str) -> Result<Arc<Live>, McpError> {
        let config = self
            .servers
            .get(name)
            .ok_or_else(|| McpError::Unknown(name.to_owned()))?;
        let unavailable = |why: String| McpError::Unavailable {
            server: name.to_owned(),
            why,
        };
        let start = async {
            let service = match config {
                ServerConfig::Stdio { command, args, env } => {
                    // The server gets its declared `env` and the harmless variables, never the
                    // worker's environment, and keeps no capabilities.
                    let mut cmd = tokio::process::Command::new(command);
                    let declared: Vec<(String, String)> =
                        env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                    cmd.args(args)
                        .env_clear()
                        .envs(crate::procs::child_env(&declared))
                        .kill_on_drop(true);
                    crate::procs::confine(&mut cmd);
                    let (transport, _stderr) = rmcp::transport::TokioChildProcess::builder(cmd)
                        .stderr(std::process::Stdio::null())
                        .spawn()
                        .map_err(|e| unavailable(format!("cannot start `{command}`: {e}")))?;
                    ().serve(transport)
                        .await
                        .map_err(|e| unavailable(format!("the MCP handshake failed: {e}")))?
                }
                ServerConfig::Http { url, headers } => {
                    let mut h = HashMap::new();
                    for (k, v) in headers {
                        let k = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                            .map_err(|e| unavailable(format!("header `{k}`: {e}")))?;
                        let v = reqwest::header::HeaderValue::from_str(v)
                            .map_err(|e| unavailable(format!("header value: {e}")))?;
                        h.insert(k, v);
                    }
                    let config = rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(url.as_str()).custom_headers(h);
                    let transport = rmcp::transport::StreamableHttpClientTransport::with_client(
                        reqwest::Client::new(),
                        config,
                    );
                    ().serve(transport).await.map_err(|e| {
                        unavailable(format!("the MCP handshake with {url} failed: {e}"))
                    })?
                }
            };
            let tools = service
                .list_all_tools()
                .await
                .map_err(|e| unavailable(format!("listing its tools failed: {e}")))?;
            Ok::<_, McpError>(Live { service, tools })
        };
        let live = tokio::time::timeout(self.start_timeout, start)
            .await
            .map_err(|_| {
                unavailable(format!(
                    "it did not answer within {}s",
                    self.start_timeout.as_secs_f64()
                ))
            })??;
        tracing::info!(
            server = name,
            tools = live.tools.len(),
            "MCP server connected"
        );
        let live = Arc::new(live);
        self.live.lock().await.insert(key.to_owned(), live.clone());
        Ok(live)
    }

    /// The tools of `server` as the model sees them (`mcp__<server>__<tool>`); `only` keeps one.
    pub async fn specs(
        &self,
        server: &str,
        only: Option<&str>,
        owner: &OwnerId,
    ) -> Result<Vec<ToolSpec>, McpError> {
        let owner = owner.as_str();
        let live = self.connect(server, owner).await?;
        Ok(live
            .tools
            .iter()
            .filter(|t| only.is_none_or(|o| t.name == o))
            .map(|t| {
                let v = serde_json::to_value(t).unwrap_or(Value::Null);
                ToolSpec {
                    kind: "function".into(),
                    function: FunctionSpec {
                        name: format!("mcp__{server}__{}", t.name),
                        description: v["description"]
                            .as_str()
                            .unwrap_or("")
                            .chars()
                            .take(1024)
                            .collect(),
                        parameters: v
                            .get("inputSchema")
                            .cloned()
                            .filter(Value::is_object)
                            .unwrap_or_else(|| json!({"type": "object"})),
                    },
                }
            })
            .collect())
    }

    /// Calls `tool` on `server`; a server that died is started again and the call sent once
    /// more. Returns the result as text and whether the tool reported success.
    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Value,
        owner: &OwnerId,
    ) -> Result<(String, bool), McpError> {
        let owner = owner.as_str();
        let args = match arguments {
            Value::Object(o) => Some(o),
            Value::Null => None,
            _ => {
                return Err(McpError::Call {
                    server: server.into(),
                    tool: tool.into(),
                    why: "arguments must be a JSON object".into(),
                });
            }
        };
        for attempt in 0..2 {
            let live = self.connect(server, owner).await?;
            // The run's menu is the list it pinned; the server's may have changed since.
            if !live.tools.iter().any(|t| t.name == tool) {
                return Err(McpError::Gone {
                    server: server.into(),
                    tool: tool.into(),
                });
            }
            let mut params = CallToolRequestParams::new(tool.to_owned());
            params.arguments = args.clone();
            match live.service.call_tool(params).await {
                Ok(result) => {
                    return Ok(render(
                        &serde_json::to_value(&result).unwrap_or(Value::Null),
                    ));
                }
                Err(e) if attempt == 0 && live.service.is_transport_closed() => {
                    tracing::warn!(server, error = %e, "MCP server went away; starting it again");
                    self.live.lock().await.remove(&self.instance(server, owner));
                }
                Err(e) => {
                    return Err(McpError::Call {
                        server: server.into(),
                        tool: tool.into(),
                        why: e.to_string(),
                    });
                }
            }
        }
        unreachable!("the loop returns on its second attempt")
    }
}

/// A `tools/call` result as text: text blocks as they are, other blocks summarised, and the
/// structured result when there is no text.
fn render(result: &Value) -> (String, bool) {
    let ok = result["isError"] != true;
    let mut parts = vec![];
    for block in result["content"].as_array().into_iter().flatten() {
        parts.push(match block["type"].as_str().unwrap_or("") {
            "text" => block["text"].as_str().unwrap_or("").to_owned(),
            "image" | "audio" => format!(
                "[{} {}, {} bytes base64: not shown]",
                block["type"].as_str().unwrap_or(""),
                block["mimeType"].as_str().unwrap_or("?"),
                block["data"].as_str().map_or(0, str::len)
            ),
            "resource" => match block["resource"]["text"].as_str() {
                Some(t) => format!(
                    "[resource {}]\n{t}",
                    block["resource"]["uri"].as_str().unwrap_or("")
                ),
                None => format!(
                    "[resource {} ({}): binary, not shown]",
                    block["resource"]["uri"].as_str().unwrap_or(""),
                    block["resource"]["mimeType"].as_str().unwrap_or("?")
                ),
            },
            "resource_link" => format!(
                "[resource link {} {}]",
                block["uri"].as_str().unwrap_or(""),
                block["name"].as_str().unwrap_or("")
            ),
            other => format!("[{other} content]"),
        });
    }
    if parts.is_empty()
        && let Some(s) = result.get("structuredContent").filter(|s| !s.is_null())
    {
        parts.push(s.to_string());
    }
    (parts.join("\n"), ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claude_code_mcp_json_parses_with_variables() {
        // SAFETY: tests in this module read only this variable.
        unsafe { std::env::set_var("SUBAGENTS_TEST_MCP_TOKEN", "s3cret") };
        let v = json!({
            "fs": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "${HOME:-/root}"], "env": {"A": "b"}},
            "remote": {"type": "http", "url": "https://mcp.example.com/mcp", "headers": {"Authorization": "Bearer ${SUBAGENTS_TEST_MCP_TOKEN}"}},
        });
        let s = parse_servers(&v).unwrap();
        assert!(
            matches!(&s["fs"], ServerConfig::Stdio { command, args, .. } if command == "npx" && args.len() == 3)
        );
        assert!(
            matches!(&s["remote"], ServerConfig::Http { headers, .. } if headers["Authorization"] == "Bearer s3cret")
        );
        assert!(
            parse_servers(
                &json!({"x": {"type": "http", "url": "https://${NOPE_NOT_SET_ANYWHERE}/"}})
            )
            .unwrap_err()
            .contains("not set")
        );
        assert!(parse_servers(&json!({"a__b": {"command": "x"}})).is_err());
        assert!(
            parse_servers(&json!({"x": {}}))
                .unwrap_err()
                .contains("needs `command`")
        );
        assert_eq!(split("mcp__fs__read_file"), Some(("fs", Some("read_file"))));
        assert_eq!(split("mcp__fs"), Some(("fs", None)));
        assert_eq!(split("read_file"), None);
    }

    #[test]
    fn results_render_as_text() {
        let r = json!({"content": [{"type": "text", "text": "hello"}, {"type": "image", "mimeType": "image/png", "data": "AAAA"}], "isError": false});
        assert_eq!(
            render(&r),
            (
                "hello\n[image image/png, 4 bytes base64: not shown]".into(),
                true
            )
        );
        let r = json!({"content": [], "structuredContent": {"a": 1}, "isError": true});
        assert_eq!(render(&r), ("{\"a\":1}".into(), false));
    }
}
