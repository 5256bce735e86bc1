"""The service contract and the pipelines that implement it."""
