"""Analysis of trained models: cost, utilisation of a device, attention, embeddings."""
