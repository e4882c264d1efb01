//! The HTTP API (`/v1`, JSON): what dashboards, background services and other agents call.
//! Thin by design: every handler validates, calls [`crate::app::App`], and renders a view.

pub mod approvals;
pub mod auth;
mod error;
pub mod overview;
pub mod quota;
pub mod runs;
pub mod schedules;
pub mod system;
pub mod ui;
pub mod views;
pub mod webhooks;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::routing::get;
use serde::de::DeserializeOwned;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use auth::Keys;
pub use error::ApiError;

use crate::app::App;

/// Shared state of the API.
#[derive(Clone)]
pub struct ApiState {
    /// The system.
    pub app: Arc<App>,
    /// Key hashes to owners.
    pub keys: Arc<Keys>,
    /// The reads that answer waits and streams, shared by every wait and stream one commit
    /// wakes ([`runs::RunSnapshot`]).
    pub waits: Arc<crate::notify::SharedReads<crate::ids::RunId, runs::RunSnapshot>>,
    /// Snapshots built once for the waits that timed out together.
    pub views: Arc<crate::notify::SharedReads<crate::ids::RunId, axum::body::Bytes>>,
    /// The overview of each owner with a stream open, computed once for all its streams.
    pub overviews: Arc<overview::Feeds>,
    /// What each key holds open, against its caps.
    pub quotas: Arc<quota::Quotas>,
}

/// `Json` whose rejections become [`ApiError`]s with stable codes. A body that holds a NUL
/// character (`\u0000`) anywhere is refused (422 `nul_character`): no database text can store
/// it, and a request that can never be stored must not look like a passing outage.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !json_content_type(req.headers()) {
            return Err(ApiError::new(
                axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as JSON with Content-Type: application/json",
            ));
        }
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::from(axum::extract::rejection::JsonRejection::from(e)))?;
        if holds_nul_escape(&bytes) {
            return Err(ApiError::new(
                axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                "nul_character",
                "the request holds a NUL character (\\u0000), which cannot be stored; remove it and send the request again",
            ));
        }
        axum::Json::<T>::from_bytes(&bytes)
            .map(|j| ApiJson(j.0))
            .map_err(ApiError::from)
    }
}

/// Whether the request says its body is JSON (`application/json` or `…+json`), as axum's
/// `Json` requires.
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(ct) = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let Some((kind, sub)) = essence.split_once('/') else {
        return false;
    };
    kind == "application" && (sub == "json" || sub.ends_with("+json"))
}

/// Whether JSON text holds the escape `\u0000` (not a literal backslash followed by `u0000`).
fn holds_nul_escape(body: &[u8]) -> bool {
    let needle = b"u0000";
    body.windows(needle.len()).enumerate().any(|(i, w)| {
        w == needle && {
            let slashes = body[..i].iter().rev().take_while(|b| **b == b'\\').count();
            slashes % 2 == 1
        }
    })
}

/// `Query` whose rejections become [`ApiError`]s.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(ApiError::from)
    }
}

/// The documented routes: registering a handler and documenting it are one step, so the
/// OpenAPI document cannot drift from what is served.
fn documented_routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(runs::start, runs::list))
        .routes(routes!(runs::start_and_wait))
        .routes(routes!(runs::get))
        .routes(routes!(runs::events))
        .routes(routes!(runs::message))
        .routes(routes!(runs::cancel))
        .routes(routes!(runs::retry))
        .routes(routes!(overview::bulk))
        .routes(routes!(overview::get))
        .routes(routes!(overview::stream))
        .routes(routes!(runs::wait))
        .routes(routes!(approvals::list))
        .routes(routes!(approvals::get, approvals::answer))
        .routes(routes!(system::thread))
        .routes(routes!(system::fork))
        .routes(routes!(system::agents))
        .routes(routes!(system::healthz))
        .routes(routes!(system::readyz))
        .routes(routes!(system::metrics))
        .routes(routes!(webhooks::create, webhooks::list))
        .routes(routes!(webhooks::get, webhooks::update, webhooks::delete))
        .routes(routes!(webhooks::rotate))
        .routes(routes!(webhooks::deliveries))
        .routes(routes!(webhooks::redeliver))
        .routes(routes!(schedules::create, schedules::list))
        .routes(routes!(
            schedules::get,
            schedules::update,
            schedules::delete
        ))
        .routes(routes!(schedules::pause))
        .routes(routes!(schedules::resume))
        .routes(routes!(schedules::trigger))
}

/// The OpenAPI 3.1 document of the API.
pub fn openapi() -> utoipa::openapi::OpenApi {
    documented_routes().into_openapi()
}

#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "subagents", description = "A durable executor for LLM subagent runs. Authenticate with `Authorization: Bearer KEY`."),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// All routes.
pub fn router(state: ApiState) -> Router {
    let body_limit = state.app.settings.max_input_bytes + 64 * 1024;
    let (router, spec) = documented_routes().split_for_parts();
    let spec = Arc::new(spec);
    // MCP clients (streamable HTTP) behind the same keys and owners as the rest of the API.
    let keyless = state.keys.is_empty();
    let mcp = Router::new()
        .nest_service(
            "/mcp",
            crate::mcp_server::http_service(
                state.app.clone(),
                std::time::Duration::from_secs(60),
                keyless,
            ),
        )
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            mcp_owner,
        ));
    router
        .merge(mcp)
        .merge(ui::routes())
        .route("/openapi.json", get(move || async move { axum::Json(spec.as_ref().clone()) }))
        .fallback(|| async { ApiError::new(axum::http::StatusCode::NOT_FOUND, "no_route", "no such endpoint; see /v1/runs, /v1/threads, /v1/approvals, /v1/agents") })
        .method_not_allowed_fallback(|| async { ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this endpoint does not take that method") })
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), local_only_without_keys))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http().make_span_with(|req: &axum::http::Request<_>| {
            let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            tracing::info_span!("http", method = %req.method(), path = %req.uri().path(), request_id = %id)
        }))
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(state)
}

/// Without keys, every request is served as the owner `local` to whoever can reach the port, so
/// only a local `Host` and a local `Origin` (when a browser sends one) are accepted: a page on
/// another site cannot reach the server through a name that resolves to 127.0.0.1 (DNS
/// rebinding), nor call it from the browser of someone who runs it.
async fn local_only_without_keys(
    axum::extract::State(state): axum::extract::State<ApiState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if !state.keys.is_empty() {
        return next.run(req).await;
    }
    let host = req
        .headers()
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let origin = req
        .headers()
        .get(axum::http::header::ORIGIN)
        .map(|o| o.to_str().unwrap_or("?"));
    let origin_ok = origin.is_none_or(|o| {
        o.split_once("://").is_some_and(|(scheme, rest)| {
            matches!(scheme, "http" | "https") && is_local_authority(rest)
        })
    });
    if !is_local_authority(host) || !origin_ok {
        tracing::warn!(
            host,
            origin,
            "refused a request with a non-local Host or Origin (no API keys are configured)"
        );
        return ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "forbidden_host",
            "without API keys this server answers only requests addressed to localhost, 127.0.0.1 or [::1]; configure SUBAGENTS_API_KEYS to serve other hosts",
        )
        .into_response();
    }
    next.run(req).await
}

/// Whether `host[:port]` names this machine by a loopback name or address (or `0.0.0.0`, which
/// a name on another site cannot be made to send).
fn is_local_authority(authority: &str) -> bool {
    let host = match authority.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, port)| {
            if port.chars().all(|c| c.is_ascii_digit()) {
                h
            } else {
                authority
            }
        }),
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified())
}

/// Authenticates an `/mcp` request like any other and hands its owner to the MCP handler.
async fn mcp_owner(
    owner: auth::Owner,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    req.extensions_mut()
        .insert(crate::mcp_server::McpOwner(owner.0));
    next.run(req).await
}

/// A bound server, serving in the background.
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Binds and serves until `shutdown` fires.
    pub async fn start(
        app: Arc<App>,
        keys: Keys,
        bind: SocketAddr,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<Server> {
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        // The owners' concurrency limits from the keys file, for every worker's claims.
        if let Err(e) = app
            .store
            .set_limits("owner:", &keys.owner_limits(app.settings.key_concurrency))
            .await
        {
            tracing::warn!(error = %e, "could not record the owners' concurrency limits");
        }
        // And their model budgets, for every worker's model calls.
        if let Err(e) = app.store.set_owner_budgets(&keys.owner_budgets()).await {
            tracing::warn!(error = %e, "could not record the owners' model budgets");
        }
        let s = &app.settings;
        let quotas = quota::Quotas::new(quota::Limits {
            streams: s.max_streams_per_key,
            waits: s.max_waits_per_key,
            queued: s.max_queued_per_key,
        });
        let router = router(ApiState {
            app,
            keys: Arc::new(keys),
            waits: Default::default(),
            views: Default::default(),
            overviews: Default::default(),
            quotas,
        });
        // `into_make_service` turns every route into a service once; serving the `Router` itself
        // rebuilds the whole route table for each connection and drops it at the end (measured:
        // most of the server's time when a run's end answers 1,000 waits, each its own connection).
        let router = router.into_make_service();
        // Events go out as soon as they are written: without TCP_NODELAY a stream's next small
        // write waits for the peer's acknowledgement of the one before.
        let listener =
            axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "could not set TCP_NODELAY");
                }
            });
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move { shutdown.cancelled().await })
                .await
        });
        Ok(Server { addr, task })
    }

    /// Waits for the server to stop.
    pub async fn join(self) -> std::io::Result<()> {
        self.task.await.unwrap_or(Ok(()))
    }
}
