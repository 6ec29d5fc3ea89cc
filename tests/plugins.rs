//! The plugin API from a user's side: every built-in sampler and model passes the same
//! conformance kit a plugin runs, `trainrec list` shows built-ins and plugins with their docs,
//! a registry refuses duplicate names, and an unknown kind gets a did-you-mean over the
//! plugins too.

use trainrec::conformance::{ModelCase, SamplerCase};
use trainrec::engine::load_and_check;
use trainrec::recipe::LoadOptions;
use trainrec::{PluginKind, Registry};
use trainrec_tests::{shared_data, workspace};

fn sampler_case(kind: &str, case: SamplerCase) {
    let registry = custom_trainrec::registry();
    let factory = registry.sampler_for(kind).unwrap_or_else(|| panic!("{kind} is registered"));
    let report = case.check_factory(factory);
    assert!(report.is_ok(), "sampler {kind}:\n{report}");
}

#[test]
fn builtin_samplers_conform() {
    sampler_case("synthetic", SamplerCase::new("train_samples = 300\neval_samples = 50\npooling_factor = 3"));
    let fixtures = workspace().join("framework/data/tests/fixtures/criteo_binary");
    sampler_case(
        "criteo_binary",
        SamplerCase::new("train = [\"train\"]\neval_fraction = 0.3").base_dir(&fixtures).batch_size(7),
    );
    sampler_case("criteo_tsv", SamplerCase::new("path = \"train.tsv\"\neval_fraction = 0.3").base_dir(&fixtures));
    sampler_case(
        "libsvm",
        SamplerCase::new("path = \"data/sample.svm\"").base_dir(workspace().join("plugins/libsvm-sampler")),
    );
    if let Some(path) = shared_data("avazu-sample/train.csv") {
        let config = format!(
            "path = {:?}\nlabel = \"click\"\ndense = [\"C15\"]\nsparse = {{ site = \"site_id\", ip = \"device_ip\" }}",
            path.display().to_string()
        );
        sampler_case("csv", SamplerCase::new(&config).batch_size(100));
    }
    if let Some(path) = shared_data("movielens-100k/u.data") {
        let config = format!("path = {:?}\nsplit = \"temporal\"", path.display().to_string());
        sampler_case("movielens", SamplerCase::new(&config).batch_size(512).rows(2000));
    }
}

#[test]
fn builtin_models_conform() {
    let registry = custom_trainrec::registry();
    let cases = [
        ("dlrm", "dense_arch = [8, 4]\nover_arch = [8, 1]"),
        ("dlrm_dcn", "dense_arch = [8, 4]\nover_arch = [8, 1]\ndcn_num_layers = 2\ndcn_low_rank_dim = 3"),
        ("deepfm", "hidden_layer_size = 8\ndeep_fm_dimension = 4"),
        (
            "two_tower",
            "query_features = [\"f0\"]\ncandidate_features = [\"f1\", \"f2\"]\nquery_tower = [8, 4]\ncandidate_tower = [4]",
        ),
        ("wide_deep", "deep = [8, 1]"),
        ("din", "candidate = \"item\"\nhistory = \"history\"\nattention_mlp = [6]\nmlp = [8, 1]"),
        ("sasrec", "target = \"item\"\nmax_length = 3\nheads = 1\ninner_size = 8\ndropout = 0.2"),
    ];
    for (kind, config) in cases {
        let factory = registry.model_for(kind).unwrap_or_else(|| panic!("{kind} is registered"));
        // SASRec reads the history and the target alone: no pooled embeddings to train.
        let pooled: &[usize] = if kind == "sasrec" { &[] } else { &[4, 4, 4] };
        let case = ModelCase::new(config, 3, pooled);
        let case = if factory.reads_sequences() { case.sequences(&[("item", 5), ("history", 5)]) } else { case };
        let report = case.check_factory(factory);
        assert!(report.is_ok(), "model {kind}:\n{report}");
    }
    assert_eq!(registry.model_kinds().len(), cases.len(), "a model without a conformance case");
}

#[test]
fn list_shows_builtins_and_plugins_with_their_docs() {
    let text = trainrec::cli::list(&custom_trainrec::registry());
    for name in [
        "synthetic",
        "criteo_tsv",
        "criteo_binary",
        "movielens",
        "parquet",
        "csv",
        "libsvm",
        "dlrm",
        "dlrm_dcn",
        "deepfm",
        "two_tower",
        "wide_deep",
        "recall_at_k",
        "ndcg",
    ] {
        let line = text.lines().find(|l| l.split_whitespace().next() == Some(name));
        let line = line.unwrap_or_else(|| panic!("{name} missing from:\n{text}"));
        assert!(line.split_whitespace().count() > 3, "{name} has no description: {line:?}");
    }
    assert!(!text.contains("`[data.sampler]` with"), "a summary is the section name, not a description:\n{text}");
}

#[test]
fn duplicate_names_stop_a_registry_and_without_replaces() {
    let err = custom_trainrec::registry().sampler::<trainrec_plugin_libsvm::LibSvmSampler>().validate().unwrap_err();
    assert!(err.to_string().contains("sampler \"libsvm\" is registered twice"), "{err}");
    let ok = custom_trainrec::registry()
        .without(PluginKind::Sampler, "libsvm")
        .sampler::<trainrec_plugin_libsvm::LibSvmSampler>();
    ok.validate().unwrap();
    Registry::builtin().validate().unwrap();
}

#[test]
fn an_unknown_kind_suggests_a_plugin() {
    let recipe = workspace().join("recipes/plugins/libsvm_wide_deep.toml");
    let options = LoadOptions { overrides: vec!["model.kind=\"wide_dep\"".into()], env: false };
    let err = load_and_check(&recipe, &options, &custom_trainrec::registry()).err().unwrap().to_string();
    assert!(err.contains("did you mean `wide_deep`?"), "{err}");
    // The built-in binary does not know the plugin's sampler, and says which it knows.
    let options = LoadOptions { overrides: vec![], env: false };
    let err = load_and_check(&recipe, &options, &Registry::builtin()).err().unwrap().to_string();
    assert!(err.contains("libsvm") && err.contains("synthetic"), "{err}");
}
