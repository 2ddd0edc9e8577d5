"""LATTICE: an LLM-built semantic tree (tree, keywords, top_down), its calibrated best-first search (search,
calibration, scorers) and search-and-insert (insert). The jobs that build trees and log traversal traces live in
``data_pipeline`` (lattice_tree, lattice_traces)."""
