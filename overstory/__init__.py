"""overstory: train and serve the learned parts of hierarchical retrieval.

Subpackages: ``core`` (configs, tracking), ``models``, ``serving``, ``retrieval``, ``data_pipeline``,
``training``, ``evaluation``; ``cli``, ``jobs`` and ``quickstart`` sit on top of them all.
"""
