"""Analysis of trained models: cost, attention, embeddings."""
