"""Generation: the sampler (batched prefill and decode under the run's precision recipe), its
filters and stop conditions, and the ``generate`` / ``eval`` commands' runs."""
