//! Samplers: the Sampler trait, synthetic and Criteo TSV data sources.
