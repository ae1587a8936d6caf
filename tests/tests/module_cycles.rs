//! No circular imports between the modules of a crate in `services/` and `shared/`.
//!
//! For every crate, each top-level module (`src/<m>.rs` or `src/<m>/…`) is a node; module `a`
//! depends on module `b` when code in `a` names `crate::b` (in a `use` or inline in a path) or,
//! in a top-level file, `super::b`. Only code counts: a doc link (`[crate::b]` in a `//!` or
//! `///` comment) or a plain comment is not a dependency, because it compiles to nothing and
//! would not break if `b` moved. Imports inside one top-level module (its submodules and their
//! `super::`) are internal to it, and the crate root (`lib.rs`/`main.rs`) declares every module,
//! so it is not a node. Unit-test modules (`#[cfg(test)] mod tests`) are not part of the
//! graph: they may use any module. A strongly connected component of more than one module is a cycle and
//! fails the test, naming its modules and the edges between them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Crates whose cycles are known and owned by another piece of work, with the reason; the test
/// fails if one of them stops having a cycle (so the entry is removed) or gains new modules.
const KNOWN: &[(&str, &[&str], &str)] = &[];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Code without comments (line comments, doc comments, block comments) and string literals.
fn strip(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            // a char literal like '"' or '{'
            out.push_str("' '");
            i += 3;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// Identifiers following `prefix::` in `code`, and for `prefix::{a, b::c}` each of `a`, `b`.
fn targets(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let pat = format!("{prefix}::");
    let mut rest = code;
    while let Some(pos) = rest.find(&pat) {
        let before = rest[..pos].chars().next_back();
        rest = &rest[pos + pat.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // `foo_crate::` or `a::crate::` — not this prefix
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let id: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !id.is_empty() && id != "self" {
                    found.insert(id);
                }
            }
        } else {
            let id: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !id.is_empty() {
                found.insert(id);
            }
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Module dependency graph of one crate: top-level module → modules it names.
fn crate_graph(src: &Path) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules = BTreeSet::new();
    let mut uses: Vec<(String, bool, String, String)> = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(src).expect("under src");
        let parts: Vec<String> = rel
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        if parts.first().is_some_and(|p| p == "bin") {
            continue; // separate binaries are their own crates
        }
        let top = parts[0].trim_end_matches(".rs").to_owned();
        if parts.len() == 1 && (top == "lib" || top == "main") {
            continue;
        }
        modules.insert(top.clone());
        let mut text = std::fs::read_to_string(f).expect("readable source");
        // A file's unit tests (`#[cfg(test)] mod …`, by convention at its end) may use any
        // module of the crate: they are not part of the module graph.
        if let Some(at) = text.find("#[cfg(test)]\nmod ") {
            text.truncate(at);
        }
        uses.push((
            top,
            parts.len() == 1 || (parts.len() == 2 && parts[1] == "mod.rs"),
            strip(&text),
            rel.display().to_string(),
        ));
    }
    let mut graph: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (top, is_top_file, code, file) in uses {
        let mut names = targets(&code, "crate");
        if is_top_file {
            names.extend(targets(&code, "super"));
        }
        for n in names {
            if n != top && modules.contains(&n) {
                graph
                    .entry(top.clone())
                    .or_default()
                    .entry(n)
                    .or_default()
                    .insert(file.clone());
            }
        }
        graph.entry(top).or_default();
    }
    graph
}

/// Strongly connected components with more than one node (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>) -> Vec<Vec<String>> {
    struct State<'a> {
        g: &'a BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on.insert(v);
        let g = s.g;
        for w in g.get(v).into_iter().flat_map(|m| m.keys()) {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on.remove(w);
                comp.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn the_checker_finds_a_cycle_and_ignores_doc_links() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::write(src.join("lib.rs"), "pub mod a; pub mod b; pub mod c;").unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::X;\n").unwrap();
    std::fs::write(src.join("b.rs"), "use super::{c, a};\npub struct X;\n").unwrap();
    std::fs::write(
        src.join("c.rs"),
        "//! See [crate::a].\n/// [`crate::b::X`]\nfn f() { let _ = \"crate::a\"; }\n",
    )
    .unwrap();
    assert_eq!(
        cycles(&crate_graph(src)),
        vec![vec!["a".to_owned(), "b".to_owned()]]
    );
}

#[test]
fn no_module_cycles_in_services_and_shared() {
    let root = workspace_root();
    let mut found = Vec::new();
    for area in ["services", "shared"] {
        let mut crates: Vec<PathBuf> = std::fs::read_dir(root.join(area))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("src").is_dir())
            .collect();
        crates.sort();
        for c in crates {
            let name = format!("{area}/{}", c.file_name().unwrap().to_string_lossy());
            let graph = crate_graph(&c.join("src"));
            for comp in cycles(&graph) {
                let edges: Vec<String> =
                    comp.iter()
                        .flat_map(|a| {
                            graph[a].iter().filter(|(b, _)| comp.contains(b)).map(
                                move |(b, files)| {
                                    format!(
                                        "{a} → {b} ({})",
                                        files.iter().cloned().collect::<Vec<_>>().join(", ")
                                    )
                                },
                            )
                        })
                        .collect();
                found.push((name.clone(), comp, edges));
            }
        }
    }
    let mut unexpected = Vec::new();
    for (krate, comp, edges) in &found {
        let known = KNOWN
            .iter()
            .any(|(k, m, _)| k == krate && m.iter().copied().eq(comp.iter().map(String::as_str)));
        if !known {
            unexpected.push(format!(
                "{krate}: cycle {}\n    {}",
                comp.join(" ↔ "),
                edges.join("\n    ")
            ));
        }
    }
    for (k, m, _) in KNOWN {
        assert!(
            found.iter().any(|(krate, comp, _)| krate == k
                && m.iter().copied().eq(comp.iter().map(String::as_str))),
            "{k}: the known cycle {m:?} is gone or changed: update KNOWN"
        );
    }
    assert!(
        unexpected.is_empty(),
        "module cycles:\n{}",
        unexpected.join("\n")
    );
}
