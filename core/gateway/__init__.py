"""The HTTP gateway (`wicore serve`): native job routes, OpenAI-compatible chat completions,
health probes and Prometheus metrics over the same Redis and workers. Imports no torch."""
