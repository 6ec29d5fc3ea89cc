//! Jagged and keyed sparse containers (JaggedTensor, KeyedJaggedTensor, KeyedTensor).
