//! The history [`super::Harness::seed_history`] writes for the dashboard benchmark: finished
//! runs spread over a month, one in a hundred within the last hour.

use chrono::{DateTime, Utc};

/// One seeded run: id, thread, created, finished, status, error kind, within the last hour.
pub(crate) type SeedRow = (
    String,
    String,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    &'static str,
    Option<&'static str>,
    bool,
);

/// Rows for [`super::Harness::seed_history`]: runs `first..first + n`, one in a hundred recent.
pub(crate) fn seed_rows(first: u32, n: u32, now: DateTime<Utc>) -> Vec<SeedRow> {
    use rand::Rng;
    let mut rng = rand::rng();
    let mut rows = Vec::with_capacity(n as usize);
    for i in 0..n {
        let recent = (first + i).is_multiple_of(100);
        let age_ms: i64 = if recent {
            rng.random_range(0..3_600_000)
        } else {
            rng.random_range(3_600_000..30 * 86_400_000)
        };
        let created = now - chrono::Duration::milliseconds(age_ms);
        let mut random = [0u8; 10];
        rng.fill(&mut random);
        let id =
            uuid::Builder::from_unix_timestamp_millis(created.timestamp_millis() as u64, &random)
                .into_uuid()
                .to_string();
        let roll: u32 = rng.random_range(0..100);
        let (status, kind) = match roll {
            0 => ("queued", None),
            1..=2 => ("cancelled", None),
            3..=8 => (
                "failed",
                Some(["model", "timeout", "tool", "context"][roll as usize % 4]),
            ),
            _ => ("succeeded", None),
        };
        let finished = (status != "queued")
            .then(|| created + chrono::Duration::milliseconds(rng.random_range(500..120_000)));
        rows.push((
            id,
            format!("seed-{}", uuid::Uuid::new_v4().simple()),
            created,
            finished,
            status,
            kind,
            recent,
        ));
    }
    rows
}
