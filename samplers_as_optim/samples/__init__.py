"""Samples and what uses them: stacked models, parallel chains, the sample store."""
