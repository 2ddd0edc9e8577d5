"""Benchmarks: serving, batched generation, load and training throughput, each printing ratios against a baseline
measured in the same run (`overstory bench serve|generate|train`). Kept apart from the library they measure."""
