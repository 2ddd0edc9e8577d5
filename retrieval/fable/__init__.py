"""FABLE (arXiv 2601.18116, "Forest-based Adaptive Bi-path LLM-Enhanced retrieval"): a forest of one typed tree per
document (forest), built offline by the generator (builder, with runs for chunk and section boundaries; the data job
``overstory data fable-forest`` runs it over a corpus), and the online strategy (strategy: the paper's Algorithm 1,
its pure steps in paths). replies reads the model's numbered selections and summaries for both sides."""
