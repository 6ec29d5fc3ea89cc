//! The shape of the source tree, checked so it cannot drift back (issue 32):
//!
//! - no import circle between the files of any crate: files that reach into each other
//!   through `crate::`, `super::` or child-module paths (or names a `use` brought in, followed
//!   through re-exports) must form a graph without cycles, so each crate reads bottom-up. The
//!   crate root's `pub use` lines are its public face, not a use; `#[cfg(test)]` modules are
//!   not part of the build and are left out; intra-doc links count like any other path (a
//!   reader follows them);
//! - no source file over [`MAX_CODE_LINES`] lines of non-test code (inline `#[cfg(test)]`
//!   modules aside).
//!
//! Files are parsed with `syn`; module files are found by following `mod` declarations from
//! each crate root (so `#[path]` attributes are honoured), and paths inside macro calls are
//! read from their tokens.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// The most lines of non-test code one source file may hold.
const MAX_CODE_LINES: usize = 900;

/// The most lines one function may span, from `fn` to its closing brace (doc comments and
/// attributes aside). A loop that grows past it wants typed parts, as `Job::run` got
/// (`engine/src/trainer.rs`), not more branches.
const MAX_FN_LINES: usize = 200;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Every crate root (`src/lib.rs`, `src/main.rs`, `src/bin/*.rs`) of the workspace's members
/// (the `members` list of the root `Cargo.toml`).
fn crate_roots() -> Vec<PathBuf> {
    let root = root();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = manifest.split("members = [").nth(1).and_then(|m| m.split(']').next()).expect("workspace members");
    let mut out = Vec::new();
    for d in members.split(',').map(|m| m.trim().trim_matches('"')).filter(|m| !m.is_empty()).map(|m| root.join(m)) {
        for f in ["src/lib.rs", "src/main.rs"] {
            if d.join(f).exists() {
                out.push(d.join(f));
            }
        }
        if let Ok(rd) = std::fs::read_dir(d.join("src/bin")) {
            out.extend(rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "rs")));
        }
    }
    out.sort();
    out
}

/// One crate's module tree: module path → the file that holds it.
struct ModTree {
    files: BTreeMap<Vec<String>, PathBuf>,
    /// Module paths declared inline (`mod x { ... }`), with the file they live in.
    inline: BTreeMap<Vec<String>, PathBuf>,
    /// Per module, the names its `use` items bring in, with the path each stands for.
    uses: BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>,
    /// Files that are test modules as a whole (`#[cfg(test)] mod tests;`).
    test_files: BTreeSet<PathBuf>,
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs
        .iter()
        .any(|a| a.path().is_ident("cfg") && a.meta.require_list().is_ok_and(|l| l.tokens.to_string().trim() == "test"))
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find_map(|a| match &a.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// The names a `use` tree brings in, each with the path it stands for (globs bring none we
/// can name).
fn use_names(prefix: &mut Vec<String>, tree: &syn::UseTree, out: &mut BTreeMap<String, Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_names(prefix, &p.tree, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) if n.ident != "self" => {
            out.insert(n.ident.to_string(), [&prefix[..], &[n.ident.to_string()]].concat());
        }
        syn::UseTree::Name(_) => {
            if let Some(last) = prefix.last() {
                out.insert(last.clone(), prefix.clone());
            }
        }
        syn::UseTree::Rename(r) => {
            out.insert(r.rename.to_string(), [&prefix[..], &[r.ident.to_string()]].concat());
        }
        syn::UseTree::Glob(_) => {}
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_names(prefix, t, out);
            }
        }
    }
}

fn parse(file: &Path) -> syn::File {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

impl ModTree {
    fn build(root_file: &Path) -> Self {
        let mut t = ModTree {
            files: BTreeMap::new(),
            inline: BTreeMap::new(),
            uses: BTreeMap::new(),
            test_files: BTreeSet::new(),
        };
        let dir = root_file.parent().unwrap().to_path_buf();
        t.walk(root_file, &dir, Vec::new());
        t
    }

    /// `file` holds module `path`; `dir` is where its child module files live.
    fn walk(&mut self, file: &Path, dir: &Path, path: Vec<String>) {
        self.files.insert(path.clone(), file.to_path_buf());
        let ast = parse(file);
        self.items(&ast.items, file, dir, &path);
    }

    fn items(&mut self, items: &[syn::Item], file: &Path, dir: &Path, path: &[String]) {
        for item in items {
            if let syn::Item::Use(u) = item {
                let names = self.uses.entry(path.to_vec()).or_default();
                use_names(&mut Vec::new(), &u.tree, names);
            }
            let syn::Item::Mod(m) = item else { continue };
            let mut child = path.to_vec();
            child.push(m.ident.to_string());
            if let Some((_, inner)) = &m.content {
                self.inline.insert(child.clone(), file.to_path_buf());
                self.items(inner, file, &dir.join(m.ident.to_string()), &child);
                continue;
            }
            let base = file.parent().unwrap();
            let target = match path_attr(&m.attrs) {
                Some(p) => base.join(p),
                None => {
                    let flat = dir.join(format!("{}.rs", m.ident));
                    if flat.exists() { flat } else { dir.join(m.ident.to_string()).join("mod.rs") }
                }
            };
            let child_dir = if target.file_name().is_some_and(|n| n == "mod.rs") {
                target.parent().unwrap().to_path_buf()
            } else {
                target.with_extension("")
            };
            if is_cfg_test(&m.attrs) {
                self.test_files.insert(target.clone());
            }
            self.walk(&target, &child_dir, child);
        }
    }

    /// `segs` as written in module `module`, as an absolute path inside the crate (`None`
    /// for a path outside it).
    fn absolute(&self, module: &[String], segs: &[String]) -> Option<Vec<String>> {
        let first = segs.first()?;
        Some(match first.as_str() {
            "crate" => segs[1..].to_vec(),
            "self" => [module, &segs[1..]].concat(),
            "super" => {
                let mut m = module.to_vec();
                let mut rest = segs;
                while rest.first().is_some_and(|s| s == "super") {
                    m.pop();
                    rest = &rest[1..];
                }
                [&m[..], rest].concat()
            }
            _ => {
                let child = [module, &segs[..1]].concat();
                if self.is_module(&child) {
                    [module, segs].concat()
                } else if let Some(target) = self.uses.get(module).and_then(|u| u.get(first)) {
                    // A name a `use` brought in: its path, then the rest.
                    let target = target.clone();
                    if target.first() == Some(first) {
                        return None;
                    }
                    let abs = self.absolute(module, &target)?;
                    [&abs[..], &segs[1..]].concat()
                } else {
                    return None;
                }
            }
        })
    }

    /// The file that defines what absolute path `path` names, following re-exports.
    fn file_of(&self, path: &[String]) -> Option<&PathBuf> {
        self.file_of_depth(path, 0)
    }

    fn file_of_depth(&self, path: &[String], depth: usize) -> Option<&PathBuf> {
        let n = (0..=path.len()).rev().find(|&n| self.is_module(&path[..n]))?;
        let module = &path[..n];
        if depth < 8
            && let Some(next) = path.get(n)
            && let Some(target) = self.uses.get(module).and_then(|u| u.get(next))
        {
            // Re-exported (`pub use a::B`): B lives where the `use` points.
            return match self.absolute(module, target) {
                Some(abs) => self.file_of_depth(&[&abs[..], &path[n + 1..]].concat(), depth + 1),
                None => None,
            };
        }
        self.files.get(module).or_else(|| self.inline.get(module))
    }

    fn is_module(&self, path: &[String]) -> bool {
        self.files.contains_key(path) || self.inline.contains_key(path)
    }
}

/// Collects the module paths one file refers to, resolved to absolute module paths.
struct Refs<'a> {
    tree: &'a ModTree,
    /// The module the visitor is in (changes inside inline modules).
    module: Vec<String>,
    out: BTreeSet<Vec<String>>,
}

impl Refs<'_> {
    fn resolve(&mut self, segs: &[String]) {
        if let Some(abs) = self.tree.absolute(&self.module, segs) {
            self.out.insert(abs);
        }
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                prefix.push(n.ident.to_string());
                let segs = prefix.clone();
                self.resolve(&segs);
                prefix.pop();
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                let segs = prefix.clone();
                self.resolve(&segs);
                prefix.pop();
            }
            syn::UseTree::Glob(_) => {
                let mut segs = prefix.clone();
                segs.push("*".into());
                self.resolve(&segs);
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }

    /// Paths inside macro calls: `crate :: a :: b`, `super :: x`, `self :: x` token runs.
    fn tokens(&mut self, ts: proc_macro2::TokenStream) {
        let toks: Vec<proc_macro2::TokenTree> = ts.into_iter().collect();
        let mut i = 0;
        while i < toks.len() {
            if let proc_macro2::TokenTree::Group(g) = &toks[i] {
                self.tokens(g.stream());
                i += 1;
                continue;
            }
            let mut segs = Vec::new();
            let mut j = i;
            while let Some(proc_macro2::TokenTree::Ident(id)) = toks.get(j) {
                segs.push(id.to_string());
                let colons = matches!((toks.get(j + 1), toks.get(j + 2)),
                    (Some(proc_macro2::TokenTree::Punct(a)), Some(proc_macro2::TokenTree::Punct(b)))
                        if a.as_char() == ':' && b.as_char() == ':');
                if !colons {
                    break;
                }
                j += 3;
            }
            if segs.len() > 1 && matches!(segs[0].as_str(), "crate" | "super" | "self") {
                self.resolve(&segs);
            }
            i = j.max(i + 1);
        }
    }
}

impl<'ast> Visit<'ast> for Refs<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        // Test modules check a file against others (a kernel against its scalar reference);
        // they are not part of the crate's build.
        if m.content.is_some() && !is_cfg_test(&m.attrs) {
            self.module.push(m.ident.to_string());
            syn::visit::visit_item_mod(self, m);
            self.module.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        // The crate root's `pub use` items are its public face (re-exports), not a use of
        // the modules they name.
        if self.module.is_empty() && matches!(u.vis, syn::Visibility::Public(_)) {
            return;
        }
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    /// `pub(crate)` and `pub(super)` name modules without using anything in them.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        self.resolve(&segs);
        syn::visit::visit_path(self, p);
    }

    /// Intra-doc links (`` [`crate::a::B`] ``) name what they link to.
    fn visit_attribute(&mut self, a: &'ast syn::Attribute) {
        if let syn::Meta::NameValue(nv) = &a.meta
            && nv.path.is_ident("doc")
            && let syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(doc), .. }) = &nv.value
        {
            let doc = doc.value();
            for link in doc.split("[`").skip(1) {
                let Some(end) = link.find('`') else { continue };
                let path = link[..end].trim_end_matches("()").trim_end_matches('!');
                let segs: Vec<String> = path.split("::").map(str::to_owned).collect();
                if segs.len() > 1
                    && matches!(segs[0].as_str(), "crate" | "super" | "self")
                    && segs.iter().all(|s| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_'))
                {
                    self.resolve(&segs);
                }
            }
        }
        syn::visit::visit_attribute(self, a);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.tokens(m.tokens.clone());
        syn::visit::visit_macro(self, m);
    }
}

/// The file → file import graph of one crate.
/// Which files each file uses.
type Graph = BTreeMap<PathBuf, BTreeSet<PathBuf>>;
/// One path that makes each edge, for the report.
type Why = BTreeMap<(PathBuf, PathBuf), String>;

fn file_graph(tree: &ModTree) -> (Graph, Why) {
    let mut graph: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    let mut why = BTreeMap::new();
    for (module, file) in &tree.files {
        if tree.test_files.contains(file) {
            continue;
        }
        let ast = parse(file);
        let mut refs = Refs { tree, module: module.clone(), out: BTreeSet::new() };
        refs.visit_file(&ast);
        let targets = graph.entry(file.clone()).or_default();
        for r in refs.out {
            if let Some(t) = tree.file_of(&r) {
                // A module's file names its children in `mod` lines; that is structure, not use.
                if t != file && !(r.len() == module.len() + 1 && r.starts_with(module)) {
                    targets.insert(t.clone());
                    why.entry((file.clone(), t.clone())).or_insert_with(|| format!("crate::{}", r.join("::")));
                }
            }
        }
    }
    (graph, why)
}

/// Strongly connected components with more than one file (Tarjan).
fn circles(graph: &Graph) -> Vec<Vec<PathBuf>> {
    struct S<'g> {
        g: &'g Graph,
        index: BTreeMap<&'g PathBuf, usize>,
        low: BTreeMap<&'g PathBuf, usize>,
        stack: Vec<&'g PathBuf>,
        on: BTreeSet<&'g PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    fn strong<'g>(s: &mut S<'g>, v: &'g PathBuf) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for w in s.g.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                strong(s, w);
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
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.clone());
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
    let mut s = S {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            strong(&mut s, v);
        }
    }
    s.out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

#[test]
fn no_import_circle_between_the_files_of_any_crate() {
    let mut found = Vec::new();
    let roots = crate_roots();
    assert!(roots.len() >= 10, "found only {} crate roots: {roots:?}", roots.len());
    for root_file in roots {
        let tree = ModTree::build(&root_file);
        let (graph, why) = file_graph(&tree);
        for c in circles(&graph) {
            let mut text = c.iter().map(|p| rel(p)).collect::<Vec<_>>().join(" <-> ");
            for ((a, b), path) in &why {
                if c.contains(a) && c.contains(b) {
                    text.push_str(&format!("\n      {} uses {path}", rel(a)));
                }
            }
            found.push(text);
        }
    }
    assert!(found.is_empty(), "import circles between files:\n  {}", found.join("\n  "));
}

/// Lines of `file` outside `#[cfg(test)]` modules.
fn code_lines(file: &Path) -> usize {
    let text = std::fs::read_to_string(file).unwrap();
    let total = text.lines().count();
    let ast = syn::parse_file(&text).unwrap();
    let test_lines: usize = ast
        .items
        .iter()
        .filter_map(|i| match i {
            syn::Item::Mod(m) if m.content.is_some() && is_cfg_test(&m.attrs) => {
                let first = m.attrs.first().map_or(m.mod_token.span, |a| a.pound_token.span);
                let last = m.content.as_ref().unwrap().0.span.close();
                Some(last.end().line - first.start().line + 1)
            }
            _ => None,
        })
        .sum();
    total - test_lines
}

#[test]
fn no_source_file_over_the_line_limit() {
    let mut over = Vec::new();
    for root_file in crate_roots() {
        let tree = ModTree::build(&root_file);
        let files: BTreeSet<&PathBuf> = tree.files.values().filter(|f| !tree.test_files.contains(*f)).collect();
        for f in files {
            let n = code_lines(f);
            if n > MAX_CODE_LINES {
                over.push(format!("{} ({n} lines of non-test code)", rel(f)));
            }
        }
    }
    assert!(over.is_empty(), "files over {MAX_CODE_LINES} lines of non-test code:\n  {}", over.join("\n  "));
}

/// Every non-test function of `file` (free, in an `impl` or a trait with a body) as (name, line,
/// lines spanned from `fn` to the closing brace).
fn function_lengths(file: &Path) -> Vec<(String, usize, usize)> {
    struct Fns(Vec<(String, usize, usize)>);
    impl Fns {
        fn add(&mut self, sig: &syn::Signature, body: &syn::Block) {
            let (first, last) = (sig.fn_token.span.start().line, body.brace_token.span.close().end().line);
            self.0.push((sig.ident.to_string(), first, last - first + 1));
        }
    }
    impl<'ast> Visit<'ast> for Fns {
        fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
            if !is_cfg_test(&m.attrs) {
                syn::visit::visit_item_mod(self, m);
            }
        }
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            self.add(&f.sig, &f.block);
            syn::visit::visit_item_fn(self, f);
        }
        fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
            self.add(&f.sig, &f.block);
            syn::visit::visit_impl_item_fn(self, f);
        }
        fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
            if let Some(body) = &f.default {
                self.add(&f.sig, body);
            }
            syn::visit::visit_trait_item_fn(self, f);
        }
    }
    let mut fns = Fns(Vec::new());
    fns.visit_file(&parse(file));
    fns.0
}

#[test]
fn no_function_over_the_length_limit() {
    let mut over = Vec::new();
    let mut longest = Vec::new();
    for root_file in crate_roots() {
        let tree = ModTree::build(&root_file);
        let files: BTreeSet<&PathBuf> = tree.files.values().filter(|f| !tree.test_files.contains(*f)).collect();
        for f in files {
            for (name, line, n) in function_lengths(f) {
                longest.push((n, format!("{}:{line} {name}", rel(f))));
                if n > MAX_FN_LINES {
                    over.push(format!("{}:{line} fn {name} ({n} lines)", rel(f)));
                }
            }
        }
    }
    longest.sort_by(|a, b| b.cmp(a));
    for (n, at) in longest.iter().take(10) {
        println!("{n:>4} lines  {at}");
    }
    assert!(over.is_empty(), "functions over {MAX_FN_LINES} lines:\n  {}", over.join("\n  "));
}

/// The length check itself: a function's span runs from `fn` to its closing brace, nested
/// functions count on their own, and test modules are left out.
#[test]
fn the_length_check_measures_functions_from_fn_to_brace() {
    let dir = std::env::temp_dir().join(format!("trainrec-fn-lengths-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lib.rs");
    let text = "/// Doc.\n#[inline]\nfn a() {\n    fn inner() {}\n    inner();\n}\nstruct S;\nimpl S {\n    fn b(&self) {}\n}\n\
                trait T {\n    fn c() {\n        let _ = 1;\n    }\n    fn d();\n}\n#[cfg(test)]\nmod tests {\n    fn e() {}\n}\n";
    std::fs::write(&file, text).unwrap();
    let got = function_lengths(&file);
    std::fs::remove_dir_all(&dir).unwrap();
    let want: Vec<(String, usize, usize)> =
        vec![("a".into(), 3, 4), ("inner".into(), 4, 1), ("b".into(), 9, 1), ("c".into(), 12, 3)];
    assert_eq!(got, want);
}

/// The checker itself, on a made-up crate: a circle through a re-export, through `super::`,
/// through a macro's tokens and through an intra-doc link is found; the same files without the back edges (or with it
/// only in a test module) have none.
#[test]
fn the_circle_check_finds_circles_through_re_exports_super_and_macros() {
    let dir = std::env::temp_dir().join(format!("trainrec-architecture-{}", std::process::id()));
    let found = |files: &[(&str, &str)]| -> Vec<Vec<String>> {
        let _ = std::fs::remove_dir_all(&dir);
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, text).unwrap();
        }
        let tree = ModTree::build(&dir.join("src/lib.rs"));
        let out = circles(&file_graph(&tree).0)
            .into_iter()
            .map(|c| c.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        out
    };
    let lib = ("src/lib.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n");
    let a = ("src/a.rs", "use crate::b::B;\npub struct A(pub B);\n");
    let c = ("src/c.rs", "pub fn f() {}\n");
    // b names A through the crate root's re-export.
    let b = ("src/b.rs", "pub struct B;\npub fn make() -> crate::A { crate::A(B) }\n");
    assert_eq!(found(&[lib, a, b, c]), vec![vec!["a.rs".to_string(), "b.rs".to_string()]]);
    // Through `super::` from an inline module, and through a macro call's tokens.
    let b = ("src/b.rs", "pub struct B;\nmod inner { pub fn f() { let _ = super::super::a::A; } }\n");
    assert_eq!(found(&[lib, a, b, c]).len(), 1);
    let b = ("src/b.rs", "pub struct B;\npub fn f() { println!(\"{}\", std::mem::size_of::<crate::a::A>()); }\n");
    assert_eq!(found(&[lib, a, b, c]).len(), 1);
    // Through an intra-doc link.
    let b = ("src/b.rs", "/// Made into a [`crate::a::A`].\npub struct B;\n");
    assert_eq!(found(&[lib, a, b, c]).len(), 1);
    // No back edge; a back edge in a test module only; a `pub(crate)` visibility.
    let b = ("src/b.rs", "pub struct B;\npub(crate) fn g() { crate::c::f() }\n");
    assert!(found(&[lib, a, b, c]).is_empty());
    let b = ("src/b.rs", "pub struct B;\n#[cfg(test)]\nmod tests { use crate::a::A; }\n");
    assert!(found(&[lib, a, b, c]).is_empty());
}
