//! `web_fetch`: a page as readable text. Only `http`/`https`; every hop of a redirect chain is
//! checked again; the host is resolved here and the connection pinned to the address that was
//! checked (so DNS cannot answer differently between the check and the connection). Loopback,
//! private, link-local and other non-public addresses are refused unless the operator allows
//! the host (`SUBAGENTS_FETCH_ALLOW`), so an agent cannot reach internal services; hosts in
//! `SUBAGENTS_FETCH_DENY` are always refused. Size and time are capped. A replay after a crash
//! fetches the page again (a GET has no side effect by contract).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Value, json};

use super::{Tool, ToolCtx, ToolError, spec, str_arg};
use crate::model::ToolSpec;

/// Redirects followed before giving up.
const MAX_REDIRECTS: usize = 5;

/// Who `web_fetch` may reach, and how much it reads.
#[derive(Clone, Debug)]
pub struct FetchPolicy {
    /// Hosts (names or addresses) allowed even when they resolve to a non-public address.
    pub allow_hosts: Vec<String>,
    /// Hosts always refused.
    pub deny_hosts: Vec<String>,
    /// Bytes of body read at most.
    pub max_bytes: usize,
    /// Time for the whole fetch, redirects included.
    pub timeout: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy { allow_hosts: vec![], deny_hosts: vec![], max_bytes: 2 * 1024 * 1024, timeout: Duration::from_secs(20) }
    }
}

/// Whether an address is one an agent may reach without an allowlist: public unicast only.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (64..128).contains(&o[1])) // shared address space (CGNAT)
                || (o[0] == 198 && (o[1] == 18 || o[1] == 19)) // benchmarking
                || o[0] >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] == 0x2001 && s[1] == 0x0db8)) // documentation
        }
    }
}

/// `web_fetch`.
pub struct WebFetch {
    /// The policy.
    pub policy: FetchPolicy,
}

impl WebFetch {
    /// Resolves `url`'s host and returns the address to connect to, or why not.
    async fn check(&self, url: &reqwest::Url) -> Result<SocketAddr, ToolError> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ToolError::new("bad_url", format!("only http and https URLs can be fetched, not `{}`", url.scheme())));
        }
        let host = url.host_str().ok_or_else(|| ToolError::new("bad_url", "the URL has no host"))?.trim_matches(['[', ']']).to_ascii_lowercase();
        let listed = |list: &[String]| list.iter().any(|h| h.eq_ignore_ascii_case(&host));
        if listed(&self.policy.deny_hosts) {
            return Err(ToolError::new("host_denied", format!("`{host}` is on the operator's deny list")));
        }
        let port = url.port_or_known_default().unwrap_or(80);
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| ToolError::new("fetch_failed", format!("cannot resolve `{host}`: {e}")))?
            .collect();
        let first = *addrs.first().ok_or_else(|| ToolError::new("fetch_failed", format!("`{host}` has no address")))?;
        if !listed(&self.policy.allow_hosts) {
            if let Some(bad) = addrs.iter().find(|a| !is_public(a.ip())) {
                return Err(ToolError::new(
                    "private_address",
                    format!("`{host}` resolves to {}, a private or local address; fetching it is not allowed (an operator can allow the host with SUBAGENTS_FETCH_ALLOW)", bad.ip()),
                ));
            }
        }
        Ok(first)
    }

    async fn fetch(&self, start: &str) -> Result<String, ToolError> {
        let mut url = reqwest::Url::parse(start).map_err(|e| ToolError::new("bad_url", format!("`{start}` is not a URL: {e}")))?;
        for _ in 0..=MAX_REDIRECTS {
            let addr = self.check(&url).await?;
            let host = url.host_str().unwrap_or_default().trim_matches(['[', ']']).to_owned();
            // Pinned to the checked address, and no automatic redirects: each hop is checked.
            let client = reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .resolve(&host, addr)
                .timeout(self.policy.timeout)
                .user_agent("subagents-web-fetch/1")
                .build()
                .map_err(|e| ToolError::new("fetch_failed", e.to_string()))?;
            let resp = client.get(url.clone()).send().await.map_err(|e| ToolError::new("fetch_failed", format!("{url}: {e}")))?;
            if resp.status().is_redirection() {
                let to = resp
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .ok_or_else(|| ToolError::new("fetch_failed", format!("{url}: a redirect without a Location")))?;
                url = url.join(to).map_err(|e| ToolError::new("bad_url", format!("redirect to `{to}`: {e}")))?;
                continue;
            }
            let status = resp.status();
            let kind = resp.headers().get(reqwest::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_ascii_lowercase();
            let mut body = Vec::new();
            let mut stream = resp.bytes_stream();
            let mut cut = false;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| ToolError::new("fetch_failed", format!("{url}: {e}")))?;
                let room = self.policy.max_bytes - body.len();
                if chunk.len() > room {
                    body.extend_from_slice(&chunk[..room]);
                    cut = true;
                    break;
                }
                body.extend_from_slice(&chunk);
            }
            let text = if kind.contains("html") || (kind.is_empty() && looks_like_html(&body)) {
                html2text::from_read(&body[..], 100).map_err(|e| ToolError::new("fetch_failed", format!("{url}: unreadable HTML: {e}")))?
            } else if kind.starts_with("text/") || kind.contains("json") || kind.contains("xml") || kind.is_empty() {
                String::from_utf8_lossy(&body).into_owned()
            } else {
                return Err(ToolError::new("not_text", format!("{url} is `{kind}`, not a text page")));
            };
            let mut out = format!("URL: {url}\nStatus: {}\n\n{}", status.as_u16(), text.trim());
            if cut {
                out.push_str(&format!("\n[page cut at {} bytes]", self.policy.max_bytes));
            }
            return Ok(out);
        }
        Err(ToolError::new("too_many_redirects", format!("more than {MAX_REDIRECTS} redirects from {start}")))
    }
}

fn looks_like_html(body: &[u8]) -> bool {
    let head = String::from_utf8_lossy(&body[..body.len().min(512)]).to_ascii_lowercase();
    head.contains("<html") || head.contains("<!doctype html")
}

#[async_trait]
impl Tool for WebFetch {
    fn spec(&self) -> ToolSpec {
        spec(
            "web_fetch",
            "Fetches a web page (http or https) and returns it as readable text. Redirects are followed; local and private network addresses are refused. `prompt` says what you are looking for: the whole page text comes back, so read it with that in mind.",
            json!({"type":"object","properties":{"url":{"type":"string"},"prompt":{"type":"string"}},"required":["url"]}),
        )
    }
    async fn call(&self, args: Value, _: &ToolCtx) -> Result<String, ToolError> {
        let url = str_arg(&args, "url")?.to_owned();
        tokio::time::timeout(self.policy.timeout, self.fetch(&url))
            .await
            .map_err(|_| ToolError::new("fetch_timeout", format!("{url} did not answer within {}s", self.policy.timeout.as_secs_f64())))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_pass() {
        for ip in ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "100.64.0.1", "::1", "fe80::1", "fd00::1", "::ffff:127.0.0.1", "224.0.0.1"] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
    }

    #[tokio::test]
    async fn local_and_odd_urls_are_refused_without_connecting() {
        let f = WebFetch { policy: FetchPolicy::default() };
        let ctx = ToolCtx::new("/nonexistent", "k", 1000);
        for (url, code) in [
            ("http://127.0.0.1:9/", "private_address"),
            ("http://localhost/", "private_address"),
            ("http://169.254.169.254/latest/meta-data", "private_address"),
            ("http://[::1]/", "private_address"),
            ("file:///etc/passwd", "bad_url"),
            ("not a url", "bad_url"),
        ] {
            let e = f.call(json!({"url": url}), &ctx).await.unwrap_err();
            assert_eq!(e.code, code, "{url}: {e}");
        }
        let denied = WebFetch { policy: FetchPolicy { deny_hosts: vec!["example.org".into()], ..Default::default() } };
        assert_eq!(denied.call(json!({"url": "https://example.org/"}), &ctx).await.unwrap_err().code, "host_denied");
    }
}
