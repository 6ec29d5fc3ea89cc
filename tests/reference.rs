//! The book's recipe reference is generated from the schema; this fails when it is stale.

use trainrec::Registry;
use trainrec_tests::{check_golden, workspace};

#[test]
fn book_reference_is_current() {
    let page = trainrec::engine::reference::recipe_reference(&Registry::builtin());
    check_golden(&workspace().join("book/src/reference/recipe.md"), &page);
}

#[test]
fn reference_documents_every_key() {
    let page = trainrec::engine::reference::recipe_reference(&Registry::builtin());
    for key in ["batch_size", "eval_every", "rowwise_adagrad", "pooling", "on_bad_row", "dense_arch", "zipf_alpha"] {
        assert!(page.contains(key), "reference lacks `{key}`");
    }
    assert!(!page.contains("|  |\n"), "a key without a doc comment");
}

#[test]
fn book_links_and_includes_resolve() {
    let src = workspace().join("book/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let mut pages = Vec::new();
    for part in summary.split("](").skip(1) {
        let target = &part[..part.find(')').expect("closing parenthesis")];
        assert!(src.join(target).exists(), "SUMMARY.md links to missing {target}");
        pages.push(src.join(target));
    }
    assert!(pages.len() >= 5);
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        for inc in text.split("{{#include ").skip(1) {
            let target = &inc[..inc.find("}}").expect("closing braces")];
            // mdBook's `file:first:last` includes those lines only.
            let (file, lines) = target.trim().split_once(':').unwrap_or((target.trim(), ""));
            let path = page.parent().unwrap().join(file);
            assert!(path.exists(), "{} includes missing {}", page.display(), path.display());
            if let Some((first, last)) = lines.split_once(':') {
                let (first, last): (usize, usize) = (first.parse().unwrap(), last.parse().unwrap());
                let n = std::fs::read_to_string(&path).unwrap().lines().count();
                assert!(1 <= first && first <= last && last <= n, "{}: lines {lines} of {n}", page.display());
            }
        }
    }
}
