//! Long runs inside their window: compaction as a committed step (and its kills), threads that
//! stay bounded, results too long for the context, the provider's context-length refusals.
//! The mock counts every request with the same tokenizer and refuses one over its window, as
//! a provider does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use subagents::app::{App, StartRun};
use subagents::model::mock::{LogEntry, MockOptions, MockServer};
use subagents::model::{ChatModel, ChatRequest, ChatResponse, DeltaSink, Message, ModelError};
use subagents::store::{ErrorKind, RunStatus};

use crate::support::*;

/// An agent with a small window: 8,000 tokens, compacting at 85 %.
const SMALL: &str = "---\ndescription: compaction test agent\ntools: [echo]\ncontext_window: 8000\nmax_steps: 500\n---\nYou test context compaction. Call echo as the scenario says.";

fn small_agent() -> Vec<(String, String)> {
    vec![("small".into(), SMALL.into())]
}

async fn start_small(
    t: &TestApp,
    input: &str,
    thread: Option<subagents::ids::ThreadId>,
) -> subagents::store::RunRecord {
    t.app
        .start_run(StartRun {
            agent: Some("small".into()),
            input: input.into(),
            thread_id: thread,
            ..Default::default()
        })
        .await
        .unwrap()
}

fn of_scenario<'a>(log: &'a [LogEntry], key: &str) -> Vec<&'a LogEntry> {
    log.iter().filter(|e| e.scenario.contains(key)).collect()
}

#[tokio::test]
async fn a_120_step_run_in_an_8000_token_window_compacts_and_finishes_right() {
    let t = spawn_app_with(Options {
        jobs: small_agent(),
        ..Default::default()
    })
    .await;
    let run = start_small(
        &t,
        "Work through it.\nSCENARIO steps=120 pad=1500 window=8000 run=long",
        None,
    )
    .await;
    let done = t
        .app
        .wait(run.id, Duration::from_secs(240))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    // The mock counts steps through every summary: a lost or doubled step would change this.
    assert_eq!(
        done.result.as_deref(),
        Some("DONE after 120 steps; saw 119 tool results")
    );
    assert_eq!(done.step, 120);

    let log = t.mock.state.log();
    let mine = of_scenario(&log, "run=long");
    assert_eq!(
        mine.len(),
        120,
        "one request per step, none refused or repeated"
    );
    assert!(
        mine.iter().all(|e| e.status == 200),
        "no request was refused"
    );
    let largest = mine.iter().map(|e| e.prompt_tokens).max().unwrap();
    assert!(largest <= 8000, "no request exceeds the window: {largest}");
    let summaries: Vec<&LogEntry> = log
        .iter()
        .filter(|e| e.summary && e.step_key.starts_with(&run.id.to_string()))
        .collect();
    assert!(
        summaries
            .iter()
            .all(|e| e.status == 200 && e.prompt_tokens <= 8000),
        "summary requests fit too"
    );

    // Every compaction is committed once, in order, over ranges that never overlap.
    let compactions = t.app.store.compactions(&run.thread_id).await.unwrap();
    eprintln!(
        "120 steps: {} compactions, largest request {largest} tokens",
        compactions.len()
    );
    assert!(compactions.len() >= 5, "{} compactions", compactions.len());
    assert_eq!(
        summaries.len(),
        compactions.len(),
        "each range summarised once"
    );
    for pair in compactions.windows(2) {
        assert!(
            pair[1].first_message_id > pair[0].last_message_id,
            "{pair:?}"
        );
    }
    for c in &compactions {
        assert!(c.tokens_after < c.tokens_before, "{c:?}");
        assert!(c.summary.starts_with("MOCK SUMMARY steps="), "{c:?}");
    }
    let events = t.events(run.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    let compacted: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "context.compacted")
        .collect();
    assert_eq!(compacted.len(), compactions.len());
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == "context.compacting")
            .count(),
        compactions.len()
    );
    let first = &compacted[0].data;
    assert_eq!(first["reason"], "threshold");
    // The summary calls are model calls: their tokens count in the run's usage, as the
    // provider reported them, with every step's.
    assert_eq!(
        first["usage"]["prompt_tokens"].as_u64(),
        Some(summaries[0].prompt_tokens),
        "{first}"
    );
    let billed: u64 = mine
        .iter()
        .chain(summaries.iter())
        .map(|e| e.prompt_tokens)
        .sum();
    assert_eq!(
        done.usage.prompt_tokens, billed,
        "steps' and summaries' prompt tokens"
    );
    assert!(
        first["tokens_before"].as_u64().unwrap() > 6800
            && first["tokens_after"].as_u64().unwrap() < 6800,
        "{first}"
    );
    // The prompt cache keeps what precedes the summary (tools, system prompt, task): more than
    // nothing, less than the new context.
    let kept = first["cache_prefix_tokens"].as_u64().unwrap();
    assert!(
        kept > 0 && kept < first["tokens_after"].as_u64().unwrap(),
        "{first}"
    );
    assert_eq!(
        first["range"]["first_message_id"],
        compactions[0].first_message_id
    );
    // Nothing is deleted: the thread still holds every message.
    let all = t
        .app
        .store
        .messages_page(&run.thread_id, 0, 10_000)
        .await
        .unwrap();
    assert_eq!(all.len(), 1 + 120 + 119);
}

/// Kills a worker process while it compacts (before or after the commit) and lets another
/// finish the run: no range is summarised into two commits, and a committed one is never
/// asked for again.
/// `database`: `None` for the SQLite file of the test's directory, else a PostgreSQL URL that
/// the app and both workers share.
async fn killed_during_compaction(point: &str, database: Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    std::fs::write(dir.path().join("jobs/small.md"), SMALL).unwrap();
    let mock = MockServer::start(([127, 0, 0, 1], 0).into(), MockOptions::default())
        .await
        .unwrap();
    let mut settings = test_settings(dir.path(), &mock);
    let mut db_env: Vec<(&str, String)> = vec![];
    if let Some(url) = database {
        settings.database_url = url.clone();
        db_env.push(("DATABASE_URL", url));
    }
    let app = App::open(settings).await.unwrap();
    let run = app
        .start_run(StartRun {
            agent: Some("small".into()),
            input: format!("SCENARIO steps=30 pad=1500 window=8000 run={point}"),
            ..Default::default()
        })
        .await
        .unwrap();
    let never = dir.path().join("never");
    let mut env = db_env.clone();
    env.push((
        "SUBAGENTS_FAILPOINTS",
        format!("{point}=wait({})", never.display()),
    ));
    let mut first = spawn_worker(dir.path(), &mock, &env);
    let deadline = Instant::now() + Duration::from_secs(60);
    // Held at the point: the summary was answered; for `after_…` the compaction is committed.
    loop {
        let summarised = mock.state.log().iter().any(|e| e.summary);
        let committed = !app
            .store
            .compactions(&run.thread_id)
            .await
            .unwrap()
            .is_empty();
        if summarised && (point.starts_with("before") || committed) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker never reached {point}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    let at_kill = app.store.compactions(&run.thread_id).await.unwrap();
    assert_eq!(
        at_kill.len(),
        usize::from(point.starts_with("after")),
        "{point}: {at_kill:?}"
    );

    let mut second = spawn_worker(dir.path(), &mock, &db_env);
    let done = app
        .wait(run.id, Duration::from_secs(120))
        .await
        .unwrap()
        .unwrap();
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(
        done.result.as_deref(),
        Some("DONE after 30 steps; saw 29 tool results")
    );

    let compactions = app.store.compactions(&run.thread_id).await.unwrap();
    for pair in compactions.windows(2) {
        assert!(
            pair[1].first_message_id > pair[0].last_message_id,
            "no range compacted twice: {pair:?}"
        );
    }
    let log = mock.state.log();
    let asked = |key: &str| {
        log.iter()
            .filter(|e| e.summary && e.step_key == key)
            .count()
    };
    let first_key = format!(
        "{}:compact:{}-{}",
        run.id, compactions[0].first_message_id, compactions[0].last_message_id
    );
    if point.starts_with("after") {
        assert_eq!(
            asked(&first_key),
            1,
            "a committed compaction is never redone"
        );
    } else {
        // The answer the dead worker got was never committed: asked again once, committed once.
        assert_eq!(asked(&first_key), 2);
    }
    for c in &compactions[1..] {
        assert_eq!(
            asked(&format!(
                "{}:compact:{}-{}",
                run.id, c.first_message_id, c.last_message_id
            )),
            1
        );
    }
    // And no step ran twice: one answered request per step.
    let served = count_served(&log);
    for step in 1..=30 {
        assert_eq!(
            served.get(&format!("{}:{step}", run.id)).copied(),
            Some(1),
            "step {step}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_before_its_compaction_commits_loses_nothing() {
    killed_during_compaction("before_compaction_commit", None).await;
}

/// The same on PostgreSQL, end to end: app and workers on one database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_worker_killed_before_its_compaction_commits_loses_nothing() {
    let url = fresh_postgres_database().await;
    killed_during_compaction("before_compaction_commit", Some(url)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_compaction_commits_does_not_summarise_again() {
    killed_during_compaction("after_compaction_commit", None).await;
}

#[tokio::test]
async fn a_thread_continued_20_times_stays_bounded() {
    let t = spawn_app_with(Options {
        jobs: small_agent(),
        ..Default::default()
    })
    .await;
    let mut thread = None;
    let mut runs = vec![];
    for i in 1..=20 {
        let r = start_small(
            &t,
            &format!("Next part.\nSCENARIO steps=6 pad=1500 window=8000 run=t{i}"),
            thread.clone(),
        )
        .await;
        thread = Some(r.thread_id.clone());
        let done = t.wait(r.id).await;
        assert_eq!(done.status, RunStatus::Succeeded, "run {i}: {done:?}");
        assert_eq!(
            done.result.as_deref(),
            Some("DONE after 6 steps; saw 5 tool results"),
            "run {i}"
        );
        runs.push(done);
    }
    let log = t.mock.state.log();
    let first_request = |i: usize| {
        let key = format!("{}:1", runs[i - 1].id);
        log.iter()
            .find(|e| e.step_key == key && e.status == 200)
            .map(|e| e.prompt_tokens)
            .unwrap()
    };
    let (third, twentieth) = (first_request(3), first_request(20));
    eprintln!(
        "first requests of runs 1..=20: {:?}",
        (1..=20).map(first_request).collect::<Vec<_>>()
    );
    assert!(
        twentieth as f64 <= third as f64 * 1.10,
        "the 20th run starts from {twentieth} tokens, the 3rd from {third}"
    );
    assert!(
        twentieth < 4000,
        "bounded well inside the window: {twentieth}"
    );
    assert!(
        log.iter()
            .all(|e| e.status == 200 && e.prompt_tokens <= 8000)
    );
    let thread = thread.unwrap();
    let compactions = t.app.store.compactions(&thread).await.unwrap();
    assert!(
        compactions.iter().any(|c| c.reason == "new_run"),
        "{compactions:?}"
    );
    // The thread view still pages through everything: 20 runs of input, 6 answers, 5 results.
    let all = t.app.store.messages_page(&thread, 0, 10_000).await.unwrap();
    assert_eq!(all.len(), 20 * 12);
}

/// A tool returning ~1 MB of numbered lines.
struct Lines(usize);

#[async_trait]
impl subagents::tools::Tool for Lines {
    fn spec(&self) -> subagents::model::ToolSpec {
        subagents::model::ToolSpec {
            kind: "function".into(),
            function: subagents::model::FunctionSpec {
                name: "dump".into(),
                description: "returns a lot".into(),
                parameters: serde_json::json!({"type": "object"}),
            },
        }
    }
    async fn call(
        &self,
        _: serde_json::Value,
        _: &subagents::tools::ToolCtx,
    ) -> Result<String, subagents::tools::ToolError> {
        Ok(numbered(self.0))
    }
}

fn numbered(lines: usize) -> String {
    (1..=lines)
        .map(|i| format!("row {i:06} of the export: alpha river stone quiet market\n"))
        .collect()
}

const READER: &str =
    "---\ndescription: reads big things\ntools: [read_file, dump]\n---\nYou read files.";

#[tokio::test]
async fn a_1_mb_file_or_result_is_seen_as_a_head_and_a_path_and_read_through_by_offset() {
    let t = spawn_app_with(Options {
        jobs: vec![("reader".into(), READER.into())],
        tools: Some(tools_with(vec![Arc::new(Lines(18_000))])),
        ..Default::default()
    })
    .await;
    let ws = subagents::tools::owner_workspace(&t.app.settings.workspace, &"local".into());
    std::fs::create_dir_all(&ws).unwrap();
    let text = numbered(18_000);
    assert!(text.len() > 1_000_000, "{}", text.len());
    std::fs::write(ws.join("big.txt"), &text).unwrap();

    for (first, label) in [("big.txt", "file"), ("tool:dump", "tool")] {
        let r = t
            .app
            .start_run(StartRun {
                agent: Some("reader".into()),
                input: format!("SCENARIO read={first} run={label}"),
                ..Default::default()
            })
            .await
            .unwrap();
        let done = t
            .app
            .wait(r.id, Duration::from_secs(120))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(done.status, RunStatus::Succeeded, "{label}: {done:?}");
        let result = done.result.unwrap();
        assert!(
            result.starts_with("READ DONE")
                && result.ends_with("row 018000 of the export: alpha river stone quiet market"),
            "{label}: {result}"
        );
        let msgs = t
            .app
            .store
            .thread_messages(&r.thread_id, 10_000)
            .await
            .unwrap();
        let results: Vec<&str> = msgs
            .iter()
            .filter_map(|m| match &m.message {
                Message::Tool { content, .. } => Some(content.as_str()),
                _ => None,
            })
            .collect();
        // The first result is a head and a path, never the megabyte.
        let head = results[0];
        assert!(head.len() < 100_000, "{label}: {} bytes", head.len());
        assert!(
            head.contains("read_file with path=`"),
            "{label}: {}",
            &head[head.len().saturating_sub(300)..]
        );
        if label == "tool" {
            assert!(
                head.contains(&format!("[result offloaded: it is {} bytes", text.len())),
                "{}",
                &head[head.len() - 400..]
            );
        } else {
            assert!(
                head.contains(&format!("of `big.txt` ({} bytes)", text.len())),
                "{}",
                &head[head.len() - 300..]
            );
        }
        // Every line was read exactly once, in order, through offsets.
        let rows: Vec<usize> = results
            .iter()
            .skip(usize::from(label == "tool"))
            .flat_map(|r| r.lines())
            .filter_map(|l| l.split_once('\t').map(|(_, line)| line))
            .filter_map(|l| l.strip_prefix("row ").and_then(|r| r[..6].parse().ok()))
            .collect();
        // After an offloaded result, reading starts at the first line its head did not show.
        let head_rows = if label == "tool" {
            head.lines().filter(|l| l.starts_with("row ")).count()
        } else {
            0
        };
        let expected_from = head_rows + 1;
        assert_eq!(
            rows,
            (expected_from..=18_000).collect::<Vec<_>>(),
            "{label}"
        );
        assert!(
            results.len() > 5,
            "{label}: paged in {} reads",
            results.len()
        );
        eprintln!(
            "{label}: {} tool results, head {} bytes, {} compactions",
            results.len(),
            head.len(),
            t.app.store.compactions(&r.thread_id).await.unwrap().len()
        );
        let largest = t
            .mock
            .state
            .log()
            .iter()
            .filter(|e| e.scenario.contains(&format!("run={label}")))
            .map(|e| e.prompt_tokens)
            .max()
            .unwrap();
        assert!(largest < 128_000, "{label}: {largest}");
    }
}

/// A provider that refuses every compaction request (as a broken summariser would).
struct NoSummaries(Arc<dyn ChatModel>);

#[async_trait]
impl ChatModel for NoSummaries {
    async fn complete(
        &self,
        req: &ChatRequest,
        on_delta: DeltaSink<'_>,
    ) -> Result<ChatResponse, ModelError> {
        let is_summary = req.messages.iter().any(|m| matches!(m, Message::System { content } if content.contains(subagents::model::compact::REQUEST_MARKER)));
        if is_summary {
            return Err(ModelError::Exhausted {
                attempts: 5,
                last: "HTTP 503: overloaded".into(),
            });
        }
        self.0.complete(req, on_delta).await
    }
}

#[tokio::test]
async fn three_failed_compactions_fail_the_run_with_kind_context_and_lose_nothing() {
    let t = spawn_app_with(Options {
        jobs: small_agent(),
        wrap_model: Some(|m| Arc::new(NoSummaries(m))),
        ..Default::default()
    })
    .await;
    let run = start_small(&t, "SCENARIO steps=60 pad=1500 run=nosum", None).await;
    let done = t.wait(run.id).await;
    assert_eq!(done.status, RunStatus::Failed);
    let e = done.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Context);
    assert!(
        e.message.contains("3 compactions in a row failed") && e.message.contains("503"),
        "{}",
        e.message
    );
    let events = t.events(run.id).await;
    assert_gap_free(&events, RunStatus::Failed);
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == "context.compacting")
            .count(),
        3
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == "context.compacted")
            .count(),
        0
    );
    // Every step it took is still committed.
    let msgs = t
        .app
        .store
        .thread_messages(&run.thread_id, 10_000)
        .await
        .unwrap();
    assert_eq!(msgs.len() as u32, 1 + 2 * done.step);
}

#[tokio::test]
async fn a_provider_refusing_a_request_as_too_long_gets_a_compaction_and_a_retry() {
    // The agent believes in 16,000 tokens; the provider holds 6,000.
    let big = SMALL.replace("context_window: 8000", "context_window: 16000");
    let t = spawn_app_with(Options {
        jobs: vec![("small".into(), big)],
        ..Default::default()
    })
    .await;
    let run = start_small(
        &t,
        "SCENARIO steps=40 pad=1500 window=6000 run=refused",
        None,
    )
    .await;
    let done = t.wait(run.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(
        done.result.as_deref(),
        Some("DONE after 40 steps; saw 39 tool results")
    );
    let log = t.mock.state.log();
    let refused = of_scenario(&log, "run=refused")
        .iter()
        .filter(|e| e.status == 400)
        .count();
    assert!(refused >= 1, "the provider refused at least once");
    assert!(
        refused <= 2,
        "after a refusal the estimate is calibrated: {refused} refusals"
    );
    let compactions = t.app.store.compactions(&run.thread_id).await.unwrap();
    eprintln!(
        "refused {refused} times; compactions: {:?}",
        compactions
            .iter()
            .map(|c| (&c.reason, c.tokens_before, c.tokens_after))
            .collect::<Vec<_>>()
    );
    assert_eq!(compactions[0].reason, "context_length");
}

#[tokio::test]
async fn a_prompt_that_alone_overflows_the_window_fails_with_kind_context_at_once() {
    let long_prompt = format!(
        "---\ndescription: d\ntools: [echo]\ncontext_window: 2000\n---\n{}",
        "Rules of the house. ".repeat(800)
    );
    let t = spawn_app_with(Options {
        jobs: vec![("huge".into(), long_prompt)],
        ..Default::default()
    })
    .await;
    let r = t
        .app
        .start_run(StartRun {
            agent: Some("huge".into()),
            input: "SCENARIO steps=3".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let done = t.wait(r.id).await;
    assert_eq!(done.status, RunStatus::Failed);
    let e = done.error.unwrap();
    assert_eq!(e.kind, ErrorKind::Context);
    assert!(
        e.message.contains("holds 2000") && e.message.contains("context_window"),
        "{}",
        e.message
    );
    assert!(
        t.mock.state.log().is_empty(),
        "no request was sent that could not fit"
    );
}

#[tokio::test]
async fn a_compaction_keeps_the_ids_of_children_still_running() {
    use crate::delegation::{call, calls, say, start_parent};
    let job = "---\nname: p-pend\ndescription: scripted parent\ntools: [echo, Task]\ncontext_window: 6000\n---\nYou delegate. MOCK:p-pend\n";
    let t = spawn_app_with(Options {
        jobs: vec![("p-pend".into(), job.into())],
        ..Default::default()
    })
    .await;
    let mut turns = vec![calls(vec![call(
        "subagent_start",
        serde_json::json!({"description": "Slow work.\nSCENARIO steps=3 latency_ms=1500 run=slowchild", "subagent": "general-purpose"}),
    )])];
    let filler = "figures from the quarterly report, row by row, with notes. ".repeat(30);
    for i in 0..14 {
        turns.push(calls(vec![call(
            "echo",
            serde_json::json!({"text": format!("{i}: {filler}")}),
        )]));
    }
    turns.push(say("done without waiting"));
    t.mock
        .state
        .set_script(subagents::model::mock::Script::from([(
            "p-pend".to_owned(),
            turns,
        )]));
    let parent = start_parent(&t, "p-pend").await;
    let done = t.wait(parent.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let child = t.app.store.children(parent.id).await.unwrap().remove(0);
    let compactions = t.app.store.compactions(&parent.thread_id).await.unwrap();
    assert!(
        !compactions.is_empty(),
        "the parent compacted while its child ran"
    );
    // The first compaction replaced the subagent_start result, and its summary names the child.
    let first = &compactions[0];
    assert!(
        first.summary.contains(&format!("run_id {}", child.id)),
        "{}",
        first.summary
    );
    assert!(first.summary.contains("still running"), "{}", first.summary);
}
