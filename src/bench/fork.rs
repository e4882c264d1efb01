//! `subagents bench-fork`: what forking a long thread costs. A fork shares its history through
//! the lineage rather than copying it, so the fork itself should not grow with the thread, and
//! a run on the fork should rebuild its context about as fast as one on the original.

use std::time::Instant;

use serde_json::json;

use crate::config::Settings;
use crate::domain::{IfBusy, NewMessage, NewRun, QueuePlace, RunLimits, TreePosition};
use crate::ids::{OwnerId, RunId, ThreadId};
use crate::model::Message;
use crate::store::{Checkpoint, Claim, ForkAt, Forked};

/// Arguments of `subagents bench-fork`.
#[derive(clap::Args, Debug, Clone)]
pub struct ForkBenchArgs {
    /// Messages in the thread that is forked.
    #[arg(long, default_value_t = 10_000)]
    pub messages: u32,
    /// Forks (and context reads) timed.
    #[arg(long, default_value_t = 50)]
    pub repeat: usize,
    /// Database (a fresh SQLite file in a temporary directory by default).
    #[arg(long, default_value = "")]
    pub dsn: String,
}

/// Seeds a thread of `messages` messages, then times `repeat` forks of it at its middle and at
/// its end, and the context read (the newest 200 messages, as a claim reads it) of the original
/// and of a fork. Prints one JSON line; true when a fork wrote no message row.
pub async fn run(mut settings: Settings, args: ForkBenchArgs) -> anyhow::Result<bool> {
    let dir = super::scratch(&mut settings, "fork", &args.dsn)?;
    let app = crate::app::App::open(settings).await?;
    let store = app.store.clone();
    let owner: OwnerId = crate::app::LOCAL_OWNER.into();
    let thread = ThreadId::generate();
    let run = RunId::new();
    store
        .create_run(NewRun {
            id: run,
            thread_id: thread.clone(),
            owner: owner.clone(),
            agent: "general-purpose".into(),
            input: "bench".into(),
            metadata: json!({}),
            limits: RunLimits {
                max_steps: 10_000,
                timeout_secs: 3600,
                max_total_tokens: None,
                max_total_steps: None,
                compact_at: None,
                output: None,
            },
            parent_run_id: None,
            tree: TreePosition::default(),
            job_id: crate::queue::new_job_id(),
            if_busy: IfBusy::Reject,
            idempotency_key: None,
            retry_of: None,
            priority: 3,
            place: QueuePlace::Back,
            agent_version: None,
            held_by: None,
            max_queued: 0,
        })
        .await?;
    let Claim::Acquired(lease, _) = store
        .claim_run(run, "bench", std::time::Duration::from_secs(600))
        .await?
    else {
        anyhow::bail!("the seeded run could not be claimed");
    };
    let t0 = Instant::now();
    let mut n = 0u32;
    while n < args.messages {
        let batch: Vec<NewMessage> = (n..(n + 200).min(args.messages))
            .map(|i| NewMessage {
                step: i / 2 + 1,
                key: format!("{run}:bench:{i}"),
                message: Message::User {
                    content: format!("message {i}: alpha river stone quiet market"),
                },
            })
            .collect();
        n += batch.len() as u32;
        store
            .checkpoint(
                &lease,
                Checkpoint {
                    messages: batch,
                    ..Default::default()
                },
            )
            .await?;
    }
    let seed_s = t0.elapsed().as_secs_f64();
    eprintln!("seeded {} messages in {seed_s:.1}s", args.messages);
    let history = store.thread_messages(&thread, u32::MAX).await?;
    let middle = history[history.len() / 2].id;
    let before = history.len();
    let time_forks = async |at: ForkAt| -> anyhow::Result<(f64, f64, ThreadId)> {
        let mut samples = vec![];
        let mut last = None;
        for _ in 0..args.repeat.max(1) {
            let fork = ThreadId::generate();
            let t = Instant::now();
            let done = store.fork_thread(&owner, &thread, at, &fork).await?;
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
            anyhow::ensure!(
                matches!(done, Forked::Done { .. }),
                "fork refused: {done:?}"
            );
            last = Some(fork);
        }
        samples.sort_by(f64::total_cmp);
        Ok((
            samples[samples.len() / 2],
            samples[samples.len() - 1],
            last.expect("at least one fork"),
        ))
    };
    let (mid_p50, mid_max, mid_fork) = time_forks(ForkAt::Message(middle)).await?;
    let (end_p50, end_max, _) = time_forks(ForkAt::End).await?;
    // A fork writes no message: the original's history is as long as before.
    let copied = store.thread_messages(&thread, u32::MAX).await?.len() != before;
    let read = async |t: &ThreadId| -> anyhow::Result<(f64, usize)> {
        let mut samples = vec![];
        let mut len = 0;
        for _ in 0..args.repeat.max(1) {
            let t0 = Instant::now();
            let (_, msgs) = store.context(t, 200).await?;
            samples.push(t0.elapsed().as_secs_f64() * 1000.0);
            len = msgs.len();
        }
        samples.sort_by(f64::total_cmp);
        Ok((samples[samples.len() / 2], len))
    };
    let (original_ms, original_len) = read(&thread).await?;
    let (fork_ms, fork_len) = read(&mid_fork).await?;
    let round = |x: f64| (x * 100.0).round() / 100.0;
    let ok = !copied && fork_len == original_len;
    println!(
        "{}",
        json!({
            "bench": "fork",
            "database": crate::app::redact(&app.settings.database_url),
            "messages": args.messages,
            "repeat": args.repeat,
            "seed_s": round(seed_s),
            "fork_at_middle_ms_p50": round(mid_p50),
            "fork_at_middle_ms_max": round(mid_max),
            "fork_at_end_ms_p50": round(end_p50),
            "fork_at_end_ms_max": round(end_max),
            "messages_copied": if copied { "some" } else { "none" },
            "context_read_original_ms_p50": round(original_ms),
            "context_read_fork_ms_p50": round(fork_ms),
            "context_messages": fork_len,
            "ok": ok,
        })
    );
    drop(app);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}
