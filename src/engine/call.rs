//! What wraps every model call of the step loop: the fleet's rate budgets before it (a call
//! that may not go parks the run, holding no slot), and after it the provider's word on its
//! limits; around it the `chat` span, the metrics and the token deltas for watchers.

use tracing::{Instrument, info_span};

use super::attempt::Attempt;
use super::{End, Engine, Flow};
use crate::budget::Admission;
use crate::delegation::Wait;
use crate::model::{ChatRequest, ChatResponse, Message, ModelError};

impl Engine {
    /// Takes the call's share of the owner's and the model's budgets, or parks the run until
    /// they free up.
    pub(super) async fn admit(&self, a: &Attempt<'_>, forced: bool) -> Flow {
        let estimate = || {
            let messages = a.ctx.messages(&a.agent.system_prompt, a.run.id);
            a.window.estimate(&messages, a.tools_now(forced)).0 as u64
        };
        let limits = &self.settings.rate_limits;
        let admission = self
            .budgets
            .admit(limits, &a.run.owner, &a.model, estimate)
            .await?;
        let Admission::Wait { until, provider } = admission else {
            return Ok(());
        };
        metrics::counter!("subagents_rate_limited_total").increment(1);
        if provider {
            tracing::info!(model = %a.model, wake_at = until, "the provider said the model's rate limit is used up; parking until it resets");
        } else {
            tracing::info!(model = %a.model, owner = %a.run.owner, wake_at = until, "a rate limit is used up; parking until it frees up");
        }
        Err(End::Park(Wait::rate_limited(until)))
    }

    /// One model call, traced (`chat`, by the OpenTelemetry GenAI conventions) and counted, its
    /// text streamed to watchers as it comes. Returns the answer (with NUL characters
    /// scrubbed) and how long it took, or the model's error for the loop to decide on.
    pub(super) async fn call_model(
        &self,
        a: &Attempt<'_>,
        step: u32,
        messages: Vec<Message>,
        forced: bool,
        estimate: usize,
        after: Option<tokio::sync::oneshot::Receiver<()>>,
    ) -> Flow<Result<(ChatResponse, u64), ModelError>> {
        let req = ChatRequest {
            model: a.model.clone(),
            messages,
            tools: a.tools_now(forced).to_vec(),
            step_key: format!("{}:{}", a.run.id, step),
            response_format: a.run.limits.output.as_ref().map(|o| o.response_format()),
        };
        let t0 = std::time::Instant::now();
        // Deltas follow the run's latest durable event (this step's `step.started`): known
        // here when this process committed it, else read beside the call. `after` is the
        // commit carrying that event when it goes beside the call: numbered once it landed.
        let deltas = self.deltas.as_ref().map(|r| {
            let (store, run) = (self.store.clone(), a.run.id);
            let known = store.latest_seq(run);
            let seq = async move {
                let known = match after {
                    Some(landed) => {
                        landed.await.ok()?;
                        store.latest_seq(run)
                    }
                    None => known,
                };
                if known.is_some() {
                    return known;
                }
                match store.get_run(run).await {
                    Ok(r) => Some(r.map_or(0, |r| r.event_seq)),
                    Err(e) => {
                        tracing::debug!(error = %e, "could not read the run's latest event");
                        None
                    }
                }
            };
            r.delta_sink(a.run.id, seq)
        });
        // In this process only while someone listens (a client may come mid-call); the
        // fragment's JSON is built once for both.
        let on_delta = |d: crate::model::Delta<'_>| {
            let live = self.live.listened(a.run.id).then_some(&self.live);
            if deltas.is_none() && live.is_none() {
                return;
            }
            let mut data = d.to_json();
            data["step"] = serde_json::json!(step);
            data["run_id"] = serde_json::json!(a.run.id);
            if let Some(r) = &deltas {
                r.send(&data.to_string());
            }
            if let Some(hub) = live {
                hub.publish(a.run.id, data);
            }
        };
        let provider = self.settings.routes.provider(&req.model).as_str();
        let chat = chat_span(a, &req, step, provider);
        let resp = self
            .model
            .complete(&req, &on_delta)
            .instrument(chat.clone())
            .await;
        record(&chat, &resp);
        if let Some(d) = deltas {
            d.finish().await;
        }
        let resp = match resp {
            Ok(r) => r.scrubbed(),
            Err(e) => return Ok(Err(e)),
        };
        let ms = t0.elapsed().as_millis() as u64;
        metrics::histogram!("subagents_model_call_seconds").record(t0.elapsed().as_secs_f64());
        metrics::counter!("subagents_tokens_total", "kind" => "prompt")
            .increment(resp.usage.prompt_tokens);
        metrics::counter!("subagents_tokens_total", "kind" => "completion")
            .increment(resp.usage.completion_tokens);
        metrics::counter!("subagents_tokens_total", "kind" => "cache_read")
            .increment(resp.usage.cache_read_tokens);
        metrics::counter!("subagents_tokens_total", "kind" => "cache_write")
            .increment(resp.usage.cache_write_tokens);
        tracing::info!(
            ms,
            tool_calls = resp.tool_calls.len(),
            estimated_tokens = estimate,
            gen_ai.usage.input_tokens = resp.usage.prompt_tokens,
            gen_ai.usage.output_tokens = resp.usage.completion_tokens,
            gen_ai.usage.cache_read.input_tokens = resp.usage.cache_read_tokens,
            gen_ai.usage.cache_creation.input_tokens = resp.usage.cache_write_tokens,
            "model responded"
        );
        Ok(Ok((resp, ms)))
    }

    /// The provider says this call used up the model's budget: the fleet waits for the reset
    /// instead of provoking 429s.
    pub(super) async fn heed_reset(&self, model: &str, resp: &ChatResponse) {
        let Some(reset) = resp.budget_resets_in else {
            return;
        };
        let at = crate::store::now_ms() + reset.as_millis().min(i64::MAX as u128 / 2) as i64;
        if let Err(e) = self.budgets.block(&format!("model:{model}"), at).await {
            tracing::warn!(error = %e, "could not record the provider's rate-limit reset");
        }
    }
}

fn chat_span(a: &Attempt<'_>, req: &ChatRequest, step: u32, provider: &str) -> tracing::Span {
    info_span!(
        "chat",
        otel.name = format!("chat {}", req.model),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = provider,
        gen_ai.request.model = %req.model,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.usage.cache_read.input_tokens = tracing::field::Empty,
        gen_ai.usage.cache_creation.input_tokens = tracing::field::Empty,
        gen_ai.response.finish_reasons = tracing::field::Empty,
        error.r#type = tracing::field::Empty,
        run_id = %a.run.id,
        thread_id = %a.run.thread_id,
        step,
    )
}

fn record(chat: &tracing::Span, resp: &Result<ChatResponse, ModelError>) {
    match resp {
        Ok(r) => {
            chat.record("gen_ai.usage.input_tokens", r.usage.prompt_tokens);
            chat.record("gen_ai.usage.output_tokens", r.usage.completion_tokens);
            chat.record(
                "gen_ai.usage.cache_read.input_tokens",
                r.usage.cache_read_tokens,
            );
            chat.record(
                "gen_ai.usage.cache_creation.input_tokens",
                r.usage.cache_write_tokens,
            );
            if let Some(f) = &r.finish_reason {
                chat.record("gen_ai.response.finish_reasons", f.as_str());
            }
        }
        Err(e) => {
            chat.record("otel.status_code", "ERROR");
            chat.record("error.type", e.kind());
        }
    }
}
