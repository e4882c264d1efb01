//! The reference pages against the code: a setting, a route, an event type or a state
//! transition that the code has and its page does not show fails here, so the pages cannot fall
//! behind.

use std::path::Path;

fn page(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("docs")
            .join(name),
    )
    .unwrap()
}

/// Every environment variable a command reads (hidden test knobs aside) has its row in
/// docs/configuration.md.
#[test]
fn every_setting_is_documented() {
    use clap::CommandFactory;
    fn walk(cmd: &clap::Command, out: &mut Vec<String>) {
        for a in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            if let Some(env) = a.get_env() {
                out.push(env.to_string_lossy().into_owned());
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut vars = vec![];
    walk(&subagents::cli::Cli::command(), &mut vars);
    vars.sort();
    vars.dedup();
    assert!(vars.len() > 40, "{vars:?}");
    let doc = page("configuration.md");
    let missing: Vec<&String> = vars
        .iter()
        .filter(|v| !doc.contains(&format!("`{v}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "settings without a row in docs/configuration.md: {missing:?}"
    );
}

/// Every route of the OpenAPI document is in docs/http-api.md.
#[test]
fn every_route_is_documented() {
    let spec = subagents::api::openapi();
    let doc = page("http-api.md");
    let missing: Vec<String> = spec
        .paths
        .paths
        .keys()
        .filter(|p| !doc.contains(p.as_str()))
        .cloned()
        .collect();
    assert!(
        missing.is_empty(),
        "routes not in docs/http-api.md: {missing:?}"
    );
}

/// Every durable event type has its row in the events table of docs/design.md, and the row
/// names every field of its payload (from `Event::samples`, every optional field set).
#[test]
fn every_event_type_and_field_is_documented() {
    let doc = page("design.md");
    let mut missing = vec![];
    for e in subagents::domain::Event::samples() {
        let name = e.name();
        let Some(row) = doc
            .lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
        else {
            missing.push(name.to_owned());
            continue;
        };
        let serde_json::Value::Object(fields) = e.data() else {
            panic!("{name}: data is not an object")
        };
        for k in fields.keys() {
            if !row.contains(&format!("`{k}")) {
                missing.push(format!("{name}.{k}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "events or fields not in docs/design.md's events table: {missing:?}"
    );
}

/// The transition table of docs/design.md is the one `lifecycle::next_status` implements, cell
/// for cell: a new status, a new event or a changed move that the page does not show fails here.
#[test]
fn the_transition_table_is_the_state_machines() {
    use subagents::lifecycle::{RunStatus, Terminal, Transition, next_status};
    // The three finishes are one column: `t`, the terminal status the holder names.
    let events: Vec<(&str, Transition)> = Transition::ALL
        .into_iter()
        .filter_map(|t| match t {
            Transition::Finish(Terminal::Succeeded) => Some(("finish(t)", t)),
            Transition::Finish(_) => None,
            t => Some((t.name(), t)),
        })
        .collect();
    let cell = |from: RunStatus, t: Transition| match (t, next_status(from, t)) {
        (_, Err(_)) => "–".to_owned(),
        (Transition::Finish(_), Ok(_)) => "t".to_owned(),
        (_, Ok(to)) => to.as_str().to_owned(),
    };
    let row = |label: &str, from: RunStatus| {
        let cells: Vec<String> = events.iter().map(|(_, t)| cell(from, *t)).collect();
        format!("| {label} | {} |", cells.join(" | "))
    };
    let names: Vec<&str> = events.iter().map(|(n, _)| *n).collect();
    let mut lines = vec![
        format!("| from \\ event | {} |", names.join(" | ")),
        format!("|{}", "---|".repeat(names.len() + 1)),
    ];
    let (ended, live): (Vec<RunStatus>, Vec<RunStatus>) =
        RunStatus::ALL.into_iter().partition(|s| s.is_terminal());
    for s in live {
        lines.push(row(s.as_str(), s));
    }
    // The terminal statuses share one row, which only holds while they allow the same moves.
    let ended_rows: Vec<String> = ended.iter().map(|s| row("", *s)).collect();
    assert!(
        ended_rows.windows(2).all(|w| w[0] == w[1]),
        "{ended_rows:?}"
    );
    let label: Vec<&str> = ended.iter().map(|s| s.as_str()).collect();
    lines.push(row(&label.join(", "), ended[0]));
    let expected = lines.join("\n");
    assert!(
        page("design.md").contains(&expected),
        "docs/design.md's transition table is not lifecycle::next_status's; it should read:\n{expected}"
    );
}

/// Every tool error code has its row in docs/agents.md, with its meaning from the code's doc,
/// and every `error[code]` a source file writes is one of them.
#[test]
fn every_tool_error_code_is_documented() {
    use subagents::tools::ErrorCode;
    let doc = page("agents.md");
    let mut missing = vec![];
    for c in ErrorCode::ALL {
        let row = format!("| `{}` | {} |", c.as_str(), c.meaning());
        if !doc.contains(&row) {
            missing.push(row);
        }
    }
    assert!(
        missing.is_empty(),
        "rows missing from docs/agents.md's tool error codes:\n{}",
        missing.join("\n")
    );
    let known: std::collections::HashSet<&str> =
        ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    let mut files = vec![];
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut dirs = vec![src];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut unknown = vec![];
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let code_lines = text.lines().filter(|l| !l.trim_start().starts_with("//"));
        for line in code_lines {
            for (i, _) in line.match_indices("error[") {
                let code: String = line[i + 6..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !code.is_empty()
                    && line[i + 6 + code.len()..].starts_with(']')
                    && !known.contains(code.as_str())
                {
                    unknown.push(format!("{}: error[{code}]", f.display()));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "codes not in tools::ErrorCode: {unknown:?}"
    );
}
