//! The HTTP API (`/v1`, JSON): what dashboards, background services and other agents call.
//! Thin by design: every handler validates, calls [`crate::app::App`], and renders a view.

pub mod auth;
mod error;
pub mod runs;
pub mod system;
pub mod views;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub use error::ApiError;
use auth::Keys;

use crate::app::App;

/// Shared state of the API.
#[derive(Clone)]
pub struct ApiState {
    /// The system.
    pub app: Arc<App>,
    /// Key hashes to owners.
    pub keys: Arc<Keys>,
}

/// `Json` whose rejections become [`ApiError`]s with stable codes.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        axum::Json::<T>::from_request(req, state).await.map(|j| ApiJson(j.0)).map_err(ApiError::from)
    }
}

/// `Query` whose rejections become [`ApiError`]s.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state).await.map(|q| ApiQuery(q.0)).map_err(ApiError::from)
    }
}

/// All routes.
pub fn router(state: ApiState) -> Router {
    let body_limit = state.app.settings.max_input_bytes + 64 * 1024;
    Router::new()
        .route("/v1/runs", post(runs::start).get(runs::list))
        .route("/v1/runs/wait", post(runs::start_and_wait))
        .route("/v1/runs/{id}", get(runs::get))
        .route("/v1/runs/{id}/events", get(runs::events))
        .route("/v1/runs/{id}/cancel", post(runs::cancel))
        .route("/v1/runs/{id}/wait", get(runs::wait))
        .route("/v1/threads/{id}", get(system::thread))
        .route("/v1/agents", get(system::agents))
        .route("/healthz", get(system::healthz))
        .route("/readyz", get(system::readyz))
        .route("/metrics", get(system::metrics))
        .fallback(|| async { ApiError::new(axum::http::StatusCode::NOT_FOUND, "no_route", "no such endpoint; see /v1/runs, /v1/threads, /v1/agents") })
        .method_not_allowed_fallback(|| async { ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this endpoint does not take that method") })
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(TraceLayer::new_for_http().make_span_with(|req: &axum::http::Request<_>| {
            let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            tracing::info_span!("http", method = %req.method(), path = %req.uri().path(), request_id = %id)
        }))
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(state)
}

/// A bound server, serving in the background.
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Binds and serves until `shutdown` fires.
    pub async fn start(app: Arc<App>, keys: Keys, bind: SocketAddr, shutdown: tokio_util::sync::CancellationToken) -> std::io::Result<Server> {
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let router = router(ApiState { app, keys: Arc::new(keys) });
        let task = tokio::spawn(async move {
            axum::serve(listener, router).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
        });
        Ok(Server { addr, task })
    }

    /// Waits for the server to stop.
    pub async fn join(self) -> std::io::Result<()> {
        self.task.await.unwrap_or(Ok(()))
    }
}
