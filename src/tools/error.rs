//! What a tool call that did not work tells the model: a stable code from one list, and a
//! message that says what to do instead. The model sees `error[code]: message` as the call's
//! result; the run goes on.

/// Defines [`ErrorCode`] from one list of variants, codes and meanings.
macro_rules! error_codes {
    ($($(#[doc = $doc:literal])+ $variant:ident => $code:literal,)+) => {
        /// The stable codes of tool errors, as `error[code]` in a call's result.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[doc = $doc])+ $variant,)+
        }

        impl ErrorCode {
            /// Every code, in the order of the documentation's table.
            pub const ALL: &[ErrorCode] = &[$(ErrorCode::$variant,)+];

            /// The code as the model and the docs see it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $code,)+
                }
            }

            /// What the code means (its doc), for the documentation's table.
            pub fn meaning(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => concat!($($doc),+).trim_ascii(),)+
                }
            }
        }
    };
}

error_codes! {
    /// The arguments are not the JSON object the tool's schema asks for.
    BadArguments => "bad_arguments",
    /// The agent was not offered a tool of that name.
    UnknownTool => "unknown_tool",
    /// The path leads outside the owner's workspace (absolute, `..`, or a link).
    PathOutsideWorkspace => "path_outside_workspace",
    /// The owner's workspace could not be opened or created.
    WorkspaceUnavailable => "workspace_unavailable",
    /// No such file, or an edit's `old_string` is not in it.
    NotFound => "not_found",
    /// An edit's `old_string` occurs more than once and `replace_all` is not set.
    NotUnique => "not_unique",
    /// The path is a directory where a file was expected.
    IsDirectory => "is_directory",
    /// The path is a FIFO, a device or a socket, not a regular file.
    NotAFile => "not_a_file",
    /// The file has more than one hard link: another name of it may lie outside the workspace.
    HardLink => "hard_link",
    /// The file is binary, not text.
    NotText => "not_text",
    /// The file is larger than the edit tools load.
    FileTooLarge => "file_too_large",
    /// The edit's result would be larger than the edit tools write.
    EditTooLarge => "edit_too_large",
    /// Reading or writing the file failed.
    IoError => "io_error",
    /// A search could not run (a bad pattern, an unreadable tree).
    SearchFailed => "search_failed",
    /// The bash tool could not start the command.
    BashFailed => "bash_failed",
    /// The URL is not an http(s) URL `web_fetch` can fetch.
    BadUrl => "bad_url",
    /// The host is refused by the fetch rules.
    HostDenied => "host_denied",
    /// The host resolves to a loopback, private or metadata address.
    PrivateAddress => "private_address",
    /// The fetch failed (connection, status, body).
    FetchFailed => "fetch_failed",
    /// The fetch took longer than its limit.
    FetchTimeout => "fetch_timeout",
    /// The fetch was redirected too many times.
    TooManyRedirects => "too_many_redirects",
    /// The tool did not finish within `SUBAGENTS_TOOL_TIMEOUT` and was stopped.
    ToolTimeout => "tool_timeout",
    /// The call was started twice and its worker died both times: it is not run again.
    ToolCrashed => "tool_crashed",
    /// The MCP server answered the call with an error.
    McpToolError => "mcp_tool_error",
    /// The MCP server could not be reached or started.
    McpUnavailable => "mcp_unavailable",
    /// The call to the MCP server failed on the way.
    McpCallFailed => "mcp_call_failed",
    /// No MCP server of that name is configured.
    McpUnknownServer => "mcp_unknown_server",
    /// The run was offered the tool when it started, but its MCP server no longer has it.
    ToolUnavailable => "tool_unavailable",
    /// A rule, a mode, a hook or a person refused the call; it was not run.
    PermissionDenied => "permission_denied",
    /// A PreToolUse hook blocked the call; it was not run.
    BlockedByHook => "blocked_by_hook",
    /// Nobody answered the call's approval in time; it was not run.
    ApprovalExpired => "approval_expired",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A tool failure the model should see (it is sent back as the tool result, not raised).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("error[{code}]: {message}")]
pub struct ToolError {
    /// What kind of failure.
    pub code: ErrorCode,
    /// What went wrong and what to do instead.
    pub message: String,
}

impl ToolError {
    /// Shorthand.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_snake_case_and_explained() {
        let mut seen = std::collections::HashSet::new();
        for c in ErrorCode::ALL {
            let s = c.as_str();
            assert!(seen.insert(s), "{s} twice");
            assert!(
                s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{s}"
            );
            assert!(!c.meaning().is_empty(), "{s}");
        }
        let e = ToolError::new(ErrorCode::NotFound, "no such file");
        assert_eq!(e.to_string(), "error[not_found]: no such file");
    }
}
