//! Delegation end to end: a scripted parent (mock-llm script keyed by `MOCK:<name>` in its
//! system prompt) hands work to children that follow SCENARIO lines.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use subagents::app::StartRun;
use subagents::delegation::child_thread;
use subagents::model::Message;
use subagents::model::mock::{Script, ScriptCall, Turn};
use subagents::store::{RunRecord, RunStatus};

use crate::support::*;

pub(crate) fn parent_job(name: &str) -> (String, String) {
    (
        name.to_owned(),
        format!(
            "---\nname: {name}\ndescription: scripted test parent\n---\nYou delegate work to subagents. MOCK:{name}\n"
        ),
    )
}

pub(crate) fn call(name: &str, arguments: Value) -> ScriptCall {
    ScriptCall {
        name: name.into(),
        arguments,
    }
}

pub(crate) fn calls(c: Vec<ScriptCall>) -> Turn {
    Turn {
        content: None,
        tool_calls: c,
    }
}

pub(crate) fn say(text: &str) -> Turn {
    Turn {
        content: Some(text.into()),
        tool_calls: vec![],
    }
}

async fn app_with(
    parent: &str,
    turns: Vec<Turn>,
    tweak: Box<dyn FnOnce(&mut subagents::config::Settings)>,
) -> TestApp {
    let t = spawn_app_with(Options {
        jobs: vec![parent_job(parent)],
        tweak,
        ..Default::default()
    })
    .await;
    t.mock
        .state
        .set_script(Script::from([(parent.to_owned(), turns)]));
    t
}

pub(crate) async fn start_parent(t: &TestApp, agent: &str) -> RunRecord {
    t.app
        .start_run(StartRun {
            agent: Some(agent.into()),
            input: "Coordinate the work.".into(),
            ..Default::default()
        })
        .await
        .unwrap()
}

/// The parent's tool results, parsed, in call order (as the model sees them).
pub(crate) async fn tool_results(t: &TestApp, run: &RunRecord) -> Vec<Value> {
    let history = t
        .app
        .store
        .thread_messages(&run.thread_id, 100_000)
        .await
        .unwrap();
    subagents::engine::context(&history, run.id)
        .into_iter()
        .filter_map(|m| match m {
            Message::Tool { content, .. } => {
                Some(serde_json::from_str(&content).unwrap_or(Value::String(content)))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_task_continues_a_childs_thread_by_the_short_id_it_returned() {
    let t = app_with(
        "p-cont",
        vec![
            calls(vec![call("task", json!({"description": "First part.\nSCENARIO steps=2 run=part1", "subagent": "general-purpose"}))]),
            calls(vec![call("task", json!({"description": "Second part.\nSCENARIO steps=2 run=part2", "subagent": "general-purpose", "thread_id": "{{last:thread_id}}"}))]),
            say("both parts done"),
        ],
        Box::new(|_| {}),
    )
    .await;
    let parent = start_parent(&t, "p-cont").await;
    assert_eq!(t.wait(parent.id).await.status, RunStatus::Succeeded);
    let kids = t.app.store.children(parent.id).await.unwrap();
    assert_eq!(kids.len(), 2);
    assert_eq!(
        kids[0].thread_id, kids[1].thread_id,
        "the second task continued the first one's thread"
    );
    let results = tool_results(&t, &parent).await;
    assert!(
        results[0]["thread_id"]
            .as_str()
            .unwrap()
            .starts_with("sub_general-purpose_"),
        "{}",
        results[0]
    );
    assert_eq!(results[1]["result"], "DONE after 2 steps");
}

#[tokio::test]
async fn task_runs_a_child_and_returns_only_its_final_text() {
    let t = app_with(
        "p-task",
        vec![
            calls(vec![call("task", json!({"description": "Child work.\nSCENARIO steps=3 run=c1", "subagent": "general-purpose"}))]),
            say("parent done"),
        ],
        Box::new(|_| {}),
    )
    .await;
    let parent = start_parent(&t, "p-task").await;
    let done = t.wait(parent.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("parent done"));
    let children = t.app.store.children(parent.id).await.unwrap();
    assert_eq!(children.len(), 1);
    let child = &children[0];
    assert_eq!(child.status, RunStatus::Succeeded);
    assert_eq!(
        child.thread_id,
        child_thread(&parent.thread_id, parent.id, "call_1_1", "general-purpose")
    );
    assert!(
        child
            .thread_id
            .as_str()
            .starts_with(&format!("{}_sub_general-purpose_", parent.thread_id))
    );
    assert_eq!(child.tree.depth, 1);
    assert_eq!(child.tree.root_run_id, Some(parent.id));
    let results = tool_results(&t, &parent).await;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["result"], "DONE after 3 steps");
    // The short form, within the parent's thread (task accepts it back to continue it).
    assert_eq!(
        format!(
            "{}_{}",
            parent.thread_id,
            results[0]["thread_id"].as_str().unwrap()
        ),
        child.thread_id.as_str()
    );
    // The parent parked while the child ran, and heard about it.
    let events = t.events(parent.id).await;
    assert_gap_free(&events, RunStatus::Succeeded);
    let k = kinds(&events);
    for want in [
        "child.started",
        "run.waiting",
        "child.finished",
        "run.resumed",
    ] {
        assert!(k.contains(&want), "{want} missing from {k:?}");
    }
    // The parent's context holds the child's answer, not its 5 intermediate messages.
    let parent_msgs = t
        .app
        .store
        .thread_messages(&parent.thread_id, 100_000)
        .await
        .unwrap();
    assert_eq!(
        parent_msgs.len(),
        4,
        "input, task call, task result, answer"
    );
    // Usage rolls up.
    let (tree, steps) = t.app.store.tree_usage(parent.id).await.unwrap();
    assert_eq!(steps, 2 + 3);
    assert!(tree.total() > done.usage.total());
}

#[tokio::test]
async fn three_children_awaited_on_one_worker_slot() {
    let starts = (1..=3)
        .map(|i| call("subagent_start", json!({"description": format!("Part {i}.\nSCENARIO steps=2 run=w{i}"), "subagent": "general-purpose"})))
        .collect();
    let t = app_with(
        "p-all",
        vec![
            calls(starts),
            calls(vec![call(
                "subagent_await",
                json!({"run_ids": "{{all:run_id}}", "mode": "all"}),
            )]),
            say("all three done"),
        ],
        Box::new(|s| s.concurrency = 1),
    )
    .await;
    let parent = start_parent(&t, "p-all").await;
    let done = t.wait(parent.id).await;
    assert_eq!(
        done.status,
        RunStatus::Succeeded,
        "one slot, parent parked while children ran: {done:?}"
    );
    assert_eq!(done.result.as_deref(), Some("all three done"));
    let children = t.app.store.children(parent.id).await.unwrap();
    assert_eq!(children.len(), 3, "each child started exactly once");
    assert!(children.iter().all(|c| c.status == RunStatus::Succeeded));
    let results = tool_results(&t, &parent).await;
    let awaited = &results[3];
    assert_eq!(awaited["wait_timed_out"], false);
    assert_eq!(awaited["runs"].as_array().unwrap().len(), 3);
    assert!(
        awaited["runs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["status"] == "succeeded" && r["result"] == "DONE after 2 steps")
    );
    let events = t.events(parent.id).await;
    assert_eq!(
        kinds(&events)
            .iter()
            .filter(|k| **k == "child.finished")
            .count(),
        3
    );
}

#[tokio::test]
async fn await_any_status_events_cancel_and_foreign_runs() {
    let t = app_with("p-any", vec![], Box::new(|_| {})).await;
    // A run that is not the parent's child: its id must look like "no such run".
    let stranger = t.run("SCENARIO steps=1 run=stranger").await;
    t.mock.state.set_script(Script::from([(
        "p-any".to_owned(),
        vec![
            calls(vec![
                call("subagent_start", json!({"description": "Fast.\nSCENARIO steps=1 run=fast", "subagent": "general-purpose"})),
                call("subagent_start", json!({"description": "Slow.\nSCENARIO steps=3 latency_ms=4000 run=slow", "subagent": "general-purpose"})),
            ]),
            calls(vec![call("subagent_await", json!({"run_ids": "{{all:run_id}}", "mode": "any", "timeout_s": 30}))]),
            calls(vec![
                call("subagent_status", json!({"run_id": "{{nth:0:run_id}}"})),
                call("subagent_events", json!({"run_id": "{{nth:0:run_id}}", "limit": 50})),
            ]),
            calls(vec![call("subagent_cancel", json!({"run_id": "{{nth:1:run_id}}"}))]),
            calls(vec![
                call("subagent_status", json!({"run_id": stranger.id.to_string()})),
                call("subagent_cancel", json!({"run_id": stranger.id.to_string()})),
                call("subagent_await", json!({"run_ids": [stranger.id.to_string()]})),
            ]),
            say("checked"),
        ],
    )]));
    let parent = start_parent(&t, "p-any").await;
    let done = t.wait(parent.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let r = tool_results(&t, &parent).await;
    // [start fast, start slow, await any, status fast, events fast, cancel slow, 3 x stranger]
    assert_eq!(r.len(), 9, "{r:#?}");
    assert_eq!(r[2]["wait_timed_out"], false);
    let statuses: Vec<&str> = r[2]["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses[0], "succeeded");
    assert_ne!(statuses[1], "succeeded", "any returns at the first end");
    assert_eq!(r[3]["status"], "succeeded");
    assert_eq!(r[3]["result"], "DONE after 1 steps");
    assert!(!r[3]["progress"].as_array().unwrap().is_empty());
    let lines = r[4]["events"].as_array().unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.as_str().unwrap().contains("succeeded")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .all(|l| !l.as_str().unwrap().contains("\"data\"")),
        "compact lines, not envelopes"
    );
    assert!(
        r[5]["result"].as_str().unwrap().starts_with("cancel"),
        "{}",
        r[5]
    );
    for x in &r[6..9] {
        assert!(x.as_str().unwrap().starts_with("error[no_such_run]"), "{x}");
    }
    let slow = r[1]["run_id"].as_str().unwrap().parse().unwrap();
    let slow = t
        .app
        .wait(slow, Duration::from_secs(20))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(slow.status, RunStatus::Cancelled);
    // The stranger was not touched.
    assert_eq!(
        t.app
            .store
            .get_run(stranger.id)
            .await
            .unwrap()
            .unwrap()
            .status,
        RunStatus::Succeeded
    );
}

#[tokio::test]
async fn cancelling_a_parked_parent_cancels_its_attached_children_only() {
    let t = app_with(
        "p-cancel",
        vec![
            calls(vec![
                call("subagent_start", json!({"description": "Attached.\nSCENARIO steps=4 latency_ms=3000 run=att", "subagent": "general-purpose"})),
                call("subagent_start", json!({"description": "Detached.\nSCENARIO steps=2 latency_ms=300 run=det", "subagent": "general-purpose", "detached": true})),
            ]),
            calls(vec![call("subagent_await", json!({"run_ids": "{{all:run_id}}"}))]),
            say("unreachable"),
        ],
        Box::new(|_| {}),
    )
    .await;
    let parent = start_parent(&t, "p-cancel").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while t
        .app
        .store
        .get_run(parent.id)
        .await
        .unwrap()
        .unwrap()
        .status
        != RunStatus::Waiting
    {
        assert!(Instant::now() < deadline, "parent never parked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked = Instant::now();
    t.app.cancel(parent.id).await.unwrap();
    assert_eq!(
        t.app
            .store
            .get_run(parent.id)
            .await
            .unwrap()
            .unwrap()
            .status,
        RunStatus::Cancelled,
        "a parked parent is cancelled at once"
    );
    let children = t.app.store.children(parent.id).await.unwrap();
    let attached = children.iter().find(|c| !c.tree.detached).unwrap();
    let detached = children.iter().find(|c| c.tree.detached).unwrap();
    let a = t
        .app
        .wait(attached.id, Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.status, RunStatus::Cancelled);
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "the running child stopped promptly"
    );
    let d = t
        .app
        .wait(detached.id, Duration::from_secs(20))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        d.status,
        RunStatus::Succeeded,
        "detached children outlive their parent"
    );
}

#[tokio::test]
async fn a_parent_that_finishes_cancels_its_running_children() {
    let t = app_with(
        "p-leave",
        vec![
            calls(vec![call("subagent_start", json!({"description": "Long.\nSCENARIO steps=5 latency_ms=2000 run=long", "subagent": "general-purpose"}))]),
            say("leaving without waiting"),
        ],
        Box::new(|_| {}),
    )
    .await;
    let parent = start_parent(&t, "p-leave").await;
    assert_eq!(t.wait(parent.id).await.status, RunStatus::Succeeded);
    let child = t.app.store.children(parent.id).await.unwrap().remove(0);
    let c = t
        .app
        .wait(child.id, Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.status, RunStatus::Cancelled);
}

#[tokio::test]
async fn depth_limit_bad_subagents_and_result_cut() {
    let t = app_with(
        "p-limits",
        vec![
            calls(vec![
                call("task", json!({"description": "x", "subagent": "nobody"})),
                call("task", json!({"subagent": "general-purpose"})),
                call("subagent_start", json!({"description": "x", "subagent": "general-purpose", "thread_id": "someone-elses-thread"})),
            ]),
            calls(vec![call("task", json!({"description": "Long answer.\nSCENARIO steps=1 run=cut", "subagent": "general-purpose"}))]),
            say("ok"),
        ],
        Box::new(|s| s.child_result_limit = 10),
    )
    .await;
    let parent = start_parent(&t, "p-limits").await;
    assert_eq!(t.wait(parent.id).await.status, RunStatus::Succeeded);
    let r = tool_results(&t, &parent).await;
    assert!(
        r[0].as_str()
            .unwrap()
            .starts_with("error[unknown_subagent]"),
        "{}",
        r[0]
    );
    assert!(
        r[1].as_str().unwrap().starts_with("error[bad_arguments]"),
        "{}",
        r[1]
    );
    assert!(
        r[2].as_str().unwrap().starts_with("error[no_such_thread]"),
        "{}",
        r[2]
    );
    let cut = r[3]["result"].as_str().unwrap();
    // Longer than the limit: the head, and the whole text in the workspace.
    assert!(
        cut.starts_with("DONE after") && cut.contains("[result offloaded: it is 18 bytes"),
        "{cut}"
    );
    let child = t
        .app
        .store
        .children(parent.id)
        .await
        .unwrap()
        .into_iter()
        .find(|c| c.status == RunStatus::Succeeded)
        .unwrap()
        .id;
    let path = format!(".results/{child}/result.txt");
    assert!(
        cut.contains(&format!("read_file with path=`{path}`")),
        "{cut}"
    );
    let ws = subagents::tools::owner_workspace(&t.app.settings.workspace, &parent.owner);
    assert!(
        std::fs::read_to_string(ws.join(&path))
            .unwrap()
            .starts_with("DONE after")
    );
    // Children (depth 1) are offered no delegation tools.
    let current = t.app.agents.current();
    let gp = current.get("general-purpose").unwrap();
    assert!(!subagents::delegation::offered(
        gp,
        1,
        &subagents::delegation::DelegationSettings::default()
    ));
    assert!(subagents::delegation::offered(
        gp,
        0,
        &subagents::delegation::DelegationSettings::default()
    ));
}

#[tokio::test]
async fn delegating_keeps_the_parent_context_small() {
    // The same 8-step job, once inline and once delegated with `task`.
    let work = "Collect the figures.\nSCENARIO steps=8 run=ctx";
    let t = app_with(
        "p-ctx",
        vec![
            calls(vec![call(
                "task",
                json!({"description": work, "subagent": "general-purpose"}),
            )]),
            say("summary"),
        ],
        Box::new(|_| {}),
    )
    .await;
    let inline = t.run(work).await;
    let parent = start_parent(&t, "p-ctx").await;
    assert_eq!(t.wait(parent.id).await.status, RunStatus::Succeeded);
    let log = t.mock.state.log();
    let chars = |run: &RunRecord| -> (usize, usize) {
        let mine: Vec<_> = log
            .iter()
            .filter(|e| e.step_key.starts_with(&run.id.to_string()) && e.status == 200)
            .collect();
        (
            mine.first().unwrap().prompt_chars,
            mine.last().unwrap().prompt_chars,
        )
    };
    let (i0, i1) = chars(&inline);
    let (d0, d1) = chars(&parent);
    let inline_gain = (i1 - i0) / 4;
    let delegated_gain = (d1 - d0) / 4;
    println!(
        "context gained by the work: inline ~{inline_gain} tokens, delegated ~{delegated_gain} tokens (chars/4)"
    );
    assert!(
        delegated_gain * 3 < inline_gain,
        "delegation keeps the parent small: {delegated_gain} vs {inline_gain}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_the_parent_waits_and_the_child_runs() {
    let t = spawn_app_with(Options {
        workers: false,
        jobs: vec![parent_job("p-kill")],
        ..Default::default()
    })
    .await;
    t.mock.state.set_script(Script::from([(
        "p-kill".to_owned(),
        vec![
            calls(vec![
                call("subagent_start", json!({"description": "One.\nSCENARIO steps=6 latency_ms=250 run=k1", "subagent": "general-purpose"})),
                call("subagent_start", json!({"description": "Two.\nSCENARIO steps=6 latency_ms=250 run=k2", "subagent": "general-purpose"})),
            ]),
            calls(vec![call("subagent_await", json!({"run_ids": "{{all:run_id}}"}))]),
            say("survived"),
        ],
    )]));
    let parent = start_parent(&t, "p-kill").await;
    let mut first = spawn_worker(t.dir.path(), &t.mock, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let p = t.app.store.get_run(parent.id).await.unwrap().unwrap();
        let kids = t.app.store.children(parent.id).await.unwrap();
        if p.status == RunStatus::Waiting && kids.iter().any(|c| c.step >= 2) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never reached waiting parent + running child"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.kill().unwrap();
    first.wait().unwrap();
    let mut second = spawn_worker(t.dir.path(), &t.mock, &[]);
    let done = t
        .app
        .wait(parent.id, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    assert_eq!(done.result.as_deref(), Some("survived"));
    let kids = t.app.store.children(parent.id).await.unwrap();
    assert_eq!(kids.len(), 2, "each child started exactly once");
    assert!(
        kids.iter().all(|c| c.status == RunStatus::Succeeded
            && c.result.as_deref() == Some("DONE after 6 steps"))
    );
    // No committed model response was asked for twice: at most one in-flight step per run.
    let mut per_run: HashMap<String, usize> = HashMap::new();
    for (key, n) in t.served() {
        if n > 1 {
            *per_run
                .entry(key.split(':').next().unwrap().to_owned())
                .or_default() += 1;
        }
    }
    assert!(per_run.values().all(|n| *n <= 1), "{per_run:?}");
    assert_gap_free(&t.events(parent.id).await, RunStatus::Succeeded);
}

#[tokio::test]
async fn a_tree_budget_on_the_root_forces_the_child_and_the_parent_to_answer() {
    let t = app_with(
        "p-budget",
        vec![calls(vec![call("task", json!({"description": "Endless.\nSCENARIO steps=50 run=budget", "subagent": "general-purpose"}))]), say("never offered tools again")],
        Box::new(|_| {}),
    )
    .await;
    let parent = t
        .app
        .start_run(StartRun {
            agent: Some("p-budget".into()),
            input: "Coordinate.".into(),
            max_total_steps: Some(4),
            ..Default::default()
        })
        .await
        .unwrap();
    let done = t.wait(parent.id).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{done:?}");
    let child = t.app.store.children(parent.id).await.unwrap().remove(0);
    assert_eq!(
        child.limits.max_total_steps,
        Some(4),
        "children inherit the tree budget"
    );
    assert!(child.forced, "the child hit the tree budget: {child:?}");
    assert_eq!(
        child.result.as_deref(),
        Some("FORCED after 3 tool results"),
        "tree steps before child step 4: parent 1 + child 3 = budget, so step 4 is forced"
    );
    assert!(done.forced, "the parent's own last call was forced too");
    let (_, steps) = t.app.store.tree_usage(parent.id).await.unwrap();
    assert_eq!(
        steps,
        1 + 4 + 1,
        "bounded: no step ran past the budget except the forced answers"
    );
}

/// With the workers' poll and the reaper ten minutes apart, runs still start at once: a start
/// in this process wakes its workers, and so does a parent's wake-up when its child ends. A
/// run left for the poll would not end within the wait below. Twenty runs back to back, each
/// started the moment the one before ended, is the pattern that once met a fetch in flight and
/// lost its wake-up. Then a run enqueued on a busy thread, which only the end of the run before
/// it starts.
#[tokio::test]
async fn runs_start_without_waiting_for_the_poll_in_one_process() {
    let t = app_with(
        "p-wake",
        vec![
            calls(vec![call("task", json!({"description": "Child.\nSCENARIO steps=2 run=wake", "subagent": "general-purpose"}))]),
            say("child done"),
        ],
        Box::new(|s| {
            s.poll_ms = 600_000;
            s.reap_ms = 600_000;
        }),
    )
    .await;
    let parent = start_parent(&t, "p-wake").await;
    let ended = t.wait(parent.id).await;
    assert_eq!(
        ended.status,
        RunStatus::Succeeded,
        "the parent and its child ran: {ended:?}"
    );
    for i in 0..20 {
        let r = t.start(&format!("Run {i}.")).await;
        let ended = t.wait(r.id).await;
        assert_eq!(
            ended.status,
            RunStatus::Succeeded,
            "run {i} started without the poll: {ended:?}"
        );
    }
    // A run enqueued behind another on its thread starts when that one ends: the end names it
    // (on SQLite, read in the end's own commit) and its worker pushes its job. Neither the poll
    // nor the reaper would start it within the wait. The run before takes three model calls of
    // a second: the queued run's own job is fetched (and let go, its thread busy) well before
    // that, so only its end can start it.
    let first = t.start("SCENARIO steps=3 latency_ms=1000 run=first").await;
    let behind = t
        .app
        .start_run(StartRun {
            input: "SCENARIO steps=1 run=behind".into(),
            thread_id: Some(first.thread_id.clone()),
            if_busy: subagents::domain::IfBusy::Enqueue,
            ..Default::default()
        })
        .await
        .unwrap();
    let db = sqlx::SqlitePool::connect(&t.app.settings.database_url)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status: String = sqlx::query_scalar("SELECT status FROM Jobs WHERE id = ?")
            .bind(&behind.job_id)
            .fetch_one(&db)
            .await
            .unwrap();
        if status != "Pending" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the queued run's job was never fetched"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = t.app.store.get_run(first.id).await.unwrap().unwrap();
    assert_eq!(
        before.status,
        RunStatus::Running,
        "the run before was still going when the queued run's job was let go"
    );
    let ended = t.wait(behind.id).await;
    assert_eq!(
        ended.status,
        RunStatus::Succeeded,
        "the thread's next run started at the end of the one before: {ended:?}"
    );
    let first = t.wait(first.id).await;
    assert!(
        ended.started_at >= first.finished_at,
        "it ran after the one before"
    );
}

/// A parent's `task` child, started in a process whose worker has a free slot, is handed to
/// that worker as it is written, as an API start is ([`subagents::worker::Local`]): it does not
/// wait for the queue's notification and a fetch. `serve` runs in its own process here, so its
/// `/metrics` count only this test's hand-overs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parents_child_is_handed_to_a_free_worker_of_its_process() {
    use subagents::model::mock::{MockOptions, MockServer};
    let dir = tempfile::tempdir().unwrap();
    let (name, body) = parent_job("p-hand");
    std::fs::create_dir_all(dir.path().join("jobs")).unwrap();
    std::fs::write(dir.path().join("jobs").join(format!("{name}.md")), body).unwrap();
    let mock = MockServer::start(([127, 0, 0, 1], 0).into(), MockOptions::default())
        .await
        .unwrap();
    mock.state.set_script(Script::from_iter([(
        name.clone(),
        vec![
            calls(vec![call(
                "task",
                json!({"description": "Quick.\nSCENARIO steps=1 run=hand", "subagent": "general-purpose"}),
            )]),
            say("parent done"),
        ],
    )]));
    let serve = Logged::spawn(
        process(
            dir.path(),
            &mock,
            &["serve", "--host", "127.0.0.1", "--port", "0"],
        )
        .current_dir(dir.path())
        .env_remove("REDIS_URL")
        .env_remove("SUBAGENTS_API_KEYS")
        .env_remove("SUBAGENTS_KEYS_FILE"),
        "serve",
    );
    let base = serve.listening_on();
    let http = reqwest::Client::new();
    let done: Value = http
        .post(format!("{base}/v1/runs/wait"))
        .json(&json!({"agent": name, "input": "Coordinate the work.", "timeout_s": 60}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(done["status"], "succeeded", "{done}");
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("subagents_jobs_direct_total{via=\"delegation\"} 1"),
        "the child was handed to the worker as it was written, not fetched: {metrics}"
    );
}
