//! Command-line flags read through the vocabulary (feature `clap`): a flag taking a [`Word`]
//! accepts its recipe spelling (`row_wise`), and the same with `-` for `_` (`row-wise`); its
//! help lists the recipe spellings.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use crate::Word;

/// The value parser of a flag taking a `W`.
pub fn word<W: Word + Send + Sync>() -> impl TypedValueParser<Value = W> {
    let values = W::WORDS.iter().map(|w| {
        let kebab = w.name().replace('_', "-");
        let value = PossibleValue::new(w.name());
        if kebab == w.name() { value } else { value.alias(kebab) }
    });
    PossibleValuesParser::new(values).map(|text| W::parse(&text).expect("clap accepted one of the words"))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::ShardingType;

    #[derive(Parser)]
    struct Args {
        #[arg(long, value_parser = super::word::<ShardingType>())]
        sharding: ShardingType,
    }

    #[test]
    fn flags_read_recipe_and_kebab_spellings_and_refuse_others() {
        let a = Args::try_parse_from(["x", "--sharding", "row_wise"]).unwrap();
        assert_eq!(a.sharding, ShardingType::RowWise);
        let a = Args::try_parse_from(["x", "--sharding", "table-row-wise"]).unwrap();
        assert_eq!(a.sharding, ShardingType::TableRowWise);
        let e = Args::try_parse_from(["x", "--sharding", "rows"]).err().unwrap().to_string();
        assert!(e.contains("row_wise") && e.contains("table_wise"), "{e}");
    }
}
