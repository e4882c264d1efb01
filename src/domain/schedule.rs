//! Schedules: an agent run on a clock. A schedule's ticks are the instants its cron expression
//! matches in its time zone; each tick fires once (its run's idempotency key is the schedule and
//! the tick), whatever the number of processes and however they crash.
//!
//! Daylight saving follows Vixie cron's rule as `croner` implements it: a fixed-time schedule
//! (`30 2 * * *`) whose wall-clock time falls in the hour that is skipped fires at the first
//! instant after the gap (03:00), and in the hour that happens twice it fires once, at the first
//! occurrence; an interval schedule (`0 * * * *`, `*/10 * * * * *`) fires at each real instant
//! that matches, so the repeated hour's ticks fire in both of its occurrences and the skipped
//! hour has none. Either way no tick is skipped or fired twice.

use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use serde::{Deserialize, Serialize};

use crate::ids::OwnerId;

/// What a tick does when the schedule's previous run is still going.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// The tick starts nothing.
    Skip,
    /// The tick's run queues behind it (on the schedule's thread; on a new thread each time
    /// the runs go side by side).
    Enqueue,
    /// The previous run is cancelled and the tick's starts when it has ended.
    CancelPrevious,
}

/// Which ticks missed while nothing ran (downtime, a pause) still fire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CatchUp {
    /// None: only a tick at most [`GRACE_MS`] old fires.
    None,
    /// The latest missed tick fires, once.
    Last,
    /// Every missed tick fires, the latest [`MAX_CATCH_UP`] at most.
    All,
}

stored_names!(Overlap {
    Skip => "skip",
    Enqueue => "enqueue",
    CancelPrevious => "cancel_previous",
});

stored_names!(CatchUp {
    None => "none",
    Last => "last",
    All => "all",
});

/// How late a tick may fire and still count as on time (not missed).
pub const GRACE_MS: i64 = 60_000;

/// Missed ticks fired at most, with `catch_up: all`.
pub const MAX_CATCH_UP: usize = 100;

/// A schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// `sch_…`.
    pub id: String,
    /// Whose runs it starts.
    pub owner: OwnerId,
    /// The cron expression (five fields, or six with seconds first).
    pub cron: String,
    /// An IANA time zone name.
    pub timezone: String,
    /// The agent its runs run.
    pub agent: String,
    /// Their input.
    pub input: String,
    /// The thread every run continues (`None`: a new thread each time).
    pub thread_id: Option<String>,
    /// What a tick does when the previous run is still going.
    pub overlap: Overlap,
    /// Which missed ticks fire.
    pub catch_up: CatchUp,
    /// Paused schedules fire nothing.
    pub paused: bool,
    /// Caller data given to each run.
    pub metadata: serde_json::Value,
    /// The runs' priority.
    pub priority: u8,
    /// The next tick not fired yet (ms since the epoch).
    pub next_fire_at: i64,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

/// A schedule's parsed clock.
#[derive(Clone, Debug)]
pub struct Clock {
    cron: Cron,
    tz: Tz,
}

impl Clock {
    /// Parses a cron expression (five fields, or six with seconds first) and a time zone.
    pub fn new(cron: &str, timezone: &str) -> Result<Clock, String> {
        let fields = cron.split_whitespace().count();
        if !(5..=6).contains(&fields) {
            return Err(format!(
                "`{cron}` has {fields} fields; a cron expression has five (minute hour day month weekday) or six (seconds first)"
            ));
        }
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(cron)
            .map_err(|e| format!("`{cron}` is not a cron expression: {e}"))?;
        let tz = Tz::from_str(timezone.trim()).map_err(|_| {
            format!("`{timezone}` is not an IANA time zone (like UTC or Europe/Paris)")
        })?;
        Ok(Clock { cron, tz })
    }

    /// The first tick after `after` (ms since the epoch), if the expression matches again.
    pub fn next_after(&self, after: i64) -> Option<i64> {
        // Ticks are whole seconds: search from the second `after` falls in.
        let at =
            DateTime::from_timestamp_millis(after.div_euclid(1000) * 1000)?.with_timezone(&self.tz);
        // In the hour that happens twice, an interval schedule's second occurrence is found
        // only by an iterator started before the first: start an hour and a bit earlier.
        let ambiguous = matches!(
            self.tz.from_local_datetime(&at.naive_local()),
            chrono::LocalResult::Ambiguous(..)
        );
        let start = if ambiguous {
            at - chrono::Duration::minutes(121)
        } else {
            at
        };
        self.cron
            .clone()
            .iter_after(start)
            .take(if ambiguous { 100_000 } else { 2 })
            .map(|t| t.timestamp_millis())
            .find(|t| *t > after)
    }

    /// The next `n` ticks after `after`.
    pub fn upcoming(&self, after: i64, n: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(n);
        let mut t = after;
        while out.len() < n {
            match self.next_after(t) {
                Some(next) => {
                    out.push(next);
                    t = next;
                }
                None => break,
            }
        }
        out
    }

    /// The ticks from `from` (included) to `to` (included), at most `cap` of the latest.
    pub fn between(&self, from: i64, to: i64, cap: usize) -> Vec<i64> {
        let mut out = std::collections::VecDeque::new();
        let mut t = from - 1;
        while let Some(next) = self.next_after(t) {
            if next > to {
                break;
            }
            out.push_back(next);
            if out.len() > cap {
                out.pop_front();
            }
            t = next;
        }
        out.into()
    }
}

/// A new schedule's id.
pub fn new_schedule_id() -> String {
    format!("sch_{}", uuid::Uuid::now_v7().simple())
}

/// The idempotency key of a tick's run: a second firing of the tick is the same start.
pub fn tick_key(schedule: &str, tick: i64) -> String {
    format!("schedule:{schedule}:{tick}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(s: &str) -> i64 {
        DateTime::parse_from_rfc3339(s).unwrap().timestamp_millis()
    }

    fn local(clock: &Clock, t: i64) -> String {
        DateTime::from_timestamp_millis(t)
            .unwrap()
            .with_timezone(&clock.tz)
            .format("%m-%d %H:%M:%S%z")
            .to_string()
    }

    #[test]
    fn five_and_six_fields_parse_and_bad_input_says_why() {
        assert!(Clock::new("*/5 * * * *", "UTC").is_ok());
        assert!(Clock::new("*/10 * * * * *", "Europe/Paris").is_ok());
        assert!(
            Clock::new("* * * *", "UTC")
                .unwrap_err()
                .contains("4 fields")
        );
        assert!(Clock::new("61 * * * *", "UTC").is_err());
        assert!(
            Clock::new("* * * * *", "Mars/Olympus")
                .unwrap_err()
                .contains("IANA")
        );
        let c = Clock::new("*/10 * * * * *", "UTC").unwrap();
        let t0 = ms("2026-01-01T00:00:05Z");
        assert_eq!(c.upcoming(t0, 2), [t0 + 5_000, t0 + 15_000]);
        assert_eq!(
            c.between(ms("2026-01-01T00:00:00Z"), ms("2026-01-01T00:01:00Z"), 100)
                .len(),
            7
        );
        assert_eq!(
            c.between(ms("2026-01-01T00:00:00Z"), ms("2026-01-01T00:01:00Z"), 3),
            [
                ms("2026-01-01T00:00:40Z"),
                ms("2026-01-01T00:00:50Z"),
                ms("2026-01-01T00:01:00Z")
            ]
        );
    }

    #[test]
    fn a_fixed_time_in_the_skipped_hour_fires_after_the_gap_and_once_in_the_repeated_hour() {
        // New York: 2026-03-08 02:00 EST jumps to 03:00 EDT; 2026-11-01 02:00 EDT falls back
        // to 01:00 EST.
        let daily = Clock::new("30 2 * * *", "America/New_York").unwrap();
        let ticks = daily.upcoming(ms("2026-03-06T12:00:00Z"), 4);
        let shown: Vec<String> = ticks.iter().map(|t| local(&daily, *t)).collect();
        assert_eq!(
            shown,
            [
                "03-07 02:30:00-0500",
                "03-08 03:00:00-0400",
                "03-09 02:30:00-0400",
                "03-10 02:30:00-0400"
            ],
            "the skipped 02:30 fires at 03:00, not never"
        );
        let daily = Clock::new("30 1 * * *", "America/New_York").unwrap();
        let ticks = daily.upcoming(ms("2026-10-31T12:00:00Z"), 2);
        let shown: Vec<String> = ticks.iter().map(|t| local(&daily, *t)).collect();
        assert_eq!(
            shown,
            ["11-01 01:30:00-0400", "11-02 01:30:00-0500"],
            "the repeated 01:30 fires once, at its first occurrence"
        );
    }

    #[test]
    fn an_hourly_schedule_fires_once_per_real_hour_across_both_changes() {
        let hourly = Clock::new("0 * * * *", "America/New_York").unwrap();
        // 2026-11-01 local day is 25 hours long; 2026-03-08 is 23.
        let fall = hourly.between(ms("2026-11-01T04:00:00Z"), ms("2026-11-02T04:59:59Z"), 1000);
        assert_eq!(
            fall.len(),
            25,
            "{:?}",
            fall.iter().map(|t| local(&hourly, *t)).collect::<Vec<_>>()
        );
        assert!(
            fall.windows(2).all(|w| w[1] - w[0] == 3_600_000),
            "one an hour"
        );
        let spring = hourly.between(ms("2026-03-08T05:00:00Z"), ms("2026-03-09T03:59:59Z"), 1000);
        assert_eq!(spring.len(), 23);
        assert!(spring.windows(2).all(|w| w[1] - w[0] == 3_600_000));
    }

    #[test]
    fn names_round_trip() {
        for o in Overlap::ALL {
            assert_eq!(Overlap::parse(o.as_str()), Some(o));
            assert_eq!(serde_json::to_value(o).unwrap(), o.as_str());
        }
        for c in CatchUp::ALL {
            assert_eq!(CatchUp::parse(c.as_str()), Some(c));
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        assert_eq!(tick_key("sch_1", 5), "schedule:sch_1:5");
    }
}
