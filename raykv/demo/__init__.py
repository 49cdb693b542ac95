"""Demo and benchmark support, apart from the product: `raykv demo` (``run``),
the multi-turn workload (``workload``), the tiny local model (``tiny_model``),
and local vLLM replicas on simulated nodes (``replicas``)."""
