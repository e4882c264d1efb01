//! The module layering drawn in the README, checked against the code: every `crate::…` path a
//! module uses must name a module of a lower layer, so no import cycle can come back.

use std::collections::HashMap;

/// Bottom layer first; a module may use only modules of lower layers.
const LAYERS: &[&[&str]] = &[
    &[
        "ids",
        "lifecycle",
        "failpoints",
        "config",
        "telemetry",
        "client",
        "policy",
        "secrets",
        "output",
    ],
    &["model", "deltas", "agents", "procs"],
    &["domain"],
    &["notify"],
    &["tools", "store", "mcp"],
    &["events", "hooks", "permissions", "pinning"],
    &["relay", "queue"],
    &["runs", "budget"],
    &["delegation"],
    &["engine"],
    &["worker"],
    &["app"],
    &["mcp_server", "schedules"],
    &["api"],
    &["webhooks"],
    &["bench"],
    &["cli"],
];

fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_module_uses_only_lower_layers() {
    let layer: HashMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(i, ms)| ms.iter().map(move |m| (*m, i)))
        .collect();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = vec![];
    files(&src, &mut all);
    let mut violations = vec![];
    for path in all {
        let rel = path.strip_prefix(&src).unwrap();
        let module = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_str()
            .unwrap()
            .trim_end_matches(".rs")
            .to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let Some(&mine) = layer.get(module.as_str()) else {
            violations.push(format!(
                "module `{module}` is in no layer: add it to LAYERS and to the README"
            ));
            continue;
        };
        let text = std::fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for (i, _) in code.match_indices("crate::") {
                let dep: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if dep == module {
                    continue;
                }
                match layer.get(dep.as_str()) {
                    Some(&theirs) if theirs < mine => {}
                    _ => violations.push(format!(
                        "{}:{}: `{module}` uses `{dep}`",
                        rel.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "layering broken:\n{}",
        violations.join("\n")
    );
}
