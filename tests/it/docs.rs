//! The reference pages against the code: a setting, a route or an event type that the code has
//! and its page does not name fails here, so the pages cannot fall behind.

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
