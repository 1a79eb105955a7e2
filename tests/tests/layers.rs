//! The module graphs of `server/src` and `core/src` have no circle: a module (a file) never
//! reaches itself through the modules it imports (`use crate::...`, `use super::...`, a child's
//! items, and paths written inline such as `crate::store::Store`). A parent that re-exports its
//! own children (`pub use child::X`, a facade) does not depend on them by that; test modules are
//! left out. This is the check `docs/SERVER-MAP.md` points to for "imports run one way".

use regex::Regex;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every module of the crate whose sources are under `src`, by path (`[]` is the crate root).
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut m: Module = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                m.pop();
            }
            out.insert(m, path);
        }
    }
    out
}

fn is_test(m: &Module) -> bool {
    m.iter().any(|c| c == "tests")
}

/// The code of a file without comments and without its inline test module.
fn code(text: &str) -> String {
    let text = text.find("#[cfg(test)]\nmod tests {").map_or(text, |i| &text[..i]);
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// `a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`.
fn expand(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else { return vec![tree] };
    let Some(close) = tree.rfind('}').filter(|&c| c > open) else { return Vec::new() };
    let (prefix, body) = (&tree[..open], &tree[open + 1..close]);
    let (mut parts, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for ch in body.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    parts.push(cur);
    parts.into_iter().filter(|p| !p.is_empty()).flat_map(|p| expand(&format!("{prefix}{p}"))).collect()
}

/// The module a path names (the longest module prefix), seen from module `from`.
fn resolve(from: &Module, path: &str, mods: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let segs: Vec<&str> = path.split("::").collect();
    let (mut base, rest) = match segs[0] {
        "crate" => (Vec::new(), &segs[1..]),
        "self" => (from.clone(), &segs[1..]),
        "super" => {
            let up = segs.iter().take_while(|s| **s == "super").count();
            (from[..from.len().saturating_sub(up)].to_vec(), &segs[up..])
        }
        // A child module's name (`use child::X` in a parent), or another crate.
        first => {
            let mut child = from.clone();
            child.push(first.to_string());
            if !mods.contains_key(&child) {
                return None;
            }
            (from.clone(), &segs[..])
        }
    };
    for s in rest {
        let mut next = base.clone();
        next.push(s.to_string());
        if !mods.contains_key(&next) {
            break;
        }
        base = next;
    }
    Some(base)
}

fn graph(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mods = modules(src);
    // A `use` item starts a line (a word "use" in a string does not).
    let uses = Regex::new(r"(?ms)^[ \t]*(pub(\([^)]*\))?\s+)?use\s+([^;]+);").unwrap();
    let inline = Regex::new(r"\b(?:crate|super)(?:::\w+)+").unwrap();
    let mut g = BTreeMap::new();
    for (m, path) in mods.iter().filter(|(m, _)| !is_test(m)) {
        let text = code(&std::fs::read_to_string(path).unwrap());
        let mut to = BTreeSet::new();
        for u in uses.captures_iter(&text) {
            let reexport = u.get(1).is_some();
            for p in expand(&u[3]) {
                let Some(t) = resolve(m, &p, &mods) else { continue };
                // A facade re-exporting its own descendants does not depend on them.
                if reexport && t.len() > m.len() && t.starts_with(m) {
                    continue;
                }
                to.insert(t);
            }
        }
        let rest = uses.replace_all(&text, "");
        for p in inline.find_iter(&rest) {
            to.extend(resolve(m, p.as_str(), &mods));
        }
        to.remove(m);
        to.retain(|t| !is_test(t));
        g.insert(m.clone(), to);
    }
    g
}

/// Strongly connected components of more than one module (Tarjan).
fn circles(g: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a Module) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        for w in t.g.get(v).into_iter().flatten() {
            let Some((w, _)) = t.g.get_key_value(w) else { continue };
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.stack.contains(&w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            while let Some(w) = t.stack.pop() {
                c.push(if w.is_empty() { "lib".to_string() } else { w.join("/") });
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                c.sort();
                t.out.push(c);
            }
        }
    }
    let mut t = T { g, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn src(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(krate).join("src")
}

#[test]
fn the_server_and_the_core_import_without_circles() {
    for krate in ["server", "core"] {
        let g = graph(&src(krate));
        assert!(g.len() > 10 && g.values().map(BTreeSet::len).sum::<usize>() > 30, "{krate}: the graph was read");
        assert_eq!(circles(&g), Vec::<Vec<String>>::new(), "{krate}/src: import circles");
    }
}

#[test]
fn the_check_sees_a_circle() {
    let m = |s: &str| -> Module { s.split('/').map(String::from).collect() };
    let mut g = BTreeMap::new();
    g.insert(m("a"), BTreeSet::from([m("b")]));
    g.insert(m("b"), BTreeSet::from([m("c")]));
    g.insert(m("c"), BTreeSet::from([m("a")]));
    g.insert(m("d"), BTreeSet::from([m("a")]));
    assert_eq!(circles(&g), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    assert_eq!(expand("super::{a, b::{c, d}}"), ["super::a", "super::b::c", "super::b::d"]);
}
