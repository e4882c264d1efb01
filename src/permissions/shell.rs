//! What a `bash` command runs, for `Bash(…)` rules. The command is parsed as bash parses it
//! (`brush-parser`), and every simple command in it is found wherever it stands: after `;`,
//! `&&`, `||`, `|` or `&`, inside subshells, groups, loops and functions, and inside command and
//! process substitutions.
//!
//! A command is *vetted* when it is nothing but simple commands of literal words joined by those
//! operators: no expansion or substitution (`$x`, `$(…)`, backquotes, arithmetic), no variable
//! assignment, no compound command, no here-document, and no redirection other than duplicating a
//! descriptor or reading or writing `/dev/null`. Only a vetted command can be allowed by a rule
//! with a specifier, and only when every one of its simple commands is (as Claude Code does):
//! `git status; rm -rf x` is two commands, and `Bash(git status:*)` vouches for one.
//!
//! Deny and ask rules match any simple command found, vetted or not, and a few common wrappers
//! (`env`, `command`, `sudo`, `xargs`, `/bin/rm` for `rm`, `bash -c '…'`) are looked through. That
//! is a best effort, not a boundary: a shell can always spell a command another way.

use brush_parser::ast::{
    Command, CommandPrefixOrSuffixItem, CompoundCommand, CompoundList, IoFileRedirectTarget,
    IoRedirect, Pipeline, SimpleCommand, Word,
};
use brush_parser::word::WordPiece;

/// How deep substitutions and `bash -c` strings are followed.
const MAX_NESTING: usize = 8;

/// A bash command, taken apart.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Analysis {
    /// Every simple command found, as its words: unquoted where they are literal, their source
    /// text where they are not.
    pub commands: Vec<Vec<String>>,
    /// Why no rule with a specifier can vouch for the command (`None`: it is vetted).
    pub opaque: Option<String>,
}

impl Analysis {
    fn refuse(&mut self, why: impl Into<String>) {
        if self.opaque.is_none() {
            self.opaque = Some(why.into());
        }
    }
}

/// Takes `command` apart (see the module doc).
pub fn analyze(command: &str) -> Analysis {
    let mut a = Analysis::default();
    walk_source(command, &mut a, 0);
    a
}

/// The forms of one simple command a deny or ask rule is matched against: the command itself,
/// the command with a path's directory dropped from its name (`/bin/rm` → `rm`), and what a
/// wrapper (`env X=1 rm`, `sudo rm`, `command rm`, `xargs rm`, `nohup rm`, `timeout 5 rm`) runs.
pub fn deny_forms(words: &[String]) -> Vec<Vec<String>> {
    let mut out = vec![words.to_vec()];
    let mut cur: &[String] = words;
    for _ in 0..4 {
        let Some(first) = cur.first() else { break };
        let name = first.rsplit('/').next().unwrap_or(first);
        if name != first.as_str() {
            let mut w = cur.to_vec();
            w[0] = name.to_owned();
            out.push(w);
        }
        let wrapped = match name {
            "env" | "sudo" | "command" | "builtin" | "exec" | "nohup" | "time" | "nice"
            | "xargs" | "stdbuf" | "doas" | "setsid" => {
                // Options and (for env) assignments before the command.
                let skip = cur[1..]
                    .iter()
                    .take_while(|w| w.starts_with('-') || w.contains('='))
                    .count();
                &cur[1 + skip..]
            }
            "timeout" => {
                let skip = cur[1..].iter().take_while(|w| w.starts_with('-')).count();
                cur.get(2 + skip..).unwrap_or(&[])
            }
            _ => break,
        };
        if wrapped.is_empty() {
            break;
        }
        out.push(wrapped.to_vec());
        cur = wrapped;
    }
    out
}

fn walk_source(source: &str, a: &mut Analysis, depth: usize) {
    if depth > MAX_NESTING {
        a.refuse("it nests commands too deeply");
        return;
    }
    let options = brush_parser::ParserOptions::default();
    let tokens = match brush_parser::tokenize_str_with_options(source, &options.tokenizer_options())
    {
        Ok(t) => t,
        Err(e) => {
            a.refuse(format!("it cannot be parsed ({e})"));
            return;
        }
    };
    match brush_parser::parse_tokens(&tokens, &options) {
        Ok(program) => {
            for list in &program.complete_commands {
                walk_list(list, a, depth);
            }
        }
        Err(e) => a.refuse(format!("it cannot be parsed ({e})")),
    }
}

fn walk_list(list: &CompoundList, a: &mut Analysis, depth: usize) {
    for item in &list.0 {
        walk_pipeline(&item.0.first, a, depth);
        for more in &item.0.additional {
            match more {
                brush_parser::ast::AndOr::And(p) | brush_parser::ast::AndOr::Or(p) => {
                    walk_pipeline(p, a, depth)
                }
            }
        }
    }
}

fn walk_pipeline(p: &Pipeline, a: &mut Analysis, depth: usize) {
    for c in &p.seq {
        walk_command(c, a, depth);
    }
}

fn walk_command(c: &Command, a: &mut Analysis, depth: usize) {
    match c {
        Command::Simple(s) => walk_simple(s, a, depth),
        Command::Compound(cc, redirects) => {
            a.refuse("it holds a compound command (a subshell, group, loop or condition)");
            walk_compound(cc, a, depth);
            for r in redirects.iter().flat_map(|r| r.0.iter()) {
                walk_redirect(r, a, depth);
            }
        }
        Command::Function(f) => {
            a.refuse("it defines a function");
            walk_compound(&f.body.0, a, depth);
        }
        Command::ExtendedTest(..) => a.refuse("it holds a `[[ … ]]` test"),
    }
}

fn walk_compound(c: &CompoundCommand, a: &mut Analysis, depth: usize) {
    match c {
        CompoundCommand::BraceGroup(g) => walk_list(&g.list, a, depth),
        CompoundCommand::Subshell(s) => walk_list(&s.list, a, depth),
        CompoundCommand::ForClause(f) => {
            for w in f.values.iter().flatten() {
                word(w, a, depth);
            }
            walk_list(&f.body.list, a, depth);
        }
        CompoundCommand::ArithmeticForClause(f) => walk_list(&f.body.list, a, depth),
        CompoundCommand::CaseClause(c) => {
            word(&c.value, a, depth);
            for item in &c.cases {
                if let Some(l) = &item.cmd {
                    walk_list(l, a, depth);
                }
            }
        }
        CompoundCommand::IfClause(i) => {
            walk_list(&i.condition, a, depth);
            walk_list(&i.then, a, depth);
            for e in i.elses.iter().flatten() {
                if let Some(c) = &e.condition {
                    walk_list(c, a, depth);
                }
                walk_list(&e.body, a, depth);
            }
        }
        CompoundCommand::WhileClause(w) | CompoundCommand::UntilClause(w) => {
            walk_list(&w.0, a, depth);
            walk_list(&w.1.list, a, depth);
        }
        CompoundCommand::Coprocess(c) => walk_command(&c.body, a, depth),
        CompoundCommand::Arithmetic(_) => {}
    }
}

fn walk_simple(s: &SimpleCommand, a: &mut Analysis, depth: usize) {
    let mut words = vec![];
    for item in s.prefix.iter().flat_map(|p| p.0.iter()) {
        item_words(item, a, depth, &mut words);
    }
    match &s.word_or_name {
        Some(name) => words.push(word(name, a, depth)),
        None => a.refuse("it runs no command (only assignments or redirections)"),
    }
    for item in s.suffix.iter().flat_map(|p| p.0.iter()) {
        item_words(item, a, depth, &mut words);
    }
    if words.is_empty() {
        return;
    }
    // `bash -c '…'`, `sh -c '…'`, `eval …`: the string is a command too.
    let name = words[0].rsplit('/').next().unwrap_or(&words[0]).to_owned();
    if matches!(name.as_str(), "bash" | "sh" | "dash" | "zsh" | "ksh")
        && let Some(i) = words.iter().position(|w| w == "-c")
        && let Some(code) = words.get(i + 1)
    {
        walk_source(&code.clone(), a, depth + 1);
    } else if name == "eval" && words.len() > 1 {
        walk_source(&words[1..].join(" "), a, depth + 1);
    }
    a.commands.push(words);
}

fn item_words(
    item: &CommandPrefixOrSuffixItem,
    a: &mut Analysis,
    depth: usize,
    words: &mut Vec<String>,
) {
    match item {
        CommandPrefixOrSuffixItem::Word(w) => words.push(word(w, a, depth)),
        CommandPrefixOrSuffixItem::IoRedirect(r) => walk_redirect(r, a, depth),
        CommandPrefixOrSuffixItem::AssignmentWord(_, w) => {
            a.refuse("it sets a variable for the command");
            // The value may hold a substitution: look inside for deny rules.
            word(w, a, depth);
        }
        CommandPrefixOrSuffixItem::ProcessSubstitution(_, sub) => {
            a.refuse("it holds a process substitution");
            walk_list(&sub.list, a, depth);
        }
    }
}

fn walk_redirect(r: &IoRedirect, a: &mut Analysis, depth: usize) {
    match r {
        IoRedirect::File(_, _, target) => match target {
            IoFileRedirectTarget::Fd(_) => {}
            IoFileRedirectTarget::Duplicate(w) => {
                let t = word(w, a, depth);
                if !(t == "-" || t.trim_end_matches('-').chars().all(|c| c.is_ascii_digit())) {
                    a.refuse(format!("it redirects to `{t}`"));
                }
            }
            IoFileRedirectTarget::Filename(w) => {
                let t = word(w, a, depth);
                if t != "/dev/null" {
                    a.refuse(format!("it redirects to or from the file `{t}`"));
                }
            }
            IoFileRedirectTarget::ProcessSubstitution(_, sub) => {
                a.refuse("it holds a process substitution");
                walk_list(&sub.list, a, depth);
            }
        },
        IoRedirect::OutputAndError(w, _) => {
            let t = word(w, a, depth);
            if t != "/dev/null" {
                a.refuse(format!("it redirects to the file `{t}`"));
            }
        }
        IoRedirect::HereDocument(..) => a.refuse("it holds a here-document"),
        IoRedirect::HereString(_, w) => {
            a.refuse("it holds a here-string");
            word(w, a, depth);
        }
    }
}

/// A word's value: unquoted when it is literal; otherwise its source text, with the command
/// refused and any substitution in it walked.
fn word(w: &Word, a: &mut Analysis, depth: usize) -> String {
    let options = brush_parser::ParserOptions::default();
    let pieces = match brush_parser::word::parse(&w.value, &options) {
        Ok(p) => p,
        Err(_) => {
            a.refuse(format!("the word `{}` cannot be parsed", w.value));
            return w.value.clone();
        }
    };
    let mut out = String::new();
    // Every piece is looked at, so a substitution after an expansion is still walked.
    let mut literal = true;
    for p in &pieces {
        literal &= literal_piece(&p.piece, &mut out, a, depth);
    }
    if literal { out } else { w.value.clone() }
}

/// Appends a literal piece's text; false (and the command refused) for an expansion.
fn literal_piece(p: &WordPiece, out: &mut String, a: &mut Analysis, depth: usize) -> bool {
    match p {
        WordPiece::Text(t) | WordPiece::SingleQuotedText(t) | WordPiece::AnsiCQuotedText(t) => {
            out.push_str(t);
            true
        }
        WordPiece::EscapeSequence(e) => {
            out.push_str(e.strip_prefix('\\').unwrap_or(e));
            true
        }
        WordPiece::DoubleQuotedSequence(inner) | WordPiece::GettextDoubleQuotedSequence(inner) => {
            // Every piece is looked at (a substitution after an expansion is still walked).
            let mut literal = true;
            for p in inner {
                literal &= literal_piece(&p.piece, out, a, depth);
            }
            literal
        }
        // `~` is the workspace (HOME): it names a directory, it runs nothing.
        WordPiece::TildeExpansion(_) => {
            out.push('~');
            true
        }
        WordPiece::CommandSubstitution(code) | WordPiece::BackquotedCommandSubstitution(code) => {
            a.refuse("it holds a command substitution");
            walk_source(code, a, depth + 1);
            false
        }
        WordPiece::ParameterExpansion(_) => {
            a.refuse("it expands a variable");
            false
        }
        WordPiece::ArithmeticExpression(_) => {
            a.refuse("it holds an arithmetic expansion");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(cmd: &str) -> Vec<Vec<String>> {
        analyze(cmd).commands
    }

    #[test]
    fn lists_and_pipelines_are_taken_apart_into_vetted_commands() {
        for (cmd, want) in [
            ("git status", vec![vec!["git", "status"]]),
            ("git status --short", vec![vec!["git", "status", "--short"]]),
            (
                "git status ; echo hi",
                vec![vec!["git", "status"], vec!["echo", "hi"]],
            ),
            (
                "git status && cat README.md",
                vec![vec!["git", "status"], vec!["cat", "README.md"]],
            ),
            (
                "git status || true",
                vec![vec!["git", "status"], vec!["true"]],
            ),
            (
                "git log | head -5",
                vec![vec!["git", "log"], vec!["head", "-5"]],
            ),
            ("git status &\nls", vec![vec!["git", "status"], vec!["ls"]]),
            (
                "git 'status' \"--short\" a\\ b",
                vec![vec!["git", "status", "--short", "a b"]],
            ),
            (
                "git status 2>&1 >/dev/null </dev/null",
                vec![vec!["git", "status"]],
            ),
            ("git status # ; rm -rf x", vec![vec!["git", "status"]]),
        ] {
            let a = analyze(cmd);
            let want: Vec<Vec<String>> = want
                .into_iter()
                .map(|c| c.into_iter().map(String::from).collect())
                .collect();
            assert_eq!(a.commands, want, "{cmd}");
            assert_eq!(a.opaque, None, "{cmd}");
        }
    }

    #[test]
    fn what_no_specifier_can_vouch_for_is_opaque_and_its_commands_are_still_found() {
        for (cmd, inner) in [
            ("git status $(rm -rf x)", Some("rm")),
            ("git status `rm -rf x`", Some("rm")),
            ("echo $HOME", None),
            ("X=1 git status", None),
            ("git status > out.txt", None),
            ("git status >> out.txt", None),
            ("git status >&out.txt", None),
            ("(rm -rf x)", Some("rm")),
            ("{ rm -rf x; }", Some("rm")),
            ("if true; then rm -rf x; fi", Some("rm")),
            ("for f in a; do rm $f; done", Some("rm")),
            ("f() { rm -rf x; }; f", Some("rm")),
            ("cat <<EOF\nhi\nEOF", None),
            ("cat <(rm -rf x)", Some("rm")),
            ("echo $((1+2))", None),
            ("echo $X$(rm -rf x)", Some("rm")),
            ("git status 'unterminated", None),
            ("git status )", None),
            ("> file", None),
        ] {
            let a = analyze(cmd);
            assert!(a.opaque.is_some(), "{cmd} should be opaque: {a:?}");
            if let Some(name) = inner {
                assert!(
                    a.commands
                        .iter()
                        .any(|c| c.first().is_some_and(|w| w == name)),
                    "{cmd}: {a:?}"
                );
            }
        }
    }

    #[test]
    fn shells_and_wrappers_are_looked_through_for_deny_rules() {
        let a = analyze("bash -c 'rm -rf /tmp/x'");
        assert!(a.commands.iter().any(|c| c[0] == "rm"), "{a:?}");
        let a = analyze("eval rm -rf x");
        assert!(a.commands.iter().any(|c| c[0] == "rm"), "{a:?}");
        let w = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let forms = deny_forms(&w("/usr/bin/env FOO=1 -i sudo -n /bin/rm -rf x"));
        assert!(forms.contains(&w("rm -rf x")), "{forms:?}");
        assert!(deny_forms(&w("timeout 5 rm x")).contains(&w("rm x")));
        assert_eq!(deny_forms(&w("git status")), vec![w("git status")]);
        assert_eq!(words("ls"), vec![vec!["ls".to_owned()]]);
    }

    #[test]
    fn deeply_nested_substitutions_are_refused_not_followed_forever() {
        let mut cmd = "rm x".to_owned();
        for _ in 0..20 {
            cmd = format!("echo $({cmd})");
        }
        let a = analyze(&cmd);
        assert!(a.opaque.is_some());
    }
}
