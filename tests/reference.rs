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
