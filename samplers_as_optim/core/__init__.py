"""The chain core: validation, keyed noise streams, process groups, shards."""
