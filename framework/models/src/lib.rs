//! Dense model parts (DLRM) built with tch.
