//! The module graph of the workspace's crates is acyclic and layered as docs/development.md's
//! "Layers" table says (issue #46). The table is the one source of truth: this test reads it,
//! reads every source file of the crates it names, takes each reference of another module of
//! the same crate (`use crate::…` with its `{…}` groups, `super::…` out of a module's own
//! folder, a `crate::…` path in code) as an edge between top-level modules (a file or a folder
//! of `src/`, as the docs name them), and fails naming the file and line of every edge from a
//! lower layer to a higher one, of every cycle, of every reference to an item of the crate
//! root (which is above every module), and every module the table misses or names wrongly.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// The docs holding the table, from the workspace's root.
const DOCS: &str = "docs/development.md";
/// The table's heading.
const HEADING: &str = "### Layers";

/// One crate of the table: its source folder and each module's layer.
#[derive(Debug, Default)]
struct Crate {
    dir: String,
    layers: BTreeMap<String, u32>,
}

/// One reference of a module to another: `from`'s file `file`, at `line`, names `to`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Edge {
    from: String,
    to: String,
    file: String,
    line: usize,
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the agent is in the workspace")
        .to_owned()
}

/// The table under [`HEADING`]: rows `| crate | layer | modules | what they are |`, in order.
fn table(docs: &str) -> Result<Vec<Crate>, String> {
    let mut lines = docs.lines().skip_while(|l| l.trim() != HEADING);
    if lines.next().is_none() {
        return Err(format!("{DOCS} has no {HEADING:?} section"));
    }
    let rows = lines
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2);
    let mut crates: Vec<Crate> = Vec::new();
    for row in rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let [_, dir, layer, modules, ..] = cells.as_slice() else {
            return Err(format!(
                "{DOCS}: a row of the layers is not a table row: {row}"
            ));
        };
        let dir = dir.trim_matches('`').to_owned();
        let layer: u32 = layer
            .parse()
            .map_err(|_| format!("{DOCS}: layer {layer:?} is not a number: {row}"))?;
        if crates.last().is_none_or(|c| c.dir != dir) {
            crates.push(Crate {
                dir: dir.clone(),
                layers: BTreeMap::new(),
            });
        }
        let layers = &mut crates.last_mut().expect("pushed").layers;
        for module in modules.split(',').map(|m| m.trim().trim_matches('`')) {
            if layers.insert(module.to_owned(), layer).is_some() {
                return Err(format!("{DOCS}: {dir}: {module} is in two layers"));
            }
        }
    }
    Ok(crates)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tok<'a> {
    Ident(&'a str),
    /// `::`
    Path,
    Punct(char),
}

/// The tokens of Rust source that paths are made of, with their lines; comments, string and
/// character literals and lifetimes left out.
fn tokens(src: &str) -> Vec<(Tok<'_>, usize)> {
    let bytes = src.as_bytes();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let ident = |c: u8| c == b'_' || c.is_ascii_alphanumeric();
    while i < bytes.len() {
        let rest = &src[i..];
        let c = bytes[i];
        let skip = if c == b'\n' {
            line += 1;
            1
        } else if c.is_ascii_whitespace() {
            1
        } else if rest.starts_with("//") {
            rest.find('\n').unwrap_or(rest.len())
        } else if rest.starts_with("/*") {
            let mut depth = 0;
            let mut j = 0;
            loop {
                if rest[j..].starts_with("/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with("*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += rest[j..].chars().next().map_or(1, char::len_utf8);
                }
                if j >= rest.len() {
                    break;
                }
            }
            j
        } else if let Some(n) = raw_string(rest) {
            n
        } else if c == b'"' || rest.starts_with("b\"") {
            let mut j = if c == b'"' { 1 } else { 2 };
            while j < rest.len() && bytes[i + j] != b'"' {
                j += if bytes[i + j] == b'\\' { 2 } else { 1 };
            }
            j + 1
        } else if c == b'\'' {
            char_literal(rest).unwrap_or_else(|| {
                // A lifetime or a label.
                1 + rest[1..].bytes().take_while(|b| ident(*b)).count()
            })
        } else if ident(c) {
            let n = rest.bytes().take_while(|b| ident(*b)).count();
            out.push((Tok::Ident(&rest[..n]), line));
            n
        } else if rest.starts_with("::") {
            out.push((Tok::Path, line));
            2
        } else {
            let ch = rest.chars().next().expect("not at the end");
            out.push((Tok::Punct(ch), line));
            ch.len_utf8()
        };
        line += src[i..i + skip].matches('\n').count() - usize::from(c == b'\n');
        i += skip;
    }
    out
}

/// The length of a raw string literal (`r"…"`, `r#"…"#`, `br#"…"#`) at the start of `s`.
fn raw_string(s: &str) -> Option<usize> {
    let body = s.strip_prefix("br").or_else(|| s.strip_prefix('r'))?;
    let hashes = body.bytes().take_while(|b| *b == b'#').count();
    if body.as_bytes().get(hashes) != Some(&b'"') {
        return None;
    }
    let close = format!("\"{}", "#".repeat(hashes));
    let start = s.len() - body.len() + hashes + 1;
    Some(start + s[start..].find(&close)? + close.len())
}

/// The length of a character literal (`'a'`, `'\n'`, `'\''`, `'\u{1F600}'`) at the start of
/// `s`, if it is one.
fn char_literal(s: &str) -> Option<usize> {
    let mut chars = s.char_indices().skip(1);
    let (_, first) = chars.next()?;
    if first == '\\' {
        let end = s[2..].find('\'')? + 2;
        // `'\''`: the quote right after the backslash is the character.
        let end = if end == 2 {
            s[3..].find('\'')? + 3
        } else {
            end
        };
        return Some(end + 1);
    }
    let (at, quote) = chars.next()?;
    (quote == '\'').then_some(at + 1)
}

/// The first names of the trees in the `{…}` group that starts at `tokens[open]`.
fn group<'a>(tokens: &[(Tok<'a>, usize)], open: usize) -> Vec<(&'a str, usize)> {
    let (mut depth, mut expect, mut names) = (0, true, Vec::new());
    for (tok, line) in &tokens[open..] {
        match tok {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            Tok::Punct(',') if depth == 1 => expect = true,
            Tok::Ident(name) if depth == 1 && expect => {
                names.push((*name, *line));
                expect = false;
            }
            _ => {}
        }
    }
    names
}

/// The top-level modules (or root items) a file of module `module` (its path from the crate
/// root, `[]` for the root) names, with their lines.
fn references(tokens: &[(Tok<'_>, usize)], module: &[String]) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    // Inline modules (`mod tests { … }`) open here, with the brace depth they close at.
    let mut inline: Vec<(usize, &str)> = Vec::new();
    let mut depth = 0;
    let named = |at: usize, out: &mut Vec<(String, usize)>| match tokens.get(at) {
        Some((Tok::Punct('{'), _)) => out.extend(
            group(tokens, at)
                .into_iter()
                .map(|(name, line)| (name.to_owned(), line)),
        ),
        Some((Tok::Ident(name), line)) => out.push(((*name).to_owned(), *line)),
        _ => {}
    };
    for (i, (tok, line)) in tokens.iter().enumerate() {
        let next = |k: usize| tokens.get(i + k).map(|t| t.0);
        let after_path = i > 0 && tokens[i - 1].0 == Tok::Path;
        match tok {
            Tok::Ident("mod") => {
                if let (Some(Tok::Ident(name)), Some(Tok::Punct('{'))) = (next(1), next(2)) {
                    inline.push((depth, name));
                }
            }
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                while inline.last().is_some_and(|(at, _)| *at >= depth) {
                    inline.pop();
                }
            }
            Tok::Ident("crate")
                if next(1) == Some(Tok::Path)
                    && !after_path
                    && (i == 0 || tokens[i - 1].0 != Tok::Punct('$')) =>
            {
                named(i + 2, &mut out);
            }
            Tok::Ident("super") if next(1) == Some(Tok::Path) && !after_path => {
                let mut at = i;
                let mut up = 0;
                while tokens.get(at).map(|t| t.0) == Some(Tok::Ident("super"))
                    && tokens.get(at + 1).map(|t| t.0) == Some(Tok::Path)
                {
                    up += 1;
                    at += 2;
                }
                let here: Vec<&str> = module
                    .iter()
                    .map(String::as_str)
                    .chain(inline.iter().map(|(_, name)| *name))
                    .collect();
                match here.len().checked_sub(up) {
                    Some(0) => named(at, &mut out),
                    Some(_) => out.push((here[0].to_owned(), *line)),
                    None => {}
                }
            }
            _ => {}
        }
    }
    out.retain(|(name, _)| !matches!(name.as_str(), "self" | "super" | "crate"));
    out
}

/// Every `.rs` file under `dir`, but not under its `bin/` (binaries are crates of their own).
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(at) = todo.pop() {
        for entry in fs::read_dir(&at).unwrap_or_else(|e| panic!("{}: {e}", at.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() && path != dir.join("bin") {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The module a file is (its path from the crate root): `[]` for `lib.rs` and `main.rs`.
fn module_of(dir: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(dir).expect("under the crate");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod")
        || matches!(parts.as_slice(), [p] if p == "lib" || p == "main")
    {
        parts.pop();
    }
    parts
}

/// The crate's modules and its edges between them (and to root items).
fn graph(root: &Path, dir: &str) -> (BTreeSet<String>, Vec<Edge>) {
    let dir_path = root.join(dir);
    let (mut modules, mut edges) = (BTreeSet::new(), Vec::new());
    for file in sources(&dir_path) {
        let module = module_of(&dir_path, &file);
        let Some(from) = module.first().cloned() else {
            continue;
        };
        modules.insert(from.clone());
        let src = fs::read_to_string(&file).expect("a source file");
        let rel = file
            .strip_prefix(root)
            .expect("in the workspace")
            .display()
            .to_string();
        for (to, line) in references(&tokens(&src), &module) {
            if to != from {
                edges.push(Edge {
                    from: from.clone(),
                    to,
                    file: rel.clone(),
                    line,
                });
            }
        }
    }
    edges.sort();
    (modules, edges)
}

/// A cycle through `start` in `next` (each module's targets), if there is one.
fn cycle_through(start: &str, next: &BTreeMap<&str, BTreeSet<&str>>) -> Option<Vec<String>> {
    fn walk<'a>(
        at: &'a str,
        start: &str,
        next: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        path: &mut Vec<&'a str>,
        seen: &mut BTreeSet<&'a str>,
    ) -> bool {
        for &to in next.get(at).into_iter().flatten() {
            if to == start {
                return true;
            }
            if seen.insert(to) {
                path.push(to);
                if walk(to, start, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start];
    let mut seen = BTreeSet::from([start]);
    walk(start, start, next, &mut path, &mut seen)
        .then(|| path.into_iter().chain([start]).map(str::to_owned).collect())
}

/// Every breach of the crate's table, in words.
fn breaches(krate: &Crate, modules: &BTreeSet<String>, edges: &[Edge]) -> Vec<String> {
    let dir = &krate.dir;
    let mut out = Vec::new();
    for module in modules {
        if !krate.layers.contains_key(module) {
            out.push(format!("{dir}: module `{module}` is in no layer of {DOCS}"));
        }
    }
    for module in krate.layers.keys() {
        if !modules.contains(module) {
            out.push(format!(
                "{dir}: {DOCS} names `{module}`, which is not a module"
            ));
        }
    }
    let mut next: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for edge in edges {
        let Edge {
            from,
            to,
            file,
            line,
        } = edge;
        if !modules.contains(to) {
            out.push(format!(
                "{file}:{line}: `{from}` names `crate::{to}`, an item of the crate root, which \
                 is above every module"
            ));
            continue;
        }
        next.entry(from.as_str()).or_default().insert(to.as_str());
        if let (Some(low), Some(high)) = (krate.layers.get(from), krate.layers.get(to))
            && high > low
        {
            out.push(format!(
                "{file}:{line}: `{from}` (layer {low}) imports `{to}` (layer {high}), a higher \
                 layer"
            ));
        }
    }
    let mut reported: BTreeSet<Vec<String>> = BTreeSet::new();
    for module in modules {
        if let Some(cycle) = cycle_through(module, &next) {
            let mut key = cycle[..cycle.len() - 1].to_vec();
            key.sort();
            if reported.insert(key) {
                let sites: Vec<String> = cycle
                    .windows(2)
                    .map(|pair| {
                        let edge = edges
                            .iter()
                            .find(|e| e.from == pair[0] && e.to == pair[1])
                            .expect("an edge of the cycle");
                        format!("{} → {} ({}:{})", pair[0], pair[1], edge.file, edge.line)
                    })
                    .collect();
                out.push(format!("{dir}: a cycle: {}", sites.join(", ")));
            }
        }
    }
    out
}

#[test]
fn the_module_graph_is_acyclic_and_layered_as_the_docs_say() {
    let root = workspace();
    let docs = fs::read_to_string(root.join(DOCS)).expect("the docs");
    let crates = table(&docs).unwrap_or_else(|e| panic!("{e}"));
    let dirs: BTreeSet<&str> = crates.iter().map(|c| c.dir.as_str()).collect();
    for wanted in [
        "agent/src",
        "agent/src/bin/meshcap-agent",
        "plugin/src",
        "xtask/src",
    ] {
        assert!(dirs.contains(wanted), "{DOCS} has no layers for {wanted}");
    }
    let mut problems = Vec::new();
    for krate in &crates {
        let (modules, edges) = graph(&root, &krate.dir);
        assert!(!modules.is_empty(), "{}: no modules found", krate.dir);
        problems.extend(breaches(krate, &modules, &edges));
    }
    assert!(
        problems.is_empty(),
        "the module graph breaks {DOCS}'s layers:\n{}",
        problems.join("\n")
    );
}

/// The reader itself, on source written to fool it.
#[test]
fn references_are_read_through_groups_super_and_inline_modules_only() {
    let src = r##"
        //! Docs: crate::docs_only, [`crate::linked`].
        use crate::{a, b::{c, d}, e::*};
        use super::f;
        /* crate::commented /* nested crate::too */ */
        fn g() -> &'static str {
            let _ = crate::h::value();
            let _ = '{'; let _ = '\''; let _ = "crate::in_string {";
            let _ = r#"crate::raw "quoted" {"#;
            other::crate_like::x;
            $crate::macro_only;
            'outer: loop { break 'outer; }
            "done"
        }
        pub(in crate::i) fn j() {}
        mod tests {
            use super::*;
            use super::super::k;
            use super::super::super::{l, m};
        }
    "##;
    let names: Vec<String> = references(&tokens(src), &["here".to_owned(), "file".to_owned()])
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    // From `here::file`, `super` is `here`; in `here::file::tests`, `super` and
    // `super::super` are in `here` and one more `super` is the crate root.
    assert_eq!(
        names,
        ["a", "b", "e", "here", "h", "i", "here", "here", "l", "m"]
    );
    let lines: Vec<usize> = references(&tokens(src), &["x".to_owned()])
        .into_iter()
        .map(|(_, line)| line)
        .collect();
    // From the top-level `x`: `super::f` is the root's `f`, and `super::super::super` is out
    // of the crate.
    assert_eq!(lines, [3, 3, 3, 4, 7, 15, 17, 18]);
}

#[test]
fn a_cycle_and_an_upward_import_are_named_with_their_files() {
    let krate = Crate {
        dir: "x/src".to_owned(),
        layers: BTreeMap::from([("low".into(), 1), ("high".into(), 2), ("peer".into(), 2)]),
    };
    let edge = |from: &str, to: &str, line| Edge {
        from: from.into(),
        to: to.into(),
        file: format!("x/src/{from}.rs"),
        line,
    };
    let modules = BTreeSet::from(["low".into(), "high".into(), "peer".into(), "new".into()]);
    let edges = [
        edge("high", "low", 1),
        edge("low", "high", 2),
        edge("high", "peer", 3),
        edge("peer", "Root", 4),
    ];
    assert_eq!(
        breaches(&krate, &modules, &edges),
        [
            "x/src: module `new` is in no layer of docs/development.md",
            "x/src/low.rs:2: `low` (layer 1) imports `high` (layer 2), a higher layer",
            "x/src/peer.rs:4: `peer` names `crate::Root`, an item of the crate root, which is \
             above every module",
            "x/src: a cycle: high → low (x/src/high.rs:1), low → high (x/src/low.rs:2)",
        ]
    );
}
