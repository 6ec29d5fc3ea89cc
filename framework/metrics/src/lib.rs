//! Recommendation metrics with TorchRec's definitions (NE, log loss, AUC).
