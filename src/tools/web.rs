//! `web_fetch`: a page as readable text. Only `http`/`https`; every hop of a redirect chain is
//! checked again; the host is resolved here and the connection pinned to the address that was
//! checked (so DNS cannot answer differently between the check and the connection). Loopback,
//! private, link-local and other non-public addresses are refused unless the operator allows
//! the host (`SUBAGENTS_FETCH_ALLOW`), so an agent cannot reach internal services; hosts in
//! `SUBAGENTS_FETCH_DENY` are always refused, by name (any case, with or without a trailing
//! dot, and their subdomains) and by the addresses they resolve to. NAT64, 6to4 and
//! IPv4-compatible IPv6 addresses count as the IPv4 address they carry. The proxy variables
//! (`HTTP_PROXY`, …) are ignored: a proxy would connect to whatever it resolves, not to the
//! address that was checked. Size and time are capped, and so is the work of reading a page:
//! HTML is converted off the async threads, and a page too deeply nested or with too many
//! elements (or one whose conversion runs past its budget) is read by a plain linear tag
//! stripper instead. A replay after a crash fetches the page again (a GET has no side effect by
//! contract).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{Value, json};

use super::{ErrorCode, Tool, ToolCtx, ToolError, spec, str_arg};
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
    /// The setting that allows a host, for the refusal's message.
    pub allow_setting: &'static str,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            allow_hosts: vec![],
            deny_hosts: vec![],
            max_bytes: 2 * 1024 * 1024,
            timeout: Duration::from_secs(20),
            allow_setting: "SUBAGENTS_FETCH_ALLOW",
        }
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
            if let Some(v4) = embedded_v4(v6) {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0] == 0x2001 && s[1] == 0) // Teredo: tunnels to any IPv4 address
                || (s[0] == 0x0064 && s[1] == 0xff9b && s[2] == 1)) // local-use NAT64
        }
    }
}

/// The IPv4 address an IPv6 address stands for: mapped (`::ffff:a.b.c.d`), compatible
/// (`::a.b.c.d`), well-known NAT64 (`64:ff9b::a.b.c.d`) and 6to4 (`2002:AABB:CCDD::`).
fn embedded_v4(v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = v6.segments();
    let o = v6.octets();
    let tail = std::net::Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    if s[..6] == [0; 6] && !(s[6] == 0 && s[7] <= 1) {
        return Some(tail);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(tail);
    }
    if s[0] == 0x2002 {
        return Some(std::net::Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

/// A host as the lists compare it: lower case, no brackets, no trailing dot.
fn host_key(h: &str) -> String {
    h.trim_matches(['[', ']'])
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// Whether `host` is `entry` or one of its subdomains (entries compared as [`host_key`]s).
fn listed(list: &[String], host: &str) -> bool {
    list.iter()
        .map(|e| host_key(e.trim()))
        .filter(|e| !e.is_empty())
        .any(|e| host == e || host.ends_with(&format!(".{e}")))
}

/// `web_fetch`.
pub struct WebFetch {
    /// The policy.
    pub policy: FetchPolicy,
}

impl WebFetch {
    /// The guard of webhook destinations: `web_fetch`'s rules with their own allow list
    /// (`SUBAGENTS_WEBHOOK_ALLOW`).
    pub fn webhook_guard(allow_hosts: Vec<String>) -> WebFetch {
        WebFetch {
            policy: FetchPolicy {
                allow_hosts,
                allow_setting: "SUBAGENTS_WEBHOOK_ALLOW",
                ..Default::default()
            },
        }
    }

    /// Resolves `url`'s host and returns the address to connect to, or why not. Webhook
    /// destinations go through the same guard (with their own allow list).
    pub async fn check(&self, url: &reqwest::Url) -> Result<SocketAddr, ToolError> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ToolError::new(
                ErrorCode::BadUrl,
                format!(
                    "only http and https URLs can be fetched, not `{}`",
                    url.scheme()
                ),
            ));
        }
        let host = host_key(
            url.host_str()
                .ok_or_else(|| ToolError::new(ErrorCode::BadUrl, "the URL has no host"))?,
        );
        if host.is_empty() {
            return Err(ToolError::new(ErrorCode::BadUrl, "the URL has no host"));
        }
        if listed(&self.policy.deny_hosts, &host) {
            return Err(ToolError::new(
                ErrorCode::HostDenied,
                format!("`{host}` is on the operator's deny list"),
            ));
        }
        let port = url.port_or_known_default().unwrap_or(80);
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| {
                ToolError::new(
                    ErrorCode::FetchFailed,
                    format!("cannot resolve `{host}`: {e}"),
                )
            })?
            .collect();
        let first = *addrs.first().ok_or_else(|| {
            ToolError::new(ErrorCode::FetchFailed, format!("`{host}` has no address"))
        })?;
        // A denied host under another name, or by its address: compare what both resolve to.
        if !self.policy.deny_hosts.is_empty() {
            let denied = self.denied_addresses().await;
            if let Some(a) = addrs
                .iter()
                .find(|a| denied.contains(&canonical_ip(a.ip())))
            {
                return Err(ToolError::new(
                    ErrorCode::HostDenied,
                    format!(
                        "`{host}` resolves to {}, an address of a host on the operator's deny list",
                        a.ip()
                    ),
                ));
            }
        }
        if !listed(&self.policy.allow_hosts, &host)
            && let Some(bad) = addrs.iter().find(|a| !is_public(a.ip()))
        {
            return Err(ToolError::new(
                ErrorCode::PrivateAddress,
                format!(
                    "`{host}` resolves to {}, a private or local address; fetching it is not allowed (an operator can allow the host with {})",
                    bad.ip(),
                    self.policy.allow_setting
                ),
            ));
        }
        Ok(first)
    }

    /// The addresses the deny list names or resolves to (as [`canonical_ip`]s).
    async fn denied_addresses(&self) -> Vec<IpAddr> {
        let mut out = vec![];
        for entry in &self.policy.deny_hosts {
            let h = host_key(entry.trim());
            if h.is_empty() {
                continue;
            }
            match h.parse::<IpAddr>() {
                Ok(ip) => out.push(canonical_ip(ip)),
                Err(_) => {
                    if let Ok(Ok(found)) = tokio::time::timeout(
                        Duration::from_secs(5),
                        tokio::net::lookup_host((h.as_str(), 80)),
                    )
                    .await
                    {
                        out.extend(found.map(|a| canonical_ip(a.ip())));
                    }
                }
            }
        }
        out
    }

    async fn fetch(&self, start: &str) -> Result<String, ToolError> {
        let mut url = reqwest::Url::parse(start).map_err(|e| {
            ToolError::new(ErrorCode::BadUrl, format!("`{start}` is not a URL: {e}"))
        })?;
        for _ in 0..=MAX_REDIRECTS {
            let addr = self.check(&url).await?;
            let host = url
                .host_str()
                .unwrap_or_default()
                .trim_matches(['[', ']'])
                .to_owned();
            // Pinned to the checked address, and no automatic redirects: each hop is checked.
            let client = reqwest::Client::builder()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .resolve(&host, addr)
                .timeout(self.policy.timeout)
                .user_agent("subagents-web-fetch/1")
                .build()
                .map_err(|e| ToolError::new(ErrorCode::FetchFailed, e.to_string()))?;
            let resp = client
                .get(url.clone())
                .send()
                .await
                .map_err(|e| ToolError::new(ErrorCode::FetchFailed, format!("{url}: {e}")))?;
            if resp.status().is_redirection() {
                let to = resp
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .ok_or_else(|| {
                        ToolError::new(
                            ErrorCode::FetchFailed,
                            format!("{url}: a redirect without a Location"),
                        )
                    })?;
                url = url.join(to).map_err(|e| {
                    ToolError::new(ErrorCode::BadUrl, format!("redirect to `{to}`: {e}"))
                })?;
                continue;
            }
            let status = resp.status();
            let kind = resp
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_ascii_lowercase();
            let mut body = Vec::new();
            let mut stream = resp.bytes_stream();
            let mut cut = false;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk
                    .map_err(|e| ToolError::new(ErrorCode::FetchFailed, format!("{url}: {e}")))?;
                let room = self.policy.max_bytes - body.len();
                if chunk.len() > room {
                    body.extend_from_slice(&chunk[..room]);
                    cut = true;
                    break;
                }
                body.extend_from_slice(&chunk);
            }
            let text = if kind.contains("html") || (kind.is_empty() && looks_like_html(&body)) {
                html_text(body, HTML_BUDGET).await
            } else if kind.starts_with("text/")
                || kind.contains("json")
                || kind.contains("xml")
                || kind.is_empty()
            {
                String::from_utf8_lossy(&body).into_owned()
            } else {
                return Err(ToolError::new(
                    ErrorCode::NotText,
                    format!("{url} is `{kind}`, not a text page"),
                ));
            };
            let mut out = format!("URL: {url}\nStatus: {}\n\n{}", status.as_u16(), text.trim());
            if cut {
                out.push_str(&format!("\n[page cut at {} bytes]", self.policy.max_bytes));
            }
            return Ok(out);
        }
        Err(ToolError::new(
            ErrorCode::TooManyRedirects,
            format!("more than {MAX_REDIRECTS} redirects from {start}"),
        ))
    }
}

/// How long converting one page may take before the plain stripper's text is used instead.
const HTML_BUDGET: Duration = Duration::from_secs(3);
/// Deepest element nesting, and most elements, a page may have for the full converter.
const MAX_HTML_DEPTH: usize = 200;
const MAX_HTML_ELEMENTS: usize = 20_000;

/// A page as readable text, converted on a blocking thread: with `html2text` when the page is
/// of a shape it handles in bounded time, within `budget`; otherwise (or past the budget) with
/// [`strip_tags`], which is linear in the page's size.
pub async fn html_text(body: Vec<u8>, budget: Duration) -> String {
    let body = std::sync::Arc::new(body);
    let shape = html_shape(&body);
    if shape.0 <= MAX_HTML_DEPTH && shape.1 <= MAX_HTML_ELEMENTS {
        let page = body.clone();
        let convert =
            tokio::task::spawn_blocking(move || html2text::from_read(&page[..], 100).ok());
        match tokio::time::timeout(budget, convert).await {
            Ok(Ok(Some(text))) => return text,
            Ok(_) => {}
            Err(_) => tracing::warn!(
                bytes = body.len(),
                "converting a page ran past its budget; using the plain text stripper"
            ),
        }
    } else {
        tracing::info!(
            depth = shape.0,
            elements = shape.1,
            "a page too deep or too large for the HTML converter; using the plain text stripper"
        );
    }
    tokio::task::spawn_blocking(move || strip_tags(&body))
        .await
        .unwrap_or_default()
}

/// Elements that never hold others, so they open no level of nesting.
const VOID: &[&str] = &[
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
    "track", "wbr", "!doctype",
];

/// (deepest nesting, elements) of a page, in one pass.
fn html_shape(body: &[u8]) -> (usize, usize) {
    let (mut depth, mut deepest, mut elements) = (0usize, 0usize, 0usize);
    let mut i = 0;
    while let Some(off) = body[i..].iter().position(|b| *b == b'<') {
        i += off + 1;
        let closing = body.get(i) == Some(&b'/');
        let start = i + usize::from(closing);
        let name_len = body[start..]
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric() || **b == b'!')
            .count();
        if name_len == 0 {
            continue;
        }
        let name = String::from_utf8_lossy(&body[start..start + name_len]).to_ascii_lowercase();
        let end = body[start..]
            .iter()
            .position(|b| *b == b'>')
            .map_or(body.len(), |p| start + p);
        if closing {
            depth = depth.saturating_sub(1);
        } else if !VOID.contains(&name.as_str())
            && !name.starts_with('!')
            && body.get(end.wrapping_sub(1)) != Some(&b'/')
        {
            elements += 1;
            depth += 1;
            deepest = deepest.max(depth);
        } else {
            elements += 1;
        }
        i = end.min(body.len());
    }
    (deepest, elements)
}

/// Text of a page without its markup, in one linear pass: `<script>` and `<style>` dropped,
/// a line break at block elements, the common entities decoded, blank runs collapsed.
pub fn strip_tags(body: &[u8]) -> String {
    let html = String::from_utf8_lossy(body);
    let lower = html.to_ascii_lowercase();
    let mut out = String::with_capacity(html.len() / 2);
    let mut i = 0;
    let bytes = html.as_bytes();
    while i < bytes.len() {
        if bytes[i] == b'<' {
            let rest = &lower[i..];
            let skip_to = |close: &str| {
                rest.find(close)
                    .map_or(bytes.len(), |p| i + p + close.len())
            };
            if rest.starts_with("<!--") {
                i = skip_to("-->");
                continue;
            }
            if rest.starts_with("<script") {
                i = skip_to("</script>");
                continue;
            }
            if rest.starts_with("<style") {
                i = skip_to("</style>");
                continue;
            }
            let end = rest.find('>').map_or(bytes.len(), |p| i + p + 1);
            let name: String = rest[1..]
                .trim_start_matches('/')
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            if matches!(
                name.as_str(),
                "p" | "div"
                    | "br"
                    | "li"
                    | "tr"
                    | "h1"
                    | "h2"
                    | "h3"
                    | "h4"
                    | "h5"
                    | "h6"
                    | "section"
                    | "article"
                    | "table"
                    | "ul"
                    | "ol"
                    | "pre"
                    | "blockquote"
                    | "hr"
            ) {
                out.push('\n');
            } else {
                out.push(' ');
            }
            i = end;
            continue;
        }
        let next = html[i..].find('<').map_or(bytes.len(), |p| i + p);
        out.push_str(&decode_entities(&html[i..next]));
        i = next;
    }
    let mut text = String::with_capacity(out.len());
    let mut blank_lines = 0;
    for line in out.lines() {
        let line = line.split_whitespace().collect::<Vec<_>>().join(" ");
        if line.is_empty() {
            blank_lines += 1;
            if blank_lines > 1 {
                continue;
            }
        } else {
            blank_lines = 0;
        }
        text.push_str(&line);
        text.push('\n');
    }
    text
}

fn decode_entities(s: &str) -> String {
    if !s.contains('&') {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(p) = rest.find('&') {
        out.push_str(&rest[..p]);
        rest = &rest[p..];
        let Some(semi) = rest[..rest.len().min(12)].find(';') else {
            out.push('&');
            rest = &rest[1..];
            continue;
        };
        let name = &rest[1..semi];
        let ch = match name {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" | "#39" => Some('\''),
            "nbsp" => Some(' '),
            n if n.starts_with("#x") || n.starts_with("#X") => u32::from_str_radix(&n[2..], 16)
                .ok()
                .and_then(char::from_u32),
            n if n.starts_with('#') => n[1..].parse().ok().and_then(char::from_u32),
            _ => None,
        };
        match ch {
            Some(c) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// An address with the IPv4 address it stands for unwrapped (see [`embedded_v4`]).
fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map_or(ip, IpAddr::V4),
        v4 => v4,
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
            .map_err(|_| {
                ToolError::new(
                    ErrorCode::FetchTimeout,
                    format!(
                        "{url} did not answer within {}s",
                        self.policy.timeout.as_secs_f64()
                    ),
                )
            })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_pass() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "224.0.0.1",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "::127.0.0.1",
            "::10.0.0.1",
            "2002:7f00:1::",
            "2002:a9fe:a9fe::1",
            "2001:0:4136:e378::1",
            "64:ff9b:1::1",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
    }

    #[tokio::test]
    async fn local_and_odd_urls_are_refused_without_connecting() {
        let f = WebFetch {
            policy: FetchPolicy::default(),
        };
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
        let denied = WebFetch {
            policy: FetchPolicy {
                deny_hosts: vec!["example.org".into(), "127.0.0.9".into()],
                allow_hosts: vec!["localhost".into()],
                ..Default::default()
            },
        };
        for url in [
            "https://example.org/",
            "https://example.org./",
            "https://EXAMPLE.org/",
            "https://www.example.org/",
        ] {
            assert_eq!(
                denied
                    .call(json!({"url": url}), &ctx)
                    .await
                    .unwrap_err()
                    .code,
                "host_denied",
                "{url}"
            );
        }
        // An allowed name that resolves to a denied address is still denied.
        let by_address = WebFetch {
            policy: FetchPolicy {
                deny_hosts: vec!["127.0.0.1".into(), "::1".into()],
                allow_hosts: vec!["localhost".into()],
                ..Default::default()
            },
        };
        assert_eq!(
            by_address
                .call(json!({"url": "http://localhost:9/"}), &ctx)
                .await
                .unwrap_err()
                .code,
            "host_denied"
        );
    }

    #[tokio::test]
    async fn a_page_of_a_million_nested_elements_is_read_in_bounded_time() {
        let mut page = String::from("<html><body>");
        for _ in 0..200_000 {
            page.push_str("<div>");
        }
        page.push_str("deep text");
        let t0 = std::time::Instant::now();
        let text = html_text(page.into_bytes(), Duration::from_secs(3)).await;
        assert!(
            text.contains("deep text"),
            "{}",
            &text[..text.len().min(200)]
        );
        // The converter is not even tried on such a page (the stripper is linear): well under
        // the budget even on a loaded machine.
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        let normal = html_text(b"<html><body><h1>Title</h1><p>Hello &amp; welcome</p><script>x()</script></body></html>".to_vec(), Duration::from_secs(10)).await;
        assert!(
            normal.contains("Title")
                && normal.contains("Hello & welcome")
                && !normal.contains("x()"),
            "{normal}"
        );
        let stripped =
            strip_tags(b"<p>a &lt;b&gt; &#65;&#x42;</p><style>p{}</style><!-- c --><div>d</div>");
        assert_eq!(stripped.trim(), "a <b> AB\n\nd");
    }
}
