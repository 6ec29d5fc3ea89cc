//! Prints the reader throughput report of [`trainrec_data::bench_readers`] as JSON.
//!
//! `cargo run -p trainrec-data --release --example bench_readers [ROWS]`

fn main() {
    let mut options = trainrec_data::BenchOptions::default();
    if let Some(rows) = std::env::args().nth(1) {
        options.rows = rows.parse().expect("ROWS must be a number");
    }
    match trainrec_data::bench_readers(&options) {
        Ok(report) => println!("{}", serde_json::to_string_pretty(&report.to_json()).expect("JSON")),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
